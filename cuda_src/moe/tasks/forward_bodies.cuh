// Forward tasks of the fused MoE layer: SwiGLU, and the bodies of the non-GEMM tasks (tasks/
// forward.cuh runs them).  Phases, in task-index order (one GPU; mok_rt/kernels/moe_plan.py):
//   F0 dispatch      row block b:             x_routed[b] <- token rows (zeros for padding)
//   F1 shared g|u    token block x I_s/128:   [x | shared_gate; shared_up] -> sgu, sact
//   F2 routed g|u    row block x I/128:       [x_routed | W_gate[e]; W_up[e]] -> gu, act
//   F3 shared down   token block x H/256:     sact * shared_down^T -> shared_y (fp32)
//   F4 routed down   row block x H/256:       act * W_down[e]^T -> y_slot[route] (unweighted)
//   F5 combine       part of a token block:  out = shared_y + sum_j w[t,j] y_slot[t*k+j]
// With expert parallelism (ep.cuh) the order is
//   Fp push (this rank's token rows -> their destinations' routed rows), Fp' notify "rows sent",
//   F1 (overlaps the dispatch), F0 receive (wait for every source; routed rows -> x_routed),
//   F2, F3, F4 (rows return to their source's slot rows), F4' notify "outputs returned",
//   F5 (wait for every destination; slot rows -> y_slot, and out unless context-only).
// Each task waits only on lower-index tasks of its rank (see task_graph.cuh), or on peers'
// tasks of lower phases, so the ranks progress as long as their kernels are resident together.
#pragma once
#include "moe/tasks/ep.cuh"
#include "moe/tasks/row_copy.cuh"
#include "moe/tasks/task_graph.cuh"

namespace mok {

// ---- SwiGLU with the optional clamp -------------------------------------------------------------
struct SwiGLU {
  bool limited;
  float limit;

  // ex2.approx and rcp.approx (2 ulp / 1 ulp; the results are rounded to bf16 or to E4M3): the
  // IEEE expf and division cost ~30 instructions each, and the epilogues apply this to 64 (forward)
  // or 128 (backward) values per thread fully unrolled, so their code outgrew the instruction
  // cache (ncu: dA epilogues stalled on instruction fetch).  Deterministic like any instruction.
  // ex2 with .ftz: __expf's ex2 keeps denormal results, which costs a range test and two
  // predicated multiplies per call; a denormal e changes nothing here (1 + e rounds to 1 either
  // way), so the results are __expf's, bit for bit.  The product is __expf's (x times log2(e)).
  __device__ __forceinline__ static float sigmoid(float x) {
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -1.44269504088896341f));
    return __fdividef(1.f, 1.f + e);
  }

  __device__ __forceinline__ float act(float g, float u) const {
    if (limited) {
      g = fminf(g, limit);
      u = fminf(fmaxf(u, -limit), limit);
    }
    return g * sigmoid(g) * u;
  }
  // dg = da * u_c * silu'(g_c) * [g <= L],  du = da * silu(g_c) * [|u| <= L].  kClamp: -1 the
  // clamp as `limited` says (a branch per call), 1 / 0 known on / off: no branch, which lets ptxas
  // move loads across the calls (the FP8 dA epilogue, da_half_as).
  template <int kClamp = -1>
  __device__ __forceinline__ void grad(float g, float u, float da, float& dg, float& du) const {
    bool pass_g = true, pass_u = true;
    if (kClamp == 1 || (kClamp < 0 && limited)) {
      pass_g = g <= limit;
      pass_u = fabsf(u) <= limit;
      g = fminf(g, limit);
      u = fminf(fmaxf(u, -limit), limit);
    }
    const float s = sigmoid(g);
    dg = pass_g ? da * u * (s * (1.f + g * (1.f - s))) : 0.f;
    du = pass_u ? da * (g * s) : 0.f;
  }
};

// The bf16 value saved for a pre-activation v, rounded to nearest unless that would move it across
// the clamp (v > L for gate, |v| > L for up): then one bf16 step toward v.  The backward
// recomputes the clamp masks from the saved values, so they match the forward's exactly.
__device__ __forceinline__ float bf16_keep_clamp_side(float v, float limit, bool two_sided) {
  const float r = __bfloat162float(__float2bfloat16_rn(v));
  const bool clamped_v = (two_sided ? fabsf(v) : v) > limit;
  const bool clamped_r = (two_sided ? fabsf(r) : r) > limit;
  if (clamped_v == clamped_r || r == 0.f) return r;
  const uint32_t bits = __float_as_uint(r) >> 16;
  const bool grow = (v > r) == (r > 0.f);  // away from zero = larger magnitude
  return __uint_as_float((grow ? bits + 1 : bits - 1) << 16);
}

