// fp8_gemm_probe_lean(_turns): the plain schedule (one partial set, wait_group 0 per K block) with
// nothing but the promotion between a warpgroup's wait for its MMAs and its next MMAs.
//
// Why (bench/NOTES-FP8-2.md, round 13): ncu's per-instruction view of cuBLAS's block-scaled kernel
// (1.2-1.3k TFLOP/s on our operands, our bits) shows the plain schedule, not two sets in flight:
// issue a K block's four MMAs, then -- while they run -- wait for the next stage's full barrier and
// load its scales, then wait_group 0, promote (64 FFMA), release the slot, issue the next block.
// Its critical path (wait -> next MMA) is ~75 instructions with no load latency in it.  Ours
// (fp8_gemm_probe) puts the full-barrier wait, the vote, the scale loads and products and the
// descriptor moves (R2UR) after the promotion: all in the path while the tensor cores wait.
// Here the next block's barrier and scales are taken under the current MMAs, and the warpgroup
// index comes from a shuffle so that the descriptors are warp-uniform (uniform registers, no
// R2UR per MMA).  kTurns: cuBLAS also orders the two warpgroups' issues with a named barrier
// (consumer 0 issues, then both meet; consumer 1 issues after meeting), measured on and off.
//
// Same products, same fma order per element: the plain probe's bits (tested).  Launch, params,
// maps: those of fp8_gemm_probe.  Included at the end of fp8_gemm_probe.cu.
#pragma once

namespace mok {
namespace fp8probe {

constexpr int kLeanTurnBarrier = 3;   // named barriers: 0 __syncthreads, 1-2 the warpgroup votes

__device__ __forceinline__ void lean_issue(const Ring& ring, int slot, int consumer, float (&acc)[kAccRegs]) {
  wgmma_fence();  // acc was read by the last promotion
  wgmma_e4m3_kblock<kBN>(acc, smem_desc_kmajor_sw128(ring.a_tile(slot) + consumer * 64 * kBK),
                         smem_desc_kmajor_sw128(ring.b_tile(slot)));
  wgmma_commit();
}

// True for every consumer thread when any of the 256 passes true (the turn barrier, as a reduction).
__device__ __forceinline__ bool consumers_any(bool v) {
  uint32_t r;
  asm volatile("{\n\t.reg .pred p, q;\n\tsetp.ne.u32 q, %1, 0;\n\t"
               "bar.red.or.pred p, %2, 256, q;\n\tselp.u32 %0, 1, 0, p;\n\t}"
               : "=r"(r) : "r"(static_cast<uint32_t>(v)), "r"(kLeanTurnBarrier) : "memory");
  return r != 0;
}

// This CTA's slot release: lane 0 of each consumer warp arrives on the slot's empty barrier
// (fp8_mc_probe.cuh releases in both CTAs of a pair).
struct ReleaseLocal {
  __device__ __forceinline__ void operator()(const Ring& ring, int slot) const { mbar_arrive(ring.empty(slot)); }
};

// One tile's K loop in the lean order; sum = the tile's fp32 totals of this thread's rows.
// Returns whether a ring wait failed (this warpgroup's verdict; the caller makes it common).
// sb: the tile's B scales per K block; sa_off: this thread's rows in a stage's A scales.
template <bool kTurns, class Release>
__device__ __forceinline__ bool lean_tile(const Ring& ring, const float* sb, uint32_t sa_off, int consumer,
                                          const MbarWaitCtx& w, wg::PipeState& ps, float (&sum)[kAccRegs],
                                          int k_blocks, const Release& release) {
  const bool arriver = (threadIdx.x & 31) == 0;
  bool failed = false;
  // Waits for the stage at ps (a warp vote, as KStep::issue says why) and reads block kb's scales.
  auto prepare = [&](int kb) -> KBlock {
    const float s_b = __ldg(sb + kb);
    if (!failed && !__all_sync(~0u, mbar_try_wait(ring.full(ps.slot), ps.phase)))
      failed = !__all_sync(~0u, mbar_wait(ring.full(ps.slot), ps.phase, w));
    const uint32_t sa = ring.sa(ps.slot) + sa_off;
    return KBlock{ps.slot, ld_shared_f32(sa) * s_b, ld_shared_f32(sa + 32u) * s_b};
  };
  auto retire = [&](float (&acc)[kAccRegs], const KBlock& b) {
    wgmma_wait<0>();
    wgmma_fence_operand(acc);
    fp8_promote(sum, acc, b.s_lo, b.s_hi);
    if (arriver) release(ring, b.slot);
  };
  float acc[kAccRegs], unused[1];
  zero_sets(sum, acc, unused);
  KBlock next = prepare(0);
  ps.advance(kStages);
  lean_issue(ring, next.slot, consumer, acc);
  for (int kb = 1; kb < k_blocks; ++kb) {  // block kb - 1 in flight
    const KBlock cur = next;
    next = prepare(kb);   // under block kb - 1's MMAs
    ps.advance(kStages);
    retire(acc, cur);
    if constexpr (kTurns) { if (consumer == 1) named_bar_sync(kLeanTurnBarrier, 256); }
    lean_issue(ring, next.slot, consumer, acc);
    if constexpr (kTurns) { if (consumer == 0) named_bar_sync(kLeanTurnBarrier, 256); }
  }
  retire(acc, next);
  return failed;
}

template <bool kTurns>
__device__ void gemm_lean(const Fp8GemmParams& p, unsigned char* smem) {
  const Ring ring{(smem_u32(smem) + 1023u) & ~1023u};
  init_ring(ring, kStages);
  if (!rows_fit(p)) return;
  const TileSpace ts = TileSpace::of(p, kBN);
  const int role = __shfl_sync(~0u, static_cast<int>(threadIdx.x) / 128, 0);  // warp-uniform by construction

  if (role == 0) {
    setmaxnreg_dec<wg::kProducerRegs>();
    if (threadIdx.x == 0) produce_ab(p, ring, ts);
    return;
  }

  setmaxnreg_inc<wg::kConsumerRegs>();
  const Consumer c = Consumer::of(p, role);
  wg::PipeState ps;
  for (int tile = blockIdx.x; tile < ts.num_tiles; tile += gridDim.x) {
    const Tile t = decode(p, tile, ts.n_tiles);
    float sum[kAccRegs];
    const bool failed = lean_tile<kTurns>(ring, c.b_scales(p, t, ts.k_blocks), 4u * c.sa_row(t), c.index, c.w, ps,
                                          sum, ts.k_blocks, ReleaseLocal{});
    // With turns both warpgroups decide together: one leaving alone would leave the other waiting
    // at the turn barrier of the next tile.
    if (kTurns ? consumers_any(failed) : wg::warpgroup_any(failed, c.index)) return;
    store_tile(p, sum, t, c.local_row, c.coord);
  }
}

}  // namespace fp8probe
}  // namespace mok

extern "C" __global__ void __launch_bounds__(fp8probe::kThreads, 1)
fp8_gemm_probe_lean(const __grid_constant__ Fp8GemmParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  if (fp8probe::launch_ok(p, /*has_cq_epilogue=*/true)) fp8probe::gemm_lean<false>(p, smem);
}

extern "C" __global__ void __launch_bounds__(fp8probe::kThreads, 1)
fp8_gemm_probe_lean_turns(const __grid_constant__ Fp8GemmParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  if (fp8probe::launch_ok(p, /*has_cq_epilogue=*/true)) fp8probe::gemm_lean<true>(p, smem);
}
