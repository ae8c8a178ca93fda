// What the FP8 megakernels (forward_fp8_kernel.cuh, moe_backward_fp8.cu) share of their start: the
// register split between the producer warpgroup and the two worker warpgroups, and the producer's
// prefetch of the launch's tensor maps.
#pragma once
#include "common/tma.cuh"
#include "moe/params.cuh"

namespace mok {

// Register split: the GEMM tasks hold 64 partial + 2 x 64 total accumulators (128 x 256 tiles as
// two sub-tiles, pipeline/gemm_fp8.cuh), ~225 live registers at the peak (the backward's dA
// epilogue also holds dG while the other sub-tile's totals wait, by row halves); 40 / 232 (the
// probe's split) uses the same pool (384 x 168) as the bf16 kernels' 56 / 224.
constexpr int kFp8ProducerRegs = 40;
constexpr int kFp8WorkerRegs = 232;
static_assert(128 * kFp8ProducerRegs + kThreads * kFp8WorkerRegs <= 384 * 168, "the CTA's register pool");

// Every map of a struct of TensorMaps into the TMA unit's descriptor cache; unused views are zeros.
template <class Maps>
__device__ __forceinline__ void prefetch_maps(const Maps& maps) {
  static_assert(sizeof(Maps) % sizeof(TensorMap) == 0, "a struct of TensorMaps");
  const TensorMap* first = reinterpret_cast<const TensorMap*>(&maps);
  for (int i = 0; i < static_cast<int>(sizeof(Maps) / sizeof(TensorMap)); ++i)
    if ((first[i].opaque[0] | first[i].opaque[1]) != 0) tma_prefetch_map(first + i);
}

}  // namespace mok
