// The GEMM engine of the MoE kernels: one CTA (kThreads = 256) computes a kBM x kBN (128 x 128)
// fp32 tile C = A * B over K with bf16 tensor cores and leaves C in shared memory for the
// caller's fused epilogue.  Replaceable as a unit: operands in, staged fp32 tile out.
//
// Operands live in global memory in either layout:
//   A [M x K]: kKMajor  -> element (m, k) at row(m)[k]      (rows are the tile's M indices)
//              kMNMajor -> element (m, k) at row(k)[m]      (rows are global K indices)
//   B [N x K]: kKMajor  -> element (n, k) at row(n)[k]      (weights [N, K])
//              kMNMajor -> element (n, k) at row(k)[n]      (activations [K, N])
// A row index o maps to seg0 + o*ld below `split` and to seg1 + (o - split)*ld above it, so a
// fused [W_gate rows; W_up rows] operand needs no copy.  Loads outside the valid M/N/K range are
// zero-filled (cp.async src-size 0); contiguous extents are multiples of 8 elements (host-checked).
//
// Engines (chosen at compile time, same interface and staged C tile):
//   default                    wgmma (sm_90a): below, kSmemBytes = 197632 (6 stages).
//   -DMOK_GEMM_ENGINE_MMA_SYNC mma.sync m16n8k16 + ldmatrix (moe/gemm_tile_mma.cuh), 81920 bytes;
//                              also what any target other than sm_90a gets.
//
// The wgmma engine.  All 256 threads copy each 64-wide k-slice (A: 128 x 64, B: 128 x 64, 16 KB
// each) with 16-byte cp.async into a kStages-slot ring, in exactly the 128B-swizzled byte layout
// TMA SWIZZLE_128B produces for the TMA engine (moe/gemm_wgmma.cuh), so the same descriptors apply:
//   K-major tile : 128 lines (tile rows) of 64 k (128 B); chunk (line, c) at sw128_offset(line, c).
//   MN-major tile: 2 panels (tile columns 0-63, 64-127) of 8 KB; panel p holds 64 lines (k) of 64
//                  M/N elements; chunk c of line k at p * 8192 + sw128_offset(k, c % 8).
// Warpgroup w (threads 128w..128w+127) multiplies tile rows 64w..64w+63 by all 128 columns:
// 4 x wgmma m64n128k16 per slice, fp32 accumulators in registers (64 per thread).
// Pipeline, slice kt (slot kt % kStages):
//   cp.async.wait_group (own copies of slice kt landed) -> fence.proxy.async.shared::cta (they are
//   generic-proxy writes; wgmma reads through the async proxy) -> __syncthreads (everyone's copies
//   of kt landed; both warpgroups retired slice kt-2) -> 4 wgmma on kt, commit -> cp.async of
//   slice kt + kStages - 2 into slot (kt - 2) % kStages -> wgmma.wait_group 1 (slice kt-1 retired,
//   kt keeps running).  So two slices are in the tensor cores and kStages - 2 in flight from memory.
// The ring overlaps the staged C tile: tile_gemm starts and ends with __syncthreads.
#pragma once
#include <climits>
#include "common/mma.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "moe/params.cuh"

#define MOK_GEMM_TILE_INTERFACE 1

