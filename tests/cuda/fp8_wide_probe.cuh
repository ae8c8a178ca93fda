// FP8 block-scaled GEMM probe with ONE wide MMA batch per K block: fp8_gemm_probe_n192 / _n160.
//
// Same problem, parameters (Fp8GemmParams), A / A-scale tensor maps, B-scale layout and promotion
// arithmetic as fp8_gemm_probe (1D-2D: s_b one scalar per (group, 128-column block, K block)):
//
//   C[r, n] = sum_kb fp32(s_a[kb, r] * s_b[g, n / 128, kb]) * (A[r, kb-block] . B[g][n, kb-block])
//
// What differs is the tile: 128 x N with N = 192 (or 160) instead of 128 x 128.  Each consumer
// warpgroup (64 rows) issues per K block one batch of four m64nNk32 MMAs into one partial set
// (N / 2 fp32 per thread), waits once, and promotes into the total (N / 2 more): 2 x 96 = 192
// accumulator registers at N = 192, under the 232 of setmaxnreg.  The other warpgroup's batch
// keeps the tensor cores busy during one warpgroup's wait + promotion (the shape of DeepSeek's
// DeepGEMM FP8 engine: one wide instruction per k32 step, BLOCK_N picked per problem).  Wider
// tiles load A fewer times per output (A traffic x 128 / N) and halve the MMA issue count per
// output against two 128-wide sub-tiles.  There is no overlapped (two sets in flight) variant:
// three sets of 96 registers do not fit.
//
// B scales: a 128 x N tile starting at column n0 spans two 128-column scale blocks when
// n0 % 128 != 0 or N > 128.  The accumulator's 8-column chunk j (columns n0 + 8j .. n0 + 8j + 7,
// the m64nN fragment layout) lies in block (n0 + 8j) / 128: the chunks before the runtime
// boundary 128 - n0 % 128 take block n0 / 128's scale, those after it the next block's.  A tile
// never spans three blocks: n0 % 128 is a multiple of gcd(N, 128), so n0 % 128 + N <= 256 for
// N = 160 and 192 (static_assert below).  Past N (the last tile) the second block is clamped to
// the last one: those columns are never stored.
// The products fp32(s_a[row] * s_b[block]) are rounded once and promoted as
// total = fma(partial, product, total), K blocks ascending -- the same operations per element as
// fp8_gemm_probe, so the same bits wherever the MMA's partial sums are the same (they are exact
// on the exact-operand tests; on general data that they do not depend on the instruction's N is
// what the random test checks).
//
// B tiles: a second B tensor map with box {128, N, 1} (Fp8WideParams::bw; TMA box dims <= 256),
// one TMA load per stage; the SWIZZLE_128B layout is the same 8-row / 1024-byte atom sequence as
// for 128 rows, so smem_desc_kmajor_sw128 describes the N-row tile unchanged (SBO = 1024).
// Stages: as many as fit in 227 KB: 5 at N = 192 (40 KB + 640 B per stage), 6 at N = 160.
// No quantised-output epilogue (g.cq must be nullptr; quantize_frag_row128 is 128-wide).
//
// Launch: 384 threads, WideCfg<N>::kSmemBytes dynamic smem (N = 192: 209104, N = 160: 226144),
// any grid.  Tensor maps (tests/test_fp8_wide_probe_gpu.py): g.a, g.sa as fp8_gemm_probe (g.b is
// not read); bw: UINT8 dims {K, N, groups}, box {128, N, 1}, SWIZZLE_128B.
//
// Included at the end of fp8_gemm_probe.cu (after fp8_wgrad_probe.cuh): uses its Fp8GemmParams,
// Tile, decode, ld_shared_f32, constants and the shared schedule (fp8_probe_schedule.cuh).

