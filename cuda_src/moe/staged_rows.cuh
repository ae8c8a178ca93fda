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
#include "moe/params.cuh"
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

// Producer: issues stage `stage` of row block `blk` into the slot at `dst`: routed row r's source
// is row slot / top_k of `src` (x or d_out); padding rows (slot < 0) load nothing.  Row slots are
// read kSlotBatch at a time (mostly L1 hits: 32 per line; a batch of 4 spills the producer's 56
// registers).  Returns the bytes issued, for the slot's expect_tx (issued after the copies: the
// phase cannot complete before that arrival).
constexpr int kSlotBatch = 2;
__device__ __forceinline__ uint32_t issue_stage(const MoESchedule& sc, const MoEDims& d, const bf16* src, int* err,
                                                int blk, int stage, const Stages& g, uint32_t dst, uint32_t bar) {
  const uint32_t row_bytes = static_cast<uint32_t>(d.hidden) * 2u;
  const int r0 = blk * kBlockM + g.first(stage), n = g.size(stage), slots = d.tokens * d.top_k;
  uint32_t bytes = 0;
#pragma unroll 1
  for (int u0 = 0; u0 < n; u0 += kSlotBatch) {
    int slot[kSlotBatch];
#pragma unroll
    for (int u = 0; u < kSlotBatch; ++u) slot[u] = u0 + u < n ? sc.row_slot[r0 + u0 + u] : -1;
#pragma unroll
    for (int u = 0; u < kSlotBatch; ++u) {
      if (slot[u] < 0) continue;
      if (slot[u] >= slots) {  // corrupt schedule: never read past the source (the workers store zeros)
        set_error(err, kErrInternal, __LINE__, r0 + u0 + u, slot[u]);
        continue;
      }
      bulk_load(dst + (u0 + u) * row_bytes, src + (size_t)(slot[u] / d.top_k) * d.hidden, row_bytes, bar);
      bytes += row_bytes;
    }
  }
  return bytes;
}

// Workers: the row block's 128 validated slots and their scales, read once per block (one load
// latency instead of one or two per row).  Function-scope __shared__; every Job that uses it is
// taken after a vote of both warpgroups, so no worker still reads the previous block's.
struct BlockRows {
  int slot[kBlockM];     // -1: padding (or a corrupt slot, which the producer reported)
  float scale[kBlockM];  // the route's weight (the backward), else unused
  __device__ __forceinline__ void load(const MoESchedule& sc, const MoEDims& d, int blk, const float* weights) {
    const int t = worker_tid();
    if (t < kBlockM) {
      const int v = sc.row_slot[blk * kBlockM + t];
      const bool ok = v >= 0 && v < d.tokens * d.top_k;
      slot[t] = ok ? v : -1;
      scale[t] = ok && weights != nullptr ? weights[v] : 1.f;
    }
    workers_sync();
  }
};

// Workers: one routed row from the slot (src, shared address) to dst, times `scale` when `scaled`
// (the register copy's arithmetic: fp32 product, round to bf16); zeros when !valid.
__device__ __forceinline__ void store_row(bf16* dst, uint32_t src, bool valid, bool scaled, float scale, int hidden) {
  const int chunks = hidden / 8;
  for (int c = worker_tid(); c < chunks; c += kThreads) {
    uint4 v = valid ? ld_shared_v4(src + 16u * c) : make_uint4(0u, 0u, 0u, 0u);
    if (valid && scaled) {
      float f[8];
      unpack_bf16x8(v, f);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] *= scale;
      v = pack_bf16x8(f);
    }
    *reinterpret_cast<uint4*>(dst + 8 * c) = v;
  }
}

// Workers: every stage of a row block: wait for its rows, out(r, shared address of the row) for
// each row r of the block (0..127) in the stage, release the slot.  True for every worker when no
// wait failed (a ring wait fails only on a bug; the workers then stop together, as after a GEMM).
template <class Out>
__device__ __forceinline__ bool drain_stages(const ws::Shared& s, wg::PipeState& ps, const Stages& g, int hidden,
                                             const MbarWaitCtx& w, Out out) {
  const uint32_t row_bytes = static_cast<uint32_t>(hidden) * 2u;
  bool failed = false;
  for (int st = 0; st < g.count; ++st) {
    if (!failed) failed = !mbar_wait(s.ring.full(ps.slot), ps.phase, w);
    const uint32_t base = s.ring.a_tile(ps.slot);
    const int r0 = g.first(st), n = g.size(st);
    for (int u = 0; u < n; ++u) out(r0 + u, base + u * row_bytes);
    __syncwarp();  // every lane of the warp has read the slot before lane 0 frees it
    if ((threadIdx.x & 31) == 0) mbar_arrive(s.ring.empty(ps.slot));
    ps.advance(ws::kStages);
  }
  return !workers_any(failed);
}

}  // namespace rows
}  // namespace mok
