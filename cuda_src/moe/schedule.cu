// The routing schedule: three small launches (count, scan, place) that turn every rank's top-k
// expert ids into this rank's row layout.  A stable counting sort: each chunk of routes counts
// its experts, a scan turns the counts into per-chunk bases, and the place pass ranks routes
// within a chunk with warp match + per-warp counts, so the order inside an expert is exactly
// the global route order -- deterministic, no order-dependent atomics.
// With expert parallelism a fourth launch comes first: schedule_exchange publishes this rank's
// routing and meets every peer (see schedule_params.cuh); every rank then lays out the same
// global routing, so every rank sees an expert id or capacity error of any rank.
#include "comm/barrier.cuh"
#include "common/errors.cuh"
#include "moe/schedule_params.cuh"

using namespace mok;

namespace {

// Prefix of routes per source rank, in shared memory; returns the total number of routes.
__device__ int load_route_bases(const ScheduleParams& p, int* base /* [num_ranks+1] */) {
  if (threadIdx.x == 0) {
    int acc = 0;
    for (int s = 0; s < p.num_ranks; ++s) {
      base[s] = acc;
      // A peer's count is read through L2 (.cg): it was written by another GPU.
      const int t = p.tokens_on_device ? __ldcg(reinterpret_cast<const int*>(p.src_tokens_at[s])) : p.src_tokens[s];
      acc += t * p.top_k;
    }
    base[p.num_ranks] = acc;
  }
  __syncthreads();
  return base[p.num_ranks];
}

__device__ __forceinline__ int source_of(const int* base, int nranks, int g) {
  int s = 0;
  while (s + 1 < nranks && base[s + 1] <= g) ++s;
  return s;
}

// The expert id of global route g (source s, local route r), or -1 with the error word set.
__device__ __forceinline__ int load_expert(const ScheduleParams& p, int s, int r) {
  long long id;
  const void* ids = reinterpret_cast<const void*>(p.src_ids[s]);
  if (p.ids_int64) id = __ldcg(reinterpret_cast<const long long*>(ids) + r);
  else id = __ldcg(reinterpret_cast<const int*>(ids) + r);
  if (id < 0 || id >= p.num_experts) {
    int shown = id > 0x7fffffffLL ? 0x7fffffff : (id < -0x7fffffffLL ? -0x7fffffff : (int)id);
    set_error(p.err, kErrExpertId, s, r / p.top_k, shown);
    return -1;
  }
  return (int)id;
}

}  // namespace

// Pass 0 (expert parallelism only; one CTA): publish this rank's token count and ids (saturated
// to int32) into its routing area, then a group barrier with every peer.  The barrier releases
// the area to the peers (system scope) and returns once every peer has published its own;
// a peer that never arrives makes it record kErrTimeout naming that peer.
extern "C" __global__ void __launch_bounds__(kScheduleThreads)
schedule_exchange(const __grid_constant__ ExchangeParams p) {
  if (error_set(p.err)) return;
  unsigned char* area = reinterpret_cast<unsigned char*>(p.peer_bases[p.rank]) + p.area_offset;
  int* ids_out = reinterpret_cast<int*>(area + kRoutingIdsOffset);
  const int n = p.tokens * p.top_k;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    long long id = p.ids_int64 ? reinterpret_cast<const long long*>(p.ids)[i] : reinterpret_cast<const int*>(p.ids)[i];
    id = id > 0x7fffffffLL ? 0x7fffffffLL : (id < -0x7fffffffLL ? -0x7fffffffLL : id);
    ids_out[i] = (int)id;
  }
  if (threadIdx.x == 0) *reinterpret_cast<int*>(area) = p.tokens;
  const GroupBarrier b{p.peer_bases, p.err, p.pad_offset, p.timeout_ns, p.rank, p.num_ranks};
  cta_group_barrier(b);
}

// Pass 1: per-chunk expert histograms (and id validation).
extern "C" __global__ void __launch_bounds__(kScheduleThreads)
schedule_count(const __grid_constant__ ScheduleParams p) {
  extern __shared__ int smem[];
  int* hist = smem;                         // [num_experts]
  int* base = smem + p.num_experts;         // [num_ranks + 1]
  if (error_set(p.err)) return;
  const int total = load_route_bases(p, base);
  const int c = blockIdx.x;
  const int begin = c * kScheduleChunk;
  if (begin >= total && !(c == 0 && total == 0)) return;
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int end = min(begin + kScheduleChunk, total);
  for (int g = begin + threadIdx.x; g < end; g += blockDim.x) {
    const int s = source_of(base, p.num_ranks, g);
    const int e = load_expert(p, s, g - base[s]);
    if (e >= 0) atomicAdd(&hist[e], 1);   // integer counts: the result does not depend on order
  }
  __syncthreads();
  int* out = p.chunk_count + (size_t)c * p.num_experts;
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) out[e] = hist[e];
}

