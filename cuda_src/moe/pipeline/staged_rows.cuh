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
#include "moe/pipeline/pipeline.cuh"

namespace mok {
namespace rows {

constexpr int kMaxRowsPerStage = kBlockM;  // small H: the whole block in few stages

// How a row block splits into ring stages: `rows` whole rows per stage (0: a row does not fit
// in a slot, H > 24576; the caller then keeps the register copy).
struct Stages {
  int rows, count;
  __device__ __forceinline__ static Stages of(int hidden) {
    const int rows = min_int(kMaxRowsPerStage, pipe::Geometry::kStageBytes / (hidden * 2));
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

// A Job streams `stages` stages through the ring when stages > 0 (0: the task keeps its register
// path, e.g. with EP or rows too wide for a slot).
__device__ __forceinline__ void use_ring(pipe::Job& job, int stages) {
  if (stages <= 0) return;
  job.gemm = pipe::kLoadRows;
  job.k_tiles = stages;
}

// Workers: `count` stages from the ring in order: wait for stage st to land, body(st, shared
// address of the slot), release the slot.  True for every worker when no wait failed (a ring wait
// fails only on a bug; the workers then stop together, as after a GEMM).
template <class Body>
__device__ __forceinline__ bool for_each_stage(const pipe::Shared& s, wg::PipeState& ps, int count,
                                               const MbarWaitCtx& w, Body body) {
  bool failed = false;
  for (int st = 0; st < count; ++st) {
    if (!failed) failed = !mbar_wait(s.ring.full(ps.slot), ps.phase, w);
    body(st, s.ring.a_tile(ps.slot));
    // The slot was read with ld.shared (generic proxy) and the producer refills it with a bulk copy
    // (async proxy): order the reads before that write across the proxies, then free the slot.
    fence_proxy_async_shared();
    __syncwarp();  // every lane of the warp has read the slot before lane 0 frees it
    if ((threadIdx.x & 31) == 0) mbar_arrive(s.ring.empty(ps.slot));
    ps.advance(pipe::kStages);
  }
  return !workers_any(failed);
}

// Workers: row block `blk` from the ring into dst (the block's first row of the routed buffer),
// times the route weights when `weights` is given, zeros for padding rows.
__device__ __forceinline__ bool copy_block(const pipe::Shared& s, wg::PipeState& ps, const MoESchedule& sc,
                                           const MoEDims& d, int blk, const float* weights, bf16* dst,
                                           const MbarWaitCtx& w) {
  __shared__ BlockRows br;
  br.load(sc, d, blk, weights);
  const Stages g = Stages::of(d.hidden);
  const uint32_t row_bytes = static_cast<uint32_t>(d.hidden) * 2u;
  return for_each_stage(s, ps, g.count, w, [&](int st, uint32_t base) {
    const int r0 = g.first(st), n = g.size(st);
    for (int u = 0; u < n; ++u) {
      const int r = r0 + u;
      store_row(dst + (size_t)r * d.hidden, base + u * row_bytes, br.slot[r] >= 0, weights != nullptr, br.scale[r],
                d.hidden);
    }
  });
}

// ---- d_topk_weights through the ring (the backward's B1) ----------------------------------------
// d_topk_weights[t, j] = <d_out[t], y_slot[t, j]>: per token k + 1 rows of H, read once.  The
// register version (backward_bodies.cuh d_weights) keeps 4 loads in flight per lane and took
// ~1.8 ms per deepseek-v3 token block.  A stage here is one (token, column piece): the piece of
// d_out[t] and of its k routes' rows (k + 1 bulk copies); warp j < k sums route j's products.
// Lanes walk their 16-byte chunks as the register version does (lane * 8 + 256 i, in order; the
// pieces start at multiples of 256 columns), the sum carries across a token's pieces, and the
// same butterfly ends it: the bits do not depend on the path (EP keeps the register version).
struct RoutePieces {
  int cols, per_token;  // piece width (columns), pieces per token; per_token = 0: not staged
  __device__ __forceinline__ static RoutePieces of(int hidden, int top_k) {
    if (top_k > kThreads / 32) return RoutePieces{0, 0};  // a warp per route
    const int fit = pipe::Geometry::kStageBytes / (2 * (top_k + 1)) / 256 * 256;
    const int cols = min_int(hidden, fit);
    return RoutePieces{cols, cols > 0 ? ceil_div(hidden, cols) : 0};
  }
  __device__ __forceinline__ int width(int piece, int hidden) const { return min_int(cols, hidden - piece * cols); }
};

// Producer: stage `stage` of the token block starting at token t0 (token t0 + stage / per_token).
__device__ __forceinline__ uint32_t issue_route_stage(const bf16* d_out, const bf16* y_slot, int hidden, int top_k,
                                                      int t0, int stage, const RoutePieces& g, uint32_t dst,
                                                      uint32_t bar) {
  const int tok = stage / g.per_token, piece = stage - tok * g.per_token;
  const size_t t = static_cast<size_t>(t0 + tok), c0 = static_cast<size_t>(piece) * g.cols;
  const uint32_t bytes = static_cast<uint32_t>(g.width(piece, hidden)) * 2u;
  const uint32_t row_bytes = static_cast<uint32_t>(g.cols) * 2u;
  bulk_load(dst, d_out + t * hidden + c0, bytes, bar);
#pragma unroll 1
  for (int j = 0; j < top_k; ++j)
    bulk_load(dst + (j + 1) * row_bytes, y_slot + (t * top_k + j) * hidden + c0, bytes, bar);
  return bytes * static_cast<uint32_t>(top_k + 1);
}

// Workers: every stage of a token block of `tokens` tokens from t0; writes d_topk_weights.
__device__ __forceinline__ bool drain_route_stages(const pipe::Shared& s, wg::PipeState& ps, const RoutePieces& g,
                                                   int hidden, int top_k, int t0, int tokens, float* d_topk_weights,
                                                   const MbarWaitCtx& w) {
  const int warp = worker_tid() >> 5, lane = worker_tid() & 31;
  const uint32_t row_bytes = static_cast<uint32_t>(g.cols) * 2u;
  float sum = 0.f;
  return for_each_stage(s, ps, tokens * g.per_token, w, [&](int st, uint32_t g_row) {
    if (warp >= top_k) return;  // warp-uniform
    const int tok = st / g.per_token, piece = st - tok * g.per_token;
    const uint32_t y_row = g_row + (warp + 1) * row_bytes;
    const int width = g.width(piece, hidden);
    for (int c = lane * 8; c < width; c += 32 * 8) {
      float gv[8], yv[8];
      unpack_bf16x8(ld_shared_v4(g_row + 2u * c), gv);
      unpack_bf16x8(ld_shared_v4(y_row + 2u * c), yv);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum = fmaf(gv[i], yv[i], sum);
    }
    if (piece == g.per_token - 1) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (lane == 0) d_topk_weights[static_cast<size_t>(t0 + tok) * top_k + warp] = sum;
      sum = 0.f;
    }
  });
}

}  // namespace rows
}  // namespace mok
