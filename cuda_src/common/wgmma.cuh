// Named wrappers over the sm_90a warpgroup MMA (wgmma) path: fences, commit/wait groups, the
// shared-memory matrix descriptors and wgmma.mma_async m64nNk16 f32 += bf16 * bf16 with both
// operands in shared memory, plus register reconfiguration (setmaxnreg).  Needs the sm_90a
// target (`-gencode=arch=compute_90a,code=sm_90a`); plain sm_90 rejects every instruction here.
//
// Facts relied on (PTX ISA 9.7.15 "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
//   * A warpgroup is 4 consecutive warps (128 threads, first warp index a multiple of 4); every
//     wgmma instruction here is .sync.aligned over the warpgroup (no divergence around it).
//   * Accumulator D of m64nNk16 (f32): N/2 registers per thread.  Thread t of the warpgroup
//     (warp w = t/32, lane l, g = l/4, c = l%4) holds, for i in [0, N/2):
//         row = 16*w + g + 8*((i >> 1) & 1),   col = 8*(i >> 2) + 2*c + (i & 1).
//   * wgmma.fence is needed before the first wgmma of a batch whose accumulator registers were
//     touched by other instructions (zeroing, the epilogue); wgmma.wait_group N returns once at
//     most N committed groups are pending, after which their registers and shared-memory
//     operands may be used again.  The compiler does not know the asynchrony: fence_operand()
//     pins the accumulator registers around those points so no access is moved across them.
//   * Shared-memory matrix descriptor (64 bits):
//         [13:0]  (start address & 0x3FFFF) >> 4
//         [29:16] leading dimension byte offset >> 4   (LBO)
//         [45:32] stride dimension byte offset >> 4    (SBO)
//         [51:49] base offset (0: swizzle pattern starts on a 1024-byte boundary for 128B)
//         [63:62] swizzle: 0 none, 1 = 128B, 2 = 64B, 3 = 32B
//   * 128B swizzle, bf16 (T = 8 elements per 16-byte chunk); canonical layouts (CuTe notation):
//       K-major  ((8,m),(T,2k)):((8T,SBO),(1,T)):  rows of 64 K-elements (128 bytes), 8-row atoms
//                of 1024 bytes; SBO = byte distance between 8-row groups (1024 when packed);
//                LBO unused ("assumed 1").  A k16 step moves the start address by 32 bytes.
//       MN-major ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)): lines of 64 MN-elements (128 bytes), one
//                line per k; SBO = distance between groups of 8 k-lines (1024 when packed),
//                LBO = distance between 64-element MN panels.  A k16 step moves 16 lines (2 KB).
//     imm-trans-a/b = 0 selects K-major, 1 MN-major ("transposed"); bf16 supports both.
//   * setmaxnreg.{inc,dec}.sync.aligned.u32 N (24 <= N <= 256, N % 8 == 0) is warpgroup-wide and
//     needs the kernel compiled for a known register budget: __launch_bounds__(threads, 1).
#pragma once
#include <stdint.h>
#include "common/wgmma_operands.cuh"

namespace mok {

// ---- synchronisation -----------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// Compiler-only barrier on accumulator registers (emits no instruction).
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// ---- register reconfiguration ------------------------------------------------------------------
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg range");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg range");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(N));
}

// ---- shared-memory matrix descriptors -----------------------------------------------------------
constexpr uint64_t kDescSwizzle128B = 1ull << 62;

__device__ __forceinline__ constexpr uint64_t desc_field(uint32_t bytes) { return (bytes & 0x3FFFFu) >> 4; }

// Descriptor of a 128B-swizzled bf16 operand starting at shared address `addr` (1024-byte aligned
// pattern start, so base offset 0).
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return desc_field(addr) | (desc_field(lbo_bytes) << 16) | (desc_field(sbo_bytes) << 32) | kDescSwizzle128B;
}
// K-major tile of 128-byte rows packed one after another: SBO = 8 rows = 1024 bytes.
__device__ __forceinline__ uint64_t smem_desc_kmajor_sw128(uint32_t addr) { return smem_desc_sw128(addr, 16, 1024); }
// MN-major tile made of 64-element panels `panel_bytes` apart, k-lines packed: SBO = 1024 bytes.
__device__ __forceinline__ uint64_t smem_desc_mnmajor_sw128(uint32_t addr, uint32_t panel_bytes) {
  return smem_desc_sw128(addr, panel_bytes, 1024);
}
// The same descriptor moved by `bytes` (multiple of 16; the start address field cannot carry
// out of its 14 bits because shared addresses stay below 256 KB).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// ---- 128B swizzle (the byte layout TMA SWIZZLE_128B writes and the sw128 descriptors read) ----
// Inside a 1024-byte aligned region of 128-byte lines, the 16-byte chunk `chunk` (0-7) of line
// `line` lives at chunk position chunk ^ (line % 8): address bits 4-6 XOR bits 7-9.  Code that
// fills such a tile itself (cp.async, st.shared) stores chunk (line, chunk) at this byte offset.
__device__ __forceinline__ constexpr uint32_t sw128_offset(uint32_t line, uint32_t chunk) {
  return line * 128u + ((chunk ^ (line & 7u)) << 4);
}

// ---- wgmma.mma_async m64nNk16, f32 accumulators, bf16 A and B from shared memory ------------------
// d (+)= A * B: A is 64 x 16 (M x K), B is 16 x N (K x N), both described by descriptors.
// accumulate = 0 ignores d's old values (D = A*B).  kTransA / kTransB: 0 K-major, 1 MN-major.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_bf16(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" MOK_WGMMA_D32 "}, %32, %33, p, 1, 1, %35, %36;\n\t}"
               : MOK_WGMMA_ACC32(d)
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB)
               : "memory");
}

template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %66, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" MOK_WGMMA_D64 "}, %64, %65, p, 1, 1, %67, %68;\n\t}"
               : MOK_WGMMA_ACC64(d)
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB)
               : "memory");
}

template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16_bf16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %130, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" MOK_WGMMA_D128 "}, %128, %129, p, 1, 1, %131, %132;\n\t}"
               : MOK_WGMMA_ACC128(d)
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB)
               : "memory");
}


// Dispatch on the tile width.
template <int N, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  static_assert(N == 64 || N == 128 || N == 256, "instantiated widths: 64, 128, 256");
  if constexpr (N == 64) wgmma_m64n64k16_bf16<kTransA, kTransB>(d, desc_a, desc_b, accumulate);
  else if constexpr (N == 128) wgmma_m64n128k16_bf16<kTransA, kTransB>(d, desc_a, desc_b, accumulate);
  else wgmma_m64n256k16_bf16<kTransA, kTransB>(d, desc_a, desc_b, accumulate);
}

// Accumulator fragment coordinates (see the header comment), relative to the warpgroup's 64 x N
// tile: register i of the calling thread.
struct WgmmaAccCoord {
  int row0, col0;  // row of even-pair registers (i & 2 == 0), column of register 0
  __device__ __forceinline__ static WgmmaAccCoord of_thread(int thread_in_warpgroup) {
    const int w = thread_in_warpgroup >> 5, l = thread_in_warpgroup & 31;
    return WgmmaAccCoord{16 * w + (l >> 2), 2 * (l & 3)};
  }
  __device__ __forceinline__ int row(int i) const { return row0 + 8 * ((i >> 1) & 1); }
  __device__ __forceinline__ int col(int i) const { return col0 + 8 * (i >> 2) + (i & 1); }
};

}  // namespace mok
