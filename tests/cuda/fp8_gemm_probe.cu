// Standalone probe of the FP8 "fp8_block" engine (docs/FP8_DESIGN.md, docs/SEMANTICS.md §10):
//
// fp8_gemm_probe      persistent grouped GEMM  C[r, :] = sum_kb s_a[r, kb] * s_b[g, n/128, kb] *
//                     (A[r, kb-block] . B[g][n, kb-block])  for rows r in [off[g], off[g+1]),
//                     e4m3 A and B (K-major), fp32 scales, fp32 promotion per 128-deep K block,
//                     fp32 or bf16 C; optionally also C quantised again (1 x 128 along N, the
//                     gate|up epilogue's aq = Q(a)), straight from the fp32 registers.
// fp8_gemm_probe_overlap  the same with two K blocks in flight per consumer warpgroup (three
//                     accumulator sets: block kb + 1's MMAs run during block kb's promotion);
//                     same promotion order, so the same bits.
// fp8_gemm_probe_lean(_turns)  the plain schedule with the next stage's wait and scales taken under
//                     the current MMAs (cuBLAS's order; fp8_lean_probe.cuh); _turns also orders the
//                     two warpgroups' issues with a named barrier.  Same bits.
// fp8_quantize_rows   bf16 rows -> e4m3 + 1 x 128 scales (the reference quantiser, warp layout).
// fp8_quantize_rows_pipelined  the same through the megakernel's dispatch quantiser
//                     (moe/tasks/quantize_rows.cuh: quad layout).
// fp8_quantize_frag_rows  fp32 rows -> e4m3 + 1 x 128 scales through the epilogue quantiser
//                     (common/fp8.cuh quantize_frag_row128: wgmma fragment layout).
// fp8_quantize_weights  bf16 [G, R, C] -> e4m3 in 128 x 128 blocks, forward copy [G, R, C] and
//                     transposed copy [G, C, R] (the dgrad operand) with their scales.
//
// GEMM tile: 128 x 128 (two consumer warpgroups of 64 rows), one K block (128 e4m3 = one
// 128-byte swizzled line) per stage, 6 stages.  Why not 128 x 256 like the bf16 engine: the
// promotion keeps two accumulator sets (the MMA's partial sum of the current K block and the
// fp32 total), N/2 registers each: 256 per thread at N = 256, more than a thread can hold.
// At N = 128 it is 128 + ~60 for addresses, scales and the epilogue (see the ptxas report).
//
// Launch: fp8_gemm_probe(_overlap): 384 threads, kGemmSmemBytes (201568) dynamic smem, any
// grid; tiles (row block of a group, 128-column tile) are dealt round-robin over the CTAs.
// fp8_quantize_rows: any grid x 256 threads.  fp8_quantize_weights: G * RB * CB CTAs x 256.
// fp8_quantize_rows_pipelined: ceil(rows / 128) CTAs x 256 (scales [KB, s_kb] only: s_row == 1).
// fp8_quantize_frag_rows: (ceil(rows / 64), ceil(K / 128)) CTAs x 128; QuantRowsParams with x = fp32 rows.
// Tensor maps (tests/test_fp8_gemm_probe_gpu.py):
//   a:  UINT8   dims {K, max_rows},    box {128, 128},   SWIZZLE_128B
//   b:  UINT8   dims {K, N, groups},   box {128, 128, 1}, SWIZZLE_128B
//   sa: FLOAT32 dims {max_rows, KB},   box {132, 1},     no swizzle  (A scales [KB, sa_ld])
// Requirements: K % 16 == 0 (TMA row pitch), N % 8 == 0, sa_ld % 4 == 0; group row offsets are
// arbitrary (tile_offset[g] = sum of ceil(rows / 128) over the groups before g, host-computed here).
//
// TMA alignment (the first GPU run's illegal instruction): a tiled TMA load faults with
// cudaErrorIllegalInstruction when its innermost coordinate times the element size is not a
// multiple of 16 bytes (the global address of the box must be 16-byte aligned; the encoder only
// checks the base and the strides).  The A and B boxes start at K = kb * 128 bytes, always
// aligned; the A-scale box's innermost coordinate is a ROW (fp32), and a group may start at any
// row (the "uneven" case: rows 277, 577).  So the scale box starts at row0 & ~3 (16 bytes) and is
// 132 wide; the consumers read it from (row0 & 3) on.  The megakernel's tiles start at multiples
// of 128 rows, so its 128-wide box is aligned as it is (moe/pipeline/gemm_fp8.cuh).
#include "common/fp8.cuh"
#include "common/mma.cuh"
#include "common/wgmma_fp8.cuh"
#include "moe/pipeline/gemm_wgmma.cuh"
#include "moe/tasks/quantize_rows.cuh"

