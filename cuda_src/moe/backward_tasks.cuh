// Backward tasks of the fused MoE layer (one GPU).  Phases, in task-index order:
//   B0 dispatch dy     row block:                 dy_routed = w[slot] * d_out[token] (zeros for padding)
//   B1 d weights       token block:               d_topk_weights[t,j] = <d_out[t], y_slot[t*k+j]>
//   B2 shared dA       token block x I_s/128:     d_out * ws_down -> SwiGLU bwd with sgu -> dsgu
//   B3 routed dA       row block x I/128:         dy_routed * W_down[e] -> SwiGLU bwd with gu -> dgu
//   B4 shared dX       token block x H/128:       dsgu * [ws_gate; ws_up] -> dx_shared (fp32)
//   B5 routed dX       row block x H/128:         dgu * [W_gate[e]; W_up[e]] -> dx_slot[route]
//   B6 wgrad down      expert x H/128 x I/128:    dW_down[e] = dy_e^T * act_e
//   B7 wgrad gate|up   expert x {g,u} x I/128 x H/128: dW_{gate,up}[e] = dG_e^T / dU_e^T * x_routed_e
//   B8 shared wgrad    H/128 x I_s/128, then {g,u} x I_s/128 x H/128 (K = T)
//   B9 combine dx      part of a token block:     dx = dx_shared + sum_j dx_slot[t*k+j]
// With expert parallelism (ep.cuh) the order is
//   Bp push (weighted d_out rows -> their destinations' routed rows = dy_routed), Bp' notify,
//   B1, B2, B0 receive (wait for every source; zero the padding rows), B3, B4,
//   B5 (rows return to their source's slot rows = dx_slot), B5' notify, B6, B7, B8,
//   B9 (wait for every destination).  Weight gradients stay on the expert's rank.
#pragma once
#include "moe/forward_tasks.cuh"

namespace mok {

// SwiGLU backward epilogue: the tile holds dA for intermediate columns col0 + [0, cols); reads
// the saved pre-activations gu (ld 2*inter, gate | up) and writes dgu (same layout).
__device__ __forceinline__ void swiglu_bwd_epilogue(const unsigned char* smem, int rows, int cols, const bf16* gu,
                                                    bf16* dgu, int inter, int col0, const SwiGLU& sw) {
  gemm::for_each_chunk(rows, cols, [&](int r, int c) {
    const size_t at = (size_t)r * 2 * inter + col0 + c;
    float da[8], g[8], u[8], dg[8], du[8];
    gemm::c_load8(smem, r, c, da);
    unpack_bf16x8(*reinterpret_cast<const uint4*>(gu + at), g);
    unpack_bf16x8(*reinterpret_cast<const uint4*>(gu + at + inter), u);
#pragma unroll
    for (int i = 0; i < 8; ++i) sw.grad(g[i], u[i], da[i], dg[i], du[i]);
    *reinterpret_cast<uint4*>(dgu + at) = pack_bf16x8(dg);
    *reinterpret_cast<uint4*>(dgu + at + inter) = pack_bf16x8(du);
  });
}

// ---- task index space -------------------------------------------------------------------------
// Tiles: dA / dX / wgrad columns are `n_cols` wide (i_tiles, si_tiles, h_tiles count them);
// wgrad rows come in kBlockM-row tiles (h_rows, i_rows, si_rows).  n_cols = kBlockM for the
// one-engine kernel, where both counts coincide.
struct BackwardPlan {
  int token_blocks, i_tiles, si_tiles, h_tiles, h_rows, i_rows, si_rows, combine_parts;
  PhaseRange push, push_notify, dispatch, d_weights, shared_da, routed_da, shared_dx, routed_dx, dx_notify,
      wgrad_down, wgrad_gate_up, shared_wgrad, combine;
  int total;

