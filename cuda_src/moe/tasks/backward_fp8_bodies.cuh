// The non-GEMM bodies and the dA epilogue of the "fp8_block" backward (tasks/backward_fp8.cuh;
// docs/FP8_BACKWARD.md; oracle: mok_rt/reference/fp8.py backward_fp8).
//   quantize_dout   the dispatch (B0: dyq = Q(d_out[token]) per routed row) and the token-order
//                   copy (P: dq = Q(d_out), the shared dA's A), the forward's pipelined quantiser
//                   (quantize_rows.cuh) with d_out as the source.  Unweighted: tw is applied to the
//                   fp32 dA instead (FP8_DESIGN "Semantics notes" (1)), so dq / dyq are bitwise the
//                   oracle's.  Second output from the same registers (DequantToBf16): the wgrads'
//                   bf16 A, dy_routed = bf16(tw * q * s) (B0) or dq_bf = bf16(q * s) (P).
//   widen_rows      bf16(q * s) of the forward's quantised context: P's xq_bf, sact
//                   (token_prep_widen) and W's x_routed, act (widen_block), the wgrads' B / A.
//   d_weights       B1: d_topk_weights = <d_out, y_slot> (the bf16 body's arithmetic, see there).
//   da_tile         a dA task's epilogue, per 128-column I block: da = tw * acc, dSwiGLU against the bf16 gu of
//                   the forward's context, dG and dU quantised per row (one 1 x 128 block each) into
//                   dguq (the dX GEMM's A) and their dequantised values rounded to bf16 into dgu (the
//                   wgrads' operand: never quantised twice).
#pragma once
#include "common/fp8.cuh"
#include "moe/params_fp8_bwd.cuh"
#include "moe/pipeline/epilogue.cuh"
#include "moe/pipeline/gemm_fp8.cuh"
#include "moe/tasks/backward_bodies.cuh"
#include "moe/tasks/quantize_rows.cuh"