namespace mok {

using bf16 = __nv_bfloat16;

struct Fp8GemmParams {
  TensorMap a;               // e4m3 A [max_rows, K]
  TensorMap b;               // e4m3 B [groups, N, K]
  TensorMap sa;              // fp32 A scales [KB, sa_ld]
  const float* sb;           // fp32 B scales [groups, NB, KB]
  const int* group_offset;   // [groups + 1] row offsets (any), off[0] = 0
  const int* tile_offset;    // [groups + 1] row-block offsets
  void* c;                   // [max_rows, N] fp32, or bf16 when c_bf16
  uint8_t* cq;               // optional (nullptr: off): e4m3 [max_rows, N], 1 x 128 blocks along N
  float* cq_scale;           // its scales [NB, cq_ld]
  int* err;                  // error word int32[4]
  long long timeout_ns;
  int groups;
  int n;
  int k;
  int max_rows;
  int c_bf16;
  int cq_ld;
  int pad_[10];
};
static_assert(sizeof(Fp8GemmParams) == 512, "Fp8GemmParams layout: update tests/test_fp8_gemm_probe_gpu.py");

struct QuantRowsParams {
  const uint16_t* x;         // bf16 [rows, K]
  uint8_t* q;                // e4m3 [rows, K]
  float* scale;              // scale of (row, kb) at scale[row * s_row + kb * s_kb]
  int rows, k;
  long long s_row, s_kb;
};

struct QuantWeightsParams {
  const uint16_t* w;         // bf16 [G, R, C]
  uint8_t* q;                // e4m3 [G, R, C]     (forward copy: reduction dim C)
  float* s;                  // fp32 [G, RB, CB]
  uint8_t* qt;               // e4m3 [G, C, R]     (transposed copy: reduction dim R)
  float* st;                 // fp32 [G, CB, RB]
  int groups, r, c;
};
static_assert(sizeof(QuantRowsParams) == 48 && sizeof(QuantWeightsParams) == 56,
              "parameter layouts: update tests/test_fp8_gemm_probe_gpu.py");

namespace fp8probe {

constexpr int kBM = 128, kBN = 128, kBK = 128;   // kBK: e4m3 elements = bytes = one swizzled line
constexpr int kStages = 6;
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kAccRegs = kBN / 2;
constexpr int kSaAlign = 4;                    // fp32 per 16 bytes: the scale box starts at row0 & ~3
constexpr int kSaBox = kBM + kSaAlign;         // 132 scales: rows row0 & ~3 .. (row0 & ~3) + 131 cover the tile
constexpr int kABytes = kBM * kBK, kBBytes = kBN * kBK, kSaBytes = kSaBox * 4;
constexpr int kSaPitch = 640;                  // sa slots 128-byte aligned (TMA's shared-memory alignment)
constexpr int kSlotBytes = kABytes + kBBytes;
constexpr uint32_t kStageTx = kABytes + kBBytes + kSaBytes;   // bytes one stage's TMA loads credit
constexpr int kRingBytes = kStages * kSlotBytes;
constexpr int kSaRingBytes = kStages * kSaPitch;
constexpr int kBarrierBytes = 2 * kStages * 8;
constexpr int kGemmSmemBytes = kRingBytes + kSaRingBytes + kBarrierBytes + 1024;
static_assert(kSaBytes % 16 == 0 && kSaBytes <= kSaPitch && kSaPitch % 128 == 0, "A-scale box and slot");
static_assert(kGemmSmemBytes == 201568, "tests/test_fp8_gemm_probe_gpu.py mirrors this");
static_assert(kGemmSmemBytes <= 227 * 1024, "fits the opt-in shared memory of sm_90");
static_assert(kABytes % 1024 == 0 && kSlotBytes % 1024 == 0, "tiles stay 1024-byte aligned (128B swizzle)");
static_assert(128 * wg::kProducerRegs + 128 * kConsumers * wg::kConsumerRegs <= 65536, "register file");

// The ring: slot s holds A (128 lines of 128 B) then B (128 lines), 1024-byte aligned; the A
// scales of slot s (132 fp32 from row row0 & ~3, kSaPitch apart) sit after the ring, then
// full[s] / empty[s].
struct Ring {
  uint32_t data;
  __device__ __forceinline__ uint32_t a_tile(int s) const { return data + (uint32_t)s * kSlotBytes; }
  __device__ __forceinline__ uint32_t b_tile(int s) const { return a_tile(s) + kABytes; }
  __device__ __forceinline__ uint32_t sa(int s) const { return data + kRingBytes + (uint32_t)s * kSaPitch; }
  __device__ __forceinline__ uint32_t full(int s) const { return data + kRingBytes + kSaRingBytes + 8u * s; }
  __device__ __forceinline__ uint32_t empty(int s) const { return full(kStages + s); }
};

__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

// A tile: rows [row0, row_end ∩ row0 + 128) of group g, columns [n0, n0 + 128).
struct Tile {
  int g, row0, row_end, n0;
};

// Largest g with tile_offset[g] <= mt (empty groups share their successor's offset and are skipped).
__device__ __forceinline__ Tile decode(const Fp8GemmParams& p, int tile, int n_tiles) {
  const int mt = tile / n_tiles;
  int lo = 0, hi = p.groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(p.tile_offset + mid) <= mt) lo = mid; else hi = mid - 1;
  }
  const int row0 = __ldg(p.group_offset + lo) + kBM * (mt - __ldg(p.tile_offset + lo));
  return Tile{lo, row0, __ldg(p.group_offset + lo + 1), (tile % n_tiles) * kBN};
}

}  // namespace fp8probe
}  // namespace mok
#include "fp8_probe_schedule.cuh"  // the schedule the probe GEMMs share
namespace mok {
namespace fp8probe {

// One K block issued by a consumer warpgroup: its ring slot and the two promotion scales.
struct KBlock {
  int slot;
  float s_lo, s_hi;  // fp32(s_a[row] * s_b) for the thread's rows g and g + 8
};

struct KStep {
  const Ring& ring;
  const float* sb;   // this tile's B scales, one per K block
  int consumer, local_row;
  int sa_row;        // the thread's row g in the stage's scale box: (row0 & 3) + local_row
  const MbarWaitCtx& w;

