// Expert parallelism in the "fp8_block" forward and backward (tasks/forward_fp8.cuh,
// backward_fp8.cuh): token rows (x, then d_out) travel to their experts' ranks as E4M3 + one fp32
// scale per 1 x 128 block, half the NVLink bytes of bf16 rows; expert rows return in bf16.
// Built on the bf16 EP machinery of ep.cuh (routed / slot regions, epoch flags, notify, waits, the
// return of the down rows into the source's slot rows, the end-of-launch barrier), which it calls
// and does not change.
//
// The FP8 layout of a rank's routed region (MoEPeers.routed_offset; the region is [max_rows, H]
// bf16, 2 max_rows H bytes, on every rank):
//   byte 0:             e4m3 rows [max_rows, H]          (row r at r H)
//   byte max_rows H:    fp32 scales [ceil(H/128), max_rows]   (block kb of row r at kb max_rows + r)
//   byte max_rows (H + 4 ceil(H/128)):  fp32 routing weights [max_rows]   (backward only)
// which is the layout of xrq / xrq_s (params_fp8.cuh) and of dyq / rs's first H/128 rows
// (params_fp8_bwd.cuh), so the receiving dispatch copies a row block as it is.  It fits:
// 4 ceil(H/128) + 4 <= H for every H >= 64 (a multiple of 64).  max_rows is the group's capacity,
// the same on every rank (the bf16 push, ep::push_token_rows, relies on it too).
//
// Quantisation: each push task quantises its token block once, with the one-GPU quantiser (x:
// fp8f::quantize_x in token order into xq / xq_s, the shared expert's A as well; d_out:
// fp8b::quantize_dout in token order into dq / ts / dq_bf, the shared expert's), then copies the
// E4M3 bytes and the scales to each route's destination.  So a routed row holds the bits the
// one-GPU dispatch would have made from the same source row.  The backward quantises d_out
// unweighted (tw scales the fp32 dA), so each route's weight travels too: the destination's dA
// epilogue reads it from the region, and its dispatch makes dy_routed = bf16(deq(dyq) * (tw * s))
// as fp8b::DequantToBf16 does on one GPU.
#pragma once
#include "moe/params_fp8.cuh"
#include "moe/tasks/ep.cuh"
#include "moe/tasks/row_copy.cuh"

namespace mok {
namespace ep8 {

__device__ __forceinline__ uint8_t* routed_q(const MoEPeers& pe, int r) {
  return reinterpret_cast<uint8_t*>(ep::routed_rows(pe, r));
}
__device__ __forceinline__ float* routed_scales(const MoEPeers& pe, const MoEDims& d, int r) {
  return reinterpret_cast<float*>(routed_q(pe, r) + (size_t)d.max_rows * d.hidden);
}

__device__ __forceinline__ float* routed_weights(const MoEPeers& pe, const MoEDims& d, int r) {
  return routed_scales(pe, d, r) + (size_t)ceil_div(d.hidden, fp8::kBlock) * d.max_rows;
}

__device__ __forceinline__ float ld_cg_f32(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
// L2 loads of peer-written data, zeros where !pred; every register written either way (a register
// written only under a predicate stays live around the task loop: see batched_chunks in row_copy.cuh).
__device__ __forceinline__ uint4 ld_cg_v4_or_zero(const void* p, bool pred) {
  uint4 v;
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t"
               "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
               "@p ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "r"(static_cast<int>(pred))
               : "memory");
  return v;
}
__device__ __forceinline__ float ld_cg_f32_or_zero(const float* p, bool pred) {
  float v;
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %2, 0;\n\tmov.b32 %0, 0;\n\t@p ld.global.cg.f32 %0, [%1];\n\t}"
               : "=f"(v)
               : "l"(p), "r"(static_cast<int>(pred))
               : "memory");
  return v;
}

