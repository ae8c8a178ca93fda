// The backward's task set (TmaBackward): phases in backward_bodies.cuh, every GEMM on the pipeline
// (pipeline/pipeline.cuh) with its epilogue straight from registers.  Tiles are 128 x 256:
//   B2/B3 dA: 256 intermediate columns; A = d_out / dy_routed (K-major), B = the down weights
//             read MN-major; SwiGLU backward reads gu at the same (row, column).
//   B4/B5 dX: 256 hidden columns; K = [gate | up] (2I): B switches from the gate to the up map
//             at k = I (both MN-major).
//   B6/B7/B8 wgrads: 128 rows (h for dW_down, i for dW_gate/up) x 256 columns, both operands
//             MN-major, K = the expert's rows (tokens for the shared expert).  K is rounded up to
//             64 rows: the rows past the expert's count are its padding rows, which are zero in
//             dy_routed, act, dgu and x_routed (dispatch writes zeros, and zeros stay zero).
#pragma once
#include "moe/tasks/backward_bodies.cuh"
#include "moe/pipeline/spread.cuh"
#include "moe/pipeline/staged_rows.cuh"
#include "moe/tasks/forward.cuh"

namespace mok {

enum BackwardJob : int {
  kBwdStop = 0,
  kBwdPush,              // a = push task
  kBwdDispatch,          // a = row block, b = expert
  kBwdDWeights,          // a = token block
  kBwdSharedDA,          // a = token block, b = intermediate tile
  kBwdRoutedDA,          // a = row block, b = intermediate tile, c = expert, e = upper half idle
  kBwdSharedDX,          // a = token block, b = hidden tile
  kBwdRoutedDX,          // a = row block, b = hidden tile, c = expert, e = upper half idle
  kBwdWgradDown,         // a = expert, b = hidden row tile (128), c = intermediate tile (256)
  kBwdWgradGateUp,       // a = expert, b = up, c = intermediate row tile (128), d = hidden tile (256)
  kBwdSharedWgradDown,   // b = hidden row tile, c = intermediate tile
  kBwdSharedWgradGateUp, // b = up, c = intermediate row tile, d = hidden tile
  kBwdCombine,           // a = combine task (a part of a token block)
};

// SwiGLU backward epilogue: the tile holds dA for intermediate columns col0 + c (c < cols); reads
// the saved pre-activations gu (ld 2*inter, gate | up) and writes dgu, 16 bytes at a time (dA is
// quad-transposed to the 8-column chunk each lane then owns; see pipeline/epilogue.cuh).
__device__ __forceinline__ void swiglu_bwd_epilogue_regs(const float (&acc)[pipe::kAccRegs], const pipe::Frag& f,
                                                         int rows, int cols, const bf16* gu, bf16* dgu, int inter,
                                                         int col0, const SwiGLU& sw) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = f.row0 + 8 * h;
    const size_t row_at = (size_t)r * 2 * inter + col0;
#pragma unroll
    for (int q = 0; q < pipe::kGroups; ++q) {
      if (32 * q >= cols) break;  // warp-uniform
      float da[8];
      pipe::group_f32(acc, q, h, da);
      if (r >= rows) continue;
      const size_t at = row_at + f.chunk_col(q);
      float g[8], u[8], dg[8], du[8];
      unpack_bf16x8(*reinterpret_cast<const uint4*>(gu + at), g);
      unpack_bf16x8(*reinterpret_cast<const uint4*>(gu + at + inter), u);
#pragma unroll
      for (int i = 0; i < 8; ++i) sw.grad(g[i], u[i], da[i], dg[i], du[i]);
      *reinterpret_cast<uint4*>(dgu + at) = pack_bf16x8(dg);
      *reinterpret_cast<uint4*>(dgu + at + inter) = pack_bf16x8(du);
    }
  }
}

struct TmaBackward {
  const MoEBackwardMaps& maps;
  const MoEBackwardParams& p;
  const MoEBackwardPlan& plan;
  const BackwardTasks& tasks;  // the non-GEMM bodies
  const pipe::ScheduledOrder& order;
  int num_blocks;

