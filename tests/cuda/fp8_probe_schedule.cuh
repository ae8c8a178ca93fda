// The schedule every FP8 GEMM probe kernel shares (fp8_gemm_probe.cu and the headers it includes):
// the ring's barriers, the capacity check, the TMA producer thread's loop and the consumers' K
// loop, one K block in flight per warpgroup or two.  A probe supplies its ring (R: full / empty
// barrier addresses per slot), the loads of one stage, and its K step (Step: issue / retire, see
// KStep in fp8_gemm_probe.cu).  Included by fp8_gemm_probe.cu after Ring, Tile and decode.
#pragma once

namespace mok {
namespace fp8probe {

// The checks every probe kernel makes first: an error word already set stops every CTA (one vote,
// so the CTA leaves as a whole); a block of other than kThreads threads, or a quantised output asked
// of a kernel without that epilogue, is an internal error.
__device__ __forceinline__ bool launch_ok(const Fp8GemmParams& p, bool has_cq_epilogue) {
  if (__syncthreads_or(threadIdx.x == 0 && error_set(p.err))) return false;
  if (blockDim.x != kThreads || (!has_cq_epilogue && p.cq != nullptr)) {
    if (threadIdx.x == 0) set_error(p.err, kErrInternal, __LINE__, blockDim.x, kThreads);
    return false;
  }
  return true;
}

// full[s]: one arrival (the producer's expect_tx) plus the TMA bytes; empty[s]: one arrival per
// consumer warp (of each CTA that reads the slot: `readers` > 1 for a cluster sharing it).
template <class R>
__device__ __forceinline__ void init_ring(const R& ring, int stages, int readers = 1) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(ring.full(s), 1);
      mbar_init(ring.empty(s), 4 * kConsumers * readers);
    }
    mbar_fence_init();
  }
  __syncthreads();
}

// Whether the groups' rows fit in C (max_rows); otherwise the error word says kErrCapacity.
__device__ __forceinline__ bool rows_fit(const Fp8GemmParams& p) {
  const int total = __ldg(p.group_offset + p.groups);
  if (total < 0 || total > p.max_rows) {
    if (blockIdx.x == 0 && threadIdx.x == 0) set_error(p.err, kErrCapacity, 0, total, p.max_rows);
    return false;
  }
  return true;
}

// A launch's tile space: N tiles of tile_n columns (times every group's 128-row tiles) and 128-deep
// K blocks.
struct TileSpace {
  int n_tiles, num_tiles, k_blocks;
  __device__ __forceinline__ static TileSpace of(const Fp8GemmParams& p, int tile_n) {
    const int n_tiles = (p.n + tile_n - 1) / tile_n;
    return TileSpace{n_tiles, __ldg(p.tile_offset + p.groups) * n_tiles, (p.k + kBK - 1) / kBK};
  }
};

// A tile's accumulators, declared per tile by the caller (the MMAs' "+f" operands would otherwise
// keep the partial sets live through the epilogue, although scale-d = 0 never reads them): all zero.
template <int kRegs, int kRegs2>
__device__ __forceinline__ void zero_sets(float (&sum)[kRegs], float (&acc)[kRegs], float (&acc2)[kRegs2]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) sum[i] = acc[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kRegs2; ++i) acc2[i] = 0.f;
}

// The producer thread: for each of this CTA's tiles (round-robin over the grid) and K block, wait
// for the slot, expect `tx` bytes (out-of-range box elements load as zeros and count) and issue
// load(slot, full barrier, tile, decoded tile, kb).
template <int kStagesT, class R, class Load>
__device__ __forceinline__ void produce(const Fp8GemmParams& p, const R& ring, int n_tiles, int num_tiles,
                                        int k_blocks, uint32_t tx, Load&& load) {
  const MbarWaitCtx w{p.err, p.timeout_ns, 0, 1};
  wg::PipeState ps;
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const Tile t = decode(p, tile, n_tiles);
    for (int kb = 0; kb < k_blocks; ++kb) {
      if (!mbar_wait(ring.empty(ps.slot), ps.phase ^ 1u, w)) return;
      const uint32_t full = ring.full(ps.slot);
      mbar_arrive_expect_tx(full, tx);
      load(ps.slot, full, tile, t, kb);
      ps.advance(kStagesT);
    }
  }
}

// A tile's K loop on one consumer warpgroup: sum (+)= the promoted K blocks.  !kOverlap: issue
// block kb, wait for it (the other warpgroup's MMAs keep the tensor cores busy meanwhile),
// promote.  kOverlap: two partial sets, block kb + 1's MMAs run while block kb is promoted; the
// same promotion order, so the same bits.  acc2 is used only with kOverlap.
template <bool kOverlap, int kRegs, class Step>
__device__ __forceinline__ void k_loop(const Step& st, wg::PipeState& ps, float (&acc)[kRegs],
                                       float (&acc2)[kOverlap ? kRegs : 1], float (&sum)[kRegs], int k_blocks,
                                       bool& failed, bool arriver) {
  if constexpr (!kOverlap) {
    for (int kb = 0; kb < k_blocks; ++kb) {
      const auto b = st.issue(ps, acc, kb, failed);
      wgmma_wait<0>();
      st.retire(sum, acc, b, arriver);
    }
  } else {
    auto ba = st.issue(ps, acc, 0, failed);
    int kb = 0;
    for (; kb + 2 < k_blocks; kb += 2) {  // acc: block kb in flight; kb + 1 and kb + 2 exist
      const auto bb = st.issue(ps, acc2, kb + 1, failed);
      wgmma_wait<1>();
      st.retire(sum, acc, ba, arriver);
      ba = st.issue(ps, acc, kb + 2, failed);
      wgmma_wait<1>();
      st.retire(sum, acc2, bb, arriver);
    }
    if (kb + 1 < k_blocks) {
      const auto bb = st.issue(ps, acc2, kb + 1, failed);
      wgmma_wait<1>();
      st.retire(sum, acc, ba, arriver);
      wgmma_wait<0>();
      st.retire(sum, acc2, bb, arriver);
    } else {
      wgmma_wait<0>();
      st.retire(sum, acc, ba, arriver);
    }
  }
}

// C rows row0 + local_row + 8h (< row_end), columns n0 + coord.col0 + 8j + {0, 1} (< N): fp32 or
// bf16 (p.c_bf16), straight from the accumulator fragment.
template <int kRegs>
__device__ __forceinline__ void store_c(const Fp8GemmParams& p, const float (&sum)[kRegs], int row0, int row_end,
                                        int n0, int local_row, const WgmmaAccCoord& coord) {
  const int cols_left = p.n - n0 - coord.col0;  // chunk j is inside C when 8j < cols_left
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + local_row + 8 * h;
    if (row >= row_end) continue;
    const size_t base = (size_t)row * p.n + n0 + coord.col0;
#pragma unroll
    for (int j = 0; j < kRegs / 4; ++j) {
      if (8 * j >= cols_left) continue;
      const float v0 = sum[4 * j + 2 * h], v1 = sum[4 * j + 2 * h + 1];
      if (p.c_bf16) *reinterpret_cast<uint32_t*>(static_cast<bf16*>(p.c) + base + 8 * j) = pack_bf16x2(v0, v1);
      else *reinterpret_cast<float2*>(static_cast<float*>(p.c) + base + 8 * j) = make_float2(v0, v1);
    }
  }
}

}  // namespace fp8probe
}  // namespace mok