// Pass 2 (one CTA): chunk bases per expert, per-rank padded offsets, block -> expert map,
// padding rows, capacity check.
extern "C" __global__ void __launch_bounds__(kScheduleThreads)
schedule_scan(const __grid_constant__ ScheduleParams p) {
  extern __shared__ int smem[];
  int* base = smem;                         // [num_ranks + 1]
  int* dest_rows = smem + kMaxRanks + 1;    // [num_ranks] padded rows each destination receives
  if (error_set(p.err)) return;
  const int total = load_route_bases(p, base);
  const int nchunks = max(1, (total + kScheduleChunk - 1) / kScheduleChunk);
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) {
    int run = 0;
    for (int c = 0; c < nchunks; ++c) {
      int* cell = p.chunk_count + (size_t)c * p.num_experts + e;
      const int v = *cell;
      *cell = run;
      run += v;
    }
    p.expert_total[e] = run;
  }
  __syncthreads();
  const int El = p.experts_per_rank;
  const int bm = p.block_m;
  // One thread per destination rank: padded offsets of its experts.  Every destination's row
  // count is checked, so that with expert parallelism every rank reports an overflow anywhere
  // (the same error on all ranks: nobody starts a layer that a peer cannot run).
  for (int d = threadIdx.x; d < p.num_ranks; d += blockDim.x) {
    long long off = 0;
    for (int le = 0; le < El; ++le) {
      const int e = d * El + le;
      const int cnt = p.expert_total[e];
      p.expert_row_base[e] = (int)min(off, 0x7fffffffLL);
      if (d == p.rank) { p.expert_count[le] = cnt; p.expert_offset[le] = (int)min(off, 0x7fffffffLL); }
      off += (long long)(cnt + bm - 1) / bm * bm;
    }
    const int rows = (int)min(off, 0x7fffffffLL);
    dest_rows[d] = rows;
    if (d == p.rank) {
      p.expert_offset[El] = rows;
      if (off > p.max_rows) {
        p.totals[0] = 0; p.totals[1] = 0;
      } else {
        p.totals[0] = rows / bm; p.totals[1] = rows;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // the first overflowing destination, so that every rank reports the same one
    for (int d = 0; d < p.num_ranks; ++d) {
      if (dest_rows[d] > p.max_rows) { set_error(p.err, kErrCapacity, d, dest_rows[d], p.max_rows); break; }
    }
  }
  __syncthreads();
  if (error_set(p.err)) return;
  // Block -> expert and padding rows, one local expert per thread.
  for (int le = threadIdx.x; le < El; le += blockDim.x) {
    const int off = p.expert_offset[le], next = p.expert_offset[le + 1];
    for (int b = off / bm; b < next / bm; ++b) p.block_expert[b] = le;
    for (int row = off + p.expert_count[le]; row < next; ++row) { p.row_src_rank[row] = -1; p.row_slot[row] = -1; }
  }
}

// Pass 3: each route's rank within its expert (stable), hence its row.
extern "C" __global__ void __launch_bounds__(kScheduleThreads)
schedule_place(const __grid_constant__ ScheduleParams p) {
  extern __shared__ int smem[];
  const int E = p.num_experts;
  int* warp_count = smem;                   // [32][E]: routes of expert e in warp w of this sub-chunk
  int* run = smem + 32 * E;                 // [E]: routes of expert e placed so far (chunk base first)
  int* base = run + E;                      // [num_ranks + 1]
  if (error_set(p.err)) return;
  const int total = load_route_bases(p, base);
  const int c = blockIdx.x;
  const int begin = c * kScheduleChunk;
  if (begin >= total) return;
  const int end = min(begin + kScheduleChunk, total);
  for (int e = threadIdx.x; e < E; e += blockDim.x) run[e] = p.chunk_count[(size_t)c * E + e];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int sub = begin; sub < end; sub += blockDim.x) {
    for (int i = threadIdx.x; i < 32 * E; i += blockDim.x) warp_count[i] = 0;
    __syncthreads();
    const int g = sub + threadIdx.x;
    int s = 0, r = 0, e = -1;
    if (g < end) {
      s = source_of(base, p.num_ranks, g);
      r = g - base[s];
      e = load_expert(p, s, r);             // already validated by schedule_count; -1 only on error
    }
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int rank_in_warp = __popc(peers & lanes_below);
    if (e >= 0 && rank_in_warp == 0) warp_count[warp * E + e] = __popc(peers);
    __syncthreads();
    if (e >= 0) {
      int pos = run[e] + rank_in_warp;
      for (int w = 0; w < warp; ++w) pos += warp_count[w * E + e];
      const int row = p.expert_row_base[e] + pos;
      if (s == p.rank) {
        p.route_row[r] = row;
        if (p.route_rank != nullptr) p.route_rank[r] = e / p.experts_per_rank;
      }
      if (e / p.experts_per_rank == p.rank) { p.row_src_rank[row] = s; p.row_slot[row] = r; }
    }
    __syncthreads();
    for (int ex = threadIdx.x; ex < E; ex += blockDim.x) {
      int add = 0;
      for (int w = 0; w < 32; ++w) add += warp_count[w * E + ex];
      run[ex] += add;
    }
    __syncthreads();
  }
}
