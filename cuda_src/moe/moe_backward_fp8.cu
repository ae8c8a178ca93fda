// The "fp8_block" backward megakernel (docs/FP8_BACKWARD.md): one persistent launch per
// backward on one GPU or one rank of an EP group, on the bf16 kernels' pipeline (roles, ring, Job queue, task order) with the
// FP8 task set of tasks/backward_fp8.cuh.  A cubin of its own, so the bf16 kernels (moe_layer.cu)
// and the FP8 forward (moe_forward_fp8.cu) are built exactly as before.
// Every phase is built; CudaBackend.backward launches it for fp8_block (backends/cuda_fp8.py).
// Launch: 384 threads (pipe::kCtaThreads), pipe::kSmemBytes of dynamic shared memory, about one
// CTA per SM; parameters: MoEFp8BackwardTmaParams (moe/params_fp8_bwd.cuh).
#include "moe/fp8_roles.cuh"
#include "moe/tasks/backward_fp8.cuh"

using namespace mok;

namespace {

// The start and role split of forward_fp8_kernel.cuh's run_fp8_forward (kept in step by hand), with EP
// its end-of-launch group barrier.
__device__ __forceinline__ void run_fp8_backward(const MoEFp8BackwardTmaParams& tp, unsigned char* smem) {
  const MoEFp8BackwardParams& q = tp.p;
  const MoEBackwardParams& p = q.p;
  const int num_blocks = p.sched.num_blocks[0];
  const pipe::Shared s = pipe::layout(smem);
  __shared__ Fp8BwdPlans plan;
  __shared__ pipe::AheadOrder order;
  if (threadIdx.x == 0) {
    plan.b = p.plan;
    plan.x = q.plan8;
    order = TmaBackwardFp8::make_order(plan.b, p, num_blocks);
  }
  if (__syncthreads_or(threadIdx.x == 0 && error_set(p.err))) return;
  if (!check_capacity(num_blocks, p.dims, p.err)) return;
  pipe::init(s);
  __syncthreads();
  const BackwardTasks tasks{p, plan.b, num_blocks};
  const TmaBackwardFp8 k{tp.maps, q, plan, tasks, order, num_blocks};
  const WaitCtx wc{p.err, p.dims.timeout_ns, p.dims.rank};
  if (threadIdx.x < 128) {
    setmaxnreg_dec<kFp8ProducerRegs>();
    if (threadIdx.x == 0) {
      prefetch_maps(tp.maps);
      pipe::producer_loop(k, s, p.cnt.task_next, plan.b.total, wc);
    }
    return;
  }
  setmaxnreg_inc<kFp8WorkerRegs>();
  pipe::worker_loop(k, s, wc);
  if (ep::enabled(p.peers))  // the peer deadline: dims.timeout_ns is the local one (TmaBackwardFp8::wait_ctx)
    ep::end_of_launch(p.peers, p.cnt.ctas_done, p.err, TmaBackwardFp8::peer_timeout_ns(p));
}

}  // namespace

extern "C" __global__ void __launch_bounds__(pipe::kCtaThreads, 1)
    moe_backward_fp8(const __grid_constant__ MoEFp8BackwardTmaParams tp) {
  extern __shared__ __align__(1024) unsigned char smem[];
  run_fp8_backward(tp, smem);
}