  // Waits for block kb's stage, reads its scales and issues its four k32 MMAs into acc (one
  // commit group).  A failed wait marks `failed` and goes on (the warpgroup decides at tile end).
  __device__ __forceinline__ KBlock issue(wg::PipeState& ps, float (&acc)[kAccRegs], int kb, bool& failed) const {
    const float s_b = __ldg(sb + kb);  // issued before the wait: its latency hides behind it
    // The verdict is a warp vote, so the code around the MMAs is warp-uniform.  With the plain
    // per-thread spin (`if (!failed) failed = !mbar_wait(...)`) ptxas serialised every wgmma of the
    // overlap schedule (C7520 "wgmma.mma_async instructions are serialized due to program
    // dependence on compiler-inserted WG.AR in divergent path": a wait_group 0 after each k32
    // MMA, so nothing overlapped); with the vote the SASS keeps 4-MMA batches and wait_group 1.
    if (!failed && !__all_sync(~0u, mbar_try_wait(ring.full(ps.slot), ps.phase)))
      failed = !__all_sync(~0u, mbar_wait(ring.full(ps.slot), ps.phase, w));
    const KBlock b{ps.slot, ld_shared_f32(ring.sa(ps.slot) + 4u * sa_row) * s_b,
                   ld_shared_f32(ring.sa(ps.slot) + 4u * (sa_row + 8)) * s_b};
    wgmma_fence();  // acc was read by the last promotion
    wgmma_e4m3_kblock<kBN>(acc, smem_desc_kmajor_sw128(ring.a_tile(ps.slot) + consumer * 64 * kBK),
                           smem_desc_kmajor_sw128(ring.b_tile(ps.slot)));
    wgmma_commit();
    ps.advance(kStages);
    return b;
  }
  // After the caller's wait_group covering b: sum += acc * scales, then release b's slot.
  __device__ __forceinline__ void retire(float (&sum)[kAccRegs], float (&acc)[kAccRegs], const KBlock& b,
                                         bool arriver) const {
    wgmma_fence_operand(acc);
    fp8_promote(sum, acc, b.s_lo, b.s_hi);
    if (arriver) mbar_arrive(ring.empty(b.slot));  // operands and scales of this slot consumed
  }
};

// The epilogue straight from registers: rows t.row0 + local_row + 8h, columns t.n0 + col(i), as C
// (fp32 or bf16) and, when p.cq, quantised again (1 x 128 along N).
__device__ __forceinline__ void store_tile(const Fp8GemmParams& p, const float (&sum)[kAccRegs], const Tile& t,
                                           int local_row, const WgmmaAccCoord& coord) {
  const int cols_left = p.n - t.n0 - coord.col0;  // chunk j is inside C when 8j < cols_left
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = t.row0 + local_row + 8 * h;
    const bool row_ok = row < t.row_end;
    const size_t base = (size_t)row * p.n + t.n0 + coord.col0;
#pragma unroll
    for (int j = 0; j < kAccRegs / 4; ++j) {
      if (!row_ok || 8 * j >= cols_left) continue;
      const float v0 = sum[4 * j + 2 * h], v1 = sum[4 * j + 2 * h + 1];
      if (p.c_bf16) *reinterpret_cast<uint32_t*>(static_cast<bf16*>(p.c) + base + 8 * j) = pack_bf16x2(v0, v1);
      else *reinterpret_cast<float2*>(static_cast<float*>(p.c) + base + 8 * j) = make_float2(v0, v1);
    }
    if (p.cq != nullptr) {  // uniform; every lane of the quad takes part in the row's amax
      const fp8::QuantizedFragRow qr = fp8::quantize_frag_row128(sum, h);
      if (row_ok) {
#pragma unroll
        for (int j = 0; j < 16; ++j)
          if (8 * j < cols_left) *reinterpret_cast<uint16_t*>(p.cq + base + 8 * j) = qr.q[j];
        if ((threadIdx.x & 3) == 0) p.cq_scale[(size_t)(t.n0 / kBN) * p.cq_ld + row] = qr.scale;
      }
    }
  }
}

// The producer thread of the 128 x 128 probe schedules (plain, overlap, lean): per stage the A
// and B tiles and A's scales.
__device__ __forceinline__ void produce_ab(const Fp8GemmParams& p, const Ring& ring, const TileSpace& ts) {
  tma_prefetch_map(&p.a);
  tma_prefetch_map(&p.b);
  tma_prefetch_map(&p.sa);
  produce<kStages>(p, ring, ts.n_tiles, ts.num_tiles, ts.k_blocks, kStageTx,
                   [&](int slot, uint32_t full, int, const Tile& t, int kb) {
                     tma_load_2d(ring.a_tile(slot), &p.a, full, kb * kBK, t.row0);
                     tma_load_3d(ring.b_tile(slot), &p.b, full, kb * kBK, t.n0, t.g);
                     tma_load_2d(ring.sa(slot), &p.sa, full, t.row0 & ~(kSaAlign - 1), kb);  // 16-byte aligned start
                   });
}

// A consumer warpgroup of the 128 x 128 probes (role 1 or 2 of the CTA's 384 threads): what it
// derives once, and the per-tile pointers every schedule takes.
struct Consumer {
  int index;            // 0 or 1: tile rows 64 index ..
  MbarWaitCtx w;        // its ring waits
  WgmmaAccCoord coord;  // this thread's accumulator fragment
  int local_row;        // tile row of register pair 0 (pair 2: + 8)
  int n_blocks;         // 128-column B-scale blocks
  __device__ __forceinline__ static Consumer of(const Fp8GemmParams& p, int role) {
    const int index = role - 1;
    const WgmmaAccCoord coord = WgmmaAccCoord::of_thread(threadIdx.x & 127);
    return Consumer{index, MbarWaitCtx{p.err, p.timeout_ns, 0, 2}, coord, 64 * index + coord.row0,
                    (p.n + kBN - 1) / kBN};
  }
  // Tile t's B scales, one per K block.
  __device__ __forceinline__ const float* b_scales(const Fp8GemmParams& p, const Tile& t, int k_blocks) const {
    return p.sb + ((size_t)t.g * n_blocks + t.n0 / kBN) * k_blocks;
  }
  // This thread's row g in a stage's A-scale box (it starts at row0 & ~3).
  __device__ __forceinline__ int sa_row(const Tile& t) const { return (t.row0 & (kSaAlign - 1)) + local_row; }
};

// kOverlap: keep two K blocks in flight (three accumulator sets) instead of one.
template <bool kOverlap>
__device__ void gemm(const Fp8GemmParams& p, unsigned char* smem) {
  const Ring ring{(smem_u32(smem) + 1023u) & ~1023u};
  init_ring(ring, kStages);
  if (!rows_fit(p)) return;
  const TileSpace ts = TileSpace::of(p, kBN);
  const int n_tiles = ts.n_tiles, num_tiles = ts.num_tiles, k_blocks = ts.k_blocks;
  const int role = threadIdx.x / 128;

  if (role == 0) {
    setmaxnreg_dec<wg::kProducerRegs>();
    if (threadIdx.x == 0) produce_ab(p, ring, ts);
    return;
  }

  setmaxnreg_inc<wg::kConsumerRegs>();
  const Consumer c = Consumer::of(p, role);
  const bool arriver = (threadIdx.x & 31) == 0;
  wg::PipeState ps;
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const Tile t = decode(p, tile, n_tiles);
    // Declared per tile (zero_sets says why).
    float acc[kAccRegs], acc2[kOverlap ? kAccRegs : 1], sum[kAccRegs];
    zero_sets(sum, acc, acc2);
    bool failed = false;
    const KStep st{ring, c.b_scales(p, t, k_blocks), c.index, c.local_row, c.sa_row(t), c.w};
    k_loop<kOverlap>(st, ps, acc, acc2, sum, k_blocks, failed, arriver);
    if (wg::warpgroup_any(failed, c.index)) return;

    store_tile(p, sum, t, c.local_row, c.coord);
  }
}

