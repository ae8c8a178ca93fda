// The dependency counters of the MoE megakernels.
//
// CTAs grab task indices in increasing order from one global counter.  A task waits only on
// tasks with lower indices, which were grabbed earlier by CTAs that are running, so the graph
// makes progress without any assumption about co-residency.  Counters live in global memory:
//   signal: the workers' writes -> proxy fence -> worker barrier -> worker 0 red.release.gpu.
//   wait:   the producer thread spins with ld.acquire.gpu (bounded by %globaltimer), then
//           fence.proxy.async.global before its TMA loads; the workers get the task after that.
// Workers read data produced inside the launch with L1-bypassing loads (ld.cg) or through TMA.
#pragma once
#include "common/errors.cuh"
#include "common/ptx.cuh"
#include "moe/params.cuh"
#include "moe/tasks/trace.cuh"

namespace mok {

struct WaitCtx {
  int* err;
  long long timeout_ns;
  int rank;
};

// Worker threads: the two consumer warpgroups (threads 128..383) run the task bodies; warpgroup 0
// is the TMA producer.  Worker barriers are the named barrier kWorkerBarrier over kThreads threads.
constexpr int kWorkerThread0 = 128;
constexpr int kWorkerBarrier = 3;  // 0 is __syncthreads, 1-2 the wgmma engine's warpgroup votes

__device__ __forceinline__ int worker_tid() { return static_cast<int>(threadIdx.x) - kWorkerThread0; }

__device__ __forceinline__ void workers_sync() {
  asm volatile("bar.sync %0, %1;" :: "n"(kWorkerBarrier), "n"(kThreads) : "memory");
}

// A worker barrier that also returns whether any worker passed true.
__device__ __forceinline__ bool workers_any(bool v) {
  uint32_t r;
  asm volatile(
      "{\n\t.reg .pred p, q;\n\tsetp.ne.u32 q, %1, 0;\n\t"
      "bar.red.or.pred p, %2, %3, q;\n\tselp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(r) : "r"(static_cast<uint32_t>(v)), "n"(kWorkerBarrier), "n"(kThreads) : "memory");
  return r != 0;
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

// The kernels read data produced inside the launch through the async proxy (TMA).  The reader
// (producer thread) fences after its acquire; writers order their generic stores before their
// release with a proxy fence (once per task).
__device__ __forceinline__ void proxy_fence_for_tma() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

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