  // d_weights (B1) waits on nothing and nothing waits on it: on one GPU it trails, overlapping
  // GEMMs; with EP it stays with the shared dA in front, covering the rows' travel (adjacent
  // phases there).
  __device__ static pipe::ScheduledOrder make_order(const MoEBackwardPlan& f, const MoEBackwardParams& p,
                                                    int num_blocks) {
    const int experts = p.dims.local_experts;
    if (f.push_notify.count > 0)  // EP: the blocks in the schedule's order (block_expert's second half)
      return pipe::ScheduledOrder::make(PhaseRange{f.d_weights.begin, f.d_weights.count + f.shared_da.count},
                                        f.dispatch, f.routed_da, PhaseRange{f.dispatch.begin, 0}, f.i_tiles,
                                        f.routed_dx, f.h_tiles, p.sched, experts, num_blocks,
                                        p.sched.block_expert + p.dims.max_blocks);
    return pipe::ScheduledOrder::make(f.shared_da, f.dispatch, f.routed_da, f.d_weights, f.i_tiles, f.routed_dx,
                                      f.h_tiles, p.sched, experts, num_blocks);
  }

  // Local waits (task counters) and peer waits (ep::wait_all_thread): see ep::local_timeout_ns.
  __device__ WaitCtx wait_ctx() const { return ep::local_wait_ctx(p); }
  __device__ WaitCtx peer_wait_ctx() const { return ep::peer_wait_ctx(p); }
  __device__ bool ep_on() const { return ep::enabled(p.peers); }
  // One GPU: the combine spread through the first half of the wgrad tiles (it waits on dX; as the
  // last phase its 256 long tasks left SMs idle ~0.4 ms at the end): pipeline/spread.cuh.  With
  // EP plan order (the combine waits on the peers' returns).
  __device__ int plan_task(int grabbed) const {
    if (plan.push_notify.count > 0) return order.map(grabbed);
    return order.map(pipe::Spread::early(plan.wgrad_down.begin, plan.combine.begin, plan.combine.count).map(grabbed));
  }
  __device__ unsigned long long* trace() const { return p.trace; }
  __device__ static int k_tiles_of(int k) { return ceil_div(k, wg::kBK); }

