// The "fp8_block" forward megakernel (docs/FP8_DESIGN.md): one persistent launch per forward or
// recompute_context on one GPU or one rank of an EP group, on the bf16 kernels' pipeline (roles,
// ring, Job queue, task order) with the FP8 task set of tasks/forward_fp8.cuh.  A cubin of its
// own, so the bf16 kernels (moe_layer.cu) are built exactly as before.
// Two kernels: moe_forward_fp8, and moe_forward_fp8_staged with the gate|up tiles' g, u stored
// through shared memory by the signaler (pipeline/staged_tile.cuh), which the host chooses where K
// is long (kernels/moe_fp8.py); the same bits either way.
// Launch: 384 threads (pipe::kCtaThreads), pipe::kSmemBytes of dynamic shared memory, a grid of
// about one CTA per SM; parameters: MoEFp8ForwardTmaParams (moe/params_fp8.cuh).
#define MOK_ZERO_FILL_ROUTES 1  // moe/tasks/row_copy.cuh: keeps the combine's route registers from spilling here
#include "moe/tasks/forward_fp8.cuh"

using namespace mok;

namespace {

// Register split: the GEMM tasks hold 64 partial + 2 x 64 total accumulators (128 x 256 tiles as two
// sub-tiles, pipeline/gemm_fp8.cuh), ~225 live registers at the peak; 40 / 232 (the probe's split)
// uses the same pool (384 x 168) as the bf16 kernels' 56 / 224.
constexpr int kFp8ProducerRegs = 40;
constexpr int kFp8WorkerRegs = 232;
static_assert(128 * kFp8ProducerRegs + kThreads * kFp8WorkerRegs <= 384 * 168, "the CTA's register pool");

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
  if (threadIdx.x == 0) sig.init();
  __syncthreads();
  const ForwardTasks tasks{p, plan.f, num_blocks};
  const TmaForwardFp8<kStaged> k{tp.maps, q, plan, tasks, order, num_blocks};
  const WaitCtx wc{p.err, p.dims.timeout_ns, p.dims.rank};
  if (threadIdx.x < 128) {
    setmaxnreg_dec<kFp8ProducerRegs>();
    if (threadIdx.x == 0) {
      const TensorMap* first = reinterpret_cast<const TensorMap*>(&tp.maps);
      for (int i = 0; i < static_cast<int>(sizeof(MoEFp8ForwardMaps) / sizeof(TensorMap)); ++i)
        if ((first[i].opaque[0] | first[i].opaque[1]) != 0) tma_prefetch_map(first + i);  // unused views: zeros
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

extern "C" __global__ void __launch_bounds__(pipe::kCtaThreads, 1)
    moe_forward_fp8(const __grid_constant__ MoEFp8ForwardTmaParams tp) {
  extern __shared__ __align__(1024) unsigned char smem[];
  run_fp8_forward<false>(tp, smem);
}

extern "C" __global__ void __launch_bounds__(pipe::kCtaThreads, 1)
    moe_forward_fp8_staged(const __grid_constant__ MoEFp8ForwardTmaParams tp) {
  extern __shared__ __align__(1024) unsigned char smem[];
  run_fp8_forward<true>(tp, smem);
}
