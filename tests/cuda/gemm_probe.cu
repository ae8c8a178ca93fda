// Standalone probe of the TMA + wgmma engine (moe/gemm_wgmma.cuh): a persistent grouped GEMM
//   C[r, :] = A[r, :] * B[g]^T   for rows r in [off[g], off[g+1]) of group g,
// bf16 in, fp32 accumulation, bf16 out, like the routed experts of the MoE layer (row offsets are
// device data, multiples of 128; groups may be empty).  B is either K-major (B[g] is N x K, the
// weights' layout) or MN-major (B[g] is K x N, an activation's layout).
//
// Two kernels, one per tile width: gemm_probe (BN = 256, 4 stages) and gemm_probe_bn128
// (BN = 128, 6 stages).  Launch: wg::kThreads (384) threads, Engine::kSmemBytes of dynamic shared
// memory (197696 and 197728 bytes), any grid (about one CTA per SM); tiles (row block, column
// tile) are dealt round-robin over the CTAs.
// Tensor maps (mok_rt/runtime/tensormap.py), SWIZZLE_128B, bf16:
//   a: dims {K, max_rows, 1}, box {64, 128, 1}
//   b: K-major  dims {K, N, groups}, box {64, BN, 1}
//      MN-major dims {N, K, groups}, box {64, 64, 1}
#include "common/mma.cuh"
#include "moe/pipeline/gemm_wgmma.cuh"

namespace mok {

using bf16 = __nv_bfloat16;

struct ProbeParams {
  TensorMap a;              // A [max_rows, K]
  TensorMap b;              // B [groups, N, K] or [groups, K, N]
  const int* group_offset;  // [groups + 1] row offsets, multiples of 128, off[0] = 0
  bf16* c;                  // [max_rows, N]
  int* err;                 // error word int32[4]
  long long timeout_ns;     // a pipeline wait longer than this sets kErrTimeout
  int groups;
  int n;                    // N, multiple of 8
  int k;                    // K, multiple of 8
  int max_rows;             // rows of A and C (capacity)
  int b_mn_major;           // 0: B K-major, 1: B MN-major
  int pad_[3];
};
static_assert(sizeof(ProbeParams) == 320, "ProbeParams layout: update tests/test_gemm_probe_gpu.py");
static_assert(alignof(ProbeParams) == 64, "tensor maps need 64-byte alignment");

namespace probe {

// The group whose rows contain row0 (largest g with off[g] <= row0; empty groups are skipped),
// or -1 when the offsets are inconsistent with a 128-row block starting at row0.
__device__ __forceinline__ int find_group(const int* off, int groups, int row0) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(off + mid) <= row0) lo = mid; else hi = mid - 1;
  }
  const bool ok = __ldg(off + lo) <= row0 && row0 + wg::kBM <= __ldg(off + lo + 1);
  return ok ? lo : -1;
}

template <int kBN, int kStages, int kBMajor>
__device__ __forceinline__ void run(const ProbeParams& p, unsigned char* smem) {
  using E = wg::Engine<kBN, kStages, wg::kKMajor, kBMajor>;
  const typename E::Ring ring = E::ring(smem);
  E::init(ring);
  __syncthreads();

  // Device-side row count (uniform: written before the launch).
  const int total = __ldg(p.group_offset + p.groups);
  if (total < 0 || total > p.max_rows || total % wg::kBM != 0) {
    if (blockIdx.x == 0 && threadIdx.x == 0) set_error(p.err, kErrCapacity, 0, total, p.max_rows);
    return;
  }
  const int n_tiles = (p.n + kBN - 1) / kBN;
  const int num_tiles = (total / wg::kBM) * n_tiles;
  const int k_tiles = (p.k + wg::kBK - 1) / wg::kBK;
  const int role = threadIdx.x / 128;

  if (role == 0) {
    setmaxnreg_dec<wg::kProducerRegs>();
    if (threadIdx.x != 0) return;
    tma_prefetch_map(&p.a);
    tma_prefetch_map(&p.b);
    const MbarWaitCtx w{p.err, p.timeout_ns, 0, 1};
    wg::PipeState ps;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const int row0 = (tile / n_tiles) * wg::kBM, n0 = (tile % n_tiles) * kBN;
      const int g = find_group(p.group_offset, p.groups, row0);
      if (g < 0) {
        set_error(p.err, kErrInternal, __LINE__, row0, p.groups);
        return;
      }
      const wg::OperandSrc a{&p.a, row0, 0}, b{&p.b, n0, g};
      if (!E::produce(ring, ps, a, b, k_tiles, w)) return;
    }
  } else {
    setmaxnreg_inc<wg::kConsumerRegs>();
    const int consumer = role - 1;
    const MbarWaitCtx w{p.err, p.timeout_ns, 0, 2};
    const WgmmaAccCoord coord = E::acc_coord(consumer);
    wg::PipeState ps;
    float acc[E::kAccRegs];
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const int row0 = (tile / n_tiles) * wg::kBM, n0 = (tile % n_tiles) * kBN;
      if (!E::consume(ring, ps, acc, k_tiles, consumer, w)) return;
      // Epilogue straight from registers: rows row0 + coord.row(i), columns n0 + coord.col(i).
      bf16* c_row = p.c + (size_t)(row0 + coord.row0) * p.n + n0 + coord.col0;  // register pairs 4j
      const size_t down8 = (size_t)8 * p.n;                                      // register pairs 4j + 2
      const int cols_left = p.n - n0 - coord.col0;  // > 8j: chunk j is inside C (n is even)
#pragma unroll
      for (int j = 0; j < E::kAccRegs / 4; ++j) {
        if (8 * j < cols_left) {
          *reinterpret_cast<uint32_t*>(c_row + 8 * j) = pack_bf16x2(acc[4 * j], acc[4 * j + 1]);
          *reinterpret_cast<uint32_t*>(c_row + down8 + 8 * j) = pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]);
        }
      }
    }
  }
}

template <int kBN, int kStages>
__device__ __forceinline__ void entry(const ProbeParams& p, unsigned char* smem) {
  // One reader, one verdict: no thread may leave before the others reach the barrier inside run().
  if (__syncthreads_or(threadIdx.x == 0 && error_set(p.err))) return;
  if (blockDim.x != wg::kThreads) {  // the roles assume three warpgroups
    if (threadIdx.x == 0) set_error(p.err, kErrInternal, __LINE__, blockDim.x, wg::kThreads);
    return;
  }
  if (p.b_mn_major) run<kBN, kStages, wg::kMNMajor>(p, smem);
  else run<kBN, kStages, wg::kKMajor>(p, smem);
}

}  // namespace probe
}  // namespace mok

using namespace mok;

extern "C" __global__ void __launch_bounds__(wg::kThreads, 1) gemm_probe(const __grid_constant__ ProbeParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  probe::entry<256, 4>(p, smem);
}

extern "C" __global__ void __launch_bounds__(wg::kThreads, 1) gemm_probe_bn128(const __grid_constant__ ProbeParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  probe::entry<128, 6>(p, smem);
}