// ---- quantisers --------------------------------------------------------------------------------------
// One warp per (row, K block), grid-strided.  Lane l: elements 4l .. 4l+3 of the block.
__device__ void quantize_rows(const QuantRowsParams& p) {
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x >> 5);
  const int k_blocks = (p.k + fp8::kBlock - 1) / fp8::kBlock;
  const long long blocks = (long long)p.rows * k_blocks;
  for (long long b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); b < blocks; b += warps) {
    const int row = (int)(b / k_blocks), kb = (int)(b % k_blocks);
    const int col = kb * fp8::kBlock + 4 * lane;
    const bool ok = col < p.k;  // K % 4 == 0: a lane's 4 elements are all in or all out
    const size_t at = (size_t)row * p.k + col;
    const uint2 raw = ok ? *reinterpret_cast<const uint2*>(p.x + at) : make_uint2(0u, 0u);
    const fp8::QuantizedRow128 r = fp8::quantize_row128_warp_bf16(raw);
    if (ok) *reinterpret_cast<uint32_t*>(p.q + at) = r.q;
    if (lane == 0) p.scale[row * p.s_row + kb * p.s_kb] = r.scale;
  }
}

// The dispatch's quantiser as the megakernel runs it: CTA b is a task of rows 128 b .. 128 b + 127,
// warp w its rows 128 b + w + 8 j, in token order.
__device__ void quantize_rows_pipelined(const QuantRowsParams& p) {
  const int lane = threadIdx.x & 31, row0 = blockIdx.x * kBlockM + (threadIdx.x >> 5);
  const int nrows = p.rows > row0 ? min(fp8f::kRowsPerWarp, (p.rows - row0 + fp8f::kQuantWarps - 1) / fp8f::kQuantWarps) : 0;
  const fp8f::QuantRows r{p.q, p.scale, (size_t)p.s_kb, p.k, row0, nrows,
                          reinterpret_cast<const bf16*>(p.x) + (size_t)(row0 + fp8f::kQuantWarps * (lane & 15)) * p.k};
  fp8f::quantize_rows_warp(r);
}