  // ---- producer -----------------------------------------------------------------------------------
  __device__ int prepare(int grabbed, pipe::Job& job, pipe::LoadSrc& a, pipe::LoadSrc& b) const {
    const int task = plan_task(grabbed);
    const MoEBackwardMaps& m = pipe::late(maps);
    const MoEDims& d = p.dims;
    const WaitCtx w = wait_ctx();
    job = pipe::Job{};
    if (plan.push.has(task)) {
      job.kind = kBwdPush;
      job.a = plan.push.local(task);
      return 1;
    }
    if (plan.push_notify.has(task)) {
      if (!wait_counter_thread(p.cnt.push_done, plan.wait_push_done, w, task)) return -1;
      ep::notify_all(p.peers, kFlagBwdRows);
      return 0;
    }
    if (plan.dispatch.has(task)) {
      const int blk = plan.dispatch.local(task);
      if (blk >= num_blocks) return 0;
      const int e = p.sched.block_expert[blk];
      if (!valid_expert(e, blk, d, p.err)) return -1;
      // EP: only the readiness chunks that hold this block's rows (ep.cuh), not every source's whole push.
      if (ep_on() && !ep::wait_block_rows_thread(p.sched, d, p.peers, blk, kFlagBwdRows, peer_wait_ctx(),
                                                 ep::kStageBwdRows))
        return -1;
      job = pipe::Job{kBwdDispatch, pipe::kLoadNone, 0, blk, e};
      rows::use_ring(job, ep_on() ? 0 : rows::Stages::of(d.hidden).count);  // one GPU: staged_rows.cuh
      return 1;
    }
    if (plan.d_weights.has(task)) {
      const int tb = plan.d_weights.local(task);
      job = pipe::Job{kBwdDWeights, pipe::kLoadNone, 0, tb};
      rows::use_ring(job, ep_on() ? 0 : tasks.token_rows(tb) * rows::RoutePieces::of(d.hidden, d.top_k).per_token);
      return 1;
    }
    if (plan.shared_da.has(task)) {
      const int q = plan.shared_da.local(task), tb = q / plan.si_tiles, n = q % plan.si_tiles;
      job = pipe::Job{kBwdSharedDA, pipe::kLoadGemm, d.hidden / wg::kBK, tb, n};
      a = pipe::kmajor(&m.d_out_k, tb * kBlockM);
      b = pipe::mnmajor(&m.shared_down_mn, n * pipe::kBN);
      return 1;
    }
    if (plan.routed_da.has(task)) {
      const int q = plan.routed_da.local(task), blk = q / plan.i_tiles, n = q % plan.i_tiles;
      if (blk >= num_blocks) return 0;
      const int e = p.sched.block_expert[blk];
      if (!valid_expert(e, blk, d, p.err)) return -1;
      const int idle = pipe::upper_half_idle(p.sched, blk, e);  // loads issued before the acquire
      if (!wait_counter_thread(p.cnt.block_dy_ready + blk, plan.wait_block_dy_ready, w, task)) return -1;
      job = pipe::Job{kBwdRoutedDA, pipe::kLoadGemm, d.hidden / wg::kBK, blk, n, e, 0, idle};
      a = pipe::kmajor(&m.dy_routed_k, blk * kBlockM);
      b = pipe::mnmajor(&m.w_down_mn, n * pipe::kBN, 0, e);
      return 1;
    }
    if (plan.shared_dx.has(task)) {
      const int q = plan.shared_dx.local(task), tb = q / plan.h_tiles, h = q % plan.h_tiles;
      if (!wait_counter_thread(p.cnt.token_dsgu_ready + tb, plan.wait_token_dsgu_ready, w, task)) return -1;
      job = pipe::Job{kBwdSharedDX, pipe::kLoadGemm, 2 * d.shared_inter / wg::kBK, tb, h};
      a = pipe::kmajor(&m.dsgu_k, tb * kBlockM);
      b = pipe::mnmajor(&m.shared_gate_mn, h * pipe::kBN, 0, 0, &m.shared_up_mn, d.shared_inter / wg::kBK);
      return 1;
    }
    if (plan.routed_dx.has(task)) {
      const int q = plan.routed_dx.local(task), blk = q / plan.h_tiles, h = q % plan.h_tiles;
      if (blk >= num_blocks) return 0;
      const int e = p.sched.block_expert[blk];
      if (!valid_expert(e, blk, d, p.err)) return -1;
      const int idle = pipe::upper_half_idle(p.sched, blk, e);
      if (!wait_counter_thread(p.cnt.block_dgu_ready + blk, plan.wait_block_dgu_ready, w, task)) return -1;
      job = pipe::Job{kBwdRoutedDX, pipe::kLoadGemm, 2 * d.inter / wg::kBK, blk, h, e, 0, idle};
      a = pipe::kmajor(&m.dgu_k, blk * kBlockM);
      b = pipe::mnmajor(&m.w_gate_mn, h * pipe::kBN, 0, e, &m.w_up_mn, d.inter / wg::kBK);
      return 1;
    }
    if (plan.dx_notify.has(task)) {
      if (!wait_counter_thread(p.cnt.dx_done, num_blocks * plan.wait_dx_done_per_block, w, task)) return -1;
      ep::notify_all(p.peers, kFlagBwdReturn);
      return 0;
    }
    if (plan.wgrad_down.has(task)) {
      const int q = plan.wgrad_down.local(task), per_e = plan.h_rows * plan.i_tiles;
      const int e = q / per_e, rem = q % per_e, h = rem / plan.i_tiles, n = rem % plan.i_tiles;
      const BackwardTasks::ExpertRows er = tasks.expert_rows(e);
      if (er.count == 0 && p.accumulate) return 0;  // adding zero: leave the caller's buffer alone
      if (er.blocks > 0 && !wait_counter_thread(p.cnt.expert_dy_ready + e, er.blocks * plan.wait_expert_dy_ready_per_block, w, task)) return -1;
      job = pipe::Job{kBwdWgradDown, pipe::kLoadGemm, k_tiles_of(er.count), e, h, n};
      a = pipe::mnmajor(&m.dy_routed_mn, h * kBlockM, er.first);
      b = pipe::mnmajor(&m.act_mn, n * pipe::kBN, er.first);
      return 1;
    }
    if (plan.wgrad_gate_up.has(task)) {
      const int q = plan.wgrad_gate_up.local(task), per_up = plan.i_rows * plan.h_tiles, per_e = 2 * per_up;
      const int e = q / per_e, rem = q % per_e, up = rem / per_up, rem2 = rem % per_up;
      const int n = rem2 / plan.h_tiles, h = rem2 % plan.h_tiles;
      const BackwardTasks::ExpertRows er = tasks.expert_rows(e);
      if (er.count == 0 && p.accumulate) return 0;
      if (er.blocks > 0 &&
          !wait_counter_thread(p.cnt.expert_dgu_ready + e, er.blocks * plan.wait_expert_dgu_ready_per_block, w, task)) return -1;
      job = pipe::Job{kBwdWgradGateUp, pipe::kLoadGemm, k_tiles_of(er.count), e, up, n, h};
      // Gate tile rows past I read up columns: garbage confined to rows the epilogue drops.
      a = pipe::mnmajor(&m.dgu_mn, up * d.inter + n * kBlockM, er.first);
      b = pipe::mnmajor(&m.x_routed_mn, h * pipe::kBN, er.first);
      return 1;
    }
    if (plan.shared_wgrad.has(task)) {
      if (d.tokens == 0 && p.accumulate) return 0;
      int q = plan.shared_wgrad.local(task);
      const int down_tiles = plan.h_rows * plan.si_tiles;
      if (q < down_tiles) {  // dWs_down[h, i] = sum_t d_out[t, h] * sact[t, i]
        const int h = q / plan.si_tiles, n = q % plan.si_tiles;
        job = pipe::Job{kBwdSharedWgradDown, pipe::kLoadGemm, k_tiles_of(d.tokens), 0, h, n};
        a = pipe::mnmajor(&m.d_out_mn, h * kBlockM);
        b = pipe::mnmajor(&m.sact_mn, n * pipe::kBN);
        return 1;
      }
      q -= down_tiles;  // dWs_{gate,up}[i, h] = sum_t dsgu[t, (up) i] * x[t, h]
      const int per_up = plan.si_rows * plan.h_tiles;
      const int up = q / per_up, rem = q % per_up, n = rem / plan.h_tiles, h = rem % plan.h_tiles;
      if (!wait_counter_thread(p.cnt.dsgu_done, plan.wait_dsgu_done, w, task)) return -1;
      job = pipe::Job{kBwdSharedWgradGateUp, pipe::kLoadGemm, k_tiles_of(d.tokens), 0, up, n, h};
      a = pipe::mnmajor(&m.dsgu_mn, up * d.shared_inter + n * kBlockM);
      b = pipe::mnmajor(&m.x_mn, h * pipe::kBN);
      return 1;
    }
    if (plan.combine.has(task)) {
      const int q = plan.combine.local(task), tb = q / plan.combine_parts;
      if (ep_on()) {
        if (!ep::wait_all_thread(p.peers, kFlagBwdReturn, kFlagBwdRows, peer_wait_ctx(), ep::kStageBwdReturn)) return -1;
      } else if (!wait_counter_thread(p.cnt.dx_done, num_blocks * plan.wait_dx_done_per_block, w, task)) {
        return -1;
      }
      if (d.shared_inter > 0 && !wait_counter_thread(p.cnt.token_dxs_ready + tb, plan.wait_token_dxs_ready, w, task)) return -1;
      job = pipe::Job{kBwdCombine, pipe::kLoadNone, 0, q};
      return 1;
    }
    return 0;
  }

