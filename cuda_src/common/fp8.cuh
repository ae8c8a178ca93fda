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
//     rare ties.  Each div.rn.f32 is a reciprocal, five dependent fma and a range check with a
//     branch to a slow path, so a loop of them runs one division at a time.  The dispatch and the
//     epilogue quantiser therefore use BlockQuotient below: the same instructions, with the
//     reciprocal part done once per block (it depends on s only), and no per-element branch; why
//     its bytes equal div.rn's is explained there.
//   * cvt.rn.satfinite: saturating round-to-nearest-even equals the oracle's clamp-then-round for
//     every finite input (anything that rounds beyond 448 is clamped to 448), keeps signed zeros
//     (-0 -> 0x80, as ml_dtypes does) and maps NaN to 0x7f.  Finite values never become NaN.
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

// ---- a block divided by its scale, one reciprocal per block ----------------------------------------
// div.rn.f32 as ptxas compiles it is a fast path (MUFU.RCP, then fma) plus a range check (FCHK)
// that sends unusual operands to a slow subroutine.  The fast path:
//   y0 = rcp(s);  e = fma(y0, -s, 1);  y = fma(y0, e, y0)        depends on s only: once per block
//   q0 = fma(v, y, 0);  r = fma(q0, -s, v);  q = fma(y, r, q0)   per element, no branch
// Why the bytes are div.rn's, for a finite block with s >= 2^-64 (kMinFastScaleBits):
//   * |v / s| >= 2^-13: for ordinary operands (s in [1, 2), quotient in [2^-13, 449]) the compiled
//     div.rn returns this q, so q = RN(v / s) there.  Each step is one rounding, and MUFU.RCP acts
//     on the significand, so scaling v and s by powers of two scales every intermediate exactly
//     while all of them stay normal, which they do: y in [2^-120, 2^64], q0 and q in [2^-14, 449],
//     r = v - s q0 is 0 or at least 2^-124 in magnitude (a multiple of min(ulp(v), ulp(s) ulp(q0))).
//     So q is div.rn's quotient, bit for bit.
//   * |v / s| < 2^-12: div.rn's quotient becomes an E4M3 zero with v's sign (0x00 / 0x80).  The
//     fma chain's errors are 2^-22 relative plus y 2^-150 <= 2^-86 absolute, so |q| < 2^-11 also
//     rounds to a zero, but its sign can differ (v = -0 gives +0).  encode_signed therefore
//     takes every byte's sign from v, which for a nonzero quotient is the sign cvt wrote anyway.
// Nothing above uses that v is a bf16: for any fp32 v with |v / s| >= 2^-13, |v| >= 2^-77 and
// ulp(v) >= 2^-100, so r is still a multiple of 2^-124 (the epilogue quantiser relies on this).
// A block with s < 2^-64 (amax below ~2^-55) is not covered: the caller falls back to div.rn, or
// (quantize_frag_row128) divides v * 2^64 by s * 2^64 instead: both products are exact (no
// overflow: |v| < 2^-55; s >= 2^-126), the real quotient is the same, so div.rn's is too.
constexpr uint32_t kMinFastScaleBits = 0x1f800000u;  // 2^-64

struct BlockQuotient {
  float s, y;  // the scale and its refined reciprocal

  __device__ __forceinline__ static BlockQuotient of(float s) {
    float y0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(s));  // MUFU.RCP (s is normal here)
    return BlockQuotient{s, __fmaf_rn(y0, __fmaf_rn(y0, -s, 1.0f), y0)};
  }
  __device__ __forceinline__ float operator()(float v) const {
    const float q0 = __fmaf_rn(v, y, 0.0f);
    return __fmaf_rn(y, __fmaf_rn(q0, -s, v), q0);
  }
  // Four elements -> E4M3 (low byte first), signs from the bf16 words lo (elements 0, 1), hi (2, 3).
  __device__ __forceinline__ uint32_t encode_signed(const float (&v)[8], int i0, uint32_t lo, uint32_t hi) const {
    const uint32_t mag = cvt_e4m3x4((*this)(v[i0]), (*this)(v[i0 + 1]), (*this)(v[i0 + 2]), (*this)(v[i0 + 3]));
    const uint32_t sign = __byte_perm(lo, hi, 0x7531);  // the high byte of each bf16
    uint32_t r;  // bit 7 of each byte from sign, the rest from mag: one LOP3
    asm("lop3.b32 %0, %1, %2, %3, 0xd8;" : "=r"(r) : "r"(mag), "r"(sign), "r"(0x80808080u));
    return r;
  }
  // One fp32 element, ready for cvt: the quotient with v's sign (one LOP3), the sign rule of
  // encode_signed for inputs that are not bf16 words.
  __device__ __forceinline__ float signed_quotient(float v) const { return copysignf((*this)(v), v); }
};

