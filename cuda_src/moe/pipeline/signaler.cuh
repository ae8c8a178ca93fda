// The signaler: one thread of the producer warpgroup (warp 1, lane 0) that performs the workers'
// counter releases, so that the release's wait for the CTA's stores (MEMBAR.GPU before the red)
// holds no worker warp, and, in the staged FP8 forward, the gate|up tiles' TMA stores of gu
// (pipeline/staged_tile.cuh).  With the release in worker 0 (task_graph.cuh signal_counter), warp 0
// of warpgroup 0 stood in that wait after every tile, and that warpgroup's next MMAs with it (wgmma
// is warpgroup-collective): ~0.5 us of each FP8 tile (bench/NOTES-FP8-2.md round 15).
//
// Hand-off: the workers' writes -> (proxy fence if a TMA reads them: their global outputs, the
// staged boxes) -> worker barrier -> worker 0 writes an entry (with a staged tile, its stores) and arrives on its
// `full` mbarrier (release.cta) -> the signaler's wait (acquire.cta) -> (the boxes' TMA stores) ->
// red.release.gpu.  The release is cumulative over what the signaler's acquire saw, which includes
// everything the workers wrote before their barrier: the same chain as worker 0's own release after
// that barrier.  It does not wait for the staged stores: gu is read only by the backward (a later
// launch; the signaler waits for its stores to complete before the CTA ends).  Once the stores have
// read the boxes, the signaler hands the held ring slot back to the producer (the consumer warps'
// arrivals, which the mainloop held back) and frees box 3.  A stop entry (counter == nullptr,
// slot < 0) ends the signaler.  Entries are reused in order; worker 0 waits for an entry's `empty`
// arrival before refilling it (a tile is ~10 us, a release ~1 us: the wait normally passes at once).
// Bounds: the signaler's wait has none of its own.  The gap between two of its CTA's posts is not
// one dependency wait (under EP several waits of 2-3 timeouts each can follow one another), so any
// bound would fail healthy runs; every return of the worker loop posts the stop entry, and the
// workers' own waits are bounded, so the signaler ends when they do.  A post that finds no free
// entry in time records kErrTimeout (what = kWhatSignalPost) and drops the release: the launch
// fails through the error word (a vote of the workers per task would cost a barrier); a held slot
// is then never handed back, and the producer's bounded wait for it fails too.
// Trace: a task's `end` (trace.cuh) is stamped when worker 0 has posted, before the release itself.
#pragma once
#include "common/mbarrier.cuh"
#include "common/ptx.cuh"
#include "common/tma.cuh"
#include "moe/pipeline/staged_tile.cuh"
#include "moe/tasks/task_graph.cuh"

namespace mok {
namespace pipe {

constexpr int kWhatSignalPost = -5;   // MbarWaitCtx::what of a post that found no free entry
constexpr int kWhatStagingFree = -6;  // ... of a staged tile whose static box was not freed in time

// The stores of a staged gate|up tile, beside its entry's release.
struct StagedStore {
  int slot;                // the held ring slot, or -1: the entry is a plain release
  const TensorMap* map;    // gu / sgu as 2D {2 I, rows}, box {64, 128}
  int gate_col, up_col;    // the tile's first gate and up columns in gu
  int row;                 // its first row
  int subtiles;            // 1 or 2: boxes S and 2 + S for S < subtiles
};

// Entry i is {counter[i], add[i]} (counter nullptr: no release; with no stores, the stop entry)
// and, in the staged kernel, stores[i] (slot -1 unless a staged tile posted it; the signaler sets
// it back), so a plain post writes the same two words in both kernels.
struct Signals {
  static constexpr int kEntries = 4;
  int** counter;          // [kEntries], shared
  int* add;               // [kEntries], shared
  StagedStore* stores;    // [kEntries], shared (read by the staged kernel only)
  int* head;              // worker 0's next entry (shared: a register across the task bodies spills)
  int* staged;            // staged tiles posted so far (shared; read by every worker after a barrier)
  uint32_t bars;          // full[i] at +8 i, empty[i] at +8 (kEntries + i), then the staging's `free`
  __device__ __forceinline__ uint32_t full(int i) const { return bars + 8u * i; }
  __device__ __forceinline__ uint32_t empty(int i) const { return bars + 8u * (kEntries + i); }
  __device__ __forceinline__ uint32_t staging_free() const { return bars + 8u * (2 * kEntries); }

