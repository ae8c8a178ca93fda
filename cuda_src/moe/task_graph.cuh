// The persistent task loop and the dependency counters of the MoE megakernels.
//
// CTAs grab task indices in increasing order from one global counter.  A task waits only on
// tasks with lower indices, which were grabbed earlier by CTAs that are running, so the graph
// makes progress without any assumption about co-residency.  Counters live in global memory:
//   signal: every thread's writes -> __syncthreads -> thread 0 red.release.gpu (cumulative).
//   wait:   thread 0 spins with ld.acquire.gpu (bounded by %globaltimer) -> barrier.
// Data produced inside the launch is then read with L1-bypassing loads (cp.async.cg, ld.cg).
#pragma once
#include "common/errors.cuh"
#include "common/ptx.cuh"

namespace mok {

struct WaitCtx {
  int* err;
  long long timeout_ns;
  int rank;
};

// Returns true on every thread once *counter >= target; false on every thread when the error
// word is set (by anyone) or the wait timed out (then kErrTimeout is recorded: rank, peer -1,
// `what` = the waiting task).  All threads of the CTA must call it.
__device__ __forceinline__ bool wait_counter(const int* counter, int target, const WaitCtx& w, int what) {
  int ok = 1;
  if (threadIdx.x == 0 && ld_acquire_gpu(counter) < target) {
    const uint64_t start = globaltimer_ns();
    unsigned backoff = 32;
    while (ld_acquire_gpu(counter) < target) {
      if (error_set(w.err)) { ok = 0; break; }
      if (globaltimer_ns() - start > static_cast<uint64_t>(w.timeout_ns)) {
        set_error(w.err, kErrTimeout, w.rank, -1, what);
        ok = 0;
        break;
      }
      nanosleep(backoff);
      backoff = backoff < 1024 ? backoff * 2 : 1024;
    }
  }
  // A barrier that also broadcasts thread 0's verdict (no shared variable to race on).
  return __syncthreads_and(ok) != 0;
}

// Publishes everything the CTA wrote for this task: counter += add.
__device__ __forceinline__ void signal_counter(int* counter, int add = 1) {
  __syncthreads();
  if (threadIdx.x == 0) red_release_gpu(counter, add);
}
__device__ __forceinline__ void signal_counters(int* c0, int* c1) {
  __syncthreads();
  if (threadIdx.x == 0) { red_release_gpu(c0, 1); red_release_gpu(c1, 1); }
}

// Runs run(task) for task indices grabbed in increasing order until num_tasks is reached or an
// error is recorded.  The two barriers per grab also separate one task's shared-memory use from
// the next one's.
template <class Run>
__device__ __forceinline__ void task_loop(int* task_next, int num_tasks, const int* err, Run&& run) {
  __shared__ int s_task;
  for (;;) {
    if (threadIdx.x == 0) s_task = error_set(err) ? num_tasks : atom_add_relaxed_gpu(task_next, 1);
    __syncthreads();
    const int task = s_task;
    __syncthreads();
    if (task >= num_tasks) return;
    run(task);
  }
}

// Task-index bookkeeping: phases are consecutive ranges of the index space.
struct PhaseRange {
  int begin, count;
  __device__ __forceinline__ bool has(int task) const { return task >= begin && task < begin + count; }
  __device__ __forceinline__ int local(int task) const { return task - begin; }
};

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }
__device__ __forceinline__ int min_int(int a, int b) { return a < b ? a : b; }

}  // namespace mok
