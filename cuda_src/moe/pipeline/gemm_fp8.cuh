// The "fp8_block" tile GEMM of the FP8 forward megakernel (docs/FP8_DESIGN.md), on the bf16
// pipeline's ring, queue and roles unchanged (pipeline/pipeline.cuh).
//
// Tile: 128 x 256 of C = A * B^T over K in 128-deep K blocks (one block = one 128-byte swizzled
// line of e4m3 = one ring stage), computed as two 128-wide sub-tiles that share the A stage.  The
// Jobs use the ring's "rows" mode (kLoadRows): the producer calls the task set's stage_rows() per
// stage, which issues the stage's TMA loads into the 48 KB slot, used whole:
//   [0, 16 KB)      A: 128 rows x 128 B (K-major SWIZZLE_128B, 1024-aligned like every slot)
//   [16 KB, 32 KB)  B of sub-tile 0: 128 rows x 128 B (gate|up: 64 gate rows, then 64 up rows)
//   [32 KB, 48 KB)  B of sub-tile 1 (not loaded when the sub-tile lies past N)
// and the A tile's 128 row scales of this K block (fp32, 512 B) into the side ring below (static
// shared memory, one 512-byte slot per ring slot, completed on the same full barrier).  Why: a
// 128 x 128 tile per stage used 32.5 KB of each slot, so only ~130 KB were in flight per SM (the
// bf16 kernels: 192 KB), and a gate|up task loaded its A tile twice (once per sub-tile).  The GPU
// trace of 2c18ca5 put every FP8 K block at ~0.9 us, gate|up and down alike (MMA ~0.28 us, the
// promotion ~0.05 us): consistent with the ring's bytes in flight, not the tensor cores, setting
// the pace (docs/FP8_DESIGN.md, "128 x 256 tiles").
//
// Consumers: per K block a warpgroup waits for the stage, then per sub-tile issues its four
// m64n128k32 MMAs into one partial set (the first with scale-d = 0), waits for them (wait_group 0:
// the other warpgroup's MMAs keep the tensor cores busy meanwhile) and promotes into that
// sub-tile's totals: total += partial * fp32(s_a[row] * s_b) with one fma.  64 partial + 2 x 64
// totals = 192 accumulators per thread; a second partial set (to overlap a promotion with the next
// MMAs inside one warpgroup) would need 256.  The stage is released after the second sub-tile's
// MMAs (its scales are in registers by then).  The B scale of a gate|up sub-tile differs between its
// gate columns (registers of chunks j < 8) and its up columns (j >= 8): two B scales per sub-tile.
// Same promotion order every run: deterministic.
#pragma once
#include "common/fp8.cuh"
#include "common/wgmma_fp8.cuh"
#include "moe/pipeline/pipeline.cuh"