namespace mok {
namespace fp8b {

// The thread index, read again where it is used.  threadIdx.x is a pure value to the compiler, so
// everything derived from it (fragment rows and columns, lanes, warps, their 64-bit forms) was
// computed once before the persistent worker loop and held in registers through every task body,
// ~10 of the 232 at the dA epilogue's peak; the volatile read keeps each body's copies inside it.
__device__ __forceinline__ int tid_here() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}
__device__ __forceinline__ int worker_tid_here() { return tid_here() - kWorkerThread0; }

// pipe::Frag::of(consumer) from tid_here() (same values).
__device__ __forceinline__ pipe::Frag frag_here() {
  const int t = tid_here(), l = t & 31;
  const int consumer = (t - kWorkerThread0) >> 7;
  return pipe::Frag{64 * consumer + 16 * ((t & 127) >> 5) + (l >> 2), 2 * (l & 3), l & 3};
}

// The dispatch's second output (fp8f::quantize_rows_warp's `second`): each quantised unit
// dequantised, times the row's weight, rounded to bf16 into a bf16 copy of the rows (row r at
// dst + r * hidden), from the registers that hold its E4M3 bytes and scale: dy_routed = bf16(tw * q
// * s), the routed wgrad's A (the oracle's dy = tw * dq), or dq_bf = bf16(q * s) (w = 1), the shared
// one's.  Lane j < 16 holds local row j's weight (0 for padding rows: their q and s are 0 anyway).
struct DequantToBf16 {
  bf16* dst;
  float lane_w;
  __device__ __forceinline__ void operator()(const fp8f::QuantRows& q, int j, int row, int col0,
                                             const fp8::QuantizedQuadBlock& b) const {
    const float m = __shfl_sync(0xffffffffu, lane_w, j) * b.scale;  // every lane: a shuffle
    bf16* const out = dst + (size_t)row * q.hidden + col0;
#pragma unroll
    for (int k = 0; k < fp8f::kUnitSlots; ++k) {
      if (col0 + 32 * k >= q.hidden) continue;
      // 8 E4M3, low byte first: elements 32 k + 0 .. 7
      const uint2 w0 = fp8::widen_e4m3x4_bf16(b.q[k].x, m), w1 = fp8::widen_e4m3x4_bf16(b.q[k].y, m);
      *reinterpret_cast<uint4*>(out + 32 * k) = make_uint4(w0.x, w0.y, w1.x, w1.y);
    }
  }
};

// B0 (routed): row block b of dyq <- Q(d_out[slot / k]) and dy_routed <- bf16(tw * deq(dyq)) (padding
// rows zero, scale 0; then block_dy_ready[b], expert_dy_ready[e]), or P's first half (token order):
// token block b of dq <- Q(d_out) and dq_bf <- bf16(deq(dq)) (then token_dq_ready[b]).  One function
// for both, so the quantiser is inlined once (as the forward's fp8f::quantize_x, whose structure
// this is).
__device__ __forceinline__ void quantize_dout(const MoEFp8BackwardParams& q, bool routed, int b, int e) {
  const MoEBackwardParams& p = q.p;
  const MoEDims& d = p.dims;
  const int wt = worker_tid_here(), lane = wt & 31;
  fp8f::QuantRows r{q.q.dyq, q.q.rs, (size_t)d.max_rows, d.hidden, b * kBlockM + (wt >> 5),
                    fp8f::kRowsPerWarp, nullptr};
  DequantToBf16 second{p.dy_routed, 0.f};
  const int row = r.row(lane & 15);
  if (routed) {
    const int slots = d.tokens * d.top_k;
    const int slot = lane < fp8f::kRowsPerWarp ? p.sched.row_slot[row] : -1;
    if (slot >= slots) set_error(p.err, kErrInternal, __LINE__, row, slot);  // corrupt schedule: never read past d_out
    if (slot >= 0 && slot < slots) {
      r.lane_src = p.d_out + (size_t)(slot / d.top_k) * d.hidden;
      second.lane_w = __ldg(p.topk_weights + slot);
    }
  } else {
    r.dst = q.q.dq;
    r.scale = q.q.ts;
    r.ld = q.plan8.token_ld;
    r.nrows = d.tokens > r.row0 ? min_int(fp8f::kRowsPerWarp, ceil_div(d.tokens - r.row0, fp8f::kQuantWarps)) : 0;
    r.lane_src = p.d_out + (size_t)row * d.hidden;  // rows past the tokens are never loaded (j >= nrows)
    second = DequantToBf16{q.q.dq_bf, 1.f};
  }
  // A ring of 6 units, not the forward's 8 (5 units = 10 KB in flight per warp, not 7 = 14 KB): with
  // 8 or 7 and the bf16 second output, the workers spill (24 bytes, with every phase in the kernel).
  // Its cost on the dispatch is to be measured on the GPU.
  fp8f::quantize_rows_warp<6>(r, second);
  if (routed)
    signal_counters(p.cnt.block_dy_ready + b, p.cnt.expert_dy_ready + e);
  else
    signal_counter(q.token_dq_ready + b);
}

// B1: d_topk_weights[t, j] = <d_out[t], y_slot[t k + j]> (unquantised d_out, the oracle's), a warp
// per route, lanes stride over H, then a fixed butterfly: the bf16 body's (BackwardTasks::d_weights)
// sums in the same order.  Why not that body: its loads are guarded by `if (c < hidden)`, and a
// register only written under a predicate keeps its old value otherwise, so ptxas held its 16
// load registers (and the hoisted lane / warp values) live around the whole worker loop: 104 bytes
// of spills at the dA epilogue's peak.  Here every load register is written (zeros past H), and
// the thread index is read inside the body (tid_here).
__device__ __forceinline__ void d_weights(const MoEBackwardParams& p, int tb) {
  const MoEDims& d = p.dims;
  const int wt = worker_tid_here(), warp = wt >> 5, lane = wt & 31;
  const int routes = min_int(kBlockM, d.tokens - tb * kBlockM) * d.top_k, slot0 = tb * kBlockM * d.top_k;
  for (int q = warp; q < routes; q += kThreads / 32) {
    const size_t slot = (size_t)slot0 + q, t = slot / d.top_k;
    const bf16* const yr = p.ctx.y_slot + slot * d.hidden;
    const bf16* const gr = p.d_out + t * d.hidden;
    float sum = 0.f;
    // 8 chunk pairs per lane in flight (a 2048-wide route in one round trip): the task runs under
    // the weight gradients, where a round trip takes microseconds, and with 2 pairs (the bf16
    // body's) it took ~0.5 ms per token block at qwen3, T = 4096.  The order of the sum is the same.
    constexpr int kPairs = 8;
    for (int c0 = lane * 8; c0 < d.hidden; c0 += 32 * 8 * kPairs) {
      uint4 yv[kPairs], gv[kPairs];
#pragma unroll
      for (int u = 0; u < kPairs; ++u) {
        const int c = c0 + u * 32 * 8;
        yv[u] = fp8f::ldg_or_zero(yr + c, c < d.hidden);
        gv[u] = fp8f::ldg_or_zero(gr + c, c < d.hidden);
      }
#pragma unroll
      for (int u = 0; u < kPairs; ++u) {
        if (c0 + u * 32 * 8 >= d.hidden) break;
        float y[8], g[8];
        unpack_bf16x8(yv[u], y);
        unpack_bf16x8(gv[u], g);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum = fmaf(g[i], y[i], sum);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) p.d_topk_weights[slot] = sum;
  }
}

// 16 bytes at p (read-only for the launch), or zeros where !pred; every register written either way
// (fp8f::ldg_or_zero's form: a register written only under a predicate stays live around the loop).
__device__ __forceinline__ uint4 ld_nc_v4_or_zero(const void* p, bool pred) {
  return fp8f::ldg_or_zero(static_cast<const bf16*>(p), pred);
}
__device__ __forceinline__ float ld_nc_f32_or_zero(const float* p, bool pred) {
  float v;
  asm("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %2, 0;\n\tmov.b32 %0, 0;\n\t@p ld.global.nc.f32 %0, [%1];\n\t}"
      : "=f"(v)
      : "l"(p), "r"(static_cast<int>(pred)));
  return v;
}

// Rows [row0, row0 + rows) of an E4M3 array [*, cols] with fp32 scales s[(c / 128) * s_ld + row]
// widened to bf16(q * s) into out (same row index, [*, cols]), and rows [row0 + rows, row0 + zero_to)
// of out written as zeros (nothing read for them).  The wgrads' bf16 operands from the forward's
// quantised context (x_routed, act, xq_bf, sact): the values the FP8 GEMMs saw, rounded to bf16
// once.  16 bytes of E4M3 per thread and step, kBatch steps in flight (cols: a multiple of 64).
// 16 (64 KB a CTA; 32 spilled 1.4 KB) measured no faster than 8: the phase runs on every SM at
// once and is bound by HBM there (~2.8 TB/s of 3.35 on an H100; bench/NOTES-FP8-3.md round 20).
__device__ __forceinline__ void widen_rows(const uint8_t* q, const float* s, size_t s_ld, bf16* out, int cols, int row0,
                                           int rows, int zero_to) {
  constexpr int kBatch = 16;
  const int cpr = cols / 16;  // 16-byte chunks per row
  const int n = zero_to * cpr, loaded = rows * cpr;
  for (int base = worker_tid_here(); base < n; base += kThreads * kBatch) {
    uint4 v[kBatch];
    float sc[kBatch];
    size_t at[kBatch];  // element offset of the chunk
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * kThreads, r = i / cpr, c = (i - r * cpr) * 16;
      at[u] = (size_t)(row0 + r) * cols + c;
      v[u] = ld_nc_v4_or_zero(q + at[u], i < loaded);
      sc[u] = ld_nc_f32_or_zero(s + (size_t)(c / fp8::kBlock) * s_ld + row0 + r, i < loaded);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (base + u * kThreads >= n) break;
      fp8::store_widened16(out + at[u], v[u], sc[u]);
    }
  }
}

// P's second half (token block tb, only with a shared expert; after quantize_dout's dq, dq_bf and
// token_dq_ready[tb] for the shared dA): the shared wgrads' other token-order operands, xq_bf =
// bf16(deq(xq)) and sact = bf16(deq(saq)), and zeros in dq_bf / xq_bf rows [T, block end) (the
// wgrads' K runs to a multiple of 64 tokens, and those maps hold the routed rows below: TMA
// zero-fills nothing there; sact's and dsgu's maps end at T); then prep_done.
__device__ __forceinline__ void token_prep_widen(const MoEFp8BackwardParams& q, int tb) {
  const MoEDims& d = q.p.dims;
  const int t0 = tb * kBlockM, rows = min_int(kBlockM, d.tokens - t0);
  const size_t ld = q.plan8.token_ld;
  widen_rows(q.qctx.xq, q.qctx.xq_s, ld, q.q.xq_bf, d.hidden, t0, rows, kBlockM);
  widen_rows(q.qctx.saq, q.qctx.saq_s, ld, q.p.ctx.sact, d.shared_inter, t0, rows, rows);
  widen_rows(q.q.dq, q.q.ts, ld, q.q.dq_bf, d.hidden, t0 + rows, 0, kBlockM - rows);  // zeros only
  signal_counter(q.prep_done);
}

// W (row block b of expert e): x_routed = bf16(deq(xrq)), act = bf16(deq(aq)) (padding rows: zeros,
// their q and scales are), the routed wgrads' B operands; then expert_widen_ready[e].
__device__ __forceinline__ void widen_block(const MoEFp8BackwardParams& q, int b, int e) {
  const MoEDims& d = q.p.dims;
  const size_t ld = d.max_rows;
  widen_rows(q.qctx.xrq, q.qctx.xrq_s, ld, q.p.ctx.x_routed, d.hidden, b * kBlockM, kBlockM, kBlockM);
  widen_rows(q.qctx.aq, q.qctx.aq_s, ld, q.p.ctx.act, d.inter, b * kBlockM, kBlockM, kBlockM);
  signal_counter(q.expert_widen_ready + e);
}

// Where one dA sub-tile's outputs go.  Rows are tile rows (0 .. 127) of the task's row block.
struct DaOut {
  const bf16* gu;   // the tile's row 0 of gu / sgu (bf16 [rows, 2 inter]: gate | up)
  bf16* dgu;        // the tile's row 0 of dgu / dsgu (same layout)
  uint8_t* dguq;    // the tile's row 0 of dguq / dsguq (e4m3 [rows, 2 ip]: gate at 0, up at ip)
  float* scale;     // rs / ts: row (H/128 + block) holds the scales of dguq's K block `block`
  size_t ld;        // of scale
  int row_base;     // scale column of tile row 0
  int rows;         // valid tile rows (the rest: stores dropped)
  int inter, ip;    // I and Ip = ceil(I / 128) * 128
  int hb;           // H / 128 (dA's K blocks, in front of dguq's in the scale array)
};

// Row half h's e4m3 + scale of a 1 x 128 I block held in register half 0 of a 64-register
// fragment (v; da_tile moves each row half there), stored at I columns i0 + (this lane's columns) of dguq
// (col_off: 0 for dG, ip for dU), and the dequantised values as bf16 into dgu at column offset
// bf_off (0 or inter), columns < inter only.  The columns in [inter, ip) of dguq are written too: v
// is zero there (B zero-filled past I), so q is zero, as the dX GEMM's A needs (NaN * 0 would
// poison the sum; FP8_DESIGN "Ip").  Every lane calls it (the row's amax is a quad reduction).
__device__ __forceinline__ void store_quantized_half(const float (&v)[fp8g::kRegs], int h, const pipe::Frag& f,
                                                     const DaOut& o, int i0, int col_off, int bf_off) {
  const fp8::QuantizedFragRow qr = fp8::quantize_frag_row128(v, 0);
  // 16-byte stores: the e4m3 bytes through pipe::e4m3_row_pieces, the bf16 words of each group of
  // 4 chunks through a quad transpose (lane c: chunk 4g + c); the shuffles before the row check.
  const pipe::E4m3RowPieces pc = pipe::e4m3_row_pieces(qr.q);
  uint32_t w[fp8::kBlock / 32][4];
#pragma unroll
  for (int g = 0; g < 4; ++g) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 x = fp8::e4m3x2_to_f32(qr.q[4 * g + k]);  // exact; times the scale: one rounding to fp32
      w[g][k] = pack_bf16x2(x.x * qr.scale, x.y * qr.scale);
    }
    pipe::quad_transpose(w[g]);
  }
  const int r = f.row0 + 8 * h;
  if (r >= o.rows) return;
  uint8_t* const qrow = o.dguq + (size_t)r * 2 * o.ip + col_off + i0 + 16 * f.quad;
  *reinterpret_cast<uint4*>(qrow) = pc.lo;
  *reinterpret_cast<uint4*>(qrow + 64) = pc.hi;
  bf16* const brow = o.dgu + (size_t)r * 2 * o.inter + bf_off + i0 + 8 * f.quad;
