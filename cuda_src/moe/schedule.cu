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

// Prefix of routes per source rank, in shared memory; returns the total number of routes.  One
// thread per source loads its count (independent loads, not a dependent chain on one thread).
__device__ int load_route_bases(const ScheduleParams& p, int* base /* [num_ranks+1] */) {
  for (int s = threadIdx.x; s < p.num_ranks; s += blockDim.x) {
    // A peer's count is read through L2 (.cg): it was written by another GPU.
    const int t = p.tokens_on_device ? __ldcg(reinterpret_cast<const int*>(p.src_tokens_at[s])) : p.src_tokens[s];
    base[s + 1] = t * p.top_k;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int acc = 0;
    for (int s = 0; s < p.num_ranks; ++s) {
      const int n = base[s + 1];
      base[s] = acc;
      acc += n;
    }
    base[p.num_ranks] = acc;
  }
  __syncthreads();
  return base[p.num_ranks];
}

// Exclusive prefix sum of one 64-bit value per thread over the whole CTA (fixed order: the
// result does not depend on timing).  `warp_sums` holds 32 values of shared memory.
__device__ long long block_exclusive_scan(long long v, long long* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  long long incl = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const long long n = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += n;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    long long w = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const long long n = __shfl_up_sync(0xffffffffu, w, off);
      if (lane >= off) w += n;
    }
    if (lane < warps) warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const long long before = warp == 0 ? 0 : warp_sums[warp - 1];
  __syncthreads();  // warp_sums may be reused by the caller
  return before + incl - v;
}

