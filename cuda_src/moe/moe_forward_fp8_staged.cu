// The "fp8_block" forward megakernel with the gate|up tiles' g, u stored through shared memory by
// the signaler (pipeline/staged_tile.cuh); the host chooses it where K is long (kernels/moe_fp8.py)
// and it gives the same bits as moe_forward_fp8.cu.  The body is forward_fp8_kernel.cuh.
#include "moe/forward_fp8_kernel.cuh"

extern "C" __global__ void __launch_bounds__(pipe::kCtaThreads, 1)
    moe_forward_fp8_staged(const __grid_constant__ MoEFp8ForwardTmaParams tp) {
  extern __shared__ __align__(1024) unsigned char smem[];
  run_fp8_forward<true>(tp, smem);
}