// The destination of route `slot`: its rank and row there, or false (and the error word set) for
// a corrupt schedule, so that nothing is written past a buffer (as ep::push_token_rows checks).
__device__ __forceinline__ bool route_target(const MoESchedule& s, const MoEDims& d, const MoEPeers& pe, int slot,
                                             int* err, int& dst, int& row) {
  dst = s.route_rank[slot];
  row = s.route_row[slot];
  if (dst >= 0 && dst < pe.num_ranks && row >= 0 && row < d.max_rows) return true;
  set_error(err, kErrInternal, __LINE__, slot, row);
  return false;
}

// A push task, after its token block tb was quantised in token order (src(): e4m3 [*, H]; scale(kb,
// t): the fp32 scale of token t's K block kb) and signalled (the signal's workers_sync orders every
// warp's stores before the loads here): the block's E4M3 rows and scales, and with `weights`
// (backward) each route's weight, to every route's destination; then push_done += 1 at system
// scope.  A token's 16-byte chunks on adjacent threads; each chunk is loaded once for its k
// routes.  The sources are accessors, not pointers: read from the parameter struct where used, they
// take no registers through the loops (as pointer arguments the forward's workers spilled 16 B).
template <class Src, class Scale>
__device__ __forceinline__ void push_quantized(const MoESchedule& sc, const MoEDims& d, const MoEPeers& pe, int tb,
                                               Src src, Scale scale, const float* weights, int* push_done, int* err) {
  const int t0 = tb * kBlockM, rows = max(0, min_int(kBlockM, d.tokens - t0));
  const int chunks = d.hidden / 16, kbs = ceil_div(d.hidden, fp8::kBlock);
  batched_chunks(
      static_cast<long long>(rows) * chunks,
      [&](long long i) { return ld_cg_v4(src() + (size_t)t0 * d.hidden + i * 16); },
      [&](long long i, const uint4& v) {
        const int t = t0 + static_cast<int>(i / chunks);
        const size_t c = static_cast<size_t>(i % chunks) * 16;
        for (int j = 0; j < d.top_k; ++j) {
          int dst, row;
          if (route_target(sc, d, pe, t * d.top_k + j, err, dst, row))
            *reinterpret_cast<uint4*>(routed_q(pe, dst) + (size_t)row * d.hidden + c) = v;
        }
      });
  for (int i = worker_tid(); i < rows * kbs; i += kThreads) {
    const int t = t0 + i / kbs, kb = i % kbs;
    const float s = ld_cg_f32(scale(kb, t));
    for (int j = 0; j < d.top_k; ++j) {
      int dst, row;
      if (route_target(sc, d, pe, t * d.top_k + j, err, dst, row))
        routed_scales(pe, d, dst)[(size_t)kb * d.max_rows + row] = s;
    }
  }
  if (weights != nullptr) {
    for (int i = worker_tid(); i < rows * d.top_k; i += kThreads) {
      const int slot = t0 * d.top_k + i;
      int dst, row;
      if (route_target(sc, d, pe, slot, err, dst, row)) routed_weights(pe, d, dst)[row] = __ldg(weights + slot);
    }
  }
  ep::signal_counter_sys(push_done);
}

// The scales of row block b of this rank's routed region -> dst_s (fp32 [ceil(H/128), max_rows]),
// 0 for padding rows.
__device__ __forceinline__ void receive_scales(const MoESchedule& sc, const MoEDims& d, const MoEPeers& pe, int b,
                                               float* dst_s) {
  const float* const src_s = routed_scales(pe, d, pe.rank);
  const size_t row0 = (size_t)b * kBlockM;
  for (int i = worker_tid(); i < kBlockM * ceil_div(d.hidden, fp8::kBlock); i += kThreads) {
    const size_t at = (size_t)(i / kBlockM) * d.max_rows + row0 + i % kBlockM;  // consecutive threads, consecutive rows
    dst_s[at] = sc.row_slot[row0 + i % kBlockM] >= 0 ? ld_cg_f32(src_s + at) : 0.f;
  }
}

