// The workers' epilogues straight from the wgmma accumulators: the accumulator layout (Frag) and
// 16-byte / 128-byte-line stores of a 128 x 256 tile.
#pragma once
#include "moe/pipeline/pipeline.cuh"

namespace mok {
namespace pipe {

// Accumulator register 4j + 2h + {0, 1} of a worker holds tile row row(h) = row0 + 8h, columns
// col(j) = col0 + 8j + {0, 1}; col0 = 2 * quad (the lane's place in its quad).
struct Frag {
  int row0, col0, quad;
  __device__ __forceinline__ static Frag of(int consumer) {
    const WgmmaAccCoord c = Geometry::acc_coord(consumer);
    return Frag{c.row0, c.col0, static_cast<int>(threadIdx.x & 3)};
  }
  // Tile column of the chunk this lane owns in group q after a quad transpose.
  __device__ __forceinline__ int chunk_col(int q) const { return 32 * q + 8 * quad; }
};

// ---- 16-byte epilogue accesses ----------------------------------------------------------------------
// In the accumulator layout a quad (4 lanes, one row) holds each 8-column chunk 4 bytes of bf16
// per lane.  Transposing groups of 4 chunks inside the quad gives lane c all of chunk 4q + c: one
// 16-byte access instead of four 4-byte ones (a quad covers 64 contiguous bytes of bf16, 128 of
// fp32, per row), a quarter of the L1 -> L2 requests.  Every lane must take part (shuffles):
// row validity only predicates the memory accesses.  Column validity is per group (32 columns)
// and warp-uniform: H, I and I_s are multiples of 64 and tiles start at multiples of 128.
constexpr int kGroups = kBN / 32;  // groups of 4 chunks per tile row

// w[k] (this lane's word of chunk 4q + k) -> w[i] = lane i's word of chunk 4q + c: the chunk's
// words in column order.  Two butterfly stages: 2x2 blocks with lane ^ 2, then inside them.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4]) {
  constexpr unsigned kAll = 0xffffffffu;
  const bool b1 = (threadIdx.x & 2) != 0, b0 = (threadIdx.x & 1) != 0;
  uint32_t s0 = b1 ? w[0] : w[2], s1 = b1 ? w[1] : w[3];
  s0 = __shfl_xor_sync(kAll, s0, 2);
  s1 = __shfl_xor_sync(kAll, s1, 2);
  if (b1) { w[0] = s0; w[1] = s1; } else { w[2] = s0; w[3] = s1; }
  uint32_t t0 = b0 ? w[0] : w[1], t1 = b0 ? w[2] : w[3];
  t0 = __shfl_xor_sync(kAll, t0, 1);
  t1 = __shfl_xor_sync(kAll, t1, 1);
  if (b0) { w[0] = t0; w[2] = t1; } else { w[1] = t0; w[3] = t1; }
}

// One row's 1 x 128 block of E4M3 in the fragment layout (q[j]: this lane's 2 bytes of chunk j, at
// bytes 8j + 2 quad) -> this lane's 16 bytes at 16 quad (lo) and at 64 + 16 quad (hi): so each warp
// store covers 64 contiguous bytes of each of its 8 rows (two full sectors), where 16 2-byte
// stores per lane cost 8x the L1 wavefronts and half-filled sectors.  Two quad transposes of the
// chunk pairs, then the bytes of a chunk put back in lane order (chunk m of a pair at 8m, lane k's
// 2 bytes at 8m + 2k).  Every lane must take part.  Columns: lo is I block columns [0, 64), hi
// [64, 128): all in or all out for I a multiple of 64.
struct E4m3RowPieces {
  uint4 lo, hi;
};
__device__ __forceinline__ E4m3RowPieces e4m3_row_pieces(const uint16_t (&q)[16]) {
  uint32_t a[4], b[4];  // a[g]: chunks 2g, 2g + 1; b[g]: chunks 8 + 2g, 9 + 2g
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    a[g] = static_cast<uint32_t>(q[2 * g]) | static_cast<uint32_t>(q[2 * g + 1]) << 16;
    b[g] = static_cast<uint32_t>(q[8 + 2 * g]) | static_cast<uint32_t>(q[9 + 2 * g]) << 16;
  }
  quad_transpose(a);  // a[k]: lane k's bytes of chunks 2 quad, 2 quad + 1
  quad_transpose(b);
  const auto in_order = [](const uint32_t (&w)[4]) {
    return make_uint4(__byte_perm(w[0], w[1], 0x5410), __byte_perm(w[2], w[3], 0x5410),
                      __byte_perm(w[0], w[1], 0x7632), __byte_perm(w[2], w[3], 0x7632));
  };
  return E4m3RowPieces{in_order(a), in_order(b)};
}