namespace mok {
namespace gemm {

constexpr int kBM = 128, kBN = 128;
static_assert(kBM == kBlockM, "a GEMM tile is one row block");
static_assert(kBM == kBN, "tile loaders assume square tiles");
constexpr int kLdC = kBN + 8;                            // fp32 C tile [128][kLdC] (69632 bytes)
constexpr int kCBytes = kBM * kLdC * 4;

enum Layout : int { kKMajor = 0, kMNMajor = 1 };         // = the wgmma transpose immediates

struct Operand {
  const bf16* seg0;
  const bf16* seg1;
  int split;   // rows below it come from seg0
  int ld;      // elements between consecutive rows
  int valid;   // valid M (or N) indices of this tile, from 0
  __device__ __forceinline__ const bf16* row(int o) const {
    return o < split ? seg0 + (size_t)o * ld : seg1 + (size_t)(o - split) * ld;
  }
};

__device__ __forceinline__ Operand operand(const bf16* p, int ld, int valid) {
  return Operand{p, p, INT_MAX, ld, valid};
}
__device__ __forceinline__ Operand operand2(const bf16* p0, const bf16* p1, int split, int ld, int valid) {
  return Operand{p0, p1, split, ld, valid};
}

// wgmma exists only on sm_90a: other device targets get the mma.sync engine.
#if !defined(MOK_GEMM_ENGINE_MMA_SYNC) && defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOK_GEMM_ENGINE_MMA_SYNC 1
#endif

#ifdef MOK_GEMM_ENGINE_MMA_SYNC
constexpr bool kWgmmaEngine = false;
#include "moe/gemm_tile_mma.cuh"
#else
constexpr bool kWgmmaEngine = true;

#ifndef MOK_GEMM_TILE_STAGES
#define MOK_GEMM_TILE_STAGES 6
#endif
constexpr int kBK = 64;                                  // one 128-byte swizzled line of bf16
constexpr int kStages = MOK_GEMM_TILE_STAGES;
static_assert(kStages >= 3, "two slots in the tensor cores plus at least one loading");
constexpr int kTileBytes = kBM * kBK * 2;                // 16384: one operand's slice
constexpr int kStageBytes = 2 * kTileBytes;              // A slice + B slice
constexpr int kRingBytes = kStages * kStageBytes;
constexpr int kPanelBytes = 64 * 128;                    // MN-major: 64 k-lines of one 64-wide panel
constexpr int kStepK = 16 * 2;                           // k16 step, K-major: 16 elements along a line
constexpr int kStepMN = 16 * 128;                        // k16 step, MN-major: 16 lines
constexpr int kAccRegs = kBN / 2;                        // m64n128 f32 accumulators per thread
// Ring + slack to align it to 1024 bytes (the dynamic buffer is only 128-aligned), or the C tile.
constexpr int kSmemBytes = kRingBytes + 1024 > kCBytes ? kRingBytes + 1024 : kCBytes;   // 197632 at 6 stages
static_assert(kSmemBytes <= 227 * 1024, "fits the opt-in shared memory of sm_90");
static_assert(kStages != 6 || kSmemBytes == 197632, "mok_rt/_moe_params.py SMEM_BYTES mirrors this");
static_assert(kThreads == 256, "two warpgroups of 64 tile rows; loaders deal 1024 chunks as 4 per thread");
static_assert(kStageBytes % 1024 == 0 && kTileBytes % 1024 == 0, "slots stay 1024-byte aligned");

// One thread's share (4 of the 1024 16-byte chunks) of copying a k-slice of an operand.
template <int kLayout>
struct SliceLoader;

// K-major: thread t copies chunk c = t % 8 (k 8c..8c+7 of the slice) of tile rows t/8 + 32i.
template <>
struct SliceLoader<kKMajor> {
  const bf16* rowp[4];  // row start + 8c (rows >= valid: unused, zero-filled)
  const bf16* dummy;    // a mapped address for the zero-filling copies (nothing is read)
  uint32_t dst;         // byte offset of chunk i = 0 in the tile; chunk i at dst + i * 4096
  uint32_t row_ok;      // bit i: row t/8 + 32i < valid
  int kc;
  __device__ __forceinline__ explicit SliceLoader(const Operand& op) {
    const int c = threadIdx.x & 7, r = threadIdx.x >> 3;
    kc = 8 * c;
    dummy = op.seg0;
    row_ok = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int o = r + 32 * i;
      rowp[i] = op.row(o) + kc;  // address arithmetic only
      row_ok |= (o < op.valid ? 1u : 0u) << i;
    }
    dst = sw128_offset(r, c);  // (r + 32i) % 8 == r % 8: the other rows are 32 lines further
  }
  __device__ __forceinline__ void load(int k0, int k_total, uint32_t tile) const {
    const bool k_ok = k0 + kc < k_total;  // k_total is a multiple of 8: a chunk is all in or out
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool ok = k_ok && ((row_ok >> i) & 1u);
      cp_async_16(tile + dst + i * (32 * 128), ok ? rowp[i] + k0 : dummy, ok);
    }
  }
};

