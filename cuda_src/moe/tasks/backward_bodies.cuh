// Backward tasks of the fused MoE layer: the bodies of the non-GEMM tasks (tasks/backward.cuh
// runs them).  Phases, in task-index order (one GPU; mok_rt/kernels/moe_plan.py); column tiles are 256
// wide, wgrad row tiles 128:
//   B0 dispatch dy     row block:                 dy_routed = w[slot] * d_out[token] (zeros for padding)
//   B1 d weights       token block:               d_topk_weights[t,j] = <d_out[t], y_slot[t*k+j]>
//   B2 shared dA       token block x I_s/256:     d_out * shared_down -> SwiGLU bwd with sgu -> dsgu
//   B3 routed dA       row block x I/256:         dy_routed * W_down[e] -> SwiGLU bwd with gu -> dgu
//   B4 shared dX       token block x H/256:       dsgu * [shared_gate; shared_up] -> dx_shared (fp32)
//   B5 routed dX       row block x H/256:         dgu * [W_gate[e]; W_up[e]] -> dx_slot[route]
//   B6 wgrad down      expert x H/128 x I/256:    dW_down[e] = dy_e^T * act_e
//   B7 wgrad gate|up   expert x {g,u} x I/128 x H/256: dW_{gate,up}[e] = dG_e^T / dU_e^T * x_routed_e
//   B8 shared wgrad    H/128 x I_s/256, then {g,u} x I_s/128 x H/256 (K = T)
//   B9 combine dx      part of a token block:     dx = dx_shared + sum_j dx_slot[t*k+j]
// With expert parallelism (ep.cuh) the order is
//   Bp push (weighted d_out rows -> their destinations' routed rows = dy_routed), Bp' notify,
//   B1, B2, B0 receive (wait for every source; zero the padding rows), B3, B4,
//   B5 (rows return to their source's slot rows = dx_slot), B5' notify, B6, B7, B8,
//   B9 (wait for every destination).  Weight gradients stay on the expert's rank.
#pragma once
#include "moe/tasks/forward_bodies.cuh"

namespace mok {

// ---- the tasks ----------------------------------------------------------------------------------
struct BackwardTasks {
  const MoEBackwardParams& p;
  const MoEBackwardPlan& plan;
  int num_blocks;        // row blocks in use (device count)
  __device__ int token_rows(int tb) const { return min_int(kBlockM, p.dims.tokens - tb * kBlockM); }

  __device__ bool ep_on() const { return ep::enabled(p.peers); }

  // B0 after its checks and wait (e: the block's valid expert).
  __device__ void dispatch_body(int b, int e) const {
    if (ep_on()) {
      const MoEDims& d = p.dims;
      const int chunks = d.hidden / 8;
      for (int idx = worker_tid(); idx < kBlockM * chunks; idx += kThreads) {
        const int r = idx / chunks, c = (idx - r * chunks) * 8;
        if (p.sched.row_slot[b * kBlockM + r] < 0)
          *reinterpret_cast<uint4*>(p.dy_routed + (size_t)(b * kBlockM + r) * d.hidden + c) = make_uint4(0u, 0u, 0u, 0u);
      }
    } else {
      gather_rows(p.sched, p.dims, b, p.d_out, p.topk_weights, p.dy_routed, p.err);
    }
    signal_counters(p.cnt.block_dy_ready + b, p.cnt.expert_dy_ready + e);
  }

  // Bp: push this rank's weighted d_out rows to their destinations, chunk by chunk (ep::push_chunks).
  __device__ void push(int q) const {
    ep::push_chunks(p.sched, p.dims, p.peers, q, p.d_out, p.topk_weights, p.err, kFlagBwdRows);
    ep::signal_counter_sys(p.cnt.push_done);
  }

  // B1: one warp per route, lanes stride over H, then a fixed butterfly: deterministic.
  __device__ void d_weights(int tb) const {
    const MoEDims& d = p.dims;
    const int warp = worker_tid() >> 5, lane = worker_tid() & 31;
    const int routes = token_rows(tb) * d.top_k, slot0 = tb * kBlockM * d.top_k;
    for (int q = warp; q < routes; q += kThreads / 32) {
      const size_t slot = (size_t)slot0 + q, t = slot / d.top_k;
      float sum = 0.f;
      // kCopyBatch / 4 chunk pairs per lane in flight (row_copy.cuh), summed in order of c.
      constexpr int kPairs = kCopyBatch / 4;
      for (int c0 = lane * 8; c0 < d.hidden; c0 += 32 * 8 * kPairs) {
        uint4 yv[kPairs], gv[kPairs];
#pragma unroll
        for (int u = 0; u < kPairs; ++u) {
          const int c = c0 + u * 32 * 8;
          if (c < d.hidden) {
            yv[u] = *reinterpret_cast<const uint4*>(p.ctx.y_slot + slot * d.hidden + c);
            gv[u] = *reinterpret_cast<const uint4*>(p.d_out + t * d.hidden + c);
          }
        }
#pragma unroll
        for (int u = 0; u < kPairs; ++u) {
          if (c0 + u * 32 * 8 >= d.hidden) break;
          float y[8], g[8];
          unpack_bf16x8(yv[u], y);
          unpack_bf16x8(gv[u], g);
#pragma unroll
          for (int i = 0; i < 8; ++i) sum = fmaf(g[i], y[i], sum);
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (lane == 0) p.d_topk_weights[slot] = sum;
    }
  }

  // Rows of local expert e: first row, unpadded count, row blocks.
  struct ExpertRows { int first, count, blocks; };
  __device__ ExpertRows expert_rows(int e) const {
    const int first = p.sched.expert_offset[e];
    return ExpertRows{first, p.sched.expert_count[e], (p.sched.expert_offset[e + 1] - first) / kBlockM};
  }

  // B9 after its waits: the kBlockM / plan.combine_parts tokens of combine task q.
  __device__ void combine_body(int q) const {
    const MoEDims& d = p.dims;
    const bool shared = d.shared_inter > 0;
    const int part_rows = kBlockM / plan.combine_parts;
    const int t0 = q * part_rows, rows = min_int(part_rows, d.tokens - t0), chunks = d.hidden / 8;
    for (int idx = worker_tid(); idx < rows * chunks; idx += kThreads) {
      const int r = idx / chunks, c = (idx - r * chunks) * 8;
      const size_t t = (size_t)(t0 + r);
      float acc[8];
      if (shared) {
        const float4 lo = ld_cg_f4(p.dx_shared + t * d.hidden + c), hi = ld_cg_f4(p.dx_shared + t * d.hidden + c + 4);
        acc[0] = lo.x; acc[1] = lo.y; acc[2] = lo.z; acc[3] = lo.w;
        acc[4] = hi.x; acc[5] = hi.y; acc[6] = hi.z; acc[7] = hi.w;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = 0.f;
      }
      // The token's routes kCopyBatch at a time, loaded together (row_copy.cuh); summed in order j.
      for (int j0 = 0; j0 < d.top_k; j0 += kCopyBatch) {
        uint4 dv[kCopyBatch];
        const int n = load_routes(dv, j0, d.top_k, [&](int j) { return p.dx_slot + (t * d.top_k + j) * d.hidden + c; });
#pragma unroll
        for (int u = 0; u < kCopyBatch; ++u) {
          if (u >= n) break;
          float v[8];
          unpack_bf16x8(dv[u], v);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += v[i];
        }
      }
      *reinterpret_cast<uint4*>(p.dx + t * d.hidden + c) = pack_bf16x8(acc);
    }
  }
};

}  // namespace mok
