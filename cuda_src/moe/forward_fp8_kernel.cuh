// The body of the "fp8_block" forward megakernels (docs/FP8_DESIGN.md), included by exactly one of
// moe_forward_fp8.cu (kStaged = false) and moe_forward_fp8_staged.cu (kStaged = true): each kernel
// its own translation unit and cubin, because with both in one unit NVVM inlined differently and
// the direct kernel's code (and time) changed.
// Launch: 384 threads (pipe::kCtaThreads), pipe::kSmemBytes of dynamic shared memory, a grid of
// about one CTA per SM; parameters: MoEFp8ForwardTmaParams (moe/params_fp8.cuh).
#pragma once
#include "moe/fp8_roles.cuh"
#include "moe/tasks/forward_fp8.cuh"

using namespace mok;

namespace {

// The same start and role split as moe_layer.cu's run_megakernel (kept in step by hand: that file
// is not touched, so the bf16 cubin cannot change), with EP its end-of-launch group barrier.
template <bool kStaged>
__device__ __forceinline__ void run_fp8_forward(const MoEFp8ForwardTmaParams& tp, unsigned char* smem) {
  const MoEFp8ForwardParams& q = tp.p;
  const MoEForwardParams& p = q.p;
  const int num_blocks = p.sched.num_blocks[0];
  const pipe::Shared s = pipe::layout(smem);
  __shared__ Fp8Plans plan;
  __shared__ pipe::AheadOrder order;
  if (threadIdx.x == 0) {
    plan.f = p.plan;
    plan.x = q.plan8;
    order = TmaForwardFp8<kStaged>::make_order(plan.f, p, num_blocks);
  }
  if (__syncthreads_or(threadIdx.x == 0 && error_set(p.err))) return;
  if (!check_capacity(num_blocks, p.dims, p.err)) return;
  pipe::init(s);
  const pipe::Signals sig = pipe::Signals::of();
  if (threadIdx.x == 0) sig.init<kStaged>();
  __syncthreads();
  const ForwardTasks tasks{p, plan.f, num_blocks};
  const TmaForwardFp8<kStaged> k{tp.maps, tp.staged, q, plan, tasks, order, num_blocks};
  const WaitCtx wc{p.err, p.dims.timeout_ns, p.dims.rank};
  if (threadIdx.x < 128) {
    setmaxnreg_dec<kFp8ProducerRegs>();
    if (threadIdx.x == 0) {
      prefetch_maps(tp.maps);
      if (kStaged)  // its two maps by hand: prefetch_maps here let ptxas reorder the kernel's setup
        for (const TensorMap* m : {&tp.staged.gu_st, &tp.staged.sgu_st})
          if ((m->opaque[0] | m->opaque[1]) != 0) tma_prefetch_map(m);
      pipe::producer_loop(k, s, p.cnt.task_next, plan.f.total, wc);
    } else if (threadIdx.x == 32) {
      sig.run<kStaged>(s);  // the workers' releases (and staged stores): pipeline/signaler.cuh
    }
    return;
  }
  setmaxnreg_inc<kFp8WorkerRegs>();
  pipe::worker_loop(k, s, wc);
  if (worker_tid() == 0) sig.stop(p.err, p.dims.timeout_ns, p.dims.rank);
  if (ep::enabled(p.peers)) ep::end_of_launch(p.peers, p.cnt.ctas_done, p.err, p.dims.timeout_ns);
}

}  // namespace

