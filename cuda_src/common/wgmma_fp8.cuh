// Named wrappers over the sm_90a FP8 warpgroup MMA: wgmma.mma_async m64nNk32 f32 += e4m3 * e4m3
// with both operands in shared memory, and the per-128-K promotion step of the "fp8_block"
// GEMM (docs/SEMANTICS.md §10, docs/FP8_DESIGN.md).  Fences, commit / wait groups, descriptors
// and the accumulator layout are shared with the bf16 path: common/wgmma.cuh.
//
// Facts relied on (PTX ISA 9.7.15, "wgmma.mma_async"; DeepSeek-V3 report §3.3.2 for the last one):
//   * .e4m3/.e5m2 operands exist only as k32 shapes (32 one-byte elements = 32 bytes of K, the
//     same 32-byte step as a bf16 k16) and only K-major: the instruction has no imm-trans-a/b
//     operands, so the operand list is  d, a-desc, b-desc, scale-d, imm-scale-a, imm-scale-b.
//     An MN-major operand (an activation read transposed, the backward's use of a weight) needs a
//     K-major copy in memory; FP8 cannot transpose on the fly.
//   * Accumulators: f32, same fragment layout as the bf16 m64nNk16 (WgmmaAccCoord).
//   * Descriptors: a K-major e4m3 tile with 128-byte rows is byte-for-byte the bf16 K-major
//     SWIZZLE_128B layout (8-row atoms of 1024 bytes, SBO = 1024, LBO unused), so
//     smem_desc_kmajor_sw128() describes it unchanged.  One 128-byte row = 128 e4m3 = exactly one
//     fp8_block K block: a TMA box {128, R} with SWIZZLE_128B brings one K block of R rows, and
//     the four k32 steps of that block advance the start address by 0, 32, 64, 96 bytes.
//   * The FP8 tensor cores do not accumulate in full fp32: DeepSeek measured about 14 bits kept
//     on H800 when a long K is accumulated inside the MMA.  The fp8_block GEMM therefore lets the
//     MMA accumulate one 128-deep K block only (4 instructions, the first with scale-d = 0) and
//     adds that partial sum, times s_a[row] * s_b, into separate fp32 registers (promote()).  The
//     scales are per K block anyway, so this is also where they must be applied.
#pragma once
#include <stdint.h>
#include "common/wgmma.cuh"

namespace mok {

constexpr int kFp8K = 32;             // K of one FP8 wgmma
constexpr uint32_t kFp8StepBytes = 32;  // K-major: start-address advance of one k32 step
constexpr int kFp8KBlock = 128;       // fp8_block scale block along K = 4 k32 steps = one 128 B row

// ---- wgmma.mma_async m64nNk32, f32 accumulators, e4m3 A and B from shared memory (K-major) ----
// d (+)= A * B: A is 64 x 32 (M x K), B is 32 x N (stored N x K), both via descriptors.
// accumulate = 0 ignores d's old values (D = A*B): the first k32 step of every K block.
__device__ __forceinline__ void wgmma_m64n64k32_e4m3(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" MOK_WGMMA_D32 "}, %32, %33, p, 1, 1;\n\t}"
               : MOK_WGMMA_ACC32(d)
               : "l"(desc_a), "l"(desc_b), "r"(accumulate)
               : "memory");
}

__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %66, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" MOK_WGMMA_D64 "}, %64, %65, p, 1, 1;\n\t}"
               : MOK_WGMMA_ACC64(d)
               : "l"(desc_a), "l"(desc_b), "r"(accumulate)
               : "memory");
}

__device__ __forceinline__ void wgmma_m64n256k32_e4m3(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %130, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {" MOK_WGMMA_D128 "}, %128, %129, p, 1, 1;\n\t}"
               : MOK_WGMMA_ACC128(d)
               : "l"(desc_a), "l"(desc_b), "r"(accumulate)
               : "memory");
}

// The wide single-batch tiles of the fp8_gemm_probe_n160 / _n192 probes (tests/cuda/fp8_wide_probe.cuh):
// one m64nNk32 per k32 step over the whole 128 x N tile, N / 2 accumulators per thread.
__device__ __forceinline__ void wgmma_m64n160k32_e4m3(float (&d)[80], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %82, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n160k32.f32.e4m3.e4m3 {" MOK_WGMMA_D80 "}, %80, %81, p, 1, 1;\n\t}"
               : MOK_WGMMA_ACC80(d)
               : "l"(desc_a), "l"(desc_b), "r"(accumulate)
               : "memory");
}

__device__ __forceinline__ void wgmma_m64n192k32_e4m3(float (&d)[96], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %98, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 {" MOK_WGMMA_D96 "}, %96, %97, p, 1, 1;\n\t}"
               : MOK_WGMMA_ACC96(d)
               : "l"(desc_a), "l"(desc_b), "r"(accumulate)
               : "memory");
}

// Dispatch on the tile width.
template <int N>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  static_assert(N == 64 || N == 128 || N == 160 || N == 192 || N == 256,
                "instantiated widths: 64, 128, 160, 192, 256");
  if constexpr (N == 64) wgmma_m64n64k32_e4m3(d, desc_a, desc_b, accumulate);
  else if constexpr (N == 128) wgmma_m64n128k32_e4m3(d, desc_a, desc_b, accumulate);
  else if constexpr (N == 160) wgmma_m64n160k32_e4m3(d, desc_a, desc_b, accumulate);
  else if constexpr (N == 192) wgmma_m64n192k32_e4m3(d, desc_a, desc_b, accumulate);
  else wgmma_m64n256k32_e4m3(d, desc_a, desc_b, accumulate);
}

// One 128-deep K block of a warpgroup's 64 x N tile: four k32 MMAs over the 128-byte rows of the
// A and B tiles whose K-major SWIZZLE_128B descriptors are given (their K block starts at byte 0
// of each row).  The first step overwrites d.  Issue-only: the caller fences before (the
// registers of d were touched by promote()) and commits / waits after.
template <int N>
__device__ __forceinline__ void wgmma_e4m3_kblock(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {
#pragma unroll
  for (int ks = 0; ks < kFp8KBlock / kFp8K; ++ks)
    wgmma_e4m3<N>(d, desc_advance(desc_a, ks * kFp8StepBytes), desc_advance(desc_b, ks * kFp8StepBytes), ks > 0);
}

// The promotion: total += partial * scale of its row, in fp32, one rounding per element (fma).
// In the fragment layout register i belongs to row half (i >> 1) & 1 (rows g and g + 8), so a
// thread needs two scales: s_a[row g] * s_b and s_a[row g + 8] * s_b, computed by the caller as
// fp32 products (one rounding each; the oracle's product is exact, see docs/FP8_DESIGN.md for
// the tolerance this costs: about 2^-24 relative, far below the MMA's own rounding).
template <int kRegs>
__device__ __forceinline__ void fp8_promote(float (&total)[kRegs], const float (&partial)[kRegs], float scale_lo,
                                            float scale_hi) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) total[i] = __fmaf_rn(partial[i], (i & 2) ? scale_hi : scale_lo, total[i]);
}

}  // namespace mok
