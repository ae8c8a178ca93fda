// Quantising rows of x (bf16 [*, hidden]) to E4M3 + one fp32 scale per 1 x 128 block, a warp per
// row: the FP8 forward's dispatch (routed rows gathered from x) and its token-order copy for the
// shared expert.  Bitwise the quantiser of common/fp8.cuh (docs/SEMANTICS.md §10).
//
// Why the structure: a row of H = 2048 is 4 KB, and a warp quantises 16 rows of a 128-row task.
// Loading a few blocks, quantising them, then loading the next few left one L2 / HBM round trip
// exposed per batch (~2 KB in flight per warp): ~94 us per task, measured.  Here the row stream is
// cut into units of 8 K blocks (1024 columns: kUnitSlots 16-byte loads per lane, a block per lane
// quad), and the warp keeps
// kRing units in registers: while it quantises unit i, units i+1 .. i+kRing-1 are in flight (14 KB
// per warp, 112 KB per SM; under the GEMMs' HBM traffic a load takes several us, bench/NOTES.md).
// The quantiser is branch-free per element (fp8::BlockScale: an FMUL and half a cvt each).
// kRing is what the registers allow (232 per worker thread) and sets the code size: the ring loop
// is unrolled kRing times.
#pragma once
#include "common/fp8.cuh"
#include "moe/pipeline/staged_rows.cuh"
#include "moe/tasks/task_graph.cuh"

namespace mok {
namespace fp8f {

constexpr int kUnitSlots = 4;                          // 16-byte loads per lane per unit
constexpr int kUnitCols = 8 * fp8::kBlock;             // a unit: 8 K blocks, one per lane quad
constexpr int kRing = 8;                               // units in registers per warp (128 registers)
constexpr int kQuantWarps = kThreads / 32;             // worker warps: warp w has rows w, w + 8, ...
constexpr int kRowsPerWarp = kBlockM / kQuantWarps;    // 16
static_assert(kRowsPerWarp <= 16, "local rows are held by lanes 0-15 and flagged in a 32-bit mask");
static_assert(kUnitSlots * 32 == fp8::kBlock, "a lane holds 32 elements of its quad's block");

// This lane's first column in a unit (common/fp8.cuh, quad layout): its v[k] starts 32 k further.
__device__ __forceinline__ int unit_lane_col() {
  const int lane = threadIdx.x & 31;
  return fp8::kBlock * (lane >> 2) + 8 * (lane & 3);
}

// The rows of one warp: local row j is dst row row0 + kQuantWarps j; lane j < 16 holds the address
// of its source row (nullptr: a padding row, quantised as zeros: q = 0, s = 0), so the per-row
// lookups of a task are one load per warp, not a round trip per row, and a shuffle per unit.
struct QuantRows {
  uint8_t* dst;     // e4m3 [rows, hidden]
  float* scale;     // fp32 [ceil(hidden / 128), ld]
  size_t ld;
  int hidden;
  int row0;         // this warp's first dst row
  int nrows;        // its rows: j < nrows (warp-uniform)
  const bf16* lane_src;  // lane j < 16: the source row of local row j

