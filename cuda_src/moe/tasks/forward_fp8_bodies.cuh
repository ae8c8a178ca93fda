// The non-GEMM bodies and the epilogues of the "fp8_block" forward (tasks/forward_fp8.cuh):
// quantising x rows (the dispatch, and the token-order copy the shared expert reads), the gate|up
// sub-tile epilogue (g, u stored in bf16; a = swiglu(g, u) kept in fp32 registers) and the
// quantisation of a whole 128-column I block of a into E4M3 + one scale per row.
// Quantisers: common/fp8.cuh, bitwise the oracle's (docs/SEMANTICS.md §10).
#pragma once
#include "common/fp8.cuh"
#include "moe/params_fp8.cuh"
#include "moe/pipeline/epilogue.cuh"
#include "moe/pipeline/gemm_fp8.cuh"
#include "moe/pipeline/staged_tile.cuh"
#include "moe/tasks/forward_bodies.cuh"
#include "moe/tasks/quantize_rows.cuh"

namespace mok {
namespace fp8f {

// F0 (FP8, routed): row block b <- Q(x[slot / k]) (padding rows zero; then block_ready[b]), or
// Fq (token order): token block b of x <- Q(x) (the shared expert's A; then token_xq_ready[b]).
// One function for both, so the pipelined quantiser (quantize_rows.cuh) is inlined once.
__device__ __forceinline__ void quantize_x(const MoEFp8ForwardParams& q, bool routed, int b) {
  const MoEForwardParams& p = q.p;
  const MoEDims& d = p.dims;
  const int lane = threadIdx.x & 31;
  QuantRows r{q.qctx.xrq, q.qctx.xrq_s, (size_t)d.max_rows, d.hidden, b * kBlockM + (worker_tid() >> 5), kRowsPerWarp,
              nullptr};
  const int row = r.row(lane & 15);
  if (routed) {
    const int slots = d.tokens * d.top_k;
    const int slot = lane < kRowsPerWarp ? p.sched.row_slot[row] : -1;
    if (slot >= slots) set_error(p.err, kErrInternal, __LINE__, row, slot);  // corrupt schedule: never read past x
    if (slot >= 0 && slot < slots) r.lane_src = p.x + (size_t)(slot / d.top_k) * d.hidden;
  } else {
    r.dst = q.qctx.xq;
    r.scale = q.qctx.xq_s;
    r.ld = q.plan8.token_ld;
    r.nrows = d.tokens > r.row0 ? min_int(kRowsPerWarp, ceil_div(d.tokens - r.row0, kQuantWarps)) : 0;
    r.lane_src = p.x + (size_t)row * d.hidden;  // rows past the tokens are never loaded (j >= nrows)
  }
  quantize_rows_warp(r);
  signal_counter(routed ? p.cnt.block_ready + b : q.token_xq_ready + b);
}

// Group q (chunks 4q .. 4q + 3) of row half h of gate|up sub-tile S (registers: chunks j < 8 =
// gate columns, j >= 8 = up columns): g and u as bf16 (rounded to nearest even: the FP8 oracle's
// context is exactly bf16(g), bf16(u) and its dSwiGLU takes the clamp masks from those, so unlike
// the bf16 forward the clamp side is not kept), quad-transposed (this lane: chunk 4q + quad), and
// a = swiglu(g, u) from the fp32 totals into act[32 S ..], the fragment layout of a 128-column I
// block (chunk 8 S + j).
template <int S>
__device__ __forceinline__ void gate_up_group(const float (&t)[fp8g::kRegs], int h, int q, const SwiGLU& sw,
                                              float (&act)[fp8g::kRegs], uint4& g, uint4& u) {
  uint32_t gw[4], uw[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int j = 4 * q + k;
    const float g0 = t[4 * j + 2 * h], g1 = t[4 * j + 2 * h + 1];
    const float u0 = t[4 * (j + 8) + 2 * h], u1 = t[4 * (j + 8) + 2 * h + 1];
    act[32 * S + 4 * j + 2 * h] = sw.act(g0, u0);
    act[32 * S + 4 * j + 2 * h + 1] = sw.act(g1, u1);
    gw[k] = pack_bf16x2(g0, g1);
    uw[k] = pack_bf16x2(u0, u1);
  }
  pipe::quad_transpose(gw);
  pipe::quad_transpose(uw);
  g = make_uint4(gw[0], gw[1], gw[2], gw[3]);
  u = make_uint4(uw[0], uw[1], uw[2], uw[3]);
}

// Sub-tile S of a gate|up task, g and u straight to gu (gate at column c, up at inter + c, for
// intermediate columns c from c0) for tile rows r < rows; gu points at the tile's row 0.
template <int S>
__device__ __forceinline__ void gate_up_subtile(const float (&t)[fp8g::kRegs], const pipe::Frag& f, int rows, bf16* gu,
                                                int inter, int c0, const SwiGLU& sw, float (&act)[fp8g::kRegs]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = f.row0 + 8 * h;
    bf16* const gu_row = gu + (size_t)r * 2 * inter;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      uint4 g, u;
      gate_up_group<S>(t, h, q, sw, act, g, u);
      if (r >= rows) continue;
      const int c = c0 + f.chunk_col(q);
      *reinterpret_cast<uint4*>(gu_row + c) = g;
      *reinterpret_cast<uint4*>(gu_row + inter + c) = u;
    }
  }
}