// MN-major: thread t copies tile columns 8c..8c+7 (c = t % 16) of the k-lines t/16 + 16i; the
// operand row of line l is k0 + l.  Row addresses are formed without branches as
// base(k < split) + k * ld, base1 = seg1 - split * ld (integer arithmetic: never dereferenced
// unless k >= split).
template <>
struct SliceLoader<kMNMajor> {
  uint64_t base0, base1;  // byte addresses of column 8c in row 0 of segment 0 / (virtual) segment 1
  const bf16* dummy;
  uint32_t row_bytes;     // ld * 2
  int split;
  int line;               // t / 16
  bool col_ok;            // valid is a multiple of 8: a chunk is all in or out
  uint32_t dst;           // chunk i at dst + i * 2048 (16 lines further)
  __device__ __forceinline__ explicit SliceLoader(const Operand& op) {
    const int c = threadIdx.x & 15;
    line = threadIdx.x >> 4;
    split = op.split;
    row_bytes = (uint32_t)op.ld * 2u;
    col_ok = 8 * c < op.valid;
    dummy = op.seg0;
    base0 = reinterpret_cast<uint64_t>(op.seg0 + 8 * c);
    base1 = reinterpret_cast<uint64_t>(op.seg1 + 8 * c) - (uint64_t)op.split * row_bytes;
    dst = (c >> 3) * kPanelBytes + sw128_offset(line, c & 7);
  }
  __device__ __forceinline__ void load(int k0, int k_total, uint32_t tile) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = k0 + line + 16 * i;
      const bool ok = col_ok && k < k_total;
      const uint64_t src = (k < split ? base0 : base1) + (uint64_t)(uint32_t)k * row_bytes;
      cp_async_16(tile + dst + i * (16 * 128), ok ? reinterpret_cast<const bf16*>(src) : dummy, ok);
    }
  }
};

// Descriptors of a slice before its k16 steps: this warpgroup's 64 A rows, all 128 B rows.
template <int kLayout>
__device__ __forceinline__ uint64_t a_desc(uint32_t tile, int wg) {
  if constexpr (kLayout == kKMajor) return smem_desc_kmajor_sw128(tile + wg * 64 * 128);
  else return smem_desc_mnmajor_sw128(tile + wg * kPanelBytes, kPanelBytes);
}
template <int kLayout>
__device__ __forceinline__ uint64_t b_desc(uint32_t tile) {
  if constexpr (kLayout == kKMajor) return smem_desc_kmajor_sw128(tile);
  else return smem_desc_mnmajor_sw128(tile, kPanelBytes);
}

// C = A * B for one tile; on return the fp32 tile is in smem as [kBM][kLdC] (see c_tile) and
// every thread of the CTA has passed a barrier after writing it.  Must be called by all threads
// (CTA-uniform arguments).
template <int kALayout, int kBLayout>
__device__ __forceinline__ void tile_gemm(const Operand& a, const Operand& b, int k_total, unsigned char* smem) {
  constexpr uint32_t a_step = kALayout == kKMajor ? kStepK : kStepMN;
  constexpr uint32_t b_step = kBLayout == kKMajor ? kStepK : kStepMN;
  const uint32_t ring = (smem_addr(smem) + 1023u) & ~1023u;
  const int wg = threadIdx.x >> 7;
  const int nk = k_total > 0 ? (k_total + kBK - 1) / kBK : 0;
  const SliceLoader<kALayout> la(a);
  const SliceLoader<kBLayout> lb(b);

  float acc[kAccRegs];
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.f;
  wgmma_fence_operand(acc);

  __syncthreads();  // the previous epilogue has read the C tile the ring overlaps
  // Prologue: slices 0 .. kStages-3, one commit group each (empty groups keep the count uniform).
#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < nk) {
      la.load(s * kBK, k_total, ring + s * kStageBytes);
      lb.load(s * kBK, k_total, ring + s * kStageBytes + kTileBytes);
    }
    cp_async_commit();
  }

  int slot = 0, fill = kStages - 2;
  for (int kt = 0; kt < nk; ++kt) {
    // kStages - 2 + kt groups are committed and slice kt is group kt: at most kStages - 3 younger.
    cp_async_wait<kStages - 3>();
    fence_proxy_async_shared();
    __syncthreads();

    wgmma_fence();  // accumulator writes (zeroing) come before the first MMA
    const uint32_t sa = ring + slot * kStageBytes;
    const uint64_t da = a_desc<kALayout>(sa, wg), db = b_desc<kBLayout>(sa + kTileBytes);
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks)
      wgmma_bf16<kBN, kALayout, kBLayout>(acc, desc_advance(da, ks * a_step), desc_advance(db, ks * b_step), 1);
    wgmma_commit();

    // Refill the slot of slice kt-2: both warpgroups retired it before the barrier above.
    const int pre = kt + kStages - 2;
    if (pre < nk) {
      const uint32_t sf = ring + fill * kStageBytes;
      la.load(pre * kBK, k_total, sf);
      lb.load(pre * kBK, k_total, sf + kTileBytes);
    }
    cp_async_commit();

    wgmma_wait<1>();  // slice kt-1 retired (its slot is refilled next iteration); kt keeps running
    wgmma_fence_operand(acc);
    slot = slot + 1 == kStages ? 0 : slot + 1;
    fill = fill + 1 == kStages ? 0 : fill + 1;
  }
  wgmma_wait<0>();
  wgmma_fence_operand(acc);
  cp_async_wait<0>();
  __syncthreads();  // no MMA or copy still uses the ring: the C tile may overwrite it

  float* c = reinterpret_cast<float*>(smem);
  WgmmaAccCoord co = WgmmaAccCoord::of_thread(threadIdx.x & 127);
  co.row0 += 64 * wg;