  __device__ __forceinline__ const bf16* src(int j) const {
    const unsigned long long a = reinterpret_cast<unsigned long long>(lane_src);
    const unsigned long long lo = __shfl_sync(0xffffffffu, static_cast<unsigned>(a), j);
    const unsigned long long hi = __shfl_sync(0xffffffffu, static_cast<unsigned>(a >> 32), j);
    return reinterpret_cast<const bf16*>(hi << 32 | lo);
  }
  __device__ __forceinline__ int row(int j) const { return row0 + kQuantWarps * j; }
};

// 16 bytes of x, or zeros where !pred: zeros, then the predicated load into the same registers (as
// a C++ select, ptxas loaded into temporaries and added four predicated moves per load).
__device__ __forceinline__ uint4 ldg_or_zero(const bf16* p, bool pred) {
  uint4 v;
  asm("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t"
      "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
      "@p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "r"(static_cast<int>(pred)));
  return v;
}

// Load unit c of local row j into v; zeros past the row's end, for padding rows and for j >= nrows.
// All lanes call it (the source lookup is a shuffle).
__device__ __forceinline__ void load_unit(uint4 (&v)[kUnitSlots], const QuantRows& q, int j, int c) {
  const bf16* src = q.src(j);
  const bool row_ok = j < q.nrows && src != nullptr;
  const int col0 = c * kUnitCols + unit_lane_col();
  if (row_ok && (c + 1) * kUnitCols <= q.hidden) {  // warp-uniform: the usual case, no predicates
#pragma unroll
    for (int k = 0; k < kUnitSlots; ++k) v[k] = __ldg(reinterpret_cast<const uint4*>(src + col0 + 32 * k));
  } else {
#pragma unroll
    for (int k = 0; k < kUnitSlots; ++k) v[k] = ldg_or_zero(src + col0 + 32 * k, row_ok && col0 + 32 * k < q.hidden);
  }
}

// A second output of each stored unit, written from the same registers (QuantRows, local row j, its
// dst row, this lane's first column, the unit's quantised blocks): none in the forward; the FP8
// backward's dispatch also writes the dequantised rows in bf16 (tasks/backward_fp8_bodies.cuh).
struct NoSecondOutput {
  __device__ __forceinline__ void operator()(const QuantRows&, int, int, int, const fp8::QuantizedQuadBlock&) const {}
};

// A quantised unit to dst row `row` (pitch `hidden`) from column col0, and its block's scale (lane 0
// of each quad) to scale[(col0 / 128) * ld + row]; columns past `hidden` are dropped.
__device__ __forceinline__ void store_quantized_unit(const fp8::QuantizedQuadBlock& b, uint8_t* dst, float* scale,
                                                     size_t ld, int hidden, int row, int col0) {
  uint8_t* const out = dst + (size_t)row * hidden + col0;
#pragma unroll
  for (int k = 0; k < kUnitSlots; ++k)
    if (col0 + 32 * k < hidden) *reinterpret_cast<uint2*>(out + 32 * k) = b.q[k];
  if ((threadIdx.x & 3) == 0 && col0 < hidden)
    scale[(size_t)(static_cast<unsigned>(col0) / fp8::kBlock) * ld + row] = b.scale;
}

// Quantise and store unit c of local row j (held in v).
template <class Second = NoSecondOutput>
__device__ __forceinline__ void store_unit(const uint4 (&v)[kUnitSlots], const QuantRows& q, int j, int c,
                                           const Second& second = Second{}) {
  const int row = q.row(j), col0 = c * kUnitCols + unit_lane_col();
  const fp8::QuantizedQuadBlock b = fp8::quantize_block_quad_bf16(v);
  store_quantized_unit(b, q.dst, q.scale, q.ld, q.hidden, row, col0);
  second(q, j, row, col0, b);
}

// Next unit: c along the row, then the next local row.
__device__ __forceinline__ void next_unit(int& j, int& c, int upr) {
  const bool wrap = ++c == upr;
  c = wrap ? 0 : c;
  j += wrap ? 1 : 0;
}

// The warp's rows, software-pipelined over units: the loads of the kRing - 1 units after unit i are
// issued before unit i is quantised.
// R: the ring's units (kRing in the forward; the FP8 backward takes fewer registers, see there).
// second: each unit's second output (NoSecondOutput: none).
template <int R = kRing, class Second = NoSecondOutput>
__device__ __forceinline__ void quantize_rows_warp(const QuantRows& q, const Second& second = Second{}) {
  const int upr = (q.hidden + kUnitCols - 1) / kUnitCols;  // units per row
  int lj = 0, lc = 0;  // the next unit to load
  int sj = 0, sc = 0;  // the next unit to quantise
  uint4 ring[R][kUnitSlots];
#pragma unroll
  for (int k = 0; k < R - 1; ++k) {
    load_unit(ring[k], q, lj, lc);
    next_unit(lj, lc, upr);
  }
  while (sj < q.nrows) {
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (sj >= q.nrows) break;  // warp-uniform
      load_unit(ring[(k + R - 1) % R], q, lj, lc);
      next_unit(lj, lc, upr);
      store_unit(ring[k], q, sj, sc, second);
      next_unit(sj, sc, upr);
    }
  }
}

// ---- a row block through the ring (the FP8 forward's dispatch on one GPU) -----------------------------
// The register ring above keeps ~112 KB of source rows in flight per SM, and the warps wait for them.
// Here the producer streams the block's source rows into the ring with one bulk copy per row
// (rows::issue_stage, the bf16 dispatch's stream: up to kStages x 48 KB in flight), and each warp
// quantises the units (row, kUnitCols columns) of a landed stage from shared memory, up to
// kRingBatch units at once: a unit's amax -> quad shuffles -> scale and multiplier chain is serial,
// and with two warps per scheduler one unit at a time left it exposed (the quantiser alone took
// ~89 us of a 128-row deepseek-v3 block, bench/NOTES-FP8-4.md round 28).  Per unit the arithmetic
// is quantize_rows_warp's, so the bytes are the same.  Rows whose slot is padding or corrupt
// (rows::BlockRows: -1) are quantised as zeros, as above.
constexpr int kRingBatch = 3;  // H = 7168: 3 rows x 7 units a stage over 8 warps; H = 2048: 12 x 2

// One unit from shared memory (zeros where !valid or past the row's end).
__device__ __forceinline__ void load_unit_shared(uint4 (&v)[kUnitSlots], uint32_t src, bool valid, int col0,
                                                 int hidden) {
#pragma unroll
  for (int k = 0; k < kUnitSlots; ++k)
    v[k] = valid && col0 + 32 * k < hidden ? ld_shared_v4(src + 64u * k) : make_uint4(0u, 0u, 0u, 0u);
}

__device__ __forceinline__ bool quantize_block_ring(const pipe::Shared& s, wg::PipeState& ps, const MoESchedule& sc,
                                                   const MoEDims& d, int blk, uint8_t* dst, float* scale, size_t ld,
                                                   const MbarWaitCtx& w) {
  __shared__ rows::BlockRows br;
  br.load(sc, d, blk, nullptr);
  const rows::Stages g = rows::Stages::of(d.hidden);
  const int upr = (d.hidden + kUnitCols - 1) / kUnitCols;
  const uint32_t row_bytes = static_cast<uint32_t>(d.hidden) * 2u;
  const int warp = worker_tid() >> 5;
  return rows::for_each_stage(s, ps, g.count, w, [&](int st, uint32_t base) {
    const int r0 = g.first(st), items = g.size(st) * upr;
#pragma unroll 1
    for (int it0 = warp; it0 < items; it0 += kQuantWarps * kRingBatch) {  // warp-uniform
      uint32_t src[kRingBatch];
      int row[kRingBatch], col0[kRingBatch];
      bool has[kRingBatch], valid[kRingBatch];
#pragma unroll
      for (int b = 0; b < kRingBatch; ++b) {
        const int it = it0 + b * kQuantWarps, u = it / upr, c = it - u * upr;
        has[b] = it < items;
        valid[b] = has[b] && br.slot[r0 + u] >= 0;
        row[b] = blk * kBlockM + r0 + u;
        col0[b] = c * kUnitCols + unit_lane_col();
        src[b] = base + static_cast<uint32_t>(u) * row_bytes + 2u * static_cast<uint32_t>(col0[b]);
      }
      fp8::QuantizedQuadBlock q[kRingBatch];
#pragma unroll
      for (int b = 0; b < kRingBatch; ++b) {
        uint4 v[kUnitSlots];
        load_unit_shared(v, src[b], valid[b], col0[b], d.hidden);
        q[b] = fp8::quantize_block_quad_bf16(v);
      }
#pragma unroll
      for (int b = 0; b < kRingBatch; ++b)
        if (has[b]) store_quantized_unit(q[b], dst, scale, ld, d.hidden, row[b], col0[b]);  // warp-uniform
    }
  });
}

}  // namespace fp8f
}  // namespace mok