#pragma unroll
  for (int g = 0; g < 4; ++g)
    if (i0 + 32 * g < o.inter)
      *reinterpret_cast<uint4*>(brow + 32 * g) = make_uint4(w[g][0], w[g][1], w[g][2], w[g][3]);
  if (f.quad == 0) o.scale[(size_t)(o.hb + (col_off + i0) / fp8::kBlock) * o.ld + o.row_base + r] = qr.scale;
}

// One row half of a dA sub-tile's epilogue (t: dA of I columns i0 .. i0 + 127 in register half
// 0, i.e. register 4j + e is row f.row0 + 8h, column f.col0 + 8j + e).  tw: the row's routing
// weight (1 for the shared expert, 0 for padding rows).  Its dG into dg, its dU over t (da is dead
// once dG and dU of a register are computed), both quantised and stored.  kClamp: the SwiGLU
// clamp known on (1) or off (0), so that the body has no branch per element.
// gu is read 4 bytes per register pair (the bf16 backward quad-transposes to 16-byte loads; here
// the quantiser needs the fragment layout, so the loads follow it; 16-byte loads transposed back
// spilled 32 bytes): 128 KB per task, from HBM (the forward wrote it long before).  The loads go
// in groups of kJ pairs, each group issued before its arithmetic: with the clamp's branch in every
// element, ptxas kept each pair next to its use, one HBM round trip each, 16 per row half
// (bench/NOTES-FP8-3.md round 18: a dA task 51 -> 37 us at qwen3-30b-a3b).
template <int kClamp>
__device__ __forceinline__ void da_half_as(float (&t)[fp8g::kRegs], const pipe::Frag& f, const DaOut& o, int i0, int h,
                                           float tw, const SwiGLU& sw) {
  constexpr int kJ = 8;  // 16 spilled 8 bytes more, no faster
  float dg[fp8g::kRegs];
  const int r = f.row0 + 8 * h;
  const bf16* const g_row = o.gu + (size_t)r * 2 * o.inter + i0 + f.col0;
  // this lane's pairs: g at g_row + 8 j, u at g_row + inter + 8 j, for 8 j < lim (constant offsets)
  const int lim = r < o.rows ? o.inter - i0 - f.col0 : 0;
  const unsigned int* const gp = reinterpret_cast<const unsigned int*>(g_row);
  const unsigned int* const up = reinterpret_cast<const unsigned int*>(g_row + o.inter);
#pragma unroll
  for (int j0 = 0; j0 < 16; j0 += kJ) {
    uint32_t gw[kJ], uw[kJ];  // past I or past the rows: g = u = 0 (and da = 0: dG = dU = 0)
#pragma unroll
    for (int jj = 0; jj < kJ; ++jj) {
      const bool ok = 8 * (j0 + jj) < lim;
      gw[jj] = ok ? __ldg(gp + 4 * (j0 + jj)) : 0u;
      uw[jj] = ok ? __ldg(up + 4 * (j0 + jj)) : 0u;
    }
#pragma unroll
    for (int jj = 0; jj < kJ; ++jj) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 4 * (j0 + jj) + e;
        const float g = fp8::bf16_bits_to_f32(e ? gw[jj] >> 16 : gw[jj] & 0xffffu);
        const float u = fp8::bf16_bits_to_f32(e ? uw[jj] >> 16 : uw[jj] & 0xffffu);
        float du;
        sw.grad<kClamp>(g, u, tw * t[i], dg[i], du);
        t[i] = du;
      }
    }
  }
  store_quantized_half(dg, h, f, o, i0, 0, 0);
  store_quantized_half(t, h, f, o, i0, o.ip, o.inter);
}
__device__ __forceinline__ void da_half(float (&t)[fp8g::kRegs], const pipe::Frag& f, const DaOut& o, int i0, int h,
                                        float tw, const SwiGLU& sw) {
  if (sw.limited)
    da_half_as<1>(t, f, o, i0, h, tw, sw);
  else
    da_half_as<0>(t, f, o, i0, h, tw, sw);
}