  __device__ static BackwardPlan make(const MoEDims& d, const MoEPeers& pe, int n_cols = gemm::kBN) {
    BackwardPlan f;
    f.token_blocks = ceil_div(d.tokens, kBlockM);
    f.i_tiles = ceil_div(d.inter, n_cols);
    f.si_tiles = ceil_div(d.shared_inter, n_cols);
    f.h_tiles = ceil_div(d.hidden, n_cols);
    f.h_rows = ceil_div(d.hidden, kBlockM);
    f.i_rows = ceil_div(d.inter, kBlockM);
    f.si_rows = ceil_div(d.shared_inter, kBlockM);
    const bool shared = d.shared_inter > 0;
    int at = 0;
    auto next = [&](int count) { PhaseRange r{at, count}; at += count; return r; };
    const bool ep = ep::enabled(pe);
    if (ep) {  // local work (d weights, shared dA) runs while the rows travel
      f.push = next(pe.push_tasks);
      f.push_notify = next(1);
      f.d_weights = next(f.token_blocks);
      f.shared_da = next(shared ? f.token_blocks * f.si_tiles : 0);
      f.dispatch = next(d.max_blocks);
    } else {
      f.push = next(0);
      f.push_notify = next(0);
      f.dispatch = next(d.max_blocks);
      f.d_weights = next(f.token_blocks);
      f.shared_da = next(shared ? f.token_blocks * f.si_tiles : 0);
    }
    f.routed_da = next(d.max_blocks * f.i_tiles);
    f.shared_dx = next(shared ? f.token_blocks * f.h_tiles : 0);
    f.routed_dx = next(d.max_blocks * f.h_tiles);
    f.dx_notify = next(ep ? 1 : 0);
    f.wgrad_down = next(d.local_experts * f.h_rows * f.i_tiles);
    f.wgrad_gate_up = next(d.local_experts * 2 * f.i_rows * f.h_tiles);
    f.shared_wgrad = next(shared ? f.h_rows * f.si_tiles + 2 * f.si_rows * f.h_tiles : 0);
    f.combine_parts = mok::combine_parts(f.token_blocks);
    f.combine = next(f.token_blocks * f.combine_parts);
    f.total = at;
    return f;
  }
};

// ---- the tasks ----------------------------------------------------------------------------------
struct BackwardTasks {
  const MoEBackwardParams& p;
  const BackwardPlan& plan;
  int num_blocks;        // row blocks in use (device count)
  unsigned char* smem;

  // Local waits (task counters) and peer waits (ep::wait_all): see ep::local_timeout_ns.
  __device__ WaitCtx wait_ctx() const { return ep::local_wait_ctx(p); }
  __device__ WaitCtx peer_wait_ctx() const { return ep::peer_wait_ctx(p); }
  __device__ int token_rows(int tb) const { return min_int(kBlockM, p.dims.tokens - tb * kBlockM); }
  __device__ static int tile_extent(int total, int tile) { return min_int(gemm::kBN, total - tile * gemm::kBN); }

  __device__ bool ep_on() const { return ep::enabled(p.peers); }

  // B0: weighted d_out rows of row block b.  With EP the sources pushed them into dy_routed
  // (this rank's routed rows): wait for every source and zero the padding rows.
  __device__ void dispatch(int b, int task) const {
    const int e = p.sched.block_expert[b];
    if (!valid_expert(e, b, p.dims, p.err)) return;
    if (ep_on() && !ep::wait_all(p.peers, kFlagBwdRows, -1, peer_wait_ctx(), ep::kStageBwdRows)) return;
    dispatch_body(b, e);
  }
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

  // Bp: push this rank's weighted d_out rows to their destinations.
  __device__ void push(int q) const {
    ep::push_rows(p.sched, p.dims, p.peers, q, p.d_out, p.topk_weights, p.err);
    ep::signal_counter_sys(p.cnt.push_done);
  }