__device__ __forceinline__ SwiGLU make_swiglu(const MoEDims& d) { return SwiGLU{d.has_limit != 0, d.swiglu_limit}; }

// Row block b of a routed buffer: row <- src[slot / k] (times weights[slot] when given), zeros
// for padding rows.  Shared by the forward (x) and the backward (d_out) dispatch.
__device__ __forceinline__ void gather_rows(const MoESchedule& s, const MoEDims& d, int b, const bf16* src,
                                            const float* weights, bf16* dst, int* err) {
  const int chunks = d.hidden / 8;
  const int slots = d.tokens * d.top_k;
  const int n = kBlockM * chunks;
  constexpr int kStride = kThreads * kCopyBatch;
  // Batches of kCopyBatch chunks per thread (row_copy.cuh): the batch's slot ids, then its source
  // chunks, all in flight together, then the stores.
  for (int base = worker_tid(); base < n; base += kStride) {
    int slot[kCopyBatch];
    uint4 v[kCopyBatch];
#pragma unroll
    for (int u = 0; u < kCopyBatch; ++u) {
      const int idx = base + u * kThreads;
      slot[u] = idx < n ? s.row_slot[b * kBlockM + idx / chunks] : -1;
    }
#pragma unroll
    for (int u = 0; u < kCopyBatch; ++u) {
      const int c = (base + u * kThreads) % chunks * 8;
      v[u] = slot[u] >= 0 && slot[u] < slots
                 ? *reinterpret_cast<const uint4*>(src + (size_t)(slot[u] / d.top_k) * d.hidden + c)
                 : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kCopyBatch; ++u) {
      const int idx = base + u * kThreads;
      if (idx >= n) break;
      const int row = b * kBlockM + idx / chunks, c = idx % chunks * 8;
      if (slot[u] >= slots) set_error(err, kErrInternal, __LINE__, row, slot[u]);  // corrupt schedule: never read past x
      uint4 w = v[u];
      if (weights != nullptr && slot[u] >= 0 && slot[u] < slots) {
        const float scale = weights[slot[u]];
        float f[8];
        unpack_bf16x8(w, f);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] *= scale;
        w = pack_bf16x8(f);
      }
      *reinterpret_cast<uint4*>(dst + (size_t)row * d.hidden + c) = w;
    }
  }
}

// A block's expert id must index this rank's weights (uniform check: every thread reads it).
__device__ __forceinline__ bool valid_expert(int e, int b, const MoEDims& d, int* err) {
  if (e >= 0 && e < d.local_experts) return true;
  if (threadIdx.x == 0) set_error(err, kErrInternal, __LINE__, b, e);
  return false;
}

// Destination of a row block's output row r in a per-route [T*k, H] buffer (nullptr: padding).
__device__ __forceinline__ bf16* route_row_ptr(const MoESchedule& s, const MoEDims& d, bf16* base, int row, int col0) {
  const int slot = s.row_slot[row];
  return (slot >= 0 && slot < d.tokens * d.top_k) ? base + (size_t)slot * d.hidden + col0 : nullptr;
}

// ---- the tasks ----------------------------------------------------------------------------------
struct ForwardTasks {
  const MoEForwardParams& p;
  const MoEForwardPlan& plan;
  int num_blocks;        // row blocks in use (device count)

  __device__ bool ep_on() const { return ep::enabled(p.peers); }

  // F0 after its wait (EP: every source's rows arrived).
  __device__ void dispatch_body(int b) const {
    if (ep_on()) {
      const MoEDims& d = p.dims;
      const bf16* rows = ep::routed_rows(p.peers, p.peers.rank);
      const size_t row0 = (size_t)b * kBlockM * d.hidden;  // element offset of the block's first row
      const int chunks = d.hidden / 8;
      batched_chunks(
          kBlockM * chunks,
          [&](long long i) {
            const int r = static_cast<int>(i / chunks);
            return p.sched.row_slot[b * kBlockM + r] >= 0 ? ld_cg_v4(rows + row0 + i * 8) : make_uint4(0u, 0u, 0u, 0u);
          },
          [&](long long i, const uint4& v) { *reinterpret_cast<uint4*>(p.ctx.x_routed + row0 + i * 8) = v; });
    } else {
      gather_rows(p.sched, p.dims, b, p.x, nullptr, p.ctx.x_routed, p.err);
    }
    signal_counter(p.cnt.block_ready + b);
  }