namespace mok {
namespace fp8g {

constexpr int kBN = 128;                       // sub-tile columns (an m64n128 MMA per warpgroup)
constexpr int kSubTiles = 2;                   // tile = 128 x 256
constexpr int kTileN = kSubTiles * kBN;
constexpr int kBK = 128;                       // K per stage (e4m3 elements = bytes)
constexpr int kRegs = kBN / 2;                 // accumulators per consumer thread and set
constexpr uint32_t kABytes = 128 * kBK;        // 16 KB
constexpr uint32_t kSubBBytes = kBN * kBK;     // 16 KB: B of one sub-tile
constexpr uint32_t kHalfBBytes = kSubBBytes / 2;  // a gate or up half of a gate|up sub-tile
constexpr uint32_t kScaleBytes = 128 * 4;
static_assert(kABytes + kSubTiles * kSubBBytes == static_cast<uint32_t>(pipe::Geometry::kStageBytes),
              "an FP8 stage fills a bf16 ring slot");
static_assert(pipe::Geometry::kABytes == static_cast<int>(kABytes), "B starts where the bf16 ring's B does");
static_assert(kABytes % 1024 == 0 && kHalfBBytes % 1024 == 0, "swizzle atoms stay 1024-byte aligned");

__device__ __forceinline__ uint32_t a_tile(const pipe::Shared& s, int slot) { return s.ring.a_tile(slot); }
__device__ __forceinline__ uint32_t b_tile(uint32_t slot_base, int sub) { return slot_base + kABytes + sub * kSubBBytes; }

// The A-scale side ring: slot i holds the scales of the stage in ring slot i.  Static shared memory
// (2 KB on top of the dynamic pipe::kSmemBytes, which the host mirrors and which stays as it is).
__device__ __forceinline__ uint32_t a_scales(int slot) {
  __shared__ __align__(128) float ring[pipe::kStages][128];
  return smem_u32(&ring[0][0]) + static_cast<uint32_t>(slot) * kScaleBytes;
}
// The ring slot of a full barrier (the producer's stage_rows gets the slot's address and barrier):
// full[i] = bars + 8 i, and bars = ring base (1024-aligned) + kRingBytes is 1024-aligned.
static_assert(pipe::Geometry::kRingBytes % 1024 == 0 && (pipe::kStages & (pipe::kStages - 1)) == 0 &&
              8 * pipe::kStages <= 1024, "full barrier address -> slot");
__device__ __forceinline__ int slot_of_full_barrier(uint32_t bar) { return (bar >> 3) & (pipe::kStages - 1); }

// Pulls the 128-byte line holding p into this SM's L1 (no register written, nothing waits).
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" :: "l"(p)); }

__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

// ---- producer: one stage's loads (into the slot at dst; returns the bytes for expect_tx) ---------
// a: 2D {K, rows}; sa: 2D {rows, K/128}; b: 3D {K, N, group}.  Sub-tile s (s < subtiles) of B:
// gate|up (b2 != nullptr): gate rows n0 + 64 s .. + 63 from b, then the same up rows from b2;
// otherwise rows n0 + 128 s .. + 127 from b.  Rows past N are zero-filled by TMA.
// TMA alignment: a tiled load whose innermost coordinate times the element size is not a multiple
// of 16 bytes faults with an illegal instruction (the probe's first GPU run: a group starting at
// row 277).  The A and B boxes start at K = kb * 128 bytes; the A-scale box's innermost coordinate
// is row0 (fp32), so row0 must be a multiple of 4: here it is always a multiple of kBlockM (tiles
// of row blocks / token blocks), and the scale arrays' ld (token_ld, R) is a multiple of 4.
static_assert(kBlockM % 4 == 0, "the A-scale box's innermost coordinate (row0, fp32) stays 16-byte aligned");
__device__ __forceinline__ uint32_t load_stage(uint32_t dst, uint32_t bar, const TensorMap* a, const TensorMap* sa,
                                               int row0, int kb, const TensorMap* b, const TensorMap* b2, int n0,
                                               int group, int subtiles) {
  const int k = kb * kBK;
  tma_load_2d(dst, a, bar, k, row0);
  tma_load_2d(a_scales(slot_of_full_barrier(bar)), sa, bar, row0, kb);
  dst += kABytes;
  if (b2 == nullptr) {
    tma_load_3d(dst, b, bar, k, n0, group);
    if (subtiles > 1) tma_load_3d(dst + kSubBBytes, b, bar, k, n0 + kBN, group);
  } else {
    tma_load_3d(dst, b, bar, k, n0, group);
    tma_load_3d(dst + kHalfBBytes, b2, bar, k, n0, group);
    if (subtiles > 1) {
      tma_load_3d(dst + kSubBBytes, b, bar, k, n0 + kBN / 2, group);
      tma_load_3d(dst + kSubBBytes + kHalfBBytes, b2, bar, k, n0 + kBN / 2, group);
    }
  }
  return kABytes + (subtiles > 1 ? 2 * kSubBBytes : kSubBBytes) + kScaleBytes;  // every box credits its full size
}

// ---- consumers ---------------------------------------------------------------------------------
// The B scales of a tile, per K block kb.  gate|up (kGateUp): one I block, so both sub-tiles take
// lo[kb] for their gate columns (chunks j < 8) and hi[kb] for their up columns (j >= 8).  down: one
// scale per sub-tile, lo[kb] for sub-tile 0 and lo[kb + step] for sub-tile 1 (the next weight row
// block: step = K blocks per row block, or 0 when there is no sub-tile 1).
struct BScales {
  const float* lo;
  const float* hi;  // gate|up; == lo for down
  int step;         // down; 0 for gate|up
  __device__ __forceinline__ void advance() { ++lo, ++hi; }  // to the next K block
};

// One K block's promotion of a sub-tile: register 4j + 2h + e belongs to row half h and chunk j;
// chunks j < 8 take the products with s_lo, the others those with s_hi.  The products are fp32,
// one rounding each (s_a[row] * s_b), computed once per K block by Products::of: a gate|up tile's
// two sub-tiles share them, and they are ready before the MMAs complete.
struct Products {
  float lo0, lo1, hi0, hi1;  // s_a[row g] * s_lo, s_a[row g + 8] * s_lo, the same with s_hi
  __device__ __forceinline__ static Products of(float sa0, float sa1, float s_lo, float s_hi) {
    return Products{sa0 * s_lo, sa1 * s_lo, sa0 * s_hi, sa1 * s_hi};
  }
};
__device__ __forceinline__ void promote(float (&total)[kRegs], const float (&partial)[kRegs], const Products& p) {
#pragma unroll
  for (int i = 0; i < kRegs / 2; ++i) total[i] = __fmaf_rn(partial[i], (i & 2) ? p.lo1 : p.lo0, total[i]);
#pragma unroll
  for (int i = kRegs / 2; i < kRegs; ++i) total[i] = __fmaf_rn(partial[i], (i & 2) ? p.hi1 : p.hi0, total[i]);
}

// The slot is consumed: the MMAs that read it are complete, and the arrive (release) orders the
// scale loads before it.
__device__ __forceinline__ void release(const pipe::Shared& s, int slot) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive(s.ring.empty(slot));
}

// One copy of the K loop per (kTwo, kIdle), see mainloop().  What lies between a wait for this
// warpgroup's MMAs and its next MMAs decides how long the tensor cores wait for it
// (docs/FP8_DESIGN.md, "Mainloop turnaround"), so that path is kept to the promotion, the release
// and the next descriptors: the scale products are formed while the first MMAs run (a gate|up
// tile's sub-tile 1 reuses them), and with kTwo a compile-time constant sub-tile 1's MMAs share a
// basic block with sub-tile 0's, so ptxas builds their descriptors under the first MMAs instead of
// after the promotion (ptxas moves no code across blocks).  Registers decide the rest: at ~225
// live, a value kept across a wait costs a spill elsewhere.  kHold: the last K block's slot is not
// released (the staged gate|up tile borrows it: pipeline/staged_tile.cuh).
template <bool kGateUp, bool kTwo, bool kIdle, bool kHold, class SB>
__device__ __forceinline__ bool mainloop_copy(const pipe::Shared& s, wg::PipeState& ps, float (&t0)[kRegs],
                                              float (&t1)[kRegs], int k_blocks, int consumer, const MbarWaitCtx& w,
                                              SB sb) {
  const uint32_t row_off =
      4u * static_cast<uint32_t>(64 * consumer + WgmmaAccCoord::of_thread(threadIdx.x & 127).row0);
  bool failed = false;
  float partial[kRegs];
#pragma unroll
  for (int i = 0; i < kRegs; ++i) partial[i] = 0.f;
  for (int kb = k_blocks; kb > 0; --kb) {
    if (!failed) failed = !mbar_wait(s.ring.full(ps.slot), ps.phase, w);
    if constexpr (!kIdle) {
      // B scales: global loads, A scales: the side ring; both consumed after the first MMAs issue.
      const float s_lo0 = __ldg(sb.lo), s_hi0 = kGateUp ? __ldg(sb.hi) : s_lo0;
      const float s_1 = kGateUp ? 0.f : __ldg(sb.lo + sb.step);  // down: sub-tile 1's B scale
      const uint32_t sa = a_scales(ps.slot) + row_off;
      const float sa0 = ld_shared_f32(sa), sa1 = ld_shared_f32(sa + 32u);
      const uint32_t base = a_tile(s, ps.slot);
      wgmma_fence();  // partial was read by the last promotion
      wgmma_e4m3_kblock<kBN>(partial, smem_desc_kmajor_sw128(base + consumer * 64 * kBK),
                             smem_desc_kmajor_sw128(b_tile(base, 0)));
      wgmma_commit();
      const Products p0 = Products::of(sa0, sa1, s_lo0, s_hi0);
      const Products p1 = kGateUp ? p0 : Products::of(sa0, sa1, s_1, s_1);
      wgmma_wait<0>();
      wgmma_fence_operand(partial);
      promote(t0, partial, p0);
      if constexpr (kTwo) {
        wgmma_fence();
        wgmma_e4m3_kblock<kBN>(partial, smem_desc_kmajor_sw128(base + consumer * 64 * kBK),
                               smem_desc_kmajor_sw128(b_tile(base, 1)));
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(partial);
      }
      if (!kHold || kb > 1) release(s, ps.slot);  // before sub-tile 1's promotion, so the refill overlaps it
      if constexpr (kTwo) promote(t1, partial, p1);
    } else if (!kHold || kb > 1) {
      release(s, ps.slot);
    }
    sb.advance();
    ps.advance(pipe::kStages);
  }
  return !workers_any(failed);
}

// t0 (+)= this warpgroup's 64 rows of sub-tile 0 over `k_blocks` stages, t1 of sub-tile 1 when
// `two` (otherwise t1 stays as it is).  `idle`: the rows are all padding; the stages are still
// waited for and released, the tensor cores skipped.  Every thread of the warpgroup calls it; true
// when no wait failed, for both warpgroups (one vote of the workers).  Three copies of the loop
// (the idle one has no MMA; ~5 % more code in the forward cubin): `two` is the same for both
// warpgroups of a task and false only at the end of N, so both run one copy, except where one is
// idle.  kHold: see mainloop_copy.
template <bool kGateUp, bool kHold = false, class SB = BScales>
__device__ __forceinline__ bool mainloop(const pipe::Shared& s, wg::PipeState& ps, float (&t0)[kRegs],
                                         float (&t1)[kRegs], int k_blocks, int consumer, const MbarWaitCtx& w,
                                         bool idle, bool two, SB sb) {
  if (idle) return mainloop_copy<kGateUp, false, true, kHold>(s, ps, t0, t1, k_blocks, consumer, w, sb);
  if (two) return mainloop_copy<kGateUp, true, false, kHold>(s, ps, t0, t1, k_blocks, consumer, w, sb);
  return mainloop_copy<kGateUp, false, false, kHold>(s, ps, t0, t1, k_blocks, consumer, w, sb);
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