  // Dispatch through the ring (one GPU; staged_rows.cuh).
  __device__ uint32_t stage_rows(const pipe::Job& job, int stage, uint32_t dst, uint32_t bar) const {
    const MoEDims& d = p.dims;
    if (job.kind == kBwdDWeights)
      return rows::issue_route_stage(p.d_out, p.ctx.y_slot, d.hidden, d.top_k, job.a * kBlockM, stage,
                                     rows::RoutePieces::of(d.hidden, d.top_k), dst, bar);
    return rows::issue_stage(p.sched, d, p.d_out, p.err, job.a, stage, rows::Stages::of(d.hidden), dst, bar);
  }

  // ---- workers -------------------------------------------------------------------------------------
  // A weight-gradient tile to grads[at + r * ld + c] in the caller's dtype (p.grad_bf16: uniform
  // over the launch), streaming: nothing in the launch reads it again.
  __device__ void store_wgrad(const float (&acc)[pipe::kAccRegs], const pipe::Frag& f, void* grads, size_t at, int ld,
                              int rows, int cols) const {
    if (p.grad_bf16)
      pipe::store_bf16<true>(acc, f, static_cast<bf16*>(grads) + at, ld, rows, cols, p.accumulate != 0);
    else
      pipe::store_f32<true>(acc, f, static_cast<float*>(grads) + at, ld, rows, cols, p.accumulate != 0);
  }

