// Expert parallelism in the "fp8_block" forward (tasks/forward_fp8.cuh): token rows travel to their
// experts' ranks as E4M3 + one fp32 scale per 1 x 128 block, half the NVLink bytes of bf16 rows.
// Built on the bf16 EP machinery of ep.cuh (routed / slot regions, epoch flags, notify, waits, the
// return of the down rows into the source's slot rows, the end-of-launch barrier), which it calls
// and does not change.
//
// The FP8 layout of a rank's routed region (MoEPeers.routed_offset; the region is [max_rows, H]
// bf16, 2 max_rows H bytes, on every rank):
//   byte 0:             e4m3 rows [max_rows, H]          (row r at r H)
//   byte max_rows H:    fp32 scales [ceil(H/128), max_rows]   (block kb of row r at kb max_rows + r)
// which is the layout of the context's xrq / xrq_s (params_fp8.cuh), so the receiving dispatch
// copies a row block as it is.  It fits: 4 ceil(H/128) <= H for every H >= 64 (a multiple of 64).
// max_rows is the group's capacity, the same on every rank (ep::push_rows relies on it too).
//
// Quantisation: each push task quantises its token block of x once, with the one-GPU quantiser
// (fp8f::quantize_x in token order, into the rank's xq / xq_s, the shared expert's A as well),
// then copies the E4M3 bytes and the scales to each route's destination.  So a routed row holds
// the bits the one-GPU dispatch would have made from the same x row.
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

__device__ __forceinline__ float ld_cg_f32(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}

// batched_chunks (row_copy.cuh) with every batch register written on every path (zeros past n):
// a register only written under a predicate keeps its old value otherwise, so ptxas kept the
// batch live around the whole task loop and the GEMM tasks spilled (the reason for
// MOK_ZERO_FILL_ROUTES there too).
template <class Load, class Store>
__device__ __forceinline__ void copy_chunks(long long n, Load load, Store store) {
  constexpr long long kStride = static_cast<long long>(kThreads) * kCopyBatch;
  for (long long base = worker_tid(); base < n; base += kStride) {
    uint4 v[kCopyBatch];
#pragma unroll
    for (int u = 0; u < kCopyBatch; ++u) {
      const long long i = base + static_cast<long long>(u) * kThreads;
      v[u] = i < n ? load(i) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kCopyBatch; ++u) {
      const long long i = base + static_cast<long long>(u) * kThreads;
      if (i < n) store(i, v[u]);
    }
  }
}

// The destination of route `slot`: its rank and row there, or false (and the error word set) for
// a corrupt schedule, so that nothing is written past a buffer (as ep::push_rows checks).
__device__ __forceinline__ bool route_target(const MoESchedule& s, const MoEDims& d, const MoEPeers& pe, int slot,
                                             int* err, int& dst, int& row) {
  dst = s.route_rank[slot];
  row = s.route_row[slot];
  if (dst >= 0 && dst < pe.num_ranks && row >= 0 && row < d.max_rows) return true;
  set_error(err, kErrInternal, __LINE__, slot, row);
  return false;
}

// Fp (FP8), after fp8f::quantize_x quantised token block tb into xq / xq_s and signalled it (its
// workers_sync orders every warp's stores before the loads here): the block's E4M3 rows and scales
// to every route's destination, then push_done += 1 at system scope.  A token's 16-byte chunks on
// adjacent threads; each chunk is loaded once for its k routes.
__device__ __forceinline__ void push_quantized(const MoEFp8ForwardParams& q, int tb) {
  const MoEForwardParams& p = q.p;
  const MoEDims& d = p.dims;
  const MoEPeers& pe = p.peers;
  const int t0 = tb * kBlockM, rows = max(0, min_int(kBlockM, d.tokens - t0));
  const int chunks = d.hidden / 16, kbs = ceil_div(d.hidden, fp8::kBlock);
  copy_chunks(
      static_cast<long long>(rows) * chunks,
      [&](long long i) { return ld_cg_v4(q.qctx.xq + (size_t)t0 * d.hidden + i * 16); },
      [&](long long i, const uint4& v) {
        const int t = t0 + static_cast<int>(i / chunks);
        const size_t c = static_cast<size_t>(i % chunks) * 16;
        for (int j = 0; j < d.top_k; ++j) {
          int dst, row;
          if (route_target(p.sched, d, pe, t * d.top_k + j, p.err, dst, row))
            *reinterpret_cast<uint4*>(routed_q(pe, dst) + (size_t)row * d.hidden + c) = v;
        }
      });
  for (int i = worker_tid(); i < rows * kbs; i += kThreads) {
    const int t = t0 + i / kbs, kb = i % kbs;
    const float s = ld_cg_f32(q.qctx.xq_s + (size_t)kb * q.plan8.token_ld + t);
    for (int j = 0; j < d.top_k; ++j) {
      int dst, row;
      if (route_target(p.sched, d, pe, t * d.top_k + j, p.err, dst, row))
        routed_scales(pe, d, dst)[(size_t)kb * d.max_rows + row] = s;
    }
  }
  ep::signal_counter_sys(p.cnt.push_done);
}

// F0 (FP8 with EP), after the producer saw every source's "rows pushed" flag: row block b of this
// rank's routed region -> xrq / xrq_s (the context, and the gate|up GEMMs' A), padding rows zero
// with scale 0 as the one-GPU dispatch writes them; then block_ready[b].  Read through L2 (ld.cg):
// peers wrote the region.
__device__ __forceinline__ void receive_block(const MoEFp8ForwardParams& q, int b) {
  const MoEForwardParams& p = q.p;
  const MoEDims& d = p.dims;
  const uint8_t* const src = routed_q(p.peers, p.peers.rank);
  const float* const src_s = routed_scales(p.peers, d, p.peers.rank);
  const size_t row0 = (size_t)b * kBlockM;
  const int chunks = d.hidden / 16, kbs = ceil_div(d.hidden, fp8::kBlock);
  copy_chunks(
      static_cast<long long>(kBlockM) * chunks,
      [&](long long i) {
        const int r = static_cast<int>(i / chunks);
        return p.sched.row_slot[row0 + r] >= 0 ? ld_cg_v4(src + row0 * d.hidden + i * 16) : make_uint4(0u, 0u, 0u, 0u);
      },
      [&](long long i, const uint4& v) { *reinterpret_cast<uint4*>(q.qctx.xrq + row0 * d.hidden + i * 16) = v; });
  for (int i = worker_tid(); i < kBlockM * kbs; i += kThreads) {
    const size_t at = (size_t)(i / kBlockM) * d.max_rows + row0 + i % kBlockM;  // consecutive threads, consecutive rows
    q.qctx.xrq_s[at] = p.sched.row_slot[row0 + i % kBlockM] >= 0 ? ld_cg_f32(src_s + at) : 0.f;
  }
  signal_counter(p.cnt.block_ready + b);
}

}  // namespace ep8
}  // namespace mok