  // Fp: push this rank's token rows to their destinations, chunk by chunk (ep::push_chunks).
  __device__ void push(int q) const {
    ep::push_chunks(p.sched, p.dims, p.peers, q, p.x, nullptr, p.err, kFlagFwdRows);
    ep::signal_counter_sys(p.cnt.push_done);
  }

  // F5: out[t] = shared_y[t] + sum_j w[t,j] * y_slot[t*k+j], fp32, j in order.  With EP the
  // routes' outputs arrive in this rank's slot rows: they are also copied into y_slot (context),
  // and a context-only launch stops there.  Runs after the producer's waits:
  // `q`: the combine task (token block q / plan.combine_parts, its part q % plan.combine_parts).
  // the kBlockM / plan.combine_parts tokens of combine task q.
  __device__ void combine_body(int q) const {
    const MoEDims& d = p.dims;
    const bool ep = ep_on();
    const bool write_out = p.context_only == 0;
    const bool shared = d.shared_inter > 0 && write_out;
    const bf16* y_src = ep ? ep::slot_rows(p.peers, p.peers.rank) : p.ctx.y_slot;
    const int part_rows = kBlockM / plan.combine_parts;
    const int t0 = q * part_rows, rows = min_int(part_rows, d.tokens - t0), chunks = d.hidden / 8;
    const int n = rows * chunks;
    // Two chunks a thread at a time (kPair), their routes' loads issued together: 2 x kCopyBatch
    // 16-byte loads in flight, where one chunk's batch left the phase at ~18 GB/s per SM, short of
    // its share of HBM.  The second of a pair past the end repeats the first (loaded, not stored).
    constexpr int kPair = 2;
    for (int idx = worker_tid(); idx < n; idx += kPair * kThreads) {
      size_t t[kPair];
      int c[kPair];
      bool valid[kPair];
#pragma unroll
      for (int h = 0; h < kPair; ++h) {
        valid[h] = idx + h * kThreads < n;
        const int i = valid[h] ? idx + h * kThreads : idx, r = i / chunks;
        t[h] = (size_t)(t0 + r);
        c[h] = (i - r * chunks) * 8;
      }
      float acc[kPair][8];
#pragma unroll
      for (int h = 0; h < kPair; ++h) {
        if (shared) {
          const float* sy = p.shared_y + t[h] * d.hidden + c[h];
          const float4 lo = ld_cg_f4(sy), hi = ld_cg_f4(sy + 4);
          acc[h][0] = lo.x; acc[h][1] = lo.y; acc[h][2] = lo.z; acc[h][3] = lo.w;
          acc[h][4] = hi.x; acc[h][5] = hi.y; acc[h][6] = hi.z; acc[h][7] = hi.w;
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[h][i] = 0.f;
        }
      }
      // The token's routes kCopyBatch at a time, loaded together (row_copy.cuh); summed in order j.
      for (int j0 = 0; j0 < d.top_k; j0 += kCopyBatch) {
        float wv[kPair][kCopyBatch];  // plain loads, issued before the volatile route loads below
        uint4 yv[kPair][kCopyBatch];
        int m = 0;
#pragma unroll
        for (int h = 0; h < kPair; ++h) {
#pragma unroll
          for (int u = 0; u < kCopyBatch; ++u)
            wv[h][u] = write_out && j0 + u < d.top_k ? p.topk_weights[t[h] * d.top_k + j0 + u] : 0.f;
          m = load_routes(yv[h], j0, d.top_k, [&](int j) { return y_src + (t[h] * d.top_k + j) * d.hidden + c[h]; });
        }
#pragma unroll
        for (int h = 0; h < kPair; ++h) {
#pragma unroll
          for (int u = 0; u < kCopyBatch; ++u) {
            if (u >= m) break;
            const size_t slot = t[h] * d.top_k + j0 + u;
            if (ep && valid[h]) *reinterpret_cast<uint4*>(p.ctx.y_slot + slot * d.hidden + c[h]) = yv[h][u];
            if (!write_out) continue;
            float y[8];
            unpack_bf16x8(yv[h][u], y);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(wv[h][u], y[i], acc[h][i]);
          }
        }
      }
#pragma unroll
      for (int h = 0; h < kPair; ++h)
        if (write_out && valid[h]) *reinterpret_cast<uint4*>(p.out + t[h] * d.hidden + c[h]) = pack_bf16x8(acc[h]);
    }
  }
};

}  // namespace mok
