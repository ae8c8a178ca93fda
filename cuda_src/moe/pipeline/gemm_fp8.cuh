// The "fp8_block" tile GEMM of the FP8 forward megakernel (docs/FP8_DESIGN.md), on the bf16
// pipeline's ring, queue and roles unchanged (pipeline/pipeline.cuh).
//
// Tile: 128 x 128 of C = A * B^T over K in 128-deep K blocks (one block = one 128-byte swizzled
// line of e4m3 = one ring stage).  The Jobs use the ring's "rows" mode (kLoadRows): the producer
// calls the task set's stage_rows() per stage, which issues the stage's three TMA loads into the
// 48 KB slot laid out as
//   [0, 16 KB)      A: 128 rows x 128 B (K-major SWIZZLE_128B, 1024-aligned like every slot)
//   [16 KB, 32 KB)  B: 128 rows x 128 B (a gate|up sub-tile: 64 gate rows, then 64 up rows)
//   [32 KB, +512)   the A tile's 128 row scales of this K block (fp32)
// so a slot is used to 32.5 of its 48 KB (4 stages of K = 128 instead of the probe's 6: the bf16
// geometry is kept so the pipeline code is shared as it is).
//
// Consumers: per K block a warpgroup waits for the stage, issues its four m64n128k32 MMAs into a
// partial set (the first with scale-d = 0), waits for them (wait_group 0: the other warpgroup's
// MMAs keep the tensor cores busy meanwhile), releases the stage (its operands are consumed and
// its scales are in registers, so the producer refills it during the promotion) and promotes:
// total += partial * fp32(s_a[row] * s_b) with one fma.  The B scale of a gate|up sub-tile differs between its gate columns (registers of
// chunks j < 8) and its up columns (j >= 8): two B scales per K block, four products per thread.
// Same promotion order every run: deterministic.
#pragma once
#include "common/fp8.cuh"
#include "common/wgmma_fp8.cuh"
#include "moe/pipeline/pipeline.cuh"