// ---- 1 x 128 blocks held by lane quads (16-byte layout) -------------------------------------------------
// Quad g of a warp (lanes 4g .. 4g+3) holds one block; lane 4g + c holds its elements 32k + 8c .. +7
// (k = 0..3) as v[k], a uint4 of bf16 (zeros past the end of the row).  So each 16-byte load of the
// warp reads 64 contiguous bytes per block and each 8-byte store writes one whole 32-byte sector, and
// the per-block work (amax, scale, reciprocal) is shared by the 32 elements a lane holds.
struct QuantizedQuadBlock {
  uint2 q[4];      // E4M3 of v[k], low byte first
  float scale;     // the block's scale
  bool needs_div;  // a finite block with s < 2^-64: BlockQuotient does not cover it (kDiv = false only)
};

__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// Every lane of the warp must call it (quad shuffles).  kDiv: each element by div.rn (the reference
// arithmetic; the fallback for needs_div blocks); otherwise BlockQuotient.
template <bool kDiv>
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
  r.needs_div = !kDiv && bs.kind == BlockScale::kFinite && __float_as_uint(bs.scale) < kMinFastScaleBits;
  const BlockQuotient d = BlockQuotient::of(bs.scale);
  const uint32_t keep = bs.kind == BlockScale::kFinite ? 0xffffffffu : 0u;
  const uint32_t special = bs.kind == BlockScale::kNonFinite ? kE4M3NaN * 0x01010101u : 0u;  // flushed: 0
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
    float f[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = bf16_bits_to_f32(w[i] & 0xffffu);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
    if (kDiv) {
      r.q[k] = make_uint2(bs.encode4(f[0], f[1], f[2], f[3]), bs.encode4(f[4], f[5], f[6], f[7]));
    } else {  // computed for every block, then masked: no branch around each group of 8
      r.q[k] = make_uint2((d.encode_signed(f, 0, w[0], w[1]) & keep) | special,
                          (d.encode_signed(f, 4, w[2], w[3]) & keep) | special);
    }
  }
  return r;
}

// ---- 1 x 128 blocks of a wgmma accumulator fragment (epilogue layout) ----------------------------------
// acc: the 64 fp32 accumulators of one 128-column block of a 64 x N warpgroup tile (for N = 128,
// the whole fragment).  For row half h (tile row row0 + 8h of the calling thread) returns the
// block's scale and, in q[j], the two E4M3 of columns 8j + 2c + {0, 1} (low byte first).  All 4
// lanes of each quad must call it, with the whole warp converged (shuffles, a vote); rows past the
// end of the matrix only predicate the caller's stores, and columns past its end must hold zeros
// (TMA zero-fills the B rows, so the accumulators there are 0).
// Division: BlockQuotient (the reciprocal once per row half, then three fma and a sign copy per
// element, no branch), bitwise div.rn as argued above.  A finite block with s < 2^-64 (amax below
// ~2^-55) divides v * 2^64 by s * 2^64 instead (exact, same quotient): a vote of the warp, and
// 32 multiplications, taken only when some row of the warp needs them.
struct QuantizedFragRow {
  uint16_t q[16];
  float scale;
};
__device__ __forceinline__ QuantizedFragRow quantize_frag_row128(const float (&acc)[64], int h) {
  float v[32];
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    v[2 * j] = acc[4 * j + 2 * h], v[2 * j + 1] = acc[4 * j + 2 * h + 1];
    m = max(m, max(abs_bits(v[2 * j]), abs_bits(v[2 * j + 1])));
  }
  const BlockScale bs = BlockScale::of_amax_bits(quad_max_u32(m));
  float s = bs.scale;
  const bool tiny = bs.kind == BlockScale::kFinite && __float_as_uint(s) < kMinFastScaleBits;
  if (__any_sync(0xffffffffu, tiny)) {  // warp-uniform; exact power-of-two scaling (see above)
    const float f = tiny ? 0x1p64f : 1.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = __fmul_rn(v[i], f);
    s = __fmul_rn(s, f);
  }
  const BlockQuotient d = BlockQuotient::of(s);
  // Flushed blocks: 0; non-finite: 0x7f7f (the quotients computed for them are dropped).
  const uint32_t keep = bs.kind == BlockScale::kFinite ? 0xffffu : 0u;
  const uint32_t special = bs.kind == BlockScale::kNonFinite ? (kE4M3NaN | (kE4M3NaN << 8)) : 0u;
  QuantizedFragRow r;
  r.scale = bs.scale;
#pragma unroll
  for (int j = 0; j < 16; ++j)
    r.q[j] = static_cast<uint16_t>((cvt_e4m3x2(d.signed_quotient(v[2 * j]), d.signed_quotient(v[2 * j + 1])) & keep) |
                                   special);
  return r;
}

}  // namespace fp8
}  // namespace mok
