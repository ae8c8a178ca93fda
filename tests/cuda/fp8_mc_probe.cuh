// fp8_gemm_probe_mc: fp8_gemm_probe_overlap (128 x 128 tiles, two K blocks in flight per consumer
// warpgroup, 6 stages) on 2-CTA clusters that share the B tile through TMA multicast.
// fp8_gemm_probe_lean_mc: the same clusters with fp8_gemm_probe_lean's consumers (fp8_lean_probe.cuh:
// the next stage taken under the running MMAs, warp-uniform descriptors).  The lean probe is the
// fastest of ours at the dense shapes and, with its short consumer path, waits on data (L2 78 %
// busy, round 13); multicast cut L2 from 82 % to 61 % for the overlap probe (round 12).
//
// Why (bench/NOTES-FP8-2.md, "cuBLAS's block-scaled GEMM"): on the same operands cuBLAS's
// 1 x 128 / 128 x 128 block-scaled kernel (nvjet ... 128x128_128x6_2x1 ... coopA: 128 x 128 x 128
// tiles, 6 stages, 2 x 1 clusters, 384 threads, 168 registers) gives the same bf16 bits 1.25x
// faster than fp8_gemm_probe_overlap, whose L2 ran 82 % busy against cuBLAS's 68 %.  A pair of
// CTAs on row blocks 2i and 2i + 1 of one group and the same 128 columns reads B once: each CTA
// loads its 64-row half of B and multicasts it into both CTAs' slot (same offset, each CTA's own
// full barrier is credited), so L2 -> SM traffic per K block goes from 32 KB to 24 KB per CTA.
//
// Ring protocol (the standard one for multicast): a slot of CTA c is written by both CTAs, so
// before a producer reloads slot s it needs both CTAs' consumers to be done with slot s: empty[s]
// counts 2 x 8 consumer-warp arrivals: lane 0 of each consumer warp arrives on its own CTA's
// empty[s] and on the peer's (mapa + mbarrier.arrive.shared::cluster).  A peer's B half
// for phase p + 1 of slot s can only land after this CTA's consumers released phase p, i.e.
// after this CTA's full[s] completed phase p, so each full barrier sees exactly one phase's bytes.
// The cluster barrier after the barriers' init (the peer may multicast or arrive before this CTA
// has initialised them otherwise) and before exit (no remote arrive may reach an exited CTA).
//
// Pairs: row blocks (2i, 2i + 1) of the launch's row-block list, dealt round-robin over the
// clusters (n fastest), CTA rank r takes row block 2i + r.  Requirement (checked, kErrInternal):
// every group has an even number of row blocks, so that a pair never spans two groups' B; the
// grid is even (a cluster is 2 CTAs).  No quantised-output epilogue (g.cq must be nullptr).
// Same arithmetic per element as fp8_gemm_probe(_overlap): the same bits (tested).
//
// Launch: 384 threads, kGemmSmemBytes dynamic smem, grid even, cluster (2, 1, 1).  Params:
// Fp8WideParams (fp8_wide_probe.cuh) with bw = B, UINT8 dims {K, N, groups}, box {128, 64, 1},
// SWIZZLE_128B (the 64-row half).
//
// Included at the end of fp8_gemm_probe.cu (after fp8_wide_probe.cuh, for Fp8WideParams, and
// fp8_lean_probe.cuh, for lean_tile).
#pragma once

