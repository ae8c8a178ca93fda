// The "fp8_block" forward megakernel (docs/FP8_DESIGN.md): one persistent launch per forward or
// recompute_context on one GPU or one rank of an EP group, on the bf16 kernels' pipeline (roles,
// ring, Job queue, task order) with the FP8 task set of tasks/forward_fp8.cuh.  A cubin of its
// own, so the bf16 kernels (moe_layer.cu) are built exactly as before.  Its twin with the gate|up
// tiles stored through shared memory is moe_forward_fp8_staged.cu; the body is forward_fp8_kernel.cuh.
#include "moe/forward_fp8_kernel.cuh"

extern "C" __global__ void __launch_bounds__(pipe::kCtaThreads, 1)
    moe_forward_fp8(const __grid_constant__ MoEFp8ForwardTmaParams tp) {
  extern __shared__ __align__(1024) unsigned char smem[];
  run_fp8_forward<false>(tp, smem);
}