#pragma unroll
  for (int i = 0; i < kAccRegs; i += 2)
    *reinterpret_cast<float2*>(c + co.row(i) * kLdC + co.col(i)) = make_float2(acc[i], acc[i + 1]);
  __syncthreads();
}
#endif  // MOK_GEMM_ENGINE_MMA_SYNC

// The staged fp32 tile left by tile_gemm: element (r, c) at c_tile(smem)[r * kLdC + c].
__device__ __forceinline__ const float* c_tile(const unsigned char* smem) {
  return reinterpret_cast<const float*>(smem);
}
// 8 consecutive fp32 of the staged tile (c multiple of 8).
__device__ __forceinline__ void c_load8(const unsigned char* smem, int r, int c, float (&v)[8]) {
  const float4* p = reinterpret_cast<const float4*>(c_tile(smem) + r * kLdC + c);
  const float4 lo = p[0], hi = p[1];
  v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
  v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
}

// Calls f(r, c) for every 8-column chunk of the staged tile with r < rows and c < cols (c a
// multiple of 8, cols a multiple of 8), spread over the CTA so that a row's chunks are adjacent
// threads (coalesced global stores).  kWidth: columns of the tile the epilogue walks.
template <int kWidth = kBN, class F>
__device__ __forceinline__ void for_each_chunk(int rows, int cols, F&& f) {
  constexpr int kChunks = kWidth / 8;
  for (int idx = threadIdx.x; idx < kBM * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    if (r < rows && c < cols) f(r, c);
  }
}

// Epilogue: C tile -> fp32 matrix (row-major, ld elements), optionally added to what is there.
__device__ __forceinline__ void store_tile_f32(const unsigned char* smem, float* dst, int ld, int rows, int cols,
                                               bool accumulate) {
  for_each_chunk(rows, cols, [&](int r, int c) {
    float v[8];
    c_load8(smem, r, c, v);
    float4* d = reinterpret_cast<float4*>(dst + (size_t)r * ld + c);
    float4 lo = make_float4(v[0], v[1], v[2], v[3]), hi = make_float4(v[4], v[5], v[6], v[7]);
    if (accumulate) {
      const float4 o0 = d[0], o1 = d[1];
      lo.x += o0.x; lo.y += o0.y; lo.z += o0.z; lo.w += o0.w;
      hi.x += o1.x; hi.y += o1.y; hi.z += o1.z; hi.w += o1.w;
    }
    d[0] = lo;
    d[1] = hi;
  });
}

// Epilogue: C tile row r -> bf16 row dst_row(r) (nullptr: row dropped), columns [0, cols).
template <class RowPtr>
__device__ __forceinline__ void store_tile_bf16_rows(const unsigned char* smem, int rows, int cols, RowPtr&& dst_row) {
  for_each_chunk(rows, cols, [&](int r, int c) {
    bf16* d = dst_row(r);
    if (d == nullptr) return;
    float v[8];
    c_load8(smem, r, c, v);
    *reinterpret_cast<uint4*>(d + c) = pack_bf16x8(v);
  });
}

}  // namespace gemm
}  // namespace mok
