// Standalone probe of the megakernel's GEMM tile engine (moe/gemm_tile.cuh) through its public
// interface: each case is one 128 x 128 tile C = A * B in one of the four layout combinations,
// with partial M/N/K and split (two-segment) operands; the full staged tile (zeros outside the
// valid rows/columns included) is stored as fp32 [128][128].
//
// Launch: kThreads (256) threads, gemm::kSmemBytes of dynamic shared memory, any grid: CTA i runs
// cases i, i + grid, ... back to back (so one CTA reuses the ring across layouts).  Thread 0 of
// CTA 0 writes gemm::kSmemBytes to status[0] and 1 (wgmma engine) or 0 (mma.sync) to status[1];
// with less dynamic shared memory than the engine needs the kernel writes status[2] = 1 and
// computes nothing (a query launch with 0 bytes reads the size).
#include "moe/gemm_tile.cuh"

namespace mok {

struct TileProbeCase {
  const bf16* a0;   // A segment 0 / 1 (rows below a_split from a0)
  const bf16* a1;
  const bf16* b0;   // B segment 0 / 1
  const bf16* b1;
  float* c;         // [128][128] fp32
  int a_split, a_ld, a_valid;
  int b_split, b_ld, b_valid;
  int k;            // K of the product
  int layout;       // bit 0: A MN-major, bit 1: B MN-major
};
static_assert(sizeof(TileProbeCase) == 72, "TileProbeCase layout: update tests/test_tile_probe_gpu.py");

struct TileProbeParams {
  const TileProbeCase* cases;
  int* status;      // int32[3], see above
  int num_cases;
  int pad_;
};
static_assert(sizeof(TileProbeParams) == 24, "TileProbeParams layout: update tests/test_tile_probe_gpu.py");

namespace {

template <int kA, int kB>
__device__ __forceinline__ void run_case(const TileProbeCase& t, unsigned char* smem) {
  gemm::tile_gemm<kA, kB>(gemm::operand2(t.a0, t.a1, t.a_split, t.a_ld, t.a_valid),
                          gemm::operand2(t.b0, t.b1, t.b_split, t.b_ld, t.b_valid), t.k, smem);
  gemm::store_tile_f32(smem, t.c, gemm::kBN, gemm::kBM, gemm::kBN, false);
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t v;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
  return v;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, 1) tile_probe(const __grid_constant__ TileProbeParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const bool enough = dynamic_smem_bytes() >= (uint32_t)gemm::kSmemBytes;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    p.status[0] = gemm::kSmemBytes;
    p.status[1] = gemm::kWgmmaEngine ? 1 : 0;
    if (!enough) p.status[2] = 1;
  }
  if (!enough) return;
  for (int i = blockIdx.x; i < p.num_cases; i += gridDim.x) {
    const TileProbeCase t = p.cases[i];  // CTA-uniform
    switch (t.layout & 3) {
      case 0: run_case<gemm::kKMajor, gemm::kKMajor>(t, smem); break;
      case 1: run_case<gemm::kMNMajor, gemm::kKMajor>(t, smem); break;
      case 2: run_case<gemm::kKMajor, gemm::kMNMajor>(t, smem); break;
      default: run_case<gemm::kMNMajor, gemm::kMNMajor>(t, smem); break;
    }
    // No barrier here on purpose: tile_gemm itself must keep the next tile's ring from
    // overwriting the C tile this epilogue still reads.
  }
}

}  // namespace mok