namespace mok {
namespace fp8g {

constexpr int kBN = 128;                       // tile columns
constexpr int kBK = 128;                       // K per stage (e4m3 elements = bytes)
constexpr int kRegs = kBN / 2;                 // accumulators per consumer thread and set
constexpr uint32_t kABytes = 128 * kBK;        // 16 KB
constexpr uint32_t kBBytes = kBN * kBK;        // 16 KB
constexpr uint32_t kHalfBBytes = kBBytes / 2;  // a gate or up half of a gate|up sub-tile
constexpr uint32_t kScaleOffset = kABytes + kBBytes;
constexpr uint32_t kScaleBytes = 128 * 4;
constexpr uint32_t kStageTx = kABytes + kBBytes + kScaleBytes;  // every box credits its full size
static_assert(kScaleOffset + kScaleBytes <= static_cast<uint32_t>(pipe::Geometry::kStageBytes),
              "an FP8 stage fits in a bf16 ring slot");
static_assert(pipe::Geometry::kABytes == static_cast<int>(kABytes), "B starts where the bf16 ring's B does");
static_assert(kABytes % 1024 == 0 && kHalfBBytes % 1024 == 0, "swizzle atoms stay 1024-byte aligned");

__device__ __forceinline__ uint32_t a_tile(const pipe::Shared& s, int slot) { return s.ring.a_tile(slot); }
__device__ __forceinline__ uint32_t b_tile(const pipe::Shared& s, int slot) { return s.ring.a_tile(slot) + kABytes; }
__device__ __forceinline__ uint32_t scales(uint32_t slot_base) { return slot_base + kScaleOffset; }

__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

// ---- producer: one stage's loads (into the slot at dst; returns the bytes for expect_tx) ---------
// a: 2D {K, rows}; sa: 2D {rows, K/128}; b: 3D {K, N, group}; b2 (gate|up): the up half, both
// halves from row n0 of their map.
// TMA alignment: a tiled load whose innermost coordinate times the element size is not a multiple
// of 16 bytes faults with an illegal instruction (the probe's first GPU run: a group starting at
// row 277).  The A and B boxes start at K = kb * 128 bytes; the A-scale box's innermost coordinate
// is row0 (fp32), so row0 must be a multiple of 4: here it is always a multiple of kBlockM (tiles
// of row blocks / token blocks), and the scale arrays' ld (token_ld, R) is a multiple of 4.
static_assert(kBlockM % 4 == 0, "the A-scale box's innermost coordinate (row0, fp32) stays 16-byte aligned");
__device__ __forceinline__ uint32_t load_stage(uint32_t dst, uint32_t bar, const TensorMap* a, const TensorMap* sa,
                                               int row0, int kb, const TensorMap* b, const TensorMap* b2, int n0,
                                               int group) {
  const int k = kb * kBK;
  tma_load_2d(dst, a, bar, k, row0);
  if (b2 == nullptr) {
    tma_load_3d(dst + kABytes, b, bar, k, n0, group);
  } else {
    tma_load_3d(dst + kABytes, b, bar, k, n0, group);
    tma_load_3d(dst + kABytes + kHalfBBytes, b2, bar, k, n0, group);
  }
  tma_load_2d(scales(dst), sa, bar, row0, kb);
  return kStageTx;
}

// ---- consumers ---------------------------------------------------------------------------------
// The B scales of a tile for K block kb: `split` = 1 for a gate|up sub-tile (gate for chunks
// j < 8, up for j >= 8), 0 for one scale (down).
struct BScales {
  const float* lo;  // [K blocks] gate (or the only one)
  const float* hi;  // [K blocks] up (== lo when not split)
};

// total (+)= this warpgroup's 64 rows of the tile over `k_blocks` stages.  `idle`: the rows are
// all padding; the stages are still waited for and released, the tensor cores skipped (total
// stays as it is).  Every thread of the warpgroup calls it; true when no wait failed, for both
// warpgroups (one vote of the workers).
__device__ __forceinline__ bool mainloop(const pipe::Shared& s, wg::PipeState& ps, float (&total)[kRegs], int k_blocks,
                                         int consumer, const MbarWaitCtx& w, bool idle, const BScales& sb) {
  const WgmmaAccCoord coord = WgmmaAccCoord::of_thread(threadIdx.x & 127);
  const uint32_t row_off = 4u * static_cast<uint32_t>(64 * consumer + coord.row0);
  const bool arriver = (threadIdx.x & 31) == 0;
  bool failed = false;
  float partial[kRegs];
#pragma unroll
  for (int i = 0; i < kRegs; ++i) partial[i] = 0.f;
  for (int kb = 0; kb < k_blocks; ++kb) {
    if (!failed) failed = !mbar_wait(s.ring.full(ps.slot), ps.phase, w);
    const uint32_t base = a_tile(s, ps.slot);
    float s_lo = 0.f, s_hi = 0.f, sa0 = 0.f, sa1 = 0.f;
    if (!idle) {
      s_lo = __ldg(sb.lo + kb), s_hi = __ldg(sb.hi + kb);  // latency hidden by the MMAs
      sa0 = ld_shared_f32(scales(base) + row_off), sa1 = ld_shared_f32(scales(base) + row_off + 32u);
      wgmma_fence();  // partial was read by the last promotion
      wgmma_e4m3_kblock<kBN>(partial, smem_desc_kmajor_sw128(base + consumer * 64 * kBK),
                             smem_desc_kmajor_sw128(b_tile(s, ps.slot)));
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operand(partial);
    }
    // The slot is consumed: the MMAs that read it are complete, and the arrive (release) orders the
    // scale loads before it.  Released before the promotion, so the producer's refill overlaps it.
    __syncwarp();
    if (arriver) mbar_arrive(s.ring.empty(ps.slot));
    ps.advance(pipe::kStages);
    if (!idle) {
      // fp32 products, one rounding each; register 4j + 2h + e: row half h, chunk j (chunks j < 8
      // take s_lo, the others s_hi: two products live at a time).
      {
        const float p0 = sa0 * s_lo, p1 = sa1 * s_lo;
#pragma unroll
        for (int i = 0; i < kRegs / 2; ++i) total[i] = __fmaf_rn(partial[i], (i & 2) ? p1 : p0, total[i]);
      }
      {
        const float p0 = sa0 * s_hi, p1 = sa1 * s_hi;
#pragma unroll
        for (int i = kRegs / 2; i < kRegs; ++i) total[i] = __fmaf_rn(partial[i], (i & 2) ? p1 : p0, total[i]);
      }
    }
  }
  return !workers_any(failed);
}

// ---- epilogue helpers (64-register fragments: the accumulator layout of common/wgmma.cuh) ---------
// Group q (chunks 4q .. 4q + 3, 32 columns) of row half h as 8 bf16 of this lane's chunk 4q + quad
// (pipe::quad_transpose): one 16-byte store per lane.
__device__ __forceinline__ uint4 group_bf16(const float (&acc)[kRegs], int q, int h) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = pack_bf16x2(acc[4 * (4 * q + k) + 2 * h], acc[4 * (4 * q + k) + 2 * h + 1]);
  pipe::quad_transpose(w);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Tile rows r < rows -> bf16 rows dst_row(r) (nullptr: dropped), columns [0, cols) of the tile
// (cols: a multiple of 32; dst_row points at the tile's column 0, 16-byte aligned).
template <class RowPtr>
__device__ __forceinline__ void store_rows_bf16(const float (&acc)[kRegs], const pipe::Frag& f, int rows, int cols,
                                                RowPtr&& dst_row) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = f.row0 + 8 * h;
    bf16* d = r < rows ? dst_row(r) : nullptr;
#pragma unroll
    for (int q = 0; q < kBN / 32; ++q) {
      if (32 * q >= cols) break;  // warp-uniform
      const uint4 v = group_bf16(acc, q, h);
      if (d != nullptr) *reinterpret_cast<uint4*>(d + f.chunk_col(q)) = v;
    }
  }
}

// Tile rows r < rows, columns c < cols -> fp32 dst[r * ld + c] (8-byte stores).
__device__ __forceinline__ void store_f32(const float (&acc)[kRegs], const pipe::Frag& f, float* dst, int ld, int rows,
                                          int cols) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = f.row0 + 8 * h;
    if (r >= rows) continue;
#pragma unroll
    for (int j = 0; j < kRegs / 4; ++j) {
      const int c = f.col0 + 8 * j;
      if (c < cols) *reinterpret_cast<float2*>(dst + (size_t)r * ld + c) = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }
}

}  // namespace fp8g
}  // namespace mok
