// Memory-level parallelism for the copy tasks (dispatch, push, combine).
//
// A loop of "load a 16-byte chunk, store it" keeps one load in flight per thread: the store needs
// the value, and neither the compiler (the loads are volatile asm / may alias the stores) nor the
// hardware lets the next load pass it.  256 threads x 16 B per ~1 us of latency is ~4 GB/s per
// SM, which made every 128-row dispatch of the qwen3 shape cost ~100-200 us of its SM.  Here
// each worker thread issues a batch of kCopyBatch independent loads, then uses them.
#pragma once
#include "common/mma.cuh"
#include "moe/tasks/task_graph.cuh"

namespace mok {

constexpr int kCopyBatch = 8;  // 16-byte loads in flight per thread (32 registers)

// Every batch register below is written on every path (zeros where nothing is loaded).  Why: a
// register only written under a predicate keeps its old value otherwise, so ptxas kept the whole
// batch (32 registers) live around the callers' task loop, through every other task's body: the
// FP8 GEMM mainloops spilled for it, and the bf16 forward with the combine's two chunks a thread.

// For every chunk index i < n of this CTA's workers, in batches: v = load(i) for the whole batch
// first, then store(i, v) for each.  load/store are called only for i < n.
template <class Load, class Store>
__device__ __forceinline__ void batched_chunks(long long n, Load load, Store store) {
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

// Up to kCopyBatch routes' 16-byte chunks of one token, loaded together: v[u] = chunk of route
// j0 + u for u < min(kCopyBatch, top_k - j0).  `row(j)` is the element offset of route j's chunk.
// The other chunks are zeros.
template <class RowPtr>
__device__ __forceinline__ int load_routes(uint4 (&v)[kCopyBatch], int j0, int top_k, RowPtr ptr) {
  const int n = min_int(kCopyBatch, top_k - j0);
#pragma unroll
  for (int u = 0; u < kCopyBatch; ++u) {
    v[u] = u < n ? ld_cg_v4(ptr(j0 + u)) : make_uint4(0u, 0u, 0u, 0u);
  }
  return n;
}

}  // namespace mok