  // The CTA's entries (static shared memory).
  __device__ __forceinline__ static Signals of() {
    __shared__ int* s_counter[kEntries];
    __shared__ int s_add[kEntries];
    __shared__ StagedStore s_stores[kEntries];
    __shared__ int s_head, s_staged;
    __shared__ __align__(8) unsigned long long s_bars[2 * kEntries + 1];
    return Signals{s_counter, s_add, s_stores, &s_head, &s_staged, smem_u32(s_bars)};
  }
  // Thread 0, before the CTA's first __syncthreads after it (kStaged: the staged kernel's parts).
  template <bool kStaged>
  __device__ __forceinline__ void init() const {
    for (int i = 0; i < kEntries; ++i) {
      mbar_init(full(i), 1);
      mbar_init(empty(i), 1);
      if (kStaged) stores[i].slot = -1;
    }
    if (kStaged) {
      mbar_init(staging_free(), 1);
      *staged = 0;
    }
    *head = 0;
  }

  // Worker 0 (after the worker barrier that follows the writes): hand counter += add to the
  // signaler, with a staged tile's stores when `st` is given.  False when no entry came free in
  // time (kErrTimeout recorded, what = kWhatSignalPost).
  __device__ __forceinline__ bool post(int* c, int a, const MbarWaitCtx& w, const StagedStore* st = nullptr) const {
    const int n = *head;
    const int i = n % kEntries;
    const uint32_t phase = static_cast<uint32_t>(n / kEntries) & 1u;
    MbarWaitCtx wp = w;
    wp.what = kWhatSignalPost;
    if (!mbar_wait(empty(i), phase ^ 1u, wp)) return false;
    counter[i] = c;
    add[i] = a;
    if (st != nullptr) stores[i] = *st;
    mbar_arrive(full(i));  // release.cta: the entry and what the workers wrote before their barrier
    *head = n + 1;
    return true;
  }
  // Worker 0, when the worker loop has returned: the stop entry.  Its wait does not watch the
  // error word (the signaler must end either way).
  __device__ __forceinline__ void stop(int* err, long long timeout_ns, int rank) const {
    post(nullptr, 0, MbarWaitCtx{err, timeout_ns, rank, kWhatSignalPost, false});
  }

  // Every worker, after the mainloop of a staged tile (which held its last slot): both warpgroups'
  // MMAs are done with that slot, and box 3 is free.  False for every worker when the wait failed
  // (kErrTimeout recorded).
  __device__ __forceinline__ bool begin_staged(const MbarWaitCtx& w) const {
    workers_sync();
    const uint32_t parity = (static_cast<uint32_t>(*staged) & 1u) ^ 1u;  // the previous staged tile's free
    MbarWaitCtx wf = w;
    wf.what = kWhatStagingFree;
    return !workers_any(!mbar_wait(staging_free(), parity, wf));
  }

  // The signaler thread: posts until the stop entry (unbounded waits: see the top of the file).
  // kStaged: the CTA runs staged gate|up tiles (only that kernel reads `stores`).
  template <bool kStaged>
  __device__ __forceinline__ void run(const Shared& s) const {
    for (int n = 0;; ++n) {
      const int i = n % kEntries;
      while (!mbar_try_wait(full(i), static_cast<uint32_t>(n / kEntries) & 1u)) {
      }
      int* const c = counter[i];
      const int a = add[i];
      const StagedStore st = kStaged ? stores[i] : StagedStore{-1, nullptr, 0, 0, 0, 0};
      if (kStaged && st.slot >= 0) stores[i].slot = -1;  // before the entry is handed back
      mbar_arrive(empty(i));
      if (st.slot < 0) {
        if (c == nullptr) break;
        red_release_gpu(c, a);
        continue;
      }
      const Staging box = Staging::of(s, st.slot);
      for (int sub = 0; sub < st.subtiles; ++sub) {
        tma_store_2d(st.map, box.box(sub), st.gate_col + 64 * sub, st.row);
        tma_store_2d(st.map, box.box(2 + sub), st.up_col + 64 * sub, st.row);
      }
      tma_store_commit();
      if (c != nullptr) red_release_gpu(c, a);
      tma_store_wait_read<0>();
      mbar_arrive_count(s.ring.empty(st.slot), wg::kEmptyArrivals);  // the consumer warps' arrivals
      mbar_arrive(staging_free());
    }
    if (kStaged) tma_store_wait<0>();  // the stores are complete before the CTA ends
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

// The end of a staged gate|up tile: the boxes are written (and the task's other outputs, which a
// TMA reads in this launch); worker 0 posts the stores and the release.
__device__ __forceinline__ void post_staged(const Signals& sg, int* counter, const StagedStore& st,
                                            const MbarWaitCtx& w) {
  fence_proxy_async();  // the boxes (read by TMA stores) and the global outputs (read by TMA loads)
  workers_sync();
  if (worker_tid() == 0) {
    sg.post(counter, 1, w, &st);
    *sg.staged += 1;
  }
}

}  // namespace pipe
}  // namespace mok