// Group q of row half h: this lane's chunk (Frag::chunk_col) as 8 bf16 ...
__device__ __forceinline__ uint4 group_bf16(const float (&acc)[kAccRegs], int q, int h) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = pack_bf16x2(acc[4 * (4 * q + k) + 2 * h], acc[4 * (4 * q + k) + 2 * h + 1]);
  quad_transpose(w);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ void add_f4(float4& a, const float4& b) {
  a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
}
__device__ __forceinline__ float4 shfl_xor_f4(float4 v, int mask) {
  constexpr unsigned kAll = 0xffffffffu;
  return make_float4(__shfl_xor_sync(kAll, v.x, mask), __shfl_xor_sync(kAll, v.y, mask),
                     __shfl_xor_sync(kAll, v.z, mask), __shfl_xor_sync(kAll, v.w, mask));
}
// ... or as 8 fp32.
__device__ __forceinline__ void group_f32(const float (&acc)[kAccRegs], int q, int h, float (&v)[8]) {
  uint32_t x[4], y[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[k] = __float_as_uint(acc[4 * (4 * q + k) + 2 * h]);
    y[k] = __float_as_uint(acc[4 * (4 * q + k) + 2 * h + 1]);
  }
  quad_transpose(x);
  quad_transpose(y);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(x[i]);
    v[2 * i + 1] = __uint_as_float(y[i]);
  }
}

// Tile rows r < rows to bf16 rows dst_row(r) (nullptr: dropped), columns [0, cols); dst_row
// already points at the tile's column 0 (16-byte aligned).
template <class RowPtr>
__device__ __forceinline__ void store_rows_bf16(const float (&acc)[kAccRegs], const Frag& f, int rows, int cols,
                                                RowPtr&& dst_row) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = f.row0 + 8 * h;
    bf16* d = r < rows ? dst_row(r) : nullptr;
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      if (32 * q >= cols) break;
      const uint4 v = group_bf16(acc, q, h);
      if (d != nullptr) *reinterpret_cast<uint4*>(d + f.chunk_col(q)) = v;
    }
  }
}

// Tile rows r < rows, columns c < cols to fp32 dst[r * ld + c], optionally added to what is
// there (one writer per element: deterministic).  dst and ld keep 32-byte alignment.  kStreaming:
// nothing in the launch reads the result again (weight gradients): its lines leave L2 first.
//
// After group_f32 the quad of row r holds the row's 128 bytes of a group, lane c chunk c (32
// bytes), which takes two 16-byte stores.  The quads of rows 2m and 2m + 1 (lanes l and l ^ 4)
// swap halves so that each store instruction writes whole 128-byte lines (one L2 request of 4
// sectors instead of 4 requests of half sectors): first row 2m, then row 2m + 1.
template <bool kStreaming>
__device__ __forceinline__ void store_f32(const float (&acc)[kAccRegs], const Frag& f, float* dst, int ld, int rows,
                                          int cols, bool accumulate) {
  const bool odd = (f.row0 & 1) != 0;
  const int r_even = f.row0 - (odd ? 1 : 0);  // the pair's even row (h = 0)
  float* const d0 = dst + (size_t)r_even * ld + 8 * f.quad + (odd ? 4 : 0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      if (32 * q >= cols) break;
      float v[8];
      group_f32(acc, q, h, v);
      const float4 lo = make_float4(v[0], v[1], v[2], v[3]), hi = make_float4(v[4], v[5], v[6], v[7]);
      const float4 got = shfl_xor_f4(odd ? lo : hi, 4);
#pragma unroll
      for (int s = 0; s < 2; ++s) {  // row r_even + 8h + s
        const bool ok = r_even + 8 * h + s < rows;
        float4 val = s ? (odd ? hi : got) : (odd ? got : lo);
        float* p = d0 + ((8 * h + s) * ld + 32 * q);  // 32-bit offset: one live 64-bit base
        if (accumulate) add_f4(val, ld_global_f4_if(ok, p));
        st_global_f4_if<kStreaming>(ok, p, val);
      }
    }
  }
}

// Tile rows r < rows, columns c < cols to bf16 dst[r * ld + c]: the fp32 sum (plus what is there,
// read as bf16, when accumulating) rounded once to nearest even.  One writer per element:
// deterministic.  A quad writes 64 contiguous bytes of a row per group; the two groups of a
// 128-byte line follow each other, so L2 sees whole lines.
// Overwriting rounds before the quad transpose (group_bf16: one transpose of packed words instead
// of two of fp32 words, the same bits).
template <bool kStreaming>
__device__ __forceinline__ void store_bf16(const float (&acc)[kAccRegs], const Frag& f, bf16* dst, int ld, int rows,
                                           int cols, bool accumulate) {
  if (!accumulate) {  // warp-uniform
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = f.row0 + 8 * h;
      bf16* const d = dst + (size_t)r * ld;  // dereferenced only where r < rows
#pragma unroll
      for (int q = 0; q < kGroups; ++q) {
        if (32 * q >= cols) break;  // warp-uniform
        st_global_u4_if<kStreaming>(r < rows, d + f.chunk_col(q), group_bf16(acc, q, h));
      }
    }
    return;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = f.row0 + 8 * h;
    const bool ok = r < rows;
    bf16* const d = dst + (size_t)r * ld;  // dereferenced only where ok
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      if (32 * q >= cols) break;  // warp-uniform
      float v[8];
      group_f32(acc, q, h, v);
      bf16* const at = d + f.chunk_col(q);
      float old[8];
      unpack_bf16x8(ld_global_u4_if(ok, at), old);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] += old[i];
      st_global_u4_if<kStreaming>(ok, at, pack_bf16x8(v));
    }
  }
}

}  // namespace pipe
}  // namespace mok
