// The Hopper GEMM engine: TMA loads into a multi-stage shared-memory ring guarded by mbarriers,
// one producer thread issuing them, and two consumer warpgroups issuing wgmma with fp32
// accumulators in registers.  A tile is kBM x BN (128 x BN) of C = A * B^T over K:
//   A: M x K, rows of the tile = M indices;   B: N x K, rows of the tile = N indices.
// Consumer warpgroup c (0 or 1) owns tile rows [64c, 64c + 64) and all BN columns; its thread
// gets its accumulator fragment (BN/2 floats) plus coordinates (acc_coord) for the caller's
// epilogue, so epilogues run straight from registers.
//
// CTA layout: kThreads = 384 = warpgroup 0 (producer: one thread issues TMA, the other warps
// leave) + warpgroups 1 and 2 (consumers).  __launch_bounds__(kThreads, 1) is required: the
// roles rebalance registers with setmaxnreg (producer kProducerRegs, consumers kConsumerRegs;
// 128*40 + 256*232 <= 65536).
//
// Operands come from tensor maps (see common/tma.cuh, mok_rt/runtime/tensormap.py), always 3D with the
// group (expert) outermost so a box never reads across groups (out-of-range rows are zeros):
//   K-major  operand (rows x K, K contiguous):  dims {K, rows, groups}, box {64, R, 1}
//            (R = 128 for A, BN for B), one load per stage.
//   MN-major operand (K x rows, rows contiguous): dims {rows, K, groups}, box {64, 64, 1},
//            R/64 loads per stage, one per 64-row panel.
// All with SWIZZLE_128B, so every k-tile of an operand lands as 128-byte swizzled lines in a
// 1024-byte aligned buffer, which is what the wgmma descriptors below describe.
//
// Pipeline protocol (per ring slot s; full[s]: 1 arrival + the stage's bytes; empty[s]: one
// arrival per consumer warp):
//   producer: wait empty[s] (parity ph^1) -> arrive.expect_tx(full[s], bytes) -> TMA loads.
//   consumer: wait full[s] (parity ph) -> wgmma x 4 (k16 steps) -> commit -> wait_group 1
//             (the previous slot's MMAs are done) -> lane 0 of each warp arrives on its empty.
// Producer and consumers walk the same tile sequence, so slot/phase counters stay in lockstep
// across tiles and the producer fills the next tile's slots during the consumers' epilogue.
//
// Failure (a wait that times out, or the error word set elsewhere) must not split a warpgroup
// around a .sync.aligned instruction: a consumer thread whose wait fails marks itself failed and
// skips its remaining waits (computing garbage) until the tile ends, where the warpgroup agrees
// with one bar.red.or (named barrier 1 + consumer index) and leaves together.
#pragma once
#include <stdint.h>
#include "common/errors.cuh"
#include "common/mbarrier.cuh"
#include "common/ptx.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"

