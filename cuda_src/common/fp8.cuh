// E4M3 conversion and the "fp8_block" quantiser of docs/SEMANTICS.md §10, for the kernels that
// quantise on the device: the dispatch (x, d_out rows), the gate|up and dSwiGLU epilogues (from
// fp32 accumulators) and quantize_weights (128 x 128 weight blocks).  The oracle is
// mok_rt/reference/quantize.py (quantize_fp8_block); everything here matches it bit for bit:
//
//   v     = fp32 input (a bf16 widened exactly, or an fp32 accumulator)
//   amax  = max |v| over the block, as an integer max of (bits & 0x7fffffff)
//   s     = fp32(amax / 448)            IEEE division (div.rn.f32), NOT a power of two: stored
//   m     = fp32(448 / amax)            IEEE division: the block's multiplier
//   q     = e4m3_rne(clamp(fp32(v * m), +-448))   one fp32 multiplication, then cvt.rn.satfinite
//   s < 2^-126 (zero block, or a scale that would be an fp32 subnormal): s = 0 and every q = 0
//   a NaN or +-inf in the block: s = NaN (0x7fc00000), every q = E4M3 NaN (0x7f)
//
// Why each choice:
//   * Integer max of the magnitude bits: exact, order-independent (so any reduction tree is
//     deterministic), and it orders NaN (> 0x7f800000) above inf above every finite value; fmaxf
//     would drop NaNs.
//   * A multiplier per block, not v / s per element: DeepSeek-V3's and DeepGEMM's quantisers do the
//     same (x * (448 / amax), scale amax / 448).  An exact v / s costs a reciprocal refined by three
//     dependent fma per element (bitwise div.rn only with a proof and a slow path for tiny scales);
//     v * m is one FMUL, and the two differ by at most an fp32 ulp before E4M3's 2^-4 rounding, which
//     moves a value by one E4M3 step where the quotient sits on a tie: about 1 in 3,500 bf16 inputs
//     (their ratios land on ties often), a few in 10^7 fp32 ones.  The quantisers run over every row of x,
//     d_out and the SwiGLU output, beside the GEMMs on the same SMs, and their instructions cost
//     tensor-core clock under the power cap (bench/NOTES-FP8-4.md rounds 28, 31).
//   * m is finite and normal for every block that is not flushed: amax >= 448 * 2^-126 gives
//     m <= 2^126, and amax <= fp32 max gives m > 2^-126.  The other two kinds get m = 0 and their
//     bytes from one LOP3 per word, (cvt & keep) | special: +0 for a flushed block (v * 0 would keep
//     v's sign), 0x7f for a non-finite one (set, not left to how cvt treats a NaN's sign).
//   * cvt.rn.satfinite: saturating round-to-nearest-even equals the oracle's clamp-then-round for
//     every finite input (anything that rounds beyond 448 is clamped to 448), keeps signed zeros
//     (-0 -> 0x80, as ml_dtypes does).  Finite values never become NaN.
//   * Subnormal fp32 inputs are kept (no -ftz; the package builds without fast math).  The flush
//     test is on the bits of s (< 0x00800000), not on a float compare, so it holds under -ftz too.
//
// Layouts (the 1 x 128 activation block is along the GEMM's reduction dimension):
//   * warp layout (weight quantiser, the probe's reference row quantiser): one block per warp,
//     lane l holds elements 4l .. 4l+3 (8 bytes of bf16 in, 4 bytes of e4m3 out per lane:
//     coalesced 256 B / 128 B).  Lanes past the end of a row pass zeros (zeros never become the
//     max, like the oracle's padding).
//   * quad layout (dispatch, moe/tasks/quantize_rows.cuh): one block per lane quad, lane 4g + c
//     holds elements 32k + 8c .. +7, k = 0..3 (quantize_block_quad_bf16 below).
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
#include "common/mma.cuh"

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
// Four E4M3 (one word, low byte first) dequantised into four bf16 (two words, memory order): each
// value exact in fp32, times `scale` (one rounding), then rounded to bf16.
__device__ __forceinline__ uint2 widen_e4m3x4_bf16(uint32_t four, float scale) {
  const float2 lo = e4m3x2_to_f32(four), hi = e4m3x2_to_f32(four >> 16);
  return make_uint2(pack_bf16x2(lo.x * scale, lo.y * scale), pack_bf16x2(hi.x * scale, hi.y * scale));
}
// Sixteen E4M3 (a 16-byte chunk, low byte first) dequantised by `scale` into dst[0 .. 15] (bf16, two
// 16-byte stores; dst 16-byte aligned).
__device__ __forceinline__ void store_widened16(__nv_bfloat16* dst, const uint4& q, float scale) {
  const uint2 a = widen_e4m3x4_bf16(q.x, scale), b = widen_e4m3x4_bf16(q.y, scale);
  const uint2 c = widen_e4m3x4_bf16(q.z, scale), d = widen_e4m3x4_bf16(q.w, scale);
  uint4* const o = reinterpret_cast<uint4*>(dst);
  o[0] = make_uint4(a.x, a.y, b.x, b.y);
  o[1] = make_uint4(c.x, c.y, d.x, d.y);
}

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
// GEMM multiplies by); encode2/4 turn the block's values into E4M3.
struct BlockScale {
  float scale;      // amax / 448, or 0 (flushed block), or NaN (non-finite block)
  float mul;        // 448 / amax, or 0 (flushed and non-finite blocks)
  uint32_t keep;    // mask of the encoded bytes: all ones for a finite block, else 0
  uint32_t special; // or-ed into them: E4M3 NaN in every byte for a non-finite block, else 0

