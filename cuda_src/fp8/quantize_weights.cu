// mok.quantize_weights on the CUDA backend (docs/SEMANTICS.md §10, docs/FP8_DESIGN.md): bf16
// master weights -> the K-major E4M3 copies and 128 x 128 fp32 scales the "fp8_block" GEMMs read.
// Bit for bit the oracle's quantize_experts (mok_rt/reference/quantize.py): the quantiser is
// common/fp8.cuh's (integer amax, div.rn scale and multiplier, satfinite cvt, flushed and NaN blocks).
//
// One launch quantises up to kMaxJobs tensors (routed gate, up, down, shared gate, up, down):
// job j covers CTAs [first_block[j], first_block[j] + G * RB * CB), one CTA per 128 x 128 block.
// Every tensor is [G, R, C] bf16 with C (the forward GEMM's reduction dimension) contiguous:
//   gate, up  [E, I, H]   (N = I, K = H)        down  [E, H, I]   (N = H, K = I)
// Outputs, per job:
//   q   e4m3 [G, R, C]   s   fp32 [G, RB, CB]   the forward copy (K-major already; nullptr: not made)
//   qt  e4m3 [G, C, R]   st  fp32 [G, CB, RB]   the input-gradient copy (nullptr: not made)
// (q == nullptr with qt: the backward on a forward that quantised bf16 master weights for itself
// needs only the transposed copies.)
// The backward's dgrad GEMMs reduce over R (dX = dG . W_gate reduces over I, dA = dY . W_down over
// H) and FP8 wgmma reads only K-major operands, hence qt.  A 128 x 128 block of the transposed
// tensor is a block of the original transposed (the grid starts at 0 on both axes, the remainder
// blocks included), its amax is the same set maximum, so its scale and every E4M3 byte are the
// same: qt/st are q/s transposed, written from the same registers (the oracle's _transposed).
// A block cut by the end of R or C (R, C multiples of 4) is a block of its own, as in the oracle.
//
// Launch: grid = total blocks of all jobs or fewer (mok_rt/kernels/fp8_quantize.py), 256 threads.
#include "common/fp8.cuh"