namespace mok {
namespace wg {

constexpr int kBM = 128;               // tile rows (2 consumer warpgroups x 64)
constexpr int kBK = 64;                // k per stage: one 128-byte swizzled line of bf16
constexpr int kConsumers = 2;          // consumer warpgroups
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= 65536, "register file");
constexpr int kLineBytes = 128;        // one swizzled line: 64 bf16
constexpr int kPanelBytes = 64 * kLineBytes;   // MN-major: 64 k-lines of one 64-wide panel
constexpr int kStepBytesK = 16 * 2;            // K-major k16 step: 16 elements along the line
constexpr int kStepBytesMN = 16 * kLineBytes;  // MN-major k16 step: 16 lines
constexpr int kEmptyArrivals = 4 * kConsumers; // one per consumer warp
constexpr int kConsumerBarrierBase = 1;        // named barriers 1, 2 (0 is __syncthreads)

enum Major : int { kKMajor = 0, kMNMajor = 1 };

// Where one operand of a tile comes from: the tensor map, the tile's first row (M for A, N for
// B) inside the group, and the group (outermost tensor coordinate).
struct OperandSrc {
  const TensorMap* map;
  int row0;
  int group;
};

// Slot / phase position in the ring (producer and consumers each keep one).
struct PipeState {
  int slot = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance(int stages) {
    if (++slot == stages) { slot = 0; phase ^= 1u; }
  }
};

// True for every thread of the calling consumer warpgroup when any of them passes true.
__device__ __forceinline__ bool warpgroup_any(bool v, int consumer) {
  uint32_t r;
  asm volatile(
      "{\n\t.reg .pred p, q;\n\tsetp.ne.u32 q, %1, 0;\n\t"
      "bar.red.or.pred p, %2, 128, q;\n\tselp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(r) : "r"(static_cast<uint32_t>(v)), "r"(kConsumerBarrierBase + consumer) : "memory");
  return r != 0;
}

template <int BN_, int kStages_, int kAMajor_, int kBMajor_>
struct Engine {
  static constexpr int BN = BN_, kStages = kStages_, kAMajor = kAMajor_, kBMajor = kBMajor_;
  static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma widths instantiated: 64, 128, 256");
  static_assert(kStages >= 2, "a ring needs two slots");
  static constexpr int kAccRegs = BN / 2;
  static constexpr int kABytes = kBM * kBK * 2;
  static constexpr int kBBytes = BN * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "slots stay 1024-byte aligned (128B swizzle)");
  static constexpr int kRingBytes = kStages * kStageBytes;
  static constexpr int kBarrierBytes = 2 * kStages * 8;
  // Dynamic shared memory a kernel must request: ring + barriers + slack to align the ring.
  static constexpr int kSmemBytes = kRingBytes + kBarrierBytes + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "fits the opt-in shared memory of sm_90");

  // ---- the ring -------------------------------------------------------------------------------
  struct Ring {
    uint32_t data;  // shared address of slot 0, 1024-byte aligned
    uint32_t bars;  // full[s] at bars + 8s, empty[s] at bars + 8(kStages + s)
    __device__ __forceinline__ uint32_t full(int s) const { return bars + 8u * s; }
    __device__ __forceinline__ uint32_t empty(int s) const { return bars + 8u * (kStages + s); }
    __device__ __forceinline__ uint32_t a_tile(int s) const { return data + (uint32_t)s * kStageBytes; }
    __device__ __forceinline__ uint32_t b_tile(int s) const { return a_tile(s) + kABytes; }
  };

  __device__ __forceinline__ static Ring ring(unsigned char* smem) {
    const uint32_t base = (smem_u32(smem) + 1023u) & ~1023u;
    return Ring{base, base + kRingBytes};
  }