namespace mok {
namespace fp8probe {

constexpr int kHalfB = kBN / 2;                       // rows of B a CTA loads and multicasts
constexpr uint32_t kHalfBBytes = kHalfB * kBK;        // 8 KB: 8 swizzle atoms, 1024-aligned
static_assert(kHalfBBytes % 1024 == 0, "the peer's half starts on a swizzle atom");

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every non-exited thread of the cluster (release / acquire: barrier inits and smem before it).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}
// Arrive on the mbarrier at the same shared-memory offset in CTA `rank` of the cluster.  Default
// semantics (release at CTA scope): what it orders is this warp's reads of the slot, done by the
// tensor cores and retired by the wait_group before it.  With `.release.cluster` ptxas puts a
// MEMBAR.ALL.GPU before every arrive, in the consumers' path between two MMA batches: measured,
// the kernel ran at half speed (bench/NOTES-FP8-2.md).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
  asm volatile("{\n\t.reg .b32 ra;\n\tmapa.shared::cluster.u32 ra, %0, %1;\n\t"
               "mbarrier.arrive.shared::cluster.b64 _, [ra];\n\t}"
               :: "r"(bar), "r"(rank) : "memory");
}
// A 3D tiled load into the same offset of every CTA in `mask`, each CTA's barrier at `bar` credited.
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const TensorMap* m, uint32_t bar, int c0, int c1,
                                                      int c2, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;"
      :: "r"(dst), "l"(tmap_addr(m)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(mask) : "memory");
}

// The pairs of a launch: pair q covers row blocks 2 (q / n_tiles) + {0, 1}, columns (q % n_tiles) * 128.
struct Pairs {
  int n_tiles, count, k_blocks;
  __device__ __forceinline__ static Pairs of(const Fp8GemmParams& p) {
    const TileSpace ts = TileSpace::of(p, kBN);
    return Pairs{ts.n_tiles, ts.num_tiles / 2, ts.k_blocks};
  }
  __device__ __forceinline__ int tile(int q, uint32_t rank) const {  // the decode() index of CTA rank's tile
    return (2 * (q / n_tiles) + static_cast<int>(rank)) * n_tiles + q % n_tiles;
  }
};

// Whether every group has an even number of row blocks (pairs never span two groups).
__device__ __forceinline__ bool pairs_ok(const Fp8GemmParams& p) {
  bool ok = (gridDim.x & 1) == 0;
  for (int g = 0; g < p.groups && ok; ++g) ok = ((__ldg(p.tile_offset + g + 1) - __ldg(p.tile_offset + g)) & 1) == 0;
  if (!ok && blockIdx.x == 0 && threadIdx.x == 0) set_error(p.err, kErrInternal, __LINE__, p.groups, gridDim.x);
  return ok;
}

// The lean consumers' release of a slot in both CTAs (lane 0 of each consumer warp).
struct ReleasePair {
  uint32_t peer;
  __device__ __forceinline__ void operator()(const Ring& ring, int slot) const {
    mbar_arrive(ring.empty(slot));
    mbar_arrive_cluster(ring.empty(slot), peer);
  }
};

// KStep with the slot released in both CTAs (lane 0 arrives on this CTA's empty barrier and the peer's).
struct KStepMc : KStep {
  uint32_t peer;
  __device__ __forceinline__ void retire(float (&sum)[kAccRegs], float (&acc)[kAccRegs], const KBlock& b,
                                         bool arriver) const {
    wgmma_fence_operand(acc);
    fp8_promote(sum, acc, b.s_lo, b.s_hi);
    if (arriver) {
      mbar_arrive(ring.empty(b.slot));
      mbar_arrive_cluster(ring.empty(b.slot), peer);
    }
  }
};