__device__ __forceinline__ int saturate_int(long long v) { return (int)min(v, 0x7fffffffLL); }

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
// padding rows, capacity check.  Every step is spread over the CTA's threads: a scan over the
// experts' padded counts in shared memory (not one thread walking E_l experts with dependent
// global loads), then one thread per expert, row block or padding row.
extern "C" __global__ void __launch_bounds__(kScheduleThreads, 1)
schedule_scan(const __grid_constant__ ScheduleParams p) {
  extern __shared__ __align__(8) int smem[];
  const int E = p.num_experts;
  long long* pre = reinterpret_cast<long long*>(smem);  // [E + 1] exclusive prefix of padded counts
  int* cnt = reinterpret_cast<int*>(pre + E + 1);       // [E] routes per global expert
  int* base = cnt + E;                                  // [num_ranks + 1]
  __shared__ long long warp_sums[32];
  __shared__ int first_over;
  if (error_set(p.err)) return;
  const int total = load_route_bases(p, base);
  const int nchunks = max(1, (total + kScheduleChunk - 1) / kScheduleChunk);
  if (threadIdx.x == 0) first_over = 0x7fffffff;
  // Chunk counts -> exclusive chunk bases, per expert.  Loads first, in groups, so that they are
  // in flight together (the stores could alias them otherwise).
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int run = 0;
    constexpr int kGroup = 8;
    for (int c0 = 0; c0 < nchunks; c0 += kGroup) {
      int v[kGroup];
#pragma unroll
      for (int i = 0; i < kGroup; ++i) v[i] = c0 + i < nchunks ? p.chunk_count[(size_t)(c0 + i) * E + e] : 0;
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        if (c0 + i < nchunks) p.chunk_count[(size_t)(c0 + i) * E + e] = run;
        run += v[i];
      }
    }
    p.expert_total[e] = run;
    cnt[e] = run;
  }
  __syncthreads();
  const int El = p.experts_per_rank;
  const long long bm = p.block_m;
  // Every expert's padded row count, scanned over all experts in global order; destination d's
  // offsets are then differences within its segment [d*El, (d+1)*El).
  {
    const int per = (E + blockDim.x - 1) / blockDim.x;
    const int i0 = min(E, (int)threadIdx.x * per), i1 = min(E, i0 + per);
    long long sum = 0;
    for (int i = i0; i < i1; ++i) sum += (cnt[i] + bm - 1) / bm * bm;
    long long at = block_exclusive_scan(sum, warp_sums);
    for (int i = i0; i < i1; ++i) { pre[i] = at; at += (cnt[i] + bm - 1) / bm * bm; }
    if (threadIdx.x == blockDim.x - 1) pre[E] = at;
  }
  __syncthreads();
  const long long mine0 = pre[p.rank * El];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int d = e / El, le = e - d * El;
    const long long off = pre[e] - pre[d * El];
    p.expert_row_base[e] = saturate_int(off);
    if (d == p.rank) { p.expert_count[le] = cnt[e]; p.expert_offset[le] = saturate_int(off); }
  }
  // Every destination's row count is checked, so that with expert parallelism every rank
  // reports an overflow anywhere (the same error on all ranks: nobody starts a layer that a
  // peer cannot run); the first overflowing destination is named, on every rank the same.
  for (int d = threadIdx.x; d < p.num_ranks; d += blockDim.x) {
    if (pre[(d + 1) * El] - pre[d * El] > p.max_rows) atomicMin(&first_over, d);
  }
  const long long rows = pre[(p.rank + 1) * El] - mine0;
  if (threadIdx.x == 0) {
    p.expert_offset[El] = saturate_int(rows);
    const bool fits = rows <= p.max_rows;
    p.totals[0] = fits ? (int)(rows / bm) : 0;
    p.totals[1] = fits ? (int)rows : 0;
  }
  __syncthreads();
  if (threadIdx.x == 0 && first_over != 0x7fffffff) {
    const int d = first_over;
    set_error(p.err, kErrCapacity, d, saturate_int(pre[(d + 1) * El] - pre[d * El]), p.max_rows);
  }
  __syncthreads();
  if (error_set(p.err)) return;
  // This rank's layout fits (rows <= max_rows): 32-bit offsets from here on.
  const long long* own = pre + p.rank * El;  // own[le] - mine0: padded offset of local expert le
  const int nb = (int)(rows / bm);
  for (int b = threadIdx.x; b < nb; b += blockDim.x) {
    // The last local expert whose offset is <= the block's first row (empty experts share an
    // offset with their successor, so the last one is the one that owns the row).
    const long long row = (long long)b * bm + mine0;
    int lo = 0, hi = El - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (own[mid] <= row) lo = mid; else hi = mid - 1;
    }
    p.block_expert[b] = lo;
  }
  for (int idx = threadIdx.x; idx < El * p.block_m; idx += blockDim.x) {
    const int le = idx / p.block_m, i = idx - le * p.block_m;
    const int row = (int)(own[le] - mine0) + cnt[p.rank * El + le] + i;
    if (row < (int)(own[le + 1] - mine0)) { p.row_src_rank[row] = -1; p.row_slot[row] = -1; }
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

// Expert parallelism: the blocks' dispatch order (BlockOrderParams, schedule_params.cuh).  One CTA:
// a key per block (from its rows' largest slot, 16-byte loads), a histogram of the keys, then warp w
// places the blocks of keys w, w + 32, ... in block order (ballot + popc: stable, no
// order-dependent atomics, so the order is a function of the schedule alone).
extern "C" __global__ void __launch_bounds__(kScheduleThreads, 1)
schedule_block_order(const __grid_constant__ BlockOrderParams p) {
  extern __shared__ int key[];                // [max_blocks]
  __shared__ int first[kOrderKeys + 1];       // first position of each key
  const int nb = p.keyed ? min(max(p.totals[0], 0), p.max_blocks) : 0;  // (the passes report a capacity error)
  for (int i = threadIdx.x; i <= kOrderKeys; i += blockDim.x) first[i] = 0;
  __syncthreads();
  for (int b = threadIdx.x; b < nb; b += blockDim.x) {
    const int4* rows = reinterpret_cast<const int4*>(p.row_slot + (size_t)b * p.block_m);
    int last = -1;
    for (int i = 0; i < p.block_m / 4; ++i) {
      const int4 v = rows[i];
      last = max(last, max(max(v.x, v.y), max(v.z, v.w)));
    }
    const int k = min(max(last, 0) / max(p.wave_routes, 1), kOrderKeys - 1);
    key[b] = k;
    atomicAdd(&first[k + 1], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int k = 0; k < kOrderKeys; ++k) first[k + 1] += first[k];
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int k = warp; k < kOrderKeys; k += blockDim.x >> 5) {
    int pos = first[k];
    const int stop = first[k + 1];
    for (int b0 = 0; b0 < nb && pos < stop; b0 += 32) {
      const int b = b0 + lane;
      const bool mine = b < nb && key[b] == k;
      const unsigned m = __ballot_sync(0xffffffffu, mine);
      if (mine) p.block_order[pos + __popc(m & lanes_below)] = b;
      pos += __popc(m);
    }
  }
  for (int i = nb + threadIdx.x; i < p.max_blocks; i += blockDim.x) p.block_order[i] = i;
}