// The same into staged boxes S (gate) and 2 + S (up), every tile row (the TMA store drops the rows
// past the tensor; pipeline/staged_tile.cuh).
template <int S>
__device__ __forceinline__ void gate_up_subtile_staged(const float (&t)[fp8g::kRegs], const pipe::Frag& f,
                                                       const pipe::Staging& st, const SwiGLU& sw,
                                                       float (&act)[fp8g::kRegs]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = f.row0 + 8 * h;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      uint4 g, u;
      gate_up_group<S>(t, h, q, sw, act, g, u);
      const int c = 4 * q + f.quad;  // the chunk this lane holds after the transposes
      pipe::st_shared_v4(st.chunk(S, r, c), g);
      pipe::st_shared_v4(st.chunk(2 + S, r, c), u);
    }
  }
}

// act of sub-tile 1 where the task has none (I ends inside the block): zeros, never the row's max.
__device__ __forceinline__ void zero_upper_half(float (&act)[fp8g::kRegs]) {
#pragma unroll
  for (int i = fp8g::kRegs / 2; i < fp8g::kRegs; ++i) act[i] = 0.f;
}

// aq = Q(a) of the 128-column I block i0 (act: its fragment; zeros past `inter`): e4m3 to aq (the
// tile's row 0; row pitch inter) for tile rows r < rows, 16-byte stores (pipe::e4m3_row_pieces), the
// row's scale to scale[(i0 / 128) * ld + row_base + r].  Every lane of each quad takes part (the
// row's amax is a quad reduction, then the quad transposes).
__device__ __forceinline__ void store_act_quantized(const float (&act)[fp8g::kRegs], const pipe::Frag& f, int rows,
                                                   uint8_t* aq, float* scale, size_t ld, int row_base, int inter,
                                                   int i0) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const fp8::QuantizedFragRow qr = fp8::quantize_frag_row128(act, h);
    const pipe::E4m3RowPieces pc = pipe::e4m3_row_pieces(qr.q);
    const int r = f.row0 + 8 * h;
    if (r >= rows) continue;
    uint8_t* const row = aq + (size_t)r * inter + i0 + 16 * f.quad;
    *reinterpret_cast<uint4*>(row) = pc.lo;
    if (i0 + 64 < inter) *reinterpret_cast<uint4*>(row + 64) = pc.hi;
    if (f.quad == 0) scale[(size_t)(i0 / fp8::kBlock) * ld + row_base + r] = qr.scale;
  }
}

}  // namespace fp8f
}  // namespace mok