  __device__ __forceinline__ static BlockScale of_amax_bits(uint32_t amax_bits) {
    if (amax_bits >= kF32Inf) return BlockScale{__uint_as_float(kF32NaN), 0.0f, 0u, kE4M3NaN * 0x01010101u};
    const float amax = __uint_as_float(amax_bits);
    const float s = div_rn(amax, kE4M3Max);
    if (__float_as_uint(s) < kF32MinNormal) return BlockScale{0.0f, 0.0f, 0u, 0u};
    return BlockScale{s, div_rn(kE4M3Max, amax), ~0u, 0u};
  }

  // One element as an fp32 ready for cvt (which saturates and rounds).  mul.rn.f32 in asm, like
  // div_rn: __fmul_rn would follow -ftz and flush subnormal inputs, which the oracle keeps.
  __device__ __forceinline__ float scaled(float v) const {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(v), "f"(mul));
    return r;
  }

  // Two / four elements -> E4M3 bytes (low byte = first element).
  __device__ __forceinline__ uint32_t encode2(float v0, float v1) const {
    return (cvt_e4m3x2(scaled(v0), scaled(v1)) & keep) | (special & 0xffffu);
  }
  __device__ __forceinline__ uint32_t encode4(float v0, float v1, float v2, float v3) const {
    return (cvt_e4m3x4(scaled(v0), scaled(v1), scaled(v2), scaled(v3)) & keep) | special;
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

// ---- 1 x 128 blocks held by lane quads (16-byte layout) -------------------------------------------------
// Quad g of a warp (lanes 4g .. 4g+3) holds one block; lane 4g + c holds its elements 32k + 8c .. +7
// (k = 0..3) as v[k], a uint4 of bf16 (zeros past the end of the row).  So each 16-byte load of the
// warp reads 64 contiguous bytes per block and each 8-byte store writes one whole 32-byte sector, and
// the per-block work (amax, two divisions) is shared by the 32 elements a lane holds.  Per element:
// a widening (one shift or mask), an FMUL and half a cvt.
struct QuantizedQuadBlock {
  uint2 q[4];      // E4M3 of v[k], low byte first
  float scale;     // the block's scale
};

__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// Every lane of the warp must call it (quad shuffles).
__device__ __forceinline__ QuantizedQuadBlock quantize_block_quad_bf16(const uint4 (&v)[4]) {
  constexpr uint32_t kAbs2 = 0x7fff7fffu;
  // |bf16| bits: ordered like the fp32 magnitude bits (those are these, shifted left by 16).
  uint32_t mk[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    mk[k] = max_u16x2(max_u16x2(v[k].x & kAbs2, v[k].y & kAbs2), max_u16x2(v[k].z & kAbs2, v[k].w & kAbs2));
  const uint32_t m = max_u16x2(max_u16x2(mk[0], mk[1]), max_u16x2(mk[2], mk[3]));
  const BlockScale bs = BlockScale::of_amax_bits(quad_max_u32(max(m & 0xffffu, m >> 16)) << 16);
  QuantizedQuadBlock r;
  r.scale = bs.scale;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
    float f[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = bf16_bits_to_f32(w[i] & 0xffffu);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
    r.q[k] = make_uint2(bs.encode4(f[0], f[1], f[2], f[3]), bs.encode4(f[4], f[5], f[6], f[7]));
  }
  return r;
}

// ---- 1 x 128 blocks of a wgmma accumulator fragment (epilogue layout) ----------------------------------
// acc: the 64 fp32 accumulators of one 128-column block of a 64 x N warpgroup tile (for N = 128,
// the whole fragment).  For row half h (tile row row0 + 8h of the calling thread) returns the
// block's scale and, in q[j], the two E4M3 of columns 8j + 2c + {0, 1} (low byte first).  All 4
// lanes of each quad must call it (the amax is a quad reduction); rows past the end of the matrix
// only predicate the caller's stores, and columns past its end must hold zeros (TMA zero-fills the
// B rows, so the accumulators there are 0).  Per element an FMUL and half a cvt, no branch.
struct QuantizedFragRow {
  uint16_t q[16];
  float scale;
};
__device__ __forceinline__ QuantizedFragRow quantize_frag_row128(const float (&acc)[64], int h) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j)
    m = max(m, max(abs_bits(acc[4 * j + 2 * h]), abs_bits(acc[4 * j + 2 * h + 1])));
  const BlockScale bs = BlockScale::of_amax_bits(quad_max_u32(m));
  QuantizedFragRow r;
  r.scale = bs.scale;
#pragma unroll
  for (int j = 0; j < 16; ++j) r.q[j] = static_cast<uint16_t>(bs.encode2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
  return r;
}

}  // namespace fp8
}  // namespace mok
