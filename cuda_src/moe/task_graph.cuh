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
#include "moe/params.cuh"
#include "moe/trace.cuh"

namespace mok {

struct WaitCtx {
  int* err;
  long long timeout_ns;
  int rank;
};

// Worker threads: the threads that run task bodies (kThreads of them).  moe_layer.cu: the whole
// CTA.  moe_layer_tma.cu defines MOK_WORKER_THREAD0=128: its workers are the two consumer
// warpgroups (threads 128..383) and warpgroup 0 is the TMA producer, so worker barriers are the
// named barrier kWorkerBarrier over kThreads threads instead of __syncthreads.
#ifndef MOK_WORKER_THREAD0
#define MOK_WORKER_THREAD0 0
#endif
constexpr int kWorkerThread0 = MOK_WORKER_THREAD0;
constexpr int kWorkerBarrier = 3;  // 0 is __syncthreads, 1-2 the wgmma engine's warpgroup votes

__device__ __forceinline__ int worker_tid() { return static_cast<int>(threadIdx.x) - kWorkerThread0; }

__device__ __forceinline__ void workers_sync() {
  if constexpr (kWorkerThread0 == 0) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" :: "n"(kWorkerBarrier), "n"(kThreads) : "memory");
  }
}

// A worker barrier that also returns whether any worker passed true.
__device__ __forceinline__ bool workers_any(bool v) {
  if constexpr (kWorkerThread0 == 0) {
    return __syncthreads_or(v) != 0;
  } else {
    uint32_t r;
    asm volatile(
        "{\n\t.reg .pred p, q;\n\tsetp.ne.u32 q, %1, 0;\n\t"
        "bar.red.or.pred p, %2, %3, q;\n\tselp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(r) : "r"(static_cast<uint32_t>(v)), "n"(kWorkerBarrier), "n"(kThreads) : "memory");
    return r != 0;
  }
}

// One thread: true once *counter >= target (acquire.gpu); false when the error word is set (by
// anyone) or the wait timed out (then kErrTimeout is recorded: rank, peer -1, `what` = the
// waiting task).
__device__ __forceinline__ bool wait_counter_thread(const int* counter, int target, const WaitCtx& w, int what) {
  if (ld_acquire_gpu(counter) >= target) return true;
  const uint64_t start = globaltimer_ns();
  unsigned backoff = 32;
  while (ld_acquire_gpu(counter) < target) {
    if (error_set(w.err)) return false;
    if (globaltimer_ns() - start > static_cast<uint64_t>(w.timeout_ns)) {
      set_error(w.err, kErrTimeout, w.rank, -1, what);
      return false;
    }
    nanosleep(backoff);
    backoff = backoff < 1024 ? backoff * 2 : 1024;
  }
  return true;
}

// The same for the whole CTA (every thread calls it; thread 0 waits, the barrier broadcasts its
// verdict without a shared variable to race on).  Only the one-engine kernel (moe_layer.cu).
__device__ __forceinline__ bool wait_counter(const int* counter, int target, const WaitCtx& w, int what) {
  const int ok = threadIdx.x == 0 ? wait_counter_thread(counter, target, w, what) : 1;
  return __syncthreads_and(ok) != 0;
}

// The TMA kernels read data produced inside the launch through the async proxy.  The reader
// (producer thread) fences after its acquire; writers also order their generic stores before
// their release with a proxy fence (cheap, once per task; a no-op in the one-engine kernel).
__device__ __forceinline__ void proxy_fence_for_tma() {
  if constexpr (kWorkerThread0 != 0) asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Publishes everything the workers wrote for this task: counter += add.
__device__ __forceinline__ void signal_counter(int* counter, int add = 1) {
  proxy_fence_for_tma();
  workers_sync();
  if (worker_tid() == 0) red_release_gpu(counter, add);
}
__device__ __forceinline__ void signal_counters(int* c0, int* c1) {
  proxy_fence_for_tma();
  workers_sync();
  if (worker_tid() == 0) { red_release_gpu(c0, 1); red_release_gpu(c1, 1); }
}

// Runs run(task) for task indices grabbed in increasing order until num_tasks is reached or an
// error is recorded.  The two barriers per grab also separate one task's shared-memory use from
// the next one's.
// `trace` (trace.cuh, may be null): one record per task, indexed by the task (grab order = task order).
template <class Run>
__device__ __forceinline__ void task_loop(int* task_next, int num_tasks, const int* err, unsigned long long* trace,
                                          Run&& run) {
  __shared__ int s_task;
  for (;;) {
    if (threadIdx.x == 0) {
      s_task = error_set(err) ? num_tasks : atom_add_relaxed_gpu(task_next, 1);
      if (s_task < num_tasks) trace_grab(trace, s_task, s_task);
    }
    __syncthreads();
    const int task = s_task;
    __syncthreads();
    if (task >= num_tasks) return;
    run(task);
    if (threadIdx.x == 0 && !error_set(err)) trace_end(trace, task);  // after its signal (its last barrier)
  }
}

// Task-index bookkeeping: phases are consecutive ranges of the index space.
struct PhaseRange {
  int begin, count;
  __device__ __forceinline__ bool has(int task) const { return task >= begin && task < begin + count; }
  __device__ __forceinline__ int local(int task) const { return task - begin; }
};

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Routing counts are device data: a schedule that overflows the buffers is reported, not used.
// Every thread reads the same count, so the verdict is CTA-uniform.
__device__ __forceinline__ bool check_capacity(int num_blocks, const MoEDims& d, int* err) {
  if (num_blocks >= 0 && num_blocks <= d.max_blocks) return true;
  if (blockIdx.x == 0 && threadIdx.x == 0) set_error(err, kErrCapacity, d.rank, num_blocks * kBlockM, d.max_rows);
  return false;
}
__device__ __forceinline__ int min_int(int a, int b) { return a < b ? a : b; }

}  // namespace mok