// The gate|up epilogue's quantiser on fp32 rows: CTA (x, y) holds rows 64x .. 64x + 63, block y, in
// the accumulator fragment of one m64n128 warpgroup (zeros past the rows and columns).  K % 8 == 0.
__device__ void quantize_frag_rows(const QuantRowsParams& p) {
  const float* x = reinterpret_cast<const float*>(p.x);
  const WgmmaAccCoord c = WgmmaAccCoord::of_thread(threadIdx.x & 127);
  const int row0 = 64 * blockIdx.x, col0 = fp8::kBlock * blockIdx.y + c.col0;
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const int row = row0 + c.row(i), col = col0 + 8 * (i >> 2) + (i & 1);
    acc[i] = row < p.rows && col < p.k ? x[(size_t)row * p.k + col] : 0.0f;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const fp8::QuantizedFragRow r = fp8::quantize_frag_row128(acc, h);
    const int row = row0 + c.row0 + 8 * h;
    if (row >= p.rows) continue;
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (col0 + 8 * j < p.k) *reinterpret_cast<uint16_t*>(p.q + (size_t)row * p.k + col0 + 8 * j) = r.q[j];
    if ((threadIdx.x & 3) == 0) p.scale[row * p.s_row + blockIdx.y * p.s_kb] = r.scale;
  }
}