// F0 (FP8 with EP), after the producer saw every source's "rows pushed" flag: row block b of this
// rank's routed region -> xrq / xrq_s (the context, and the gate|up GEMMs' A), padding rows zero
// with scale 0 as the one-GPU dispatch writes them; then block_ready[b].  Read through L2 (ld.cg):
// peers wrote the region.
__device__ __forceinline__ void receive_block(const MoEFp8ForwardParams& q, int b) {
  const MoEForwardParams& p = q.p;
  const MoEDims& d = p.dims;
  const uint8_t* const src = routed_q(p.peers, p.peers.rank);
  const size_t row0 = (size_t)b * kBlockM;
  const int chunks = d.hidden / 16;
  batched_chunks(
      static_cast<long long>(kBlockM) * chunks,
      [&](long long i) {
        const int r = static_cast<int>(i / chunks);
        return p.sched.row_slot[row0 + r] >= 0 ? ld_cg_v4(src + row0 * d.hidden + i * 16) : make_uint4(0u, 0u, 0u, 0u);
      },
      [&](long long i, const uint4& v) { *reinterpret_cast<uint4*>(q.qctx.xrq + row0 * d.hidden + i * 16) = v; });
  receive_scales(p.sched, d, p.peers, b, q.qctx.xrq_s);
  signal_counter(p.cnt.block_ready + b);
}

// The routing weight of routed row `row` on this rank (the dA epilogue's tw), 0 for padding rows.
__device__ __forceinline__ float routed_weight(const MoESchedule& sc, const MoEDims& d, const MoEPeers& pe, int row) {
  return ld_cg_f32_or_zero(routed_weights(pe, d, pe.rank) + row, sc.row_slot[row] >= 0);
}

// B0 (FP8 with EP), after every source's "rows pushed" flag: row block b of the routed region ->
// dyq (e4m3) and rs's first H/128 rows (the dA GEMM's A), and dy_routed = bf16(deq * (tw * s)) (the
// wgrad's A: fp8b::DequantToBf16's arithmetic, the same bits); padding rows zero, scale 0.  Then
// block_dy_ready[b], expert_dy_ready[e].  16 E4M3 per thread and step, kBatch steps in flight.
__device__ __forceinline__ void receive_dq_block(const MoESchedule& sc, const MoEDims& d, const MoEPeers& pe, int b,
                                                 uint8_t* dyq, float* rs, bf16* dy_routed) {
  constexpr int kBatch = 4;
  const uint8_t* const src = routed_q(pe, pe.rank);
  const float* const src_s = routed_scales(pe, d, pe.rank);
  const float* const src_w = routed_weights(pe, d, pe.rank);
  const int cpr = d.hidden / 16, n = kBlockM * cpr, row0 = b * kBlockM;
  for (int base = worker_tid(); base < n; base += kThreads * kBatch) {
    uint4 v[kBatch];
    float m[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * kThreads, row = row0 + min_int(i, n - 1) / cpr, c = i % cpr * 16;
      const bool ok = i < n && sc.row_slot[row] >= 0;
      v[u] = ld_cg_v4_or_zero(src + (size_t)row * d.hidden + c, ok);
      m[u] = ld_cg_f32_or_zero(src_w + row, ok) * ld_cg_f32_or_zero(src_s + (size_t)(c / fp8::kBlock) * d.max_rows + row, ok);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * kThreads;
      if (i >= n) break;
      const size_t at = (size_t)row0 * d.hidden + (size_t)i * 16;  // element offset of the chunk
      *reinterpret_cast<uint4*>(dyq + at) = v[u];
      const uint32_t e[4] = {v[u].x, v[u].y, v[u].z, v[u].w};  // 16 E4M3, low byte first
      uint32_t w[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float2 f = fp8::e4m3x2_to_f32(e[k >> 1] >> (16 * (k & 1)));  // exact
        w[k] = pack_bf16x2(f.x * m[u], f.y * m[u]);
      }
      uint4* const o = reinterpret_cast<uint4*>(dy_routed + at);
      o[0] = make_uint4(w[0], w[1], w[2], w[3]);
      o[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
  }
  receive_scales(sc, d, pe, b, rs);
}

}  // namespace ep8
}  // namespace mok