namespace mok {

struct Fp8WideParams {
  Fp8GemmParams g;   // A, A scales, B scales (1D-2D), offsets, C, error word, sizes; g.b unused, g.cq nullptr
  TensorMap bw;      // e4m3 B [groups, N, K], box {128, kBN, 1}
};
static_assert(sizeof(Fp8WideParams) == 640, "Fp8WideParams layout: update tests/test_fp8_wide_probe_gpu.py");

namespace fp8probe {

template <int kBNW>
struct WideCfg {
  static constexpr int kBN = kBNW;
  static constexpr int kAccRegs = kBN / 2;
  static constexpr int kBBytes = kBN * kBK;
  static constexpr int kSlotBytes = kABytes + kBBytes;
  static constexpr int kPerStage = kSlotBytes + kSaPitch + 16;   // tile, A-scale slot, two barriers
  static constexpr int kStages = (227 * 1024 - 1024) / kPerStage < 6 ? (227 * 1024 - 1024) / kPerStage : 6;
  static constexpr int kRingBytes = kStages * kSlotBytes;
  static constexpr int kSaRingBytes = kStages * kSaPitch;
  static constexpr int kBarrierBytes = 2 * kStages * 8;
  static constexpr int kSmemBytes = kRingBytes + kSaRingBytes + kBarrierBytes + 1024;
  static constexpr uint32_t kStageTx = kABytes + kBBytes + kSaBytes;
  static_assert(kBN % 32 == 0 && kBN > 128 && kBN <= 256, "one m64nNk32 per k32 step; TMA box rows <= 256");
  // n0 % 128 is a multiple of gcd(N, 128) = 32 or 64 here; the largest one plus N stays within two blocks.
  static_assert(128 - (kBN % 64 == 0 ? 64 : 32) + kBN <= 256, "a tile spans at most two B-scale blocks");
  static_assert(kSlotBytes % 1024 == 0, "tiles stay 1024-byte aligned (128B swizzle)");
  static_assert(kSmemBytes <= 227 * 1024, "fits the opt-in shared memory of sm_90");
  static_assert(kStages >= 4, "pipeline depth");
};

static_assert(WideCfg<192>::kStages == 5 && WideCfg<192>::kSmemBytes == 209104 && WideCfg<160>::kStages == 6 &&
                  WideCfg<160>::kSmemBytes == 226144,
              "tests/test_fp8_wide_probe_gpu.py mirrors these");

template <class C>
struct RingW {
  uint32_t data;
  __device__ __forceinline__ uint32_t a_tile(int s) const { return data + (uint32_t)s * C::kSlotBytes; }
  __device__ __forceinline__ uint32_t b_tile(int s) const { return a_tile(s) + kABytes; }
  __device__ __forceinline__ uint32_t sa(int s) const { return data + C::kRingBytes + (uint32_t)s * kSaPitch; }
  __device__ __forceinline__ uint32_t full(int s) const { return data + C::kRingBytes + C::kSaRingBytes + 8u * s; }
  __device__ __forceinline__ uint32_t empty(int s) const { return full(C::kStages + s); }
};

// One K block issued by a consumer warpgroup: its slot and the four promotion scales
// fp32(s_a[row] * s_b[block]) for the thread's rows g, g + 8 and the tile's two scale blocks.
struct KBlockW {
  int slot;
  float lo0, hi0, lo1, hi1;
};

template <class C>
struct KStepW {
  const RingW<C>& ring;
  const float* sb0;  // the tile's first B-scale block, one per K block
  const float* sb1;  // the next block (clamped to the last one)
  int consumer;
  int sa_row;        // the thread's row g in the stage's scale box: (row0 & 3) + local_row
  int split;         // first chunk (8 columns) in the second scale block: (128 - n0 % 128) / 8
  const MbarWaitCtx& w;

  // As KStep::issue: warp-voted wait (see there for why), scales, one batch of four MMAs.
  __device__ __forceinline__ KBlockW issue(wg::PipeState& ps, float (&acc)[C::kAccRegs], int kb, bool& failed) const {
    const float s_b0 = __ldg(sb0 + kb), s_b1 = __ldg(sb1 + kb);  // before the wait: latency hidden
    if (!failed && !__all_sync(~0u, mbar_try_wait(ring.full(ps.slot), ps.phase)))
      failed = !__all_sync(~0u, mbar_wait(ring.full(ps.slot), ps.phase, w));
    const float sa_lo = ld_shared_f32(ring.sa(ps.slot) + 4u * sa_row);
    const float sa_hi = ld_shared_f32(ring.sa(ps.slot) + 4u * (sa_row + 8));
    // Plain fp32 products (one rounding), as fp8_gemm_probe's `s_a * s_b`.
    const KBlockW b{ps.slot, __fmul_rn(sa_lo, s_b0), __fmul_rn(sa_hi, s_b0), __fmul_rn(sa_lo, s_b1),
                    __fmul_rn(sa_hi, s_b1)};
    wgmma_fence();  // acc was read by the last promotion
    wgmma_e4m3_kblock<C::kBN>(acc, smem_desc_kmajor_sw128(ring.a_tile(ps.slot) + consumer * 64 * kBK),
                              smem_desc_kmajor_sw128(ring.b_tile(ps.slot)));
    wgmma_commit();
    ps.advance(C::kStages);
    return b;
  }