// One CTA (8 warps) per 128 x 128 block; warp w holds rows 16w .. 16w+15 of the block in the warp
// layout (64 values per lane).  The block's amax: per lane, per warp (redux), then the 8 warps'
// maxima read in a fixed order from shared memory.  The e4m3 block is staged in shared memory
// (pitch 132: the column reads of the transposed write hit 32 different banks) and written again
// transposed, one 128-byte output line per warp: the dgrad copy (same values, same scale).
constexpr int kWPitch = 132;
__device__ void quantize_weights(const QuantWeightsParams& p) {
  __shared__ uint32_t warp_max[8];
  __shared__ __align__(16) uint8_t tile[128 * kWPitch];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rb_n = (p.r + 127) / 128, cb_n = (p.c + 127) / 128;
  const int g = blockIdx.x / (rb_n * cb_n), rb = (blockIdx.x / cb_n) % rb_n, cb = blockIdx.x % cb_n;
  const int col = cb * 128 + 4 * lane;
  const bool col_ok = col < p.c;  // C % 4 == 0
  float v[16][4];
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int row = rb * 128 + 16 * warp + i;
    uint2 raw = make_uint2(0u, 0u);
    if (col_ok && row < p.r) raw = *reinterpret_cast<const uint2*>(p.w + ((size_t)g * p.r + row) * p.c + col);
    v[i][0] = fp8::bf16_bits_to_f32(raw.x & 0xffffu);
    v[i][1] = fp8::bf16_bits_to_f32(raw.x >> 16);
    v[i][2] = fp8::bf16_bits_to_f32(raw.y & 0xffffu);
    v[i][3] = fp8::bf16_bits_to_f32(raw.y >> 16);
#pragma unroll
    for (int e = 0; e < 4; ++e) m = max(m, fp8::abs_bits(v[i][e]));
  }
  m = fp8::warp_max_u32(m);
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  m = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = max(m, warp_max[i]);
  const fp8::BlockScale bs = fp8::BlockScale::of_amax_bits(m);
  if (threadIdx.x == 0) {
    p.s[((size_t)g * rb_n + rb) * cb_n + cb] = bs.scale;
    p.st[((size_t)g * cb_n + cb) * rb_n + rb] = bs.scale;
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int r_local = 16 * warp + i, row = rb * 128 + r_local;
    const uint32_t q = bs.encode4(v[i][0], v[i][1], v[i][2], v[i][3]);
    *reinterpret_cast<uint32_t*>(tile + r_local * kWPitch + 4 * lane) = q;
    if (col_ok && row < p.r) *reinterpret_cast<uint32_t*>(p.q + ((size_t)g * p.r + row) * p.c + col) = q;
  }
  __syncthreads();
  // Transposed: output line c_local (a column of the block), word r4 = rows 4r4 .. 4r4+3.