// kMulticast = false (fp8_gemm_probe_mc_own, a control): the same clusters, pairs and two-CTA
// release protocol, but each CTA loads its whole B tile itself (g.b, box {128, 128, 1}): what the
// coupling of the pair costs without the multicast.  kLean: fp8_gemm_probe_lean's consumers.
template <bool kMulticast, bool kLean = false>
__device__ void gemm_mc(const Fp8WideParams& pw, unsigned char* smem) {
  const Fp8GemmParams& p = pw.g;
  const Ring ring{(smem_u32(smem) + 1023u) & ~1023u};
  init_ring(ring, kStages, /*readers=*/2);  // both CTAs' consumer warps release a slot
  cluster_sync();                           // the peer's barriers exist before any multicast or arrive
  const uint32_t rank = cluster_rank(), peer = rank ^ 1u;
  const Pairs pr = Pairs::of(p);
  const int clusters = gridDim.x / 2, cluster = blockIdx.x / 2;
  // Lean: warp-uniform by construction (its descriptors then live in uniform registers).
  const int role = kLean ? __shfl_sync(~0u, static_cast<int>(threadIdx.x) / 128, 0) : threadIdx.x / 128;
  if (!rows_fit(p) || !pairs_ok(p)) {  // the same verdict in both CTAs
    cluster_sync();
    return;
  }
  if (role == 0) {
    setmaxnreg_dec<wg::kProducerRegs>();
    if (threadIdx.x == 0) {
      tma_prefetch_map(&p.a);
      tma_prefetch_map(kMulticast ? &pw.bw : &p.b);
      tma_prefetch_map(&p.sa);
      const MbarWaitCtx w{p.err, p.timeout_ns, 0, 1};
      wg::PipeState ps;
      bool alive = true;
      for (int q = cluster; q < pr.count && alive; q += clusters) {
        const Tile t = decode(p, pr.tile(q, rank), pr.n_tiles);
        for (int kb = 0; kb < pr.k_blocks; ++kb) {
          if (!(alive = mbar_wait(ring.empty(ps.slot), ps.phase ^ 1u, w))) break;
          const uint32_t full = ring.full(ps.slot);
          mbar_arrive_expect_tx(full, kStageTx);  // A + the whole B (both halves) + the A scales
          tma_load_2d(ring.a_tile(ps.slot), &p.a, full, kb * kBK, t.row0);
          if constexpr (kMulticast)
            tma_load_3d_multicast(ring.b_tile(ps.slot) + rank * kHalfBBytes, &pw.bw, full, kb * kBK,
                                  t.n0 + kHalfB * static_cast<int>(rank), t.g, 0x3);
          else
            tma_load_3d(ring.b_tile(ps.slot), &p.b, full, kb * kBK, t.n0, t.g);
          tma_load_2d(ring.sa(ps.slot), &p.sa, full, t.row0 & ~(kSaAlign - 1), kb);
          ps.advance(kStages);
        }
      }
    }
  } else {
    setmaxnreg_inc<wg::kConsumerRegs>();
    const Consumer c = Consumer::of(p, role);
    wg::PipeState ps;
    for (int q = cluster; q < pr.count; q += clusters) {
      const Tile t = decode(p, pr.tile(q, rank), pr.n_tiles);
      const float* sb = c.b_scales(p, t, pr.k_blocks);
      float acc[kAccRegs], acc2[kAccRegs], sum[kAccRegs];
      if constexpr (!kLean) zero_sets(sum, acc, acc2);
      bool failed = false;
      if constexpr (kLean) {
        failed = lean_tile<false>(ring, sb, 4u * c.sa_row(t), c.index, c.w, ps, sum, pr.k_blocks, ReleasePair{peer});
      } else {
        const KStepMc st{{ring, sb, c.index, c.local_row, c.sa_row(t), c.w}, peer};
        k_loop<true>(st, ps, acc, acc2, sum, pr.k_blocks, failed, (threadIdx.x & 31) == 0);
      }
      if (wg::warpgroup_any(failed, c.index)) return;  // exited threads do not hold the cluster barrier
      store_c(p, sum, t.row0, t.row_end, t.n0, c.local_row, c.coord);
    }
  }
  cluster_sync();
}

}  // namespace fp8probe
}  // namespace mok

extern "C" __global__ void __launch_bounds__(fp8probe::kThreads, 1)
fp8_gemm_probe_mc(const __grid_constant__ Fp8WideParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  if (fp8probe::launch_ok(p.g, /*has_cq_epilogue=*/false)) fp8probe::gemm_mc<true>(p, smem);
}

extern "C" __global__ void __launch_bounds__(fp8probe::kThreads, 1)
fp8_gemm_probe_mc_own(const __grid_constant__ Fp8WideParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  if (fp8probe::launch_ok(p.g, /*has_cq_epilogue=*/false)) fp8probe::gemm_mc<false>(p, smem);
}

extern "C" __global__ void __launch_bounds__(fp8probe::kThreads, 1)
fp8_gemm_probe_lean_mc(const __grid_constant__ Fp8WideParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  if (fp8probe::launch_ok(p.g, /*has_cq_epilogue=*/false)) fp8probe::gemm_mc<true, true>(p, smem);
}