  // After wait_group 0: sum += acc * scale of (row half, chunk's block), fp8_promote's order and
  // operations per element; then release the slot.
  __device__ __forceinline__ void retire(float (&sum)[C::kAccRegs], float (&acc)[C::kAccRegs], const KBlockW& b,
                                         bool arriver) const {
    wgmma_fence_operand(acc);
#pragma unroll
    for (int j = 0; j < C::kAccRegs / 4; ++j) {
      const bool second = j >= split;
      const float s_lo = second ? b.lo1 : b.lo0, s_hi = second ? b.hi1 : b.hi0;
      sum[4 * j + 0] = __fmaf_rn(acc[4 * j + 0], s_lo, sum[4 * j + 0]);
      sum[4 * j + 1] = __fmaf_rn(acc[4 * j + 1], s_lo, sum[4 * j + 1]);
      sum[4 * j + 2] = __fmaf_rn(acc[4 * j + 2], s_hi, sum[4 * j + 2]);
      sum[4 * j + 3] = __fmaf_rn(acc[4 * j + 3], s_hi, sum[4 * j + 3]);
    }
    if (arriver) mbar_arrive(ring.empty(b.slot));  // operands and scales of this slot consumed
  }
};

template <int kBNW>
__device__ void gemm_wide(const Fp8WideParams& pw, unsigned char* smem) {
  using C = WideCfg<kBNW>;
  const Fp8GemmParams& p = pw.g;
  const RingW<C> ring{(smem_u32(smem) + 1023u) & ~1023u};
  init_ring(ring, C::kStages);
  if (!rows_fit(p)) return;
  const TileSpace ts = TileSpace::of(p, C::kBN);
  const int n_tiles = ts.n_tiles, num_tiles = ts.num_tiles, k_blocks = ts.k_blocks;
  const int role = threadIdx.x / 128;

  if (role == 0) {
    setmaxnreg_dec<wg::kProducerRegs>();
    if (threadIdx.x != 0) return;
    tma_prefetch_map(&p.a);
    tma_prefetch_map(&pw.bw);
    tma_prefetch_map(&p.sa);
    produce<C::kStages>(p, ring, n_tiles, num_tiles, k_blocks, C::kStageTx,
                        [&](int slot, uint32_t full, int tile, const Tile& t, int kb) {
                          const int n0 = (tile % n_tiles) * C::kBN;   // decode's n0 is for 128-wide tiles
                          tma_load_2d(ring.a_tile(slot), &p.a, full, kb * kBK, t.row0);
                          tma_load_3d(ring.b_tile(slot), &pw.bw, full, kb * kBK, n0, t.g);   // N rows in one box
                          tma_load_2d(ring.sa(slot), &p.sa, full, t.row0 & ~(kSaAlign - 1), kb);  // 16-byte aligned start
                        });
    return;
  }

  setmaxnreg_inc<wg::kConsumerRegs>();
  const int consumer = role - 1;
  const MbarWaitCtx w{p.err, p.timeout_ns, 0, 2};
  const WgmmaAccCoord coord = WgmmaAccCoord::of_thread(threadIdx.x & 127);
  const int local_row = 64 * consumer + coord.row0;   // tile row of register pair 0 (pair 2: + 8)
  const bool arriver = (threadIdx.x & 31) == 0;
  const int n_blocks = (p.n + kBN - 1) / kBN;          // 128-column scale blocks
  wg::PipeState ps;
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const Tile t = decode(p, tile, n_tiles);
    const int n0 = (tile % n_tiles) * C::kBN;
    const int blk0 = n0 / kBN, blk1 = min(blk0 + 1, n_blocks - 1);
    const float* sb0 = p.sb + ((size_t)t.g * n_blocks + blk0) * k_blocks;
    const float* sb1 = p.sb + ((size_t)t.g * n_blocks + blk1) * k_blocks;
    // Declared per tile (zero_sets says why).
    float acc[C::kAccRegs], unused[1], sum[C::kAccRegs];
    zero_sets(sum, acc, unused);
    bool failed = false;
    const KStepW<C> st{ring, sb0, sb1, consumer, (t.row0 & (kSaAlign - 1)) + local_row, (kBN - (n0 & (kBN - 1))) >> 3, w};
    k_loop<false>(st, ps, acc, unused, sum, k_blocks, failed, arriver);   // no overlap: one set of N / 2 more does not fit
    if (wg::warpgroup_any(failed, consumer)) return;
    store_c(p, sum, t.row0, t.row_end, n0, local_row, coord);
  }
}

template <int kBNW>
__device__ __forceinline__ void entry_wide(const Fp8WideParams& p, unsigned char* smem) {
  if (launch_ok(p.g, /*has_cq_epilogue=*/false)) gemm_wide<kBNW>(p, smem);
}

}  // namespace fp8probe
}  // namespace mok

extern "C" __global__ void __launch_bounds__(mok::fp8probe::kThreads, 1)
fp8_gemm_probe_n192(const __grid_constant__ mok::Fp8WideParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  mok::fp8probe::entry_wide<192>(p, smem);
}

extern "C" __global__ void __launch_bounds__(mok::fp8probe::kThreads, 1)
fp8_gemm_probe_n160(const __grid_constant__ mok::Fp8WideParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  mok::fp8probe::entry_wide<160>(p, smem);
}