namespace mok {
namespace fp8q {

constexpr int kMaxJobs = 6;
constexpr int kThreads = 256;  // 8 warps; warp w holds rows 16w .. 16w + 15 of the block

struct Job {
  const uint16_t* w;  // bf16 [groups, r, c]
  uint8_t* q;         // e4m3 [groups, r, c], or nullptr (transposed copy only)
  float* s;           // fp32 [groups, rb, cb] (with q)
  uint8_t* qt;        // e4m3 [groups, c, r], or nullptr (forward copy only)
  float* st;          // fp32 [groups, cb, rb] (with qt)
  int groups, r, c;
  int first_block;    // the job's first CTA
};
static_assert(sizeof(Job) == 56, "Job layout: update mok_rt/kernels/fp8_quantize.py");

struct Params {
  Job jobs[kMaxJobs];
  int num_jobs;
  int pad_;
};
static_assert(sizeof(Params) == kMaxJobs * 56 + 8, "Params layout: update mok_rt/kernels/fp8_quantize.py");

// The transposed copy goes through shared memory: the block's bytes in row order (pitch 132, so
// each row's 4-byte words stay aligned), then read down the columns, so that each warp writes one
// whole 128-byte line of qt.  (tests/cuda/fp8_gemm_probe.cu's quantize_weights, verified bitwise
// on an H200, is the same code.)
constexpr int kTilePitch = 132;

// The block's amax: per lane, per warp (redux: exact, any order), then the 8 warps' maxima read
// from shared memory.  Lanes hold elements 4l .. 4l + 3 of a row (the warp layout of fp8.cuh);
// elements past the tensor are zeros, which never become the max (the oracle pads the same way).
__device__ void quantize_block(const Job& jb, int blk) {
  __shared__ uint32_t warp_max[kThreads / 32];
  __shared__ __align__(16) uint8_t tile[128 * kTilePitch];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rb_n = (jb.r + 127) / 128, cb_n = (jb.c + 127) / 128;
  const int g = blk / (rb_n * cb_n), rb = (blk / cb_n) % rb_n, cb = blk % cb_n;
  const int col = cb * 128 + 4 * lane;
  const bool col_ok = col < jb.c;  // c % 4 == 0: a lane's 4 elements are all in or all out
  const bool forward = jb.q != nullptr, transposed = jb.qt != nullptr;  // uniform: one job per block
  float v[16][4];
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {  // 16 independent 8-byte loads in flight per lane
    const int row = rb * 128 + 16 * warp + i;
    uint2 raw = make_uint2(0u, 0u);
    if (col_ok && row < jb.r) raw = *reinterpret_cast<const uint2*>(jb.w + ((size_t)g * jb.r + row) * jb.c + col);
    v[i][0] = fp8::bf16_bits_to_f32(raw.x & 0xffffu);
    v[i][1] = fp8::bf16_bits_to_f32(raw.x >> 16);
    v[i][2] = fp8::bf16_bits_to_f32(raw.y & 0xffffu);
    v[i][3] = fp8::bf16_bits_to_f32(raw.y >> 16);
#pragma unroll
    for (int e = 0; e < 4; ++e) m = max(m, fp8::abs_bits(v[i][e]));
  }
  m = fp8::warp_max_u32(m);
  if (lane == 0) warp_max[warp] = m;
  // Also orders the previous block's transposed reads of `tile` before this block's writes.
  __syncthreads();
  m = 0;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) m = max(m, warp_max[i]);
  __syncthreads();  // warp_max is reused by this CTA's next block
  const fp8::BlockScale bs = fp8::BlockScale::of_amax_bits(m);
  if (threadIdx.x == 0) {
    if (forward) jb.s[((size_t)g * rb_n + rb) * cb_n + cb] = bs.scale;
    if (transposed) jb.st[((size_t)g * cb_n + cb) * rb_n + rb] = bs.scale;  // the same block's scale
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int r_local = 16 * warp + i, row = rb * 128 + r_local;
    const uint32_t q = bs.encode4(v[i][0], v[i][1], v[i][2], v[i][3]);
    // Elements past the tensor land in the tile too (never written out below).
    if (transposed) *reinterpret_cast<uint32_t*>(tile + r_local * kTilePitch + 4 * lane) = q;
    if (forward && col_ok && row < jb.r) *reinterpret_cast<uint32_t*>(jb.q + ((size_t)g * jb.r + row) * jb.c + col) = q;
  }
  if (!transposed) return;
  __syncthreads();
  // Output line c_local of qt (a column of the block); lane r4 packs rows 4 r4 .. 4 r4 + 3.
#pragma unroll 4
  for (int i = 0; i < 16; ++i) {
    const int c_local = 8 * i + warp;
    const int out_row = cb * 128 + c_local, out_col = rb * 128 + 4 * lane;  // in qt [G, C, R]
    const uint8_t* src = tile + (4 * lane) * kTilePitch + c_local;
    const uint32_t word = src[0] | (src[kTilePitch] << 8) | (src[2 * kTilePitch] << 16) |
                          ((uint32_t)src[3 * kTilePitch] << 24);
    if (out_row < jb.c && out_col < jb.r)  // r % 4 == 0: a word is all in or all out
      *reinterpret_cast<uint32_t*>(jb.qt + ((size_t)g * jb.c + out_row) * jb.r + out_col) = word;
  }
}

}  // namespace fp8q
}  // namespace mok

using namespace mok;

// Grid-strided over the blocks of every job (the host may launch fewer CTAs than blocks).
extern "C" __global__ void __launch_bounds__(fp8q::kThreads) fp8_quantize_weights(const __grid_constant__ fp8q::Params p) {
  const int n = p.num_jobs;
  const int total = n > 0 ? p.jobs[n - 1].first_block +
                                p.jobs[n - 1].groups * ((p.jobs[n - 1].r + 127) / 128) * ((p.jobs[n - 1].c + 127) / 128)
                          : 0;
  for (int blk = blockIdx.x; blk < total; blk += gridDim.x) {
    int j = 0;
    while (j + 1 < n && blk >= p.jobs[j + 1].first_block) ++j;  // uniform across the CTA
    fp8q::quantize_block(p.jobs[j], blk - p.jobs[j].first_block);
  }
}
