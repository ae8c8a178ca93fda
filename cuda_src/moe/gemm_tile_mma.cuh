// The mma.sync GEMM engine (fallback, sm_80+ instructions): one CTA computes the 128 x 128 fp32
// tile C = A * B with mma.sync m16n8k16, ldmatrix and a kStages-deep cp.async ring of padded
// (unswizzled) tiles, and leaves C in shared memory.  Selected with -DMOK_GEMM_ENGINE_MMA_SYNC;
// the default engine is wgmma (gemm_tile.cuh).  Not a standalone header: gemm_tile.cuh includes
// it inside namespace mok::gemm after the shared interface (Operand, kBM, kBN, kLdC, kCBytes).
#pragma once
#ifndef MOK_GEMM_TILE_INTERFACE
#error "include moe/gemm_tile.cuh, not moe/gemm_tile_mma.cuh"
#endif

constexpr int kBK = 32, kStages = 4;
constexpr int kWarpsM = 2, kWarpsN = 4;                  // 8 warps, each a 64 x 32 sub-tile
constexpr int kWM = kBM / kWarpsM, kWN = kBN / kWarpsN;
constexpr int kMI = kWM / 16, kNI = kWN / 8;             // mma tiles per warp: 4 x 4
static_assert(kWarpsM * kWarpsN * 32 == kThreads, "one warp per sub-tile");

// Shared-memory tiles, padded by 8 elements per row so that the 8 rows one ldmatrix reads hit
// distinct banks (and rows stay 16-byte aligned for cp.async).
constexpr int kLdK = kBK + 8;                            // K-major tile [128][kLdK]
constexpr int kLdMN = kBM + 8;                           // MN-major tile [kBK][kLdMN]
constexpr int kTileBytes = (kBM * kLdK > kBK * kLdMN ? kBM * kLdK : kBK * kLdMN) * 2;
constexpr int kStageBytes = 2 * kTileBytes;              // A tile + B tile
constexpr int kPipeBytes = kStages * kStageBytes;
// 81920 bytes; the launcher may request more (the wgmma engine's size serves both engines).
constexpr int kSmemBytes = kPipeBytes > kCBytes ? kPipeBytes : kCBytes;

// Issues the cp.async copies of one kBK slice of an operand into a shared tile
// (2 x 16-byte chunks per thread either way: 128 x 32 or 32 x 128 elements).
template <int kLayout>
__device__ __forceinline__ void load_slice(const Operand& op, int k0, int k_total, uint32_t tile) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int q = threadIdx.x + i * kThreads;
    if (kLayout == kKMajor) {
      const int o = q >> 2, kc = (q & 3) * 8, k = k0 + kc;
      const bool ok = o < op.valid && k < k_total;
      cp_async_16(tile + (o * kLdK + kc) * 2, ok ? op.row(o) + k : op.seg0, ok);
    } else {
      const int kr = q >> 4, c = (q & 15) * 8, k = k0 + kr;
      const bool ok = k < k_total && c < op.valid;
      cp_async_16(tile + (kr * kLdMN + c) * 2, ok ? op.row(k) + c : op.seg0, ok);
    }
  }
}

// A fragments of the warp's kMI m16 tiles for the k16 step at ks.
template <int kLayout>
__device__ __forceinline__ void load_a_frags(uint32_t (&a)[kMI][4], uint32_t tile, int wm, int ks) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi) {
    const int m = wm * kWM + mi * 16;
    if (kLayout == kKMajor) {  // lanes 0-15: rows m..m+15 at k, lanes 16-31: same rows at k+8
      ldmatrix_x4(a[mi], tile + ((m + (lane & 15)) * kLdK + ks + (lane >> 4) * 8) * 2);
    } else {                   // stored [k][m]: matrix j = lane/8 is (m half j&1, k half j>>1)
      const int k = ks + (lane & 7) + (lane >> 4) * 8;
      ldmatrix_x4_trans(a[mi], tile + (k * kLdMN + m + ((lane >> 3) & 1) * 8) * 2);
    }
  }
}

// B fragments of the warp's kNI n8 tiles: b[ni][0] = k 0-7, b[ni][1] = k 8-15 of the step.
template <int kLayout>
__device__ __forceinline__ void load_b_frags(uint32_t (&b)[kNI][2], uint32_t tile, int wn, int ks) {
  const int lane = threadIdx.x & 31, j = lane >> 3, r = lane & 7;
#pragma unroll
  for (int np = 0; np < kNI / 2; ++np) {  // one x4 load covers two n8 tiles
    const int n = wn * kWN + np * 16 + (j >> 1) * 8;
    uint32_t v[4];
    if (kLayout == kKMajor) {
      ldmatrix_x4(v, tile + ((n + r) * kLdK + ks + (j & 1) * 8) * 2);
    } else {
      ldmatrix_x4_trans(v, tile + ((ks + r + (j & 1) * 8) * kLdMN + n) * 2);
    }
    b[2 * np][0] = v[0]; b[2 * np][1] = v[1];
    b[2 * np + 1][0] = v[2]; b[2 * np + 1][1] = v[3];
  }
}

// C = A * B for one tile; on return the fp32 tile is in smem as [kBM][kLdC] (see c_tile) and
// every thread of the CTA has passed a barrier after writing it.  Must be called by all threads.
template <int kALayout, int kBLayout>
__device__ __forceinline__ void tile_gemm(const Operand& a, const Operand& b, int k_total, unsigned char* smem) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const uint32_t base = smem_addr(smem);
  const int nk = (k_total + kBK - 1) / kBK;

  float acc[kMI][kNI][4];
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.f;

  // Prologue: slices 0 .. kStages-2, one commit group each (empty groups keep the count uniform).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) {
      const uint32_t st = base + s * kStageBytes;
      load_slice<kALayout>(a, s * kBK, k_total, st);
      load_slice<kBLayout>(b, s * kBK, k_total, st + kTileBytes);
    }
    cp_async_commit();
  }

  for (int kt = 0; kt < nk; ++kt) {
    // Slice kt has landed once at most kStages-2 younger groups are pending; the barrier also
    // tells everyone that slot (kt-1) % kStages, read in the previous iteration, is free.
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int pre = kt + kStages - 1;
    if (pre < nk) {
      const uint32_t st = base + (pre % kStages) * kStageBytes;
      load_slice<kALayout>(a, pre * kBK, k_total, st);
      load_slice<kBLayout>(b, pre * kBK, k_total, st + kTileBytes);
    }
    cp_async_commit();

    const uint32_t sa = base + (kt % kStages) * kStageBytes, sb = sa + kTileBytes;
#pragma unroll
    for (int ks = 0; ks < kBK; ks += 16) {
      uint32_t af[kMI][4], bf[kNI][2];
      load_a_frags<kALayout>(af, sa, wm, ks);
      load_b_frags<kBLayout>(bf, sb, wn, ks);
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNI; ++ni) mma_bf16_16816(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is drained and read: the C tile may overwrite it

  float* c = reinterpret_cast<float*>(smem);
  const int g = lane >> 2, t2 = (lane & 3) * 2;
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNI; ++ni) {
      const int row = wm * kWM + mi * 16 + g, col = wn * kWN + ni * 8 + t2;
      *reinterpret_cast<float2*>(c + row * kLdC + col) = make_float2(acc[mi][ni][0], acc[mi][ni][1]);
      *reinterpret_cast<float2*>(c + (row + 8) * kLdC + col) = make_float2(acc[mi][ni][2], acc[mi][ni][3]);
    }
  __syncthreads();
}