// The dA epilogue of a task: sub-tile 0 (t0: I columns i0 ..) and, when `two`, sub-tile 1 (t1:
// i0 + 128 ..), each by row halves.  One copy of the row half's code (da_half), run up to four
// times, each run's registers moved into t0's half 0 before it: fully unrolled (four copies,
// ~9,400 instructions, ~150 KB of code per task, against the forward gate|up epilogue's ~2,500)
// the epilogue ran from the instruction cache's misses: 54-61 us a task, ~20 us a sub-tile
// with its gu loads or its stores removed.  Rolled, a dA task takes 51 / 81 us at qwen3 / the
// deepseek-v3 slice against 79 / 108 (bench/NOTES-FP8-3.md round 18).  Why by row halves:
// with a whole sub-tile's dG live (64) next to its dU (64), the other sub-tile's totals (64) and
// the quantiser's copy, ptxas spilled 288 bytes at 232 registers; by halves the peak is ~32 lower.
__device__ __forceinline__ void da_tile(float (&t0)[fp8g::kRegs], float (&t1)[fp8g::kRegs], bool two,
                                        const pipe::Frag& f, const DaOut& o, int i0, float tw0, float tw1,
                                        const SwiGLU& sw) {
  const int passes = two ? 4 : 2;
#pragma unroll 1
  for (int pass = 0; pass < passes; ++pass) {
    const int h = pass & 1;
    da_half(t0, f, o, i0 + (pass >> 1) * fp8g::kBN, h, h ? tw1 : tw0, sw);
    if (h == 0) {  // row half 1 of the same sub-tile next
#pragma unroll
      for (int j = 0; j < 16; ++j) t0[4 * j] = t0[4 * j + 2], t0[4 * j + 1] = t0[4 * j + 3];
    } else {  // sub-tile 1 next, its row half 0 in place (after the last pass a dead copy:
              // guarding it spilled 88 B)
#pragma unroll
      for (int i = 0; i < fp8g::kRegs; ++i) t0[i] = t1[i];
    }
  }
}

}  // namespace fp8b
}  // namespace mok