#pragma unroll 4
  for (int i = 0; i < 16; ++i) {
    const int c_local = 8 * i + warp, r4 = lane;
    const int out_row = cb * 128 + c_local, out_col = rb * 128 + 4 * r4;  // in qt [G, C, R]
    const uint8_t* src = tile + (4 * r4) * kWPitch + c_local;
    const uint32_t word = src[0] | (src[kWPitch] << 8) | (src[2 * kWPitch] << 16) | ((uint32_t)src[3 * kWPitch] << 24);
    if (out_row < p.c && out_col < p.r)  // R % 4 == 0
      *reinterpret_cast<uint32_t*>(p.qt + ((size_t)g * p.c + out_row) * p.r + out_col) = word;
  }
}

}  // namespace fp8probe
}  // namespace mok

using namespace mok;

namespace mok {
namespace fp8probe {
template <bool kOverlap>
__device__ __forceinline__ void entry(const Fp8GemmParams& p, unsigned char* smem) {
  if (launch_ok(p, /*has_cq_epilogue=*/true)) gemm<kOverlap>(p, smem);
}
}  // namespace fp8probe
}  // namespace mok

extern "C" __global__ void __launch_bounds__(fp8probe::kThreads, 1)
fp8_gemm_probe(const __grid_constant__ Fp8GemmParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  fp8probe::entry<false>(p, smem);
}

extern "C" __global__ void __launch_bounds__(fp8probe::kThreads, 1)
fp8_gemm_probe_overlap(const __grid_constant__ Fp8GemmParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  fp8probe::entry<true>(p, smem);
}

extern "C" __global__ void __launch_bounds__(256) fp8_quantize_rows(const __grid_constant__ QuantRowsParams p) {
  fp8probe::quantize_rows(p);
}

extern "C" __global__ void __launch_bounds__(256) fp8_quantize_weights(const __grid_constant__ QuantWeightsParams p) {
  fp8probe::quantize_weights(p);
}

extern "C" __global__ void __launch_bounds__(256) fp8_quantize_rows_pipelined(const __grid_constant__ QuantRowsParams p) {
  fp8probe::quantize_rows_pipelined(p);
}

extern "C" __global__ void __launch_bounds__(128) fp8_quantize_frag_rows(const __grid_constant__ QuantRowsParams p) {
  fp8probe::quantize_frag_rows(p);
}

// fp8_gemm_probe_1d1d(_overlap): the GEMM above with per-column B scales (the weight-gradient
// GEMM's 1D-1D scaling), in a header of its own to keep this file's size in bounds.
#include "fp8_wgrad_probe.cuh"

// fp8_gemm_probe_n192 / _n160: the GEMM above with 128 x N tiles and one m64nNk32 batch per K
// block.
#include "fp8_wide_probe.cuh"

// fp8_gemm_probe_lean(_turns): the plain schedule with only the promotion between wait and issue.
#include "fp8_lean_probe.cuh"

// fp8_gemm_probe_mc / _lean_mc: the overlap / lean schedule on 2-CTA clusters multicasting the B tile.
#include "fp8_mc_probe.cuh"
