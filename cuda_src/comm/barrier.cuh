// Group barrier across the ranks of a symmetric heap: signal pads, release/acquire at system
// scope, bounded by %globaltimer.
//
// Every rank's symmetric block holds a signal pad of pad_words(size) ints (zeroed at creation):
//   pad[0]      the owner's barrier epoch (read and written only by the owner)
//   pad[1 + s]  the last epoch rank s has signalled to the owner
// A barrier increments the caller's epoch e, stores e into pad[1 + me] of every rank's pad
// (st.release.sys: publishes what the caller wrote before), then waits until every pad[1 + s] of
// its own pad reaches e (ld.acquire.sys).  Epochs only grow, so the barrier is reusable without a
// reset and a fast rank may signal the next epoch while a slow one still checks this one (">=").
// A rank that does not arrive within timeout_ns makes the waiter record kErrTimeout (info: my rank,
// the first missing rank, the epoch) in its error word and return false: no trap, no hang.
#pragma once
#include <stdint.h>

#include "common/errors.cuh"
#include "common/ptx.cuh"

namespace mok {

// Mirrored by mok_rt.symmetric._BarrierParams (same order and types).
struct GroupBarrier {
  const unsigned long long* peer_bases;  // [size] every rank's block base, in this rank's address space
  int* err;                              // this rank's error word (int32[4])
  unsigned long long pad_offset;         // bytes from a block base to its signal pad
  unsigned long long timeout_ns;         // how long to wait for the slowest rank
  int rank;
  int size;
};
static_assert(sizeof(GroupBarrier) == 40, "GroupBarrier layout is mirrored in Python");

__host__ __device__ constexpr int pad_words(int size) { return 1 + size; }

__device__ __forceinline__ int* signal_pad(const GroupBarrier& b, int r) {
  return reinterpret_cast<int*>(b.peer_bases[r] + b.pad_offset);
}

// Epoch e has been reached when v >= e, compared modulo 2^32 so the epoch may wrap.
__device__ __forceinline__ bool epoch_reached(int v, int e) {
  return static_cast<int>(static_cast<unsigned>(v) - static_cast<unsigned>(e)) >= 0;
}

// Tell rank `peer` that this rank reached `epoch`.  Release at system scope: every write that
// happens-before it (this thread's, and its CTA's after a __syncthreads) is visible to a rank
// that observes the signal with an acquire.
__device__ __forceinline__ void signal_peer(const GroupBarrier& b, int peer, int epoch) {
  st_release_sys(signal_pad(b, peer) + 1 + b.rank, epoch);
}

__device__ __forceinline__ bool peer_arrived(const GroupBarrier& b, int peer, int epoch) {
  return epoch_reached(ld_acquire_sys(signal_pad(b, b.rank) + 1 + peer), epoch);
}

// The barrier, run by all 32 lanes of ONE warp (one warp per rank per barrier).  Lanes handle
// peers lane, lane + 32, ...; decisions are warp-uniform so the ballots stay convergent.
// Returns true when every rank arrived; false after a timeout (error word set) or when the
// error word was already set on entry (an earlier failure: do no further work).
__device__ bool warp_group_barrier(const GroupBarrier& b) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  if (error_set(b.err)) return false;

  int* own = signal_pad(b, b.rank);
  int epoch = 0;
  if (lane == 0) {
    epoch = ld_relaxed_sys(own) + 1;
    st_relaxed_sys(own, epoch);
  }
  epoch = __shfl_sync(kAll, epoch, 0);

  fence_acq_rel_sys();
  for (int p = lane; p < b.size; p += 32) signal_peer(b, p, epoch);

  unsigned long long deadline = 0;
  if (lane == 0) deadline = globaltimer_ns() + b.timeout_ns;
  deadline = __shfl_sync(kAll, deadline, 0);

  for (int base = 0; base < b.size; base += 32) {
    const int p = base + lane;
    bool arrived = p >= b.size;
    for (;;) {
      if (!arrived) arrived = peer_arrived(b, p, epoch);
      const unsigned pending = __ballot_sync(kAll, !arrived);
      if (pending == 0) break;
      // Lane 0's clock decides for the warp so that every lane leaves the loop together.
      const bool expired = __shfl_sync(kAll, globaltimer_ns() > deadline, 0);
      if (expired) {
        if (lane == 0) set_error(b.err, kErrTimeout, b.rank, base + __ffs(pending) - 1, epoch);
        __syncwarp();
        return false;
      }
      nanosleep(100);
    }
  }
  return true;
}

// The barrier for a whole CTA: orders the CTA's earlier writes before the signals (bar.sync, then
// warp 0's release) and its later reads after the waits.  Every thread of the CTA must call it.
__device__ bool cta_group_barrier(const GroupBarrier& b) {
  __shared__ int ok;
  __syncthreads();
  if (threadIdx.x < 32) {
    const bool r = warp_group_barrier(b);
    if (threadIdx.x == 0) ok = r;
  }
  __syncthreads();
  return ok != 0;
}

}  // namespace mok
