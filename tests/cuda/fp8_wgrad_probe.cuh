// FP8 weight-gradient GEMM probe: the fp8_gemm_probe engine with 1D-1D scales (issue 18).
//
// A wgrad dW[e] = X_e^T . dY_e reduces over the expert's tokens, so both operands are quantised
// along the token direction: a scale per (output row, 128-token block) for A = X_e^T and a scale
// per (output column, 128-token block) for B = dY_e^T.  The B scale is therefore no longer one
// scalar per (128-column tile, K block) as in fp8_gemm_probe (1D-2D) but one per column:
//
//   C[r, n] = sum_kb fp32(s_a[kb, r] * s_b[g, kb, n]) * (A[r, kb-block] . B[g][n, kb-block])
//
// with the promotion  total[i] = fma(partial[i], fp32(s_a[row(i)] * s_b[col(i)]), total[i])  in a
// fixed order (K blocks ascending, one rounding for the scale product, one for the fma), so the
// bits do not depend on the grid or the schedule.
//
// fp8_gemm_probe_1d1d          one K block in flight per consumer warpgroup (as fp8_gemm_probe)
// fp8_gemm_probe_1d1d_overlap  two K blocks in flight (as fp8_gemm_probe_overlap); same bits
//
// What changes against the 1D-2D engine:
// * each stage also holds the tile's 128 column scales of its K block: one more TMA box
//   (FLOAT32 {128, 1, 1} of the map sb: dims {N, KB, groups}), credited to the same full barrier
//   as A, B and the A scales, so "stage full" covers all four;
// * the per-column scales are read at promotion time (retire), not at issue: a thread's 32
//   columns (col0 + 8j + {0, 1}, the m64nN accumulator layout) as 16 ld.shared.v2.f32, reused for
//   its two rows.  Reading them at issue would keep 32 more registers live across the MMAs.
//   The slot is released (empty arrival) only after those reads.
// * no quantised-output epilogue (a weight gradient is consumed in fp32 / bf16).
//
// Launch: 384 threads, kWgradSmemBytes (204672) dynamic smem, any grid.  Params: Fp8WgradParams =
// Fp8GemmParams (its sb pointer, cq, cq_scale unused; cq must be nullptr) + the B-scale tensor map.
// Tensor maps (tests/test_fp8_wgrad_probe_gpu.py): a, b, sa as fp8_gemm_probe;
//   sbm: FLOAT32 dims {N, KB, groups}, box {128, 1, 1}, no swizzle  (B scales [G, KB, N])
// Requirements: as fp8_gemm_probe (K % 16 == 0, N % 8 == 0 -- then the sb row pitch N * 4 is a
// multiple of 16 bytes as TMA requires), rows and N need not be tile multiples.  The sb box starts
// at column n0 = 128 * tile: 512-byte aligned, so no offset trick as for the A scales is needed;
// columns past N load as zeros (and are never stored).
//
// Included at the end of fp8_gemm_probe.cu: uses its Fp8GemmParams, Ring, Tile, decode, ld_shared_f32
// and the shared schedule (fp8_probe_schedule.cuh).

namespace mok {

struct Fp8WgradParams {
  Fp8GemmParams g;   // A, B, A scales, offsets, C, error word, sizes (g.sb, g.cq* unused)
  TensorMap sbm;     // fp32 B scales [groups, KB, N]
};
static_assert(sizeof(Fp8WgradParams) == 640, "Fp8WgradParams layout: update tests/test_fp8_wgrad_probe_gpu.py");

namespace fp8probe {

constexpr int kSbBytes = kBN * 4;                     // one K block's column scales of a tile
constexpr int kSbBase = kRingBytes + kSaRingBytes + 128;  // after the barriers (96 bytes), 128-aligned
constexpr uint32_t kStageTx1d = kStageTx + kSbBytes;
constexpr int kWgradSmemBytes = kSbBase + kStages * kSbBytes + 1024;
static_assert(kBarrierBytes <= 128 && kSbBytes % 128 == 0, "sb slots 128-byte aligned after the barriers");
static_assert(kWgradSmemBytes == 204672, "tests/test_fp8_wgrad_probe_gpu.py mirrors this");
static_assert(kWgradSmemBytes <= 227 * 1024, "fits the opt-in shared memory of sm_90");

// Ring of fp8_gemm_probe (same A / B / A-scale / barrier addresses) plus the B-scale slots.
struct Ring1d : Ring {
  __device__ __forceinline__ uint32_t sb(int s) const { return data + kSbBase + (uint32_t)s * kSbBytes; }
};

__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

// One K block issued by a consumer warpgroup: its ring slot and the thread's two A scales.
struct KBlock1d {
  int slot;
  float sa_lo, sa_hi;  // s_a of the thread's rows g and g + 8
};

struct KStep1d {
  const Ring1d& ring;
  int consumer;
  int sa_row;        // the thread's row g in the stage's A-scale box: (row0 & 3) + local_row
  int col0;          // the thread's first column in the tile (WgmmaAccCoord::col0)
  const MbarWaitCtx& w;

  // As KStep::issue (warp-voted wait, see there), without any B scale.
  __device__ __forceinline__ KBlock1d issue(wg::PipeState& ps, float (&acc)[kAccRegs], int /*kb*/, bool& failed) const {
    if (!failed && !__all_sync(~0u, mbar_try_wait(ring.full(ps.slot), ps.phase)))
      failed = !__all_sync(~0u, mbar_wait(ring.full(ps.slot), ps.phase, w));
    const KBlock1d b{ps.slot, ld_shared_f32(ring.sa(ps.slot) + 4u * sa_row),
                     ld_shared_f32(ring.sa(ps.slot) + 4u * (sa_row + 8))};
    wgmma_fence();  // acc was read by the last promotion
    wgmma_e4m3_kblock<kBN>(acc, smem_desc_kmajor_sw128(ring.a_tile(ps.slot) + consumer * 64 * kBK),
                           smem_desc_kmajor_sw128(ring.b_tile(ps.slot)));
    wgmma_commit();
    ps.advance(kStages);
    return b;
  }