  // Bp', B5': once `target` tasks counted by `counter` are done, tell every rank.
  __device__ void notify(const int* counter, int target, int kind, int task) const {
    if (!wait_counter(counter, target, wait_ctx(), task)) return;
    if (threadIdx.x == 0) ep::notify_all(p.peers, kind);
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

  // B2: shared dA for token block tb, intermediate columns n*128 ...
  __device__ void shared_da(int tb, int n) const {
    const MoEDims& d = p.dims;
    const int t0 = tb * kBlockM, rows = token_rows(tb), i0 = n * gemm::kBN, cols = tile_extent(d.shared_inter, n);
    gemm::tile_gemm<gemm::kKMajor, gemm::kMNMajor>(
        gemm::operand(p.d_out + (size_t)t0 * d.hidden, d.hidden, rows),
        gemm::operand(p.w.ws_down + i0, d.shared_inter, cols), d.hidden, smem);
    const size_t off = (size_t)t0 * 2 * d.shared_inter;
    swiglu_bwd_epilogue(smem, rows, cols, p.ctx.sgu + off, p.dsgu + off, d.shared_inter, i0, make_swiglu(d));
    signal_counters(p.cnt.token_dsgu_ready + tb, p.cnt.dsgu_done);
  }

  // B3: routed dA for row block b, intermediate columns n*128 ...
  __device__ void routed_da(int b, int n, int task) const {
    const MoEDims& d = p.dims;
    const int e = p.sched.block_expert[b];
    if (!valid_expert(e, b, d, p.err)) return;
    if (!wait_counter(p.cnt.block_dy_ready + b, 1, wait_ctx(), task)) return;
    const size_t row0 = (size_t)b * kBlockM;
    const int i0 = n * gemm::kBN, cols = tile_extent(d.inter, n);
    gemm::tile_gemm<gemm::kKMajor, gemm::kMNMajor>(
        gemm::operand(p.dy_routed + row0 * d.hidden, d.hidden, kBlockM),
        gemm::operand(p.w.w_down + (size_t)e * d.hidden * d.inter + i0, d.inter, cols), d.hidden, smem);
    const size_t off = row0 * 2 * d.inter;
    swiglu_bwd_epilogue(smem, kBlockM, cols, p.ctx.gu + off, p.dgu + off, d.inter, i0, make_swiglu(d));
    signal_counters(p.cnt.block_dgu_ready + b, p.cnt.expert_dgu_ready + e);
  }

  // B4: shared dX for token block tb, hidden columns h*128 ...; K = [gate | up] (2 I_s).
  __device__ void shared_dx(int tb, int h, int task) const {
    const MoEDims& d = p.dims;
    if (!wait_counter(p.cnt.token_dsgu_ready + tb, plan.si_tiles, wait_ctx(), task)) return;
    const int t0 = tb * kBlockM, rows = token_rows(tb), h0 = h * gemm::kBN, cols = tile_extent(d.hidden, h);
    gemm::tile_gemm<gemm::kKMajor, gemm::kMNMajor>(
        gemm::operand(p.dsgu + (size_t)t0 * 2 * d.shared_inter, 2 * d.shared_inter, rows),
        gemm::operand2(p.w.ws_gate + h0, p.w.ws_up + h0, d.shared_inter, d.hidden, cols), 2 * d.shared_inter,
        smem);
    gemm::store_tile_f32(smem, p.dx_shared + (size_t)t0 * d.hidden + h0, d.hidden, rows, cols, false);
    signal_counter(p.cnt.token_dxs_ready + tb);
  }

  // B5: routed dX for row block b, hidden columns h*128 ...; rows go to their route's slot.
  __device__ void routed_dx(int b, int h, int task) const {
    const MoEDims& d = p.dims;
    const int e = p.sched.block_expert[b];
    if (!valid_expert(e, b, d, p.err)) return;
    if (!wait_counter(p.cnt.block_dgu_ready + b, plan.i_tiles, wait_ctx(), task)) return;
    const size_t row0 = (size_t)b * kBlockM, w0 = (size_t)e * d.inter * d.hidden;
    const int h0 = h * gemm::kBN, cols = tile_extent(d.hidden, h);
    gemm::tile_gemm<gemm::kKMajor, gemm::kMNMajor>(
        gemm::operand(p.dgu + row0 * 2 * d.inter, 2 * d.inter, kBlockM),
        gemm::operand2(p.w.w_gate + w0 + h0, p.w.w_up + w0 + h0, d.inter, d.hidden, cols), 2 * d.inter, smem);
    if (ep_on()) {  // rows go straight to their source rank's slot rows
      gemm::store_tile_bf16_rows(smem, kBlockM, cols, [&](int r) {
        return ep::return_row_ptr(p.sched, p.peers, d, (int)row0 + r, h0, p.err);
      });
      ep::signal_counter_sys(p.cnt.dx_done);
      return;
    }
    gemm::store_tile_bf16_rows(smem, kBlockM, cols, [&](int r) {
      return route_row_ptr(p.sched, d, p.dx_slot, (int)row0 + r, h0);
    });
    signal_counter(p.cnt.dx_done);
  }

  // Rows of local expert e: first row, unpadded count, row blocks.
  struct ExpertRows { int first, count, blocks; };
  __device__ ExpertRows expert_rows(int e) const {
    const int first = p.sched.expert_offset[e];
    return ExpertRows{first, p.sched.expert_count[e], (p.sched.expert_offset[e + 1] - first) / kBlockM};
  }

  // B6: dW_down[e][h, i] = sum over the expert's rows of dy[row, h] * act[row, i].
  __device__ void wgrad_down(int e, int h, int n, int task) const {
    const MoEDims& d = p.dims;
    const ExpertRows er = expert_rows(e);
    if (er.count == 0 && p.accumulate) return;  // adding zero: leave the caller's buffer alone
    if (er.blocks > 0 && !wait_counter(p.cnt.expert_dy_ready + e, er.blocks, wait_ctx(), task)) return;
    const int h0 = h * gemm::kBN, hs = tile_extent(d.hidden, h), i0 = n * gemm::kBN, is = tile_extent(d.inter, n);
    gemm::tile_gemm<gemm::kMNMajor, gemm::kMNMajor>(
        gemm::operand(p.dy_routed + (size_t)er.first * d.hidden + h0, d.hidden, hs),
        gemm::operand(p.ctx.act + (size_t)er.first * d.inter + i0, d.inter, is), er.count, smem);
    gemm::store_tile_f32(smem, p.grads.dw_down + ((size_t)e * d.hidden + h0) * d.inter + i0, d.inter, hs, is,
                         p.accumulate != 0);
  }

  // B7: dW_gate[e][i, h] (up = 0) or dW_up[e][i, h] (up = 1) = sum over rows of dgu[row, i] * x_routed[row, h].
  __device__ void wgrad_gate_up(int e, int up, int n, int h, int task) const {
    const MoEDims& d = p.dims;
    const ExpertRows er = expert_rows(e);
    if (er.count == 0 && p.accumulate) return;
    if (er.blocks > 0 &&
        !wait_counter(p.cnt.expert_dgu_ready + e, er.blocks * plan.i_tiles, wait_ctx(), task)) return;
    const int h0 = h * gemm::kBN, hs = tile_extent(d.hidden, h), i0 = n * gemm::kBN, is = tile_extent(d.inter, n);
    gemm::tile_gemm<gemm::kMNMajor, gemm::kMNMajor>(
        gemm::operand(p.dgu + (size_t)er.first * 2 * d.inter + up * d.inter + i0, 2 * d.inter, is),
        gemm::operand(p.ctx.x_routed + (size_t)er.first * d.hidden + h0, d.hidden, hs), er.count, smem);
    float* dw = up ? p.grads.dw_up : p.grads.dw_gate;
    gemm::store_tile_f32(smem, dw + ((size_t)e * d.inter + i0) * d.hidden + h0, d.hidden, is, hs,
                         p.accumulate != 0);
  }

  // B8: shared expert weight gradients, K = T (masked).
  __device__ void shared_wgrad(int q, int task) const {
    const MoEDims& d = p.dims;
    if (d.tokens == 0 && p.accumulate) return;
    const int down_tiles = plan.h_tiles * plan.si_tiles;
    if (q < down_tiles) {  // dWs_down[h, i] = sum_t d_out[t, h] * sact[t, i]
      const int h = q / plan.si_tiles, n = q % plan.si_tiles;
      const int h0 = h * gemm::kBN, hs = tile_extent(d.hidden, h), i0 = n * gemm::kBN;
      const int is = tile_extent(d.shared_inter, n);
      gemm::tile_gemm<gemm::kMNMajor, gemm::kMNMajor>(gemm::operand(p.d_out + h0, d.hidden, hs),
                                                      gemm::operand(p.ctx.sact + i0, d.shared_inter, is), d.tokens,
                                                      smem);
      gemm::store_tile_f32(smem, p.grads.dws_down + (size_t)h0 * d.shared_inter + i0, d.shared_inter, hs, is,
                           p.accumulate != 0);
      return;
    }
    // dWs_{gate,up}[i, h] = sum_t dsgu[t, (up) i] * x[t, h]
    q -= down_tiles;
    const int up = q / (plan.si_tiles * plan.h_tiles), rem = q % (plan.si_tiles * plan.h_tiles);
    const int n = rem / plan.h_tiles, h = rem % plan.h_tiles;
    if (!wait_counter(p.cnt.dsgu_done, plan.token_blocks * plan.si_tiles, wait_ctx(), task)) return;
    const int h0 = h * gemm::kBN, hs = tile_extent(d.hidden, h), i0 = n * gemm::kBN;
    const int is = tile_extent(d.shared_inter, n);
    gemm::tile_gemm<gemm::kMNMajor, gemm::kMNMajor>(
        gemm::operand(p.dsgu + up * d.shared_inter + i0, 2 * d.shared_inter, is),
        gemm::operand(p.x + h0, d.hidden, hs), d.tokens, smem);
    float* dw = up ? p.grads.dws_up : p.grads.dws_gate;
    gemm::store_tile_f32(smem, dw + (size_t)i0 * d.hidden + h0, d.hidden, is, hs, p.accumulate != 0);
  }

  // B9: dx[t] = dx_shared[t] + sum_j dx_slot[t*k+j], fp32, j in order.
  // `q`: the combine task (token block q / plan.combine_parts, its part q % plan.combine_parts).
  __device__ void combine(int q, int task) const {
    const MoEDims& d = p.dims;
    const int tb = q / plan.combine_parts;
    if (ep_on()) {  // dx_slot is this rank's slot rows, written by every destination
      if (!ep::wait_all(p.peers, kFlagBwdReturn, kFlagBwdRows, peer_wait_ctx(), ep::kStageBwdReturn)) return;
    } else if (!wait_counter(p.cnt.dx_done, num_blocks * plan.h_tiles, wait_ctx(), task)) {
      return;
    }
    if (d.shared_inter > 0 && !wait_counter(p.cnt.token_dxs_ready + tb, plan.h_tiles, wait_ctx(), task)) return;
    combine_body(q);
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

  __device__ void run(int task) const {
    if (plan.push.has(task)) {
      push(plan.push.local(task));
    } else if (plan.push_notify.has(task)) {
      notify(p.cnt.push_done, p.peers.push_tasks, kFlagBwdRows, task);
    } else if (plan.dispatch.has(task)) {
      const int b = plan.dispatch.local(task);
      if (b < num_blocks) dispatch(b, task);
    } else if (plan.d_weights.has(task)) {
      d_weights(plan.d_weights.local(task));
    } else if (plan.shared_da.has(task)) {
      const int q = plan.shared_da.local(task);
      shared_da(q / plan.si_tiles, q % plan.si_tiles);
    } else if (plan.routed_da.has(task)) {
      const int q = plan.routed_da.local(task), b = q / plan.i_tiles;
      if (b < num_blocks) routed_da(b, q % plan.i_tiles, task);
    } else if (plan.shared_dx.has(task)) {
      const int q = plan.shared_dx.local(task);
      shared_dx(q / plan.h_tiles, q % plan.h_tiles, task);
    } else if (plan.routed_dx.has(task)) {
      const int q = plan.routed_dx.local(task), b = q / plan.h_tiles;
      if (b < num_blocks) routed_dx(b, q % plan.h_tiles, task);
    } else if (plan.dx_notify.has(task)) {
      notify(p.cnt.dx_done, num_blocks * plan.h_tiles, kFlagBwdReturn, task);
    } else if (plan.wgrad_down.has(task)) {
      const int q = plan.wgrad_down.local(task), per_e = plan.h_tiles * plan.i_tiles;
      const int e = q / per_e, rem = q % per_e;
      wgrad_down(e, rem / plan.i_tiles, rem % plan.i_tiles, task);
    } else if (plan.wgrad_gate_up.has(task)) {
      const int q = plan.wgrad_gate_up.local(task), per_e = 2 * plan.i_tiles * plan.h_tiles;
      const int e = q / per_e, rem = q % per_e, per_up = plan.i_tiles * plan.h_tiles;
      const int up = rem / per_up, rem2 = rem % per_up;
      wgrad_gate_up(e, up, rem2 / plan.h_tiles, rem2 % plan.h_tiles, task);
    } else if (plan.shared_wgrad.has(task)) {
      shared_wgrad(plan.shared_wgrad.local(task), task);
    } else if (plan.combine.has(task)) {
      combine(plan.combine.local(task), task);
    }
  }
};

}  // namespace mok
