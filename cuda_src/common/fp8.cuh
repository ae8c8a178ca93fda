// E4M3 conversion and the "fp8_block" quantiser of docs/SEMANTICS.md §10, for the kernels that
// quantise on the device: the dispatch (x, d_out rows), the gate|up and dSwiGLU epilogues (from
// fp32 accumulators) and quantize_weights (128 x 128 weight blocks).  The oracle is
// mok_rt/reference/quantize.py (quantize_fp8_block); everything here matches it bit for bit:
//
//   v     = fp32 input (a bf16 widened exactly, or an fp32 accumulator)
//   amax  = max |v| over the block, as an integer max of (bits & 0x7fffffff)
//   s     = fp32(amax / 448)            IEEE division (div.rn.f32), NOT a power of two
//   q     = e4m3_rne(clamp(fp32(v / s), +-448))   div.rn.f32, then cvt.rn.satfinite
//   s < 2^-126 (zero block, or a scale that would be an fp32 subnormal): s = 0 and every q = 0
//   a NaN or +-inf in the block: s = NaN (0x7fc00000), every q = E4M3 NaN (0x7f)
//
// Why each choice:
//   * Integer max of the magnitude bits: exact, order-independent (so any reduction tree is
//     deterministic), and it orders NaN (> 0x7f800000) above inf above every finite value; fmaxf
//     would drop NaNs.
//   * A true division, not v * (1/s): the reciprocal is off by up to an ulp, which moves fp32(v/s)
//     across an E4M3 rounding midpoint now and then, so the bits would differ from the oracle in
//     rare ties.  div.rn.f32 costs a few instructions in its fast path (rcp + two fma + a range
//     check); the quantisers are memory-bound, so this is not where the time goes.
//   * cvt.rn.satfinite: saturating round-to-nearest-even equals the oracle's clamp-then-round for
//     every finite input (anything that rounds beyond 448 is clamped to 448), keeps signed zeros
//     (-0 -> 0x80, as ml_dtypes does) and maps NaN to 0x7f.  Finite values never become NaN.
//   * Subnormal fp32 inputs are kept (no -ftz; the package builds without fast math).  The flush
//     test is on the bits of s (< 0x00800000), not on a float compare, so it holds under -ftz too.
//
// Layouts (the 1 x 128 activation block is along the GEMM's reduction dimension):
//   * warp layout (dispatch, weight quantiser): one block per warp, lane l holds elements
//     4l .. 4l+3 (8 bytes of bf16 in, 4 bytes of e4m3 out per lane: coalesced 256 B / 128 B).
//     Lanes past the end of a row pass zeros (zeros never become the max, like the oracle's padding).
//   * wgmma fragment layout (epilogues, common/wgmma.cuh): row 16w + g + 8h of a 64 x 128
//     warpgroup tile lives in the quad g of warp w; lane c of the quad holds columns
//     8j + 2c + {0, 1}, j = 0..15, in registers 4j + 2h + {0, 1}.  The row's amax is a max over
//     the lane's 32 values, then over the quad (shfl xor 1, 2).
//
// Scale storage the GEMMs read (tests/cuda/fp8_gemm_probe.cu, docs/FP8_DESIGN.md):
//   activations: fp32 [ceil(K/128), ld] (K-block major, rows contiguous, ld >= rows, ld % 4 == 0)
//                so one TMA box {128, 1} brings a tile's 128 row scales of one K block;
//   weights:     fp32 [groups, ceil(N/128), ceil(K/128)] (the oracle's QTensor.scales layout).
#pragma once
#include <stdint.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace mok {
namespace fp8 {

constexpr float kE4M3Max = 448.0f;
constexpr int kBlock = 128;                     // elements per scale block along K
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kF32Inf = 0x7f800000u;       // amax bits >= this: inf or NaN in the block
constexpr uint32_t kF32MinNormal = 0x00800000u; // 2^-126: smaller scales flush the block
constexpr uint32_t kF32NaN = 0x7fc00000u;       // the scale of a non-finite block
constexpr uint32_t kE4M3NaN = 0x7fu;            // every element of a non-finite block

// ---- conversions -----------------------------------------------------------------------------------
// Two fp32 -> two E4M3, saturating, round to nearest even.  PTX puts operand a in the upper byte:
// the result's low byte (first in memory) is `lo`.
__device__ __forceinline__ uint32_t cvt_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
// Four values -> one word, v0 in the lowest byte (memory order).
__device__ __forceinline__ uint32_t cvt_e4m3x4(float v0, float v1, float v2, float v3) {
  return cvt_e4m3x2(v0, v1) | (cvt_e4m3x2(v2, v3) << 16);
}
// Two E4M3 (low byte first) -> two fp32, exact (every E4M3 value is an f16 value).
__device__ __forceinline__ float2 e4m3x2_to_f32(uint32_t two) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(two)));
  return __half22float2(*reinterpret_cast<const __half2*>(&h2));
}
__device__ __forceinline__ float bf16_bits_to_f32(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// IEEE fp32 division, round to nearest even, whatever the compiler flags (-prec-div, fast math).
__device__ __forceinline__ float div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// ---- amax ------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & kAbsMask; }

// Warp-wide unsigned max (every lane gets it).  redux.sync (sm_80+): one instruction, and a max
// has no rounding, so the result does not depend on the reduction order.
__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) {
  uint32_t r;
  asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
  return r;
}
// Max over the 4 lanes of a quad (lanes 4g .. 4g+3): the wgmma fragment's row owners.
__device__ __forceinline__ uint32_t quad_max_u32(uint32_t v) {
  v = max(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return max(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// ---- one block's scale -------------------------------------------------------------------------------
// The quantiser of one block, made from its amax bits.  `scale` is what gets stored (and what the
// GEMM multiplies by); encode() turns the block's values into E4M3.
struct BlockScale {
  float scale;   // amax / 448, or 0 (flushed block), or NaN (non-finite block)
  uint32_t kind; // kFinite, kFlushed or kNonFinite

  static constexpr uint32_t kFinite = 0, kFlushed = 1, kNonFinite = 2;

  __device__ __forceinline__ static BlockScale of_amax_bits(uint32_t amax_bits) {
    if (amax_bits >= kF32Inf) return BlockScale{__uint_as_float(kF32NaN), kNonFinite};
    const float s = div_rn(__uint_as_float(amax_bits), kE4M3Max);
    if (__float_as_uint(s) < kF32MinNormal) return BlockScale{0.0f, kFlushed};
    return BlockScale{s, kFinite};
  }

  // One element as an fp32 ready for cvt: v / s (the cvt saturates and rounds).
  __device__ __forceinline__ float scaled(float v) const { return div_rn(v, scale); }

  // Two / four elements -> E4M3 bytes (low byte = first element).  The special kinds bypass the
  // division: 0 / 0 and x / NaN would give NaN where the oracle wants 0 (flushed blocks).
  __device__ __forceinline__ uint32_t encode2(float v0, float v1) const {
    if (kind == kFinite) return cvt_e4m3x2(scaled(v0), scaled(v1));
    return kind == kFlushed ? 0u : (kE4M3NaN | (kE4M3NaN << 8));
  }
  __device__ __forceinline__ uint32_t encode4(float v0, float v1, float v2, float v3) const {
    return encode2(v0, v1) | (encode2(v2, v3) << 16);
  }
};

// ---- a 1 x 128 block held by a warp (warp layout) ------------------------------------------------------
struct QuantizedRow128 {
  uint32_t q;    // this lane's 4 E4M3 (elements 4l .. 4l+3, low byte first)
  float scale;   // the block's scale (same in every lane)
};

// Every lane of the warp must call it (redux.sync over all 32 lanes).
__device__ __forceinline__ QuantizedRow128 quantize_row128_warp(const float (&v)[4]) {
  uint32_t m = max(max(abs_bits(v[0]), abs_bits(v[1])), max(abs_bits(v[2]), abs_bits(v[3])));
  const BlockScale bs = BlockScale::of_amax_bits(warp_max_u32(m));
  return QuantizedRow128{bs.encode4(v[0], v[1], v[2], v[3]), bs.scale};
}

// The dispatch's entry point: lane l's 4 bf16 (8 bytes, elements 4l .. 4l+3 of the block, as two
// little-endian words; zeros past the end of the row).
__device__ __forceinline__ QuantizedRow128 quantize_row128_warp_bf16(uint2 bf16x4) {
  const float v[4] = {bf16_bits_to_f32(bf16x4.x & 0xffffu), bf16_bits_to_f32(bf16x4.x >> 16),
                      bf16_bits_to_f32(bf16x4.y & 0xffffu), bf16_bits_to_f32(bf16x4.y >> 16)};
  return quantize_row128_warp(v);
}

// ---- 1 x 128 blocks of a wgmma accumulator fragment (epilogue layout) ----------------------------------
// acc: the 64 fp32 accumulators of one 128-column block of a 64 x N warpgroup tile (for N = 128,
// the whole fragment).  For row half h (tile row row0 + 8h of the calling thread) returns the
// block's scale and, in q[j], the two E4M3 of columns 8j + 2c + {0, 1} (low byte first).  All 4
// lanes of each quad must call it (shuffles); rows past the end of the matrix only predicate the
// caller's stores, and columns past its end must hold zeros (TMA zero-fills the B rows, so the
// accumulators there are 0).
struct QuantizedFragRow {
  uint16_t q[16];
  float scale;
};
__device__ __forceinline__ QuantizedFragRow quantize_frag_row128(const float (&acc)[64], int h) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) m = max(m, max(abs_bits(acc[4 * j + 2 * h]), abs_bits(acc[4 * j + 2 * h + 1])));
  const BlockScale bs = BlockScale::of_amax_bits(quad_max_u32(m));
  QuantizedFragRow r;
  r.scale = bs.scale;
#pragma unroll
  for (int j = 0; j < 16; ++j) r.q[j] = static_cast<uint16_t>(bs.encode2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
  return r;
}

}  // namespace fp8
}  // namespace mok