  // The weight gradients: short K, long fp32 epilogues (pipeline/pipeline.cuh, "GEMMs in turns").
  __device__ static bool in_turns(const pipe::Job& job) {
    return job.kind == kBwdWgradDown || job.kind == kBwdWgradGateUp || job.kind == kBwdSharedWgradDown ||
           job.kind == kBwdSharedWgradGateUp;
  }
  __device__ bool run(const pipe::Job& job, const pipe::Shared& s, wg::PipeState& ps, float (&acc)[pipe::kAccRegs],
                      int consumer, const MbarWaitCtx& w, const pipe::Turns& turns) const {
    const MoEDims& d = p.dims;
    const pipe::Frag f = pipe::Frag::of(consumer);
    switch (job.kind) {
      case kBwdPush:
        tasks.push(job.a);
        return true;
      case kBwdDispatch: {
        if (job.gemm != pipe::kLoadRows) {
          tasks.dispatch_body(job.a, job.b);
          return true;
        }
        const bool ok = rows::copy_block(s, ps, p.sched, d, job.a, p.topk_weights,
                                         p.dy_routed + (size_t)job.a * kBlockM * d.hidden, w);
        if (!ok) return false;
        signal_counters(p.cnt.block_dy_ready + job.a, p.cnt.expert_dy_ready + job.b);
        return true;
      }
      case kBwdDWeights: {
        if (job.gemm != pipe::kLoadRows) {
          tasks.d_weights(job.a);
          return true;
        }
        return rows::drain_route_stages(s, ps, rows::RoutePieces::of(d.hidden, d.top_k), d.hidden, d.top_k,
                                        job.a * kBlockM, tasks.token_rows(job.a), p.d_topk_weights, w);
      }
      case kBwdCombine:
        tasks.combine_body(job.a);
        return true;
      case kBwdSharedDA: {
        if (!pipe::gemm<wg::kKMajor, wg::kMNMajor>(s, ps, acc, job.k_tiles, consumer, w)) return false;
        const int t0 = job.a * kBlockM, i0 = job.b * pipe::kBN;
        const size_t off = (size_t)t0 * 2 * d.shared_inter;
        swiglu_bwd_epilogue_regs(acc, f, min_int(kBlockM, d.tokens - t0), min_int(pipe::kBN, d.shared_inter - i0),
                                 p.ctx.sgu + off, p.dsgu + off, d.shared_inter, i0, make_swiglu(d));
        signal_counters(p.cnt.token_dsgu_ready + job.a, p.cnt.dsgu_done);
        return true;
      }
      case kBwdRoutedDA: {
        if (!pipe::gemm<wg::kKMajor, wg::kMNMajor>(s, ps, acc, job.k_tiles, consumer, w, job.e)) return false;
        const int i0 = job.b * pipe::kBN;
        const size_t off = (size_t)job.a * kBlockM * 2 * d.inter;
        swiglu_bwd_epilogue_regs(acc, f, kBlockM, min_int(pipe::kBN, d.inter - i0), p.ctx.gu + off, p.dgu + off,
                                 d.inter, i0, make_swiglu(d));
        signal_counters(p.cnt.block_dgu_ready + job.a, p.cnt.expert_dgu_ready + job.c);
        return true;
      }
      case kBwdSharedDX: {
        if (!pipe::gemm<wg::kKMajor, wg::kMNMajor>(s, ps, acc, job.k_tiles, consumer, w)) return false;
        const int t0 = job.a * kBlockM, h0 = job.b * pipe::kBN;
        pipe::store_f32<false>(acc, f, p.dx_shared + (size_t)t0 * d.hidden + h0, d.hidden, min_int(kBlockM, d.tokens - t0),
                      min_int(pipe::kBN, d.hidden - h0), false);
        signal_counter(p.cnt.token_dxs_ready + job.a);
        return true;
      }
      case kBwdRoutedDX: {
        if (!pipe::gemm<wg::kKMajor, wg::kMNMajor>(s, ps, acc, job.k_tiles, consumer, w, job.e)) return false;
        store_routed_tile(acc, f, p.sched, p.peers, d, p.err, job.a * kBlockM, job.b * pipe::kBN, p.dx_slot,
                          p.cnt.dx_done);
        return true;
      }
      case kBwdWgradDown: {
        if (!pipe::gemm_in_turns<wg::kMNMajor, wg::kMNMajor>(s, ps, acc, job.k_tiles, consumer, w, turns)) return false;
        const int e = job.a, h0 = job.b * kBlockM, i0 = job.c * pipe::kBN;
        store_wgrad(acc, f, p.grads.dw_down, ((size_t)e * d.hidden + h0) * d.inter + i0, d.inter,
                    min_int(kBlockM, d.hidden - h0), min_int(pipe::kBN, d.inter - i0));
        return true;
      }
      case kBwdWgradGateUp: {
        if (!pipe::gemm_in_turns<wg::kMNMajor, wg::kMNMajor>(s, ps, acc, job.k_tiles, consumer, w, turns)) return false;
        const int e = job.a, i0 = job.c * kBlockM, h0 = job.d * pipe::kBN;
        store_wgrad(acc, f, job.b ? p.grads.dw_up : p.grads.dw_gate, ((size_t)e * d.inter + i0) * d.hidden + h0,
                    d.hidden, min_int(kBlockM, d.inter - i0), min_int(pipe::kBN, d.hidden - h0));
        return true;
      }
      case kBwdSharedWgradDown: {
        if (!pipe::gemm_in_turns<wg::kMNMajor, wg::kMNMajor>(s, ps, acc, job.k_tiles, consumer, w, turns)) return false;
        const int h0 = job.b * kBlockM, i0 = job.c * pipe::kBN;
        store_wgrad(acc, f, p.grads.d_shared_down, (size_t)h0 * d.shared_inter + i0, d.shared_inter,
                    min_int(kBlockM, d.hidden - h0), min_int(pipe::kBN, d.shared_inter - i0));
        return true;
      }
      case kBwdSharedWgradGateUp: {
        if (!pipe::gemm_in_turns<wg::kMNMajor, wg::kMNMajor>(s, ps, acc, job.k_tiles, consumer, w, turns)) return false;
        const int i0 = job.c * kBlockM, h0 = job.d * pipe::kBN;
        store_wgrad(acc, f, job.b ? p.grads.d_shared_up : p.grads.d_shared_gate, (size_t)i0 * d.hidden + h0, d.hidden,
                    min_int(kBlockM, d.shared_inter - i0), min_int(pipe::kBN, d.hidden - h0));
        return true;
      }
      default:
        return false;
    }
  }
};

}  // namespace mok
