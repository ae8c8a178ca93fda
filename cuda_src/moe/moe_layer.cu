// The fused MoE layer kernels: one persistent forward and one persistent backward on the
// warp-specialised TMA + wgmma pipeline; each is deterministic (fixed reduction orders).
// Launch: 384 threads (pipe::kCtaThreads), pipe::kSmemBytes of dynamic shared memory, a grid of about
// one CTA per SM; the parameter struct carries one TMA map per operand view (params_tma.cuh).
// Roles and protocol: pipeline/pipeline.cuh; tasks: tasks/forward.cuh, tasks/backward.cuh; the
// task plan comes from the host in the parameter struct (mok_rt/kernels/moe_plan.py).
#include "moe/tasks/backward.cuh"

using namespace mok;

namespace {

// Uniform start: every thread takes the same verdicts, then thread 0 sets up the barriers.
__device__ __forceinline__ bool start(const int* err, int num_blocks, const MoEDims& d, int* err_w,
                                      const pipe::Shared& s) {
  if (__syncthreads_or(threadIdx.x == 0 && error_set(err))) return false;
  if (!check_capacity(num_blocks, d, err_w)) return false;
  pipe::init(s);
  __syncthreads();
  return true;
}

// The descriptors into the TMA unit's cache before the first loads need them (unused views are
// all zeros: skipped).
template <class Maps>
__device__ __forceinline__ void prefetch_maps(const Maps& m) {
  const TensorMap* first = reinterpret_cast<const TensorMap*>(&m);
  for (int i = 0; i < static_cast<int>(sizeof(Maps) / sizeof(TensorMap)); ++i) {
    if ((first[i].opaque[0] | first[i].opaque[1]) != 0) tma_prefetch_map(first + i);
  }
}

// The body of both kernels: plan and task order into shared memory (the producer's registers
// could not hold them), the uniform start, then the two roles (pipeline/pipeline.cuh) and, with EP,
// the end-of-launch group barrier.
template <class Kernel, class Plan, class Tasks, class Params, class Maps>
__device__ __forceinline__ void run_megakernel(const Params& p, const Maps& maps, unsigned char* smem) {
  const int num_blocks = p.sched.num_blocks[0];
  const pipe::Shared s = pipe::layout(smem);
  __shared__ Plan plan;
  __shared__ pipe::ScheduledOrder order;
  if (threadIdx.x == 0) {
    plan = p.plan;
    order = Kernel::make_order(plan, p, num_blocks);
  }
  if (!start(p.err, num_blocks, p.dims, p.err, s)) return;
  const Tasks tasks{p, plan, num_blocks};
  const Kernel k{maps, p, plan, tasks, order, num_blocks};
  const WaitCtx wc{p.err, p.dims.timeout_ns, p.dims.rank};
  if (threadIdx.x < 128) {
    setmaxnreg_dec<pipe::kProducerRegs>();
    if (threadIdx.x == 0) {
      prefetch_maps(maps);
      pipe::producer_loop(k, s, p.cnt.task_next, plan.total, wc);
    }
    return;
  }
  setmaxnreg_inc<pipe::kWorkerRegs>();
  pipe::worker_loop(k, s, wc);
  if (ep::enabled(p.peers)) ep::end_of_launch(p.peers, p.cnt.ctas_done, p.err, p.dims.timeout_ns);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(pipe::kCtaThreads, 1)
    moe_forward(const __grid_constant__ MoEForwardTmaParams tp) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const MoEForwardParams& p = tp.p;
  run_megakernel<TmaForward, MoEForwardPlan, ForwardTasks>(p, tp.maps, smem);
}

extern "C" __global__ void __launch_bounds__(pipe::kCtaThreads, 1)
    moe_backward(const __grid_constant__ MoEBackwardTmaParams tp) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const MoEBackwardParams& p = tp.p;
  run_megakernel<TmaBackward, MoEBackwardPlan, BackwardTasks>(p, tp.maps, smem);
}