  // After the caller's wait_group covering b: sum[i] += acc[i] * fp32(s_a[row(i)] * s_b[col(i)]),
  // then release b's slot.  Register i: column col0 + 8 (i >> 2) + (i & 1), row g + 8 ((i >> 1) & 1).
  __device__ __forceinline__ void retire(float (&sum)[kAccRegs], float (&acc)[kAccRegs], const KBlock1d& b,
                                         bool arriver) const {
    wgmma_fence_operand(acc);
    const uint32_t sb = ring.sb(b.slot) + 4u * col0;
#pragma unroll
    for (int j = 0; j < kAccRegs / 4; ++j) {
      const float2 s = ld_shared_f32x2(sb + 32u * j);  // 8 columns = 32 bytes apart
      sum[4 * j + 0] = __fmaf_rn(acc[4 * j + 0], __fmul_rn(b.sa_lo, s.x), sum[4 * j + 0]);
      sum[4 * j + 1] = __fmaf_rn(acc[4 * j + 1], __fmul_rn(b.sa_lo, s.y), sum[4 * j + 1]);
      sum[4 * j + 2] = __fmaf_rn(acc[4 * j + 2], __fmul_rn(b.sa_hi, s.x), sum[4 * j + 2]);
      sum[4 * j + 3] = __fmaf_rn(acc[4 * j + 3], __fmul_rn(b.sa_hi, s.y), sum[4 * j + 3]);
    }
    if (arriver) mbar_arrive(ring.empty(b.slot));  // operands and both scale sets of this slot consumed
  }
};

// The fp8probe::gemm schedule with the 1D-1D promotion; fp32 or bf16 C, no quantised output.
template <bool kOverlap>
__device__ void gemm_1d1d(const Fp8WgradParams& pw, unsigned char* smem) {
  const Fp8GemmParams& p = pw.g;
  const Ring1d ring{{(smem_u32(smem) + 1023u) & ~1023u}};
  init_ring(ring, kStages);
  if (!rows_fit(p)) return;
  const TileSpace ts = TileSpace::of(p, kBN);
  const int n_tiles = ts.n_tiles, num_tiles = ts.num_tiles, k_blocks = ts.k_blocks;
  const int role = threadIdx.x / 128;

  if (role == 0) {
    setmaxnreg_dec<wg::kProducerRegs>();
    if (threadIdx.x != 0) return;
    tma_prefetch_map(&p.a);
    tma_prefetch_map(&p.b);
    tma_prefetch_map(&p.sa);
    tma_prefetch_map(&pw.sbm);
    produce<kStages>(p, ring, n_tiles, num_tiles, k_blocks, kStageTx1d,
                     [&](int slot, uint32_t full, int, const Tile& t, int kb) {
                       tma_load_2d(ring.a_tile(slot), &p.a, full, kb * kBK, t.row0);
                       tma_load_3d(ring.b_tile(slot), &p.b, full, kb * kBK, t.n0, t.g);
                       tma_load_2d(ring.sa(slot), &p.sa, full, t.row0 & ~(kSaAlign - 1), kb);  // 16-byte aligned start
                       tma_load_3d(ring.sb(slot), &pw.sbm, full, t.n0, kb, t.g);               // n0 * 4: 512-byte aligned
                     });
    return;
  }

  setmaxnreg_inc<wg::kConsumerRegs>();
  const int consumer = role - 1;
  const MbarWaitCtx w{p.err, p.timeout_ns, 0, 2};
  const WgmmaAccCoord coord = WgmmaAccCoord::of_thread(threadIdx.x & 127);
  const int local_row = 64 * consumer + coord.row0;   // tile row of register pair 0 (pair 2: + 8)
  const bool arriver = (threadIdx.x & 31) == 0;
  wg::PipeState ps;
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const Tile t = decode(p, tile, n_tiles);
    // Declared per tile (zero_sets says why).
    float acc[kAccRegs], acc2[kOverlap ? kAccRegs : 1], sum[kAccRegs];
    zero_sets(sum, acc, acc2);
    bool failed = false;
    const KStep1d st{ring, consumer, (t.row0 & (kSaAlign - 1)) + local_row, coord.col0, w};
    k_loop<kOverlap>(st, ps, acc, acc2, sum, k_blocks, failed, arriver);
    if (wg::warpgroup_any(failed, consumer)) return;
    store_c(p, sum, t.row0, t.row_end, t.n0, local_row, coord);   // fp32 or bf16, no cq path
  }
}

template <bool kOverlap>
__device__ __forceinline__ void entry_1d1d(const Fp8WgradParams& p, unsigned char* smem) {
  if (launch_ok(p.g, /*has_cq_epilogue=*/false)) gemm_1d1d<kOverlap>(p, smem);
}

}  // namespace fp8probe
}  // namespace mok

extern "C" __global__ void __launch_bounds__(mok::fp8probe::kThreads, 1)
fp8_gemm_probe_1d1d(const __grid_constant__ mok::Fp8WgradParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  mok::fp8probe::entry_1d1d<false>(p, smem);
}

extern "C" __global__ void __launch_bounds__(mok::fp8probe::kThreads, 1)
fp8_gemm_probe_1d1d_overlap(const __grid_constant__ mok::Fp8WgradParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  mok::fp8probe::entry_1d1d<true>(p, smem);
}
