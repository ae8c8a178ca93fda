// Row-block copies through the GEMM ring: the dispatch tasks of the TMA kernels.
//
// A register copy (row_copy.cuh) keeps ~32 KB in flight per SM.  The timelines measured the
// dispatch that way at 8-10 GB/s per SM: ~230 us per 128-row block of deepseek-v3 (1.8 MB),
// 7-14 % of the SM time of a forward.  Here the producer thread streams the block's source rows
// into the ring slots with 1-D bulk copies (one per row, completion credited to the slot's full
// barrier), so up to kStages x 48 KB are in flight, and the workers store each slot's rows to the
// routed buffer (16-byte ld.shared / st.global; zeros for padding rows; the backward's route
// weight applied on the way, with the register copy's arithmetic) and release the slot as a
// GEMM releases a k-tile.  Producer and workers walk the same stages, so the ring stays in step
// with the GEMM Jobs around the copy.
#pragma once
#include "moe/ws_pipeline.cuh"

namespace mok {
namespace rows {

constexpr int kMaxRowsPerStage = kBlockM;  // small H: the whole block in few stages

// How a row block splits into ring stages: `rows` whole rows per stage (0: a row does not fit
// in a slot, H > 24576; the caller then keeps the register copy).
struct Stages {
  int rows, count;
  __device__ __forceinline__ static Stages of(int hidden) {
    const int rows = min_int(kMaxRowsPerStage, ws::Geometry::kStageBytes / (hidden * 2));
    return Stages{rows, rows > 0 ? ceil_div(kBlockM, rows) : 0};
  }
  __device__ __forceinline__ int first(int stage) const { return stage * rows; }
  __device__ __forceinline__ int size(int stage) const { return min_int(rows, kBlockM - stage * rows); }
};

// Producer: issues stage `stage` of row block `blk` into the slot at `dst`; src(row) is the
// source row of routed row `row` (nullptr: padding, nothing loaded).  Returns the bytes issued,
// for the slot's expect_tx (issued after the copies: the phase cannot complete before the arrival).
template <class Src>
__device__ __forceinline__ uint32_t issue_stage(int blk, int stage, const Stages& g, int hidden, uint32_t dst,
                                                uint32_t bar, Src src) {
  const uint32_t row_bytes = static_cast<uint32_t>(hidden) * 2u;
  const int r0 = blk * kBlockM + g.first(stage), n = g.size(stage);
  uint32_t bytes = 0;
#pragma unroll 1
  for (int u = 0; u < n; ++u) {
    const bf16* p = src(r0 + u);
    if (p == nullptr) continue;
    bulk_load(dst + u * row_bytes, p, row_bytes, bar);
    bytes += row_bytes;
  }
  return bytes;
}

// Workers: one routed row from the slot (src, shared address) to dst, times *weight when given
// (the register copy's arithmetic: fp32 product, round to bf16); zeros when !valid.
__device__ __forceinline__ void store_row(bf16* dst, uint32_t src, bool valid, const float* weight, int hidden) {
  const int chunks = hidden / 8;
  const float scale = valid && weight != nullptr ? *weight : 1.f;
  for (int c = worker_tid(); c < chunks; c += kThreads) {
    uint4 v = valid ? ld_shared_v4(src + 16u * c) : make_uint4(0u, 0u, 0u, 0u);
    if (valid && weight != nullptr) {
      float f[8];
      unpack_bf16x8(v, f);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] *= scale;
      v = pack_bf16x8(f);
    }
    *reinterpret_cast<uint4*>(dst + 8 * c) = v;
  }
}

// Workers: every stage of row block `blk`: wait for its rows, out(row, shared address of the
// row) for each, release the slot.  True for every worker when no wait failed (a ring wait
// fails only on a bug; the workers then stop together, as after a GEMM).
template <class Out>
__device__ __forceinline__ bool drain_stages(const ws::Shared& s, wg::PipeState& ps, int blk, const Stages& g,
                                             int hidden, const MbarWaitCtx& w, Out out) {
  const uint32_t row_bytes = static_cast<uint32_t>(hidden) * 2u;
  bool failed = false;
  for (int st = 0; st < g.count; ++st) {
    if (!failed) failed = !mbar_wait(s.ring.full(ps.slot), ps.phase, w);
    const uint32_t base = s.ring.a_tile(ps.slot);
    const int r0 = blk * kBlockM + g.first(st), n = g.size(st);
    for (int u = 0; u < n; ++u) out(r0 + u, base + u * row_bytes);
    __syncwarp();  // every lane of the warp has read the slot before lane 0 frees it
    if ((threadIdx.x & 31) == 0) mbar_arrive(s.ring.empty(ps.slot));
    ps.advance(ws::kStages);
  }
  return !workers_any(failed);
}

}  // namespace rows
}  // namespace mok