  // Thread 0 initialises the barriers; every thread must then pass a CTA barrier before use.
  __device__ __forceinline__ static void init(const Ring& r) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) {
        mbar_init(r.full(s), 1);
        mbar_init(r.empty(s), kEmptyArrivals);
      }
      mbar_fence_init();
    }
  }

  // ---- producer (one thread) -------------------------------------------------------------------
  template <int kMajor, int kRows>
  __device__ __forceinline__ static void load_operand(const OperandSrc& op, int k0, uint32_t dst, uint32_t bar) {
    if constexpr (kMajor == kKMajor) {
      tma_load_3d(dst, op.map, bar, k0, op.row0, op.group);
    } else {
#pragma unroll
      for (int p = 0; p < kRows / 64; ++p) tma_load_3d(dst + p * kPanelBytes, op.map, bar, op.row0 + 64 * p, k0, op.group);
    }
  }

  // Issues the k_tiles stages of one tile.  False when a wait failed (the caller stops).
  __device__ __forceinline__ static bool produce(const Ring& r, PipeState& ps, const OperandSrc& a,
                                                 const OperandSrc& b, int k_tiles, const MbarWaitCtx& w) {
    for (int kt = 0; kt < k_tiles; ++kt) {
      if (!mbar_wait(r.empty(ps.slot), ps.phase ^ 1u, w)) return false;
      const uint32_t full = r.full(ps.slot);
      mbar_arrive_expect_tx(full, kStageBytes);  // out-of-range box elements still count
      load_operand<kAMajor, kBM>(a, kt * kBK, r.a_tile(ps.slot), full);
      load_operand<kBMajor, BN>(b, kt * kBK, r.b_tile(ps.slot), full);
      ps.advance(kStages);
    }
    return true;
  }

  // ---- consumers (a whole warpgroup) --------------------------------------------------------------
  // Descriptors of this warpgroup's A rows and of all B rows in slot s, before the k16 steps.
  __device__ __forceinline__ static uint64_t a_desc(const Ring& r, int s, int consumer) {
    if constexpr (kAMajor == kKMajor) return smem_desc_kmajor_sw128(r.a_tile(s) + consumer * 64 * kLineBytes);
    else return smem_desc_mnmajor_sw128(r.a_tile(s) + consumer * kPanelBytes, kPanelBytes);
  }
  __device__ __forceinline__ static uint64_t b_desc(const Ring& r, int s) {
    if constexpr (kBMajor == kKMajor) return smem_desc_kmajor_sw128(r.b_tile(s));
    else return smem_desc_mnmajor_sw128(r.b_tile(s), kPanelBytes);
  }

  // acc = A[64 rows of this warpgroup] * B^T over k_tiles stages.  Every thread of the warpgroup
  // calls it; returns the warpgroup-uniform verdict (false: stop, a wait failed somewhere).
  // hand_over >= 0: after issuing k-tile `hand_over`'s MMAs the warpgroup arrives on named
  // barrier hand_over_bar (256 threads: the other consumer warpgroup waits there for its turn).
  __device__ __forceinline__ static bool consume(const Ring& r, PipeState& ps, float (&acc)[kAccRegs], int k_tiles,
                                                 int consumer, const MbarWaitCtx& w, int hand_over = -1,
                                                 int hand_over_bar = 0) {
    constexpr uint32_t a_step = kAMajor == kKMajor ? kStepBytesK : kStepBytesMN;
    constexpr uint32_t b_step = kBMajor == kKMajor ? kStepBytesK : kStepBytesMN;
    const bool arriver = (threadIdx.x & 31) == 0;
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.f;
    wgmma_fence_operand(acc);
    bool failed = false;
    int prev = -1;
    for (int kt = 0; kt < k_tiles; ++kt) {
      if (!failed) failed = !mbar_wait(r.full(ps.slot), ps.phase, w);
      wgmma_fence();  // the zeroing / previous epilogue's register accesses come first
      const uint64_t da = a_desc(r, ps.slot, consumer), db = b_desc(r, ps.slot);
#pragma unroll
      for (int ks = 0; ks < kBK / 16; ++ks)
        wgmma_bf16<BN, kAMajor, kBMajor>(acc, desc_advance(da, ks * a_step), desc_advance(db, ks * b_step), 1);
      wgmma_commit();
      wgmma_wait<1>();  // the previous slot's MMAs have read their operands
      wgmma_fence_operand(acc);
      if (prev >= 0 && arriver) mbar_arrive(r.empty(prev));
      prev = ps.slot;
      ps.advance(kStages);
      if (kt == hand_over) named_bar_arrive(hand_over_bar, 2 * 128);  // both consumer warpgroups
    }
    wgmma_wait<0>();
    wgmma_fence_operand(acc);
    if (prev >= 0 && arriver) mbar_arrive(r.empty(prev));
    return !warpgroup_any(failed, consumer);
  }

  // The calling consumer thread's fragment coordinates inside the 128 x BN tile.
  __device__ __forceinline__ static WgmmaAccCoord acc_coord(int consumer) {
    WgmmaAccCoord c = WgmmaAccCoord::of_thread(threadIdx.x & 127);
    c.row0 += 64 * consumer;
    return c;
  }
};

// Calls f(row, col, v0, v1) for each pair of horizontally adjacent accumulators of the calling
// thread: (row, col) and (row, col + 1) of the 128 x BN tile.  Pairs come in column order, the
// row-g pair before the row-g+8 pair of each 8-column chunk.
template <int kAccRegs, class F>
__device__ __forceinline__ void for_each_acc_pair(const float (&acc)[kAccRegs], const WgmmaAccCoord& c, F&& f) {
#pragma unroll
  for (int i = 0; i < kAccRegs; i += 2) f(c.row(i), c.col(i), acc[i], acc[i + 1]);
}

}  // namespace wg
}  // namespace mok
