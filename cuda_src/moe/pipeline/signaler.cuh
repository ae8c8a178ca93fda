// The signaler: one thread of the producer warpgroup (warp 1, lane 0) that performs the workers'
// counter releases, so that the release's wait for the CTA's stores (MEMBAR.GPU before the red)
// holds no worker warp.  With the release in worker 0 (task_graph.cuh signal_counter), warp 0 of
// warpgroup 0 stood in that wait after every tile, and that warpgroup's next MMAs with it (wgmma is
// warpgroup-collective): ~0.5 us of each FP8 tile (bench/NOTES-FP8-2.md round 15).
//
// Hand-off: the workers' writes -> (proxy fence if a TMA reads them) -> worker barrier -> worker 0
// writes {counter, add} into a free entry and arrives on its `full` mbarrier (release.cta) -> the
// signaler's wait (acquire.cta) -> red.release.gpu.  The release is cumulative over what the
// signaler's acquire saw, which includes everything the workers wrote before their barrier: the
// same chain as worker 0's own release after that barrier.  A stop entry (counter == nullptr) ends
// the signaler.  Entries are reused in order; worker 0 waits for an entry's `empty` arrival before
// refilling it (a tile is ~10 us, a release ~1 us: the wait normally passes at once).
// Bounds: the signaler's wait has none of its own.  The gap between two of its CTA's posts is not
// one dependency wait (under EP several waits of 2-3 timeouts each can follow one another), so any
// bound would fail healthy runs; every return of the worker loop posts the stop entry, and the
// workers' own waits are bounded, so the signaler ends when they do.  A post that finds no free
// entry in time records kErrTimeout (what = kWhatSignalPost) and drops the release: the launch
// fails through the error word (a vote of the workers per task would cost a barrier).
// Trace: a task's `end` (trace.cuh) is stamped when worker 0 has posted, before the release itself.
#pragma once
#include "common/mbarrier.cuh"
#include "common/ptx.cuh"
#include "moe/tasks/task_graph.cuh"

namespace mok {
namespace pipe {

constexpr int kWhatSignalPost = -5;  // MbarWaitCtx::what of a post that found no free entry

struct Signals {
  static constexpr int kEntries = 4;
  int** counter;     // [kEntries], shared
  int* add;          // [kEntries], shared
  int* head;         // worker 0's next entry (shared: a register across the task bodies spills)
  uint32_t bars;     // full[i] at +8 i, empty[i] at +8 (kEntries + i)
  __device__ __forceinline__ uint32_t full(int i) const { return bars + 8u * i; }
  __device__ __forceinline__ uint32_t empty(int i) const { return bars + 8u * (kEntries + i); }

  // The CTA's entries (static shared memory).
  __device__ __forceinline__ static Signals of() {
    __shared__ int* s_counter[kEntries];
    __shared__ int s_add[kEntries];
    __shared__ int s_head;
    __shared__ __align__(8) unsigned long long s_bars[2 * kEntries];
    return Signals{s_counter, s_add, &s_head, smem_u32(s_bars)};
  }
  // Thread 0, before the CTA's first __syncthreads after it.
  __device__ __forceinline__ void init() const {
    for (int i = 0; i < kEntries; ++i) {
      mbar_init(full(i), 1);
      mbar_init(empty(i), 1);
    }
    *head = 0;
  }

  // Worker 0 (after the worker barrier that follows the writes): hand counter += add to the
  // signaler.  False when no entry came free in time (kErrTimeout recorded, what = kWhatSignalPost).
  __device__ __forceinline__ bool post(int* c, int a, const MbarWaitCtx& w) const {
    const int n = *head;
    const int i = n % kEntries;
    const uint32_t phase = static_cast<uint32_t>(n / kEntries) & 1u;
    MbarWaitCtx wp = w;
    wp.what = kWhatSignalPost;
    if (!mbar_wait(empty(i), phase ^ 1u, wp)) return false;
    counter[i] = c;
    add[i] = a;
    mbar_arrive(full(i));  // release.cta: the entry and what the workers wrote before their barrier
    *head = n + 1;
    return true;
  }
  // Worker 0, when the worker loop has returned: the stop entry.  Its wait does not watch the
  // error word (the signaler must end either way).
  __device__ __forceinline__ void stop(int* err, long long timeout_ns, int rank) const {
    post(nullptr, 0, MbarWaitCtx{err, timeout_ns, rank, kWhatSignalPost, false});
  }

  // The signaler thread: releases until the stop entry (unbounded waits: see the top of the file).
  __device__ __forceinline__ void run() const {
    for (int n = 0;; ++n) {
      const int i = n % kEntries;
      while (!mbar_try_wait(full(i), static_cast<uint32_t>(n / kEntries) & 1u)) {
      }
      int* const c = counter[i];
      const int a = add[i];
      mbar_arrive(empty(i));
      if (c == nullptr) return;
      red_release_gpu(c, a);
    }
  }
};

// The workers' signal through the signaler: like signal_counter (task_graph.cuh), but worker 0 only
// posts the release.  kForTma: the data is read through TMA (the async proxy) in this launch, so
// each writer fences its generic stores against it first; data read with generic loads needs none.
template <bool kForTma>
__device__ __forceinline__ void signal_posted(const Signals& sg, int* counter, const MbarWaitCtx& w, int add = 1) {
  if (kForTma) proxy_fence_for_tma();
  workers_sync();
  if (worker_tid() == 0) sg.post(counter, add, w);
}

}  // namespace pipe
}  // namespace mok
