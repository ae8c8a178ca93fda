// The forward's task set (TmaForward): the producer decodes each plan task (phases in
// forward_bodies.cuh, plan in params.cuh), does its waits and streams its operands; the workers
// run the GEMMs on the pipeline (pipeline/pipeline.cuh) with epilogues straight from registers.
// Tiles are 128 x 256:
//   F1/F2 gate|up: 128 intermediate columns (B = 128 gate rows | 128 up rows, two TMA boxes);
//   F3/F4 down:    256 hidden columns.
// The one-GPU dispatch streams its rows through the ring (pipeline/staged_rows.cuh).  The other
// non-GEMM tasks (push, EP dispatch, combine) run the bodies of forward_bodies.cuh on the 256
// workers after the producer did their waits; the notify tasks run entirely on the producer.
#pragma once
#include "moe/tasks/forward_bodies.cuh"
#include "moe/params_tma.cuh"
#include "moe/pipeline/staged_rows.cuh"
#include "moe/pipeline/epilogue.cuh"

namespace mok {

constexpr int kTmaGateUpCols = pipe::kBN / 2;  // 128

enum ForwardJob : int {
  kFwdStop = 0,
  kFwdPush,        // a = push task
  kFwdDispatch,    // a = row block
  kFwdSharedGU,    // a = token block, b = gate|up tile
  kFwdRoutedGU,    // a = row block, b = gate|up tile, c = expert, e = upper half idle
  kFwdSharedDown,  // a = token block, b = hidden tile
  kFwdRoutedDown,  // a = row block, b = hidden tile, c = expert, e = upper half idle
  kFwdCombine,     // a = combine task (a part of a token block)
};

// SwiGLU epilogue of a 128 x 256 gate|up tile from registers: column c < 128 is gate and 128 + c
// up for intermediate column col0 + c, i.e. registers 4j.. and 4(j + 16).. of the same thread.
// Writes gu (bf16, ld 2*inter: gate | up) and act (bf16, ld inter) for rows < rows, columns
// col0 + c < inter; SwiGLU (forward_bodies.cuh).  Values are computed in
// the accumulator layout and quad-transposed (pipe::quad_transpose) for 16-byte stores.
__device__ __forceinline__ void swiglu_epilogue_regs(const float (&acc)[pipe::kAccRegs], const pipe::Frag& f, int rows,
                                                     bf16* gu, bf16* act, int inter, int col0, const SwiGLU& sw) {
  constexpr int kHalf = pipe::kAccRegs / 8;  // 16 register quads (8-column chunks) per half
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = f.row0 + 8 * h;
    bf16* gu_row = gu + (size_t)r * 2 * inter;
    bf16* act_row = act + (size_t)r * inter;
#pragma unroll
    for (int q = 0; q < kHalf / 4; ++q) {
      if (col0 + 32 * q >= inter) break;  // warp-uniform (see pipeline/epilogue.cuh)
      uint32_t gw[4], uw[4], aw[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int j = 4 * q + k;
        float g0 = acc[4 * j + 2 * h], g1 = acc[4 * j + 2 * h + 1];
        float u0 = acc[4 * (j + kHalf) + 2 * h], u1 = acc[4 * (j + kHalf) + 2 * h + 1];
        aw[k] = pack_bf16x2(sw.act(g0, u0), sw.act(g1, u1));
        if (sw.limited) {
          g0 = bf16_keep_clamp_side(g0, sw.limit, false);
          g1 = bf16_keep_clamp_side(g1, sw.limit, false);
          u0 = bf16_keep_clamp_side(u0, sw.limit, true);
          u1 = bf16_keep_clamp_side(u1, sw.limit, true);
        }
        gw[k] = pack_bf16x2(g0, g1);
        uw[k] = pack_bf16x2(u0, u1);
      }
      pipe::quad_transpose(gw);
      pipe::quad_transpose(uw);
      pipe::quad_transpose(aw);
      if (r >= rows) continue;
      const int c = col0 + f.chunk_col(q);
      *reinterpret_cast<uint4*>(gu_row + c) = make_uint4(gw[0], gw[1], gw[2], gw[3]);
      *reinterpret_cast<uint4*>(gu_row + inter + c) = make_uint4(uw[0], uw[1], uw[2], uw[3]);
      *reinterpret_cast<uint4*>(act_row + c) = make_uint4(aw[0], aw[1], aw[2], aw[3]);
    }
  }
}

// A routed row block's output tile (F4 down, B5 dX: hidden columns h0 ...) to the rows of its
// routes: with EP straight into the source rank's slot rows (system-scope signal), else into
// `local` ([T*k, H], one row per route); then `done` += 1.
__device__ __forceinline__ void store_routed_tile(const float (&acc)[pipe::kAccRegs], const pipe::Frag& f,
                                                  const MoESchedule& sc, const MoEPeers& pe, const MoEDims& d,
                                                  int* err, int row0, int h0, bf16* local, int* done) {
  const int cols = min_int(pipe::kBN, d.hidden - h0);
  if (ep::enabled(pe)) {
    pipe::store_rows_bf16(acc, f, kBlockM, cols, [&](int r) { return ep::return_row_ptr(sc, pe, d, row0 + r, h0, err); });
    ep::signal_counter_sys(done);
  } else {
    pipe::store_rows_bf16(acc, f, kBlockM, cols, [&](int r) { return route_row_ptr(sc, d, local, row0 + r, h0); });
    signal_counter(done);
  }
}

struct TmaForward {
  const MoEForwardMaps& maps;
  const MoEForwardParams& p;
  const MoEForwardPlan& plan;
  const ForwardTasks& tasks;  // the non-GEMM bodies
  const pipe::ScheduledOrder& order;
  int num_blocks;

  __device__ static pipe::ScheduledOrder make_order(const MoEForwardPlan& f, const MoEForwardParams& p,
                                                    int num_blocks) {
    // EP: the blocks in the schedule's order (block_expert's second half; pipe::ScheduledOrder).
    const int* block_order = f.push.count > 0 ? p.sched.block_expert + p.dims.max_blocks : nullptr;
    return pipe::ScheduledOrder::make(f.shared_gu, f.dispatch, f.routed_gu, PhaseRange{f.dispatch.begin, 0},
                                      f.gu_tiles, f.routed_down, f.h_tiles, p.sched, p.dims.local_experts, num_blocks,
                                      block_order);
  }

  // Local waits (task counters) and peer waits (ep::wait_all_thread): see ep::local_timeout_ns.
  __device__ WaitCtx wait_ctx() const { return ep::local_wait_ctx(p); }
  __device__ WaitCtx peer_wait_ctx() const { return ep::peer_wait_ctx(p); }
  __device__ bool ep_on() const { return ep::enabled(p.peers); }
  __device__ int plan_task(int grabbed) const { return order.map(grabbed); }
  __device__ unsigned long long* trace() const { return p.trace; }

  // ---- producer -----------------------------------------------------------------------------------
  __device__ int prepare(int grabbed, pipe::Job& job, pipe::LoadSrc& a, pipe::LoadSrc& b) const {
    const int task = order.map(grabbed);
    const MoEForwardMaps& m = pipe::late(maps);
    const MoEDims& d = p.dims;
    const WaitCtx w = wait_ctx();
    job = pipe::Job{};
    if (plan.push.has(task)) {
      job.kind = kFwdPush;
      job.a = plan.push.local(task);
      return 1;
    }
    if (plan.push_notify.has(task)) {
      if (!wait_counter_thread(p.cnt.push_done, plan.wait_push_done, w, task)) return -1;
      ep::notify_all(p.peers, kFlagFwdRows);
      return 0;
    }
    if (plan.dispatch.has(task)) {
      const int blk = plan.dispatch.local(task);
      if (blk >= num_blocks) return 0;
      // EP: only the readiness chunks that hold this block's rows (ep.cuh), not every source's whole push.
      if (ep_on() && !ep::wait_block_rows_thread(p.sched, d, p.peers, blk, kFlagFwdRows, peer_wait_ctx(),
                                                 ep::kStageFwdRows))
        return -1;
      job.kind = kFwdDispatch;
      job.a = blk;
      rows::use_ring(job, ep_on() ? 0 : rows::Stages::of(d.hidden).count);
      return 1;
    }
    if (plan.shared_gu.has(task)) {
      const int q = plan.shared_gu.local(task), tb = q / plan.sgu_tiles, n = q % plan.sgu_tiles;
      job = pipe::Job{kFwdSharedGU, pipe::kLoadGemm, d.hidden / wg::kBK, tb, n};
      a = pipe::kmajor(&m.x_k, tb * kBlockM);
      b = pipe::kmajor(&m.shared_gate_k, n * kTmaGateUpCols, 0, &m.shared_up_k);
      return 1;
    }
    if (plan.routed_gu.has(task)) {
      const int q = plan.routed_gu.local(task), blk = q / plan.gu_tiles, n = q % plan.gu_tiles;
      if (blk >= num_blocks) return 0;
      const int e = p.sched.block_expert[blk];
      if (!valid_expert(e, blk, d, p.err)) return -1;
      const int idle = pipe::upper_half_idle(p.sched, blk, e);  // loads issued before the acquire
      if (!wait_counter_thread(p.cnt.block_ready + blk, plan.wait_block_ready, w, task)) return -1;
      job = pipe::Job{kFwdRoutedGU, pipe::kLoadGemm, d.hidden / wg::kBK, blk, n, e, 0, idle};
      a = pipe::kmajor(&m.x_routed_k, blk * kBlockM);
      b = pipe::kmajor(&m.w_gate_k, n * kTmaGateUpCols, e, &m.w_up_k);
      return 1;
    }
    if (plan.shared_down.has(task)) {
      const int q = plan.shared_down.local(task), tb = q / plan.h_tiles, h = q % plan.h_tiles;
      if (!wait_counter_thread(p.cnt.token_sact_ready + tb, plan.wait_token_sact_ready, w, task)) return -1;
      job = pipe::Job{kFwdSharedDown, pipe::kLoadGemm, d.shared_inter / wg::kBK, tb, h};
      a = pipe::kmajor(&m.sact_k, tb * kBlockM);
      b = pipe::kmajor(&m.shared_down_k, h * pipe::kBN);
      return 1;
    }
    if (plan.routed_down.has(task)) {
      const int q = plan.routed_down.local(task), blk = q / plan.h_tiles, h = q % plan.h_tiles;
      if (blk >= num_blocks) return 0;
      const int e = p.sched.block_expert[blk];
      if (!valid_expert(e, blk, d, p.err)) return -1;
      const int idle = pipe::upper_half_idle(p.sched, blk, e);
      if (!wait_counter_thread(p.cnt.block_act_ready + blk, plan.wait_block_act_ready, w, task)) return -1;
      job = pipe::Job{kFwdRoutedDown, pipe::kLoadGemm, d.inter / wg::kBK, blk, h, e, 0, idle};
      a = pipe::kmajor(&m.act_k, blk * kBlockM);
      b = pipe::kmajor(&m.w_down_k, h * pipe::kBN, e);
      return 1;
    }
    if (plan.down_notify.has(task)) {
      if (!wait_counter_thread(p.cnt.down_done, num_blocks * plan.wait_down_done_per_block, w, task)) return -1;
      ep::notify_all(p.peers, kFlagFwdReturn);
      return 0;
    }
    if (plan.combine.has(task)) {
      const int q = plan.combine.local(task), tb = q / plan.combine_parts;
      if (ep_on()) {
        if (!ep::wait_all_thread(p.peers, kFlagFwdReturn, kFlagFwdRows, peer_wait_ctx(), ep::kStageFwdReturn)) return -1;
      } else if (!wait_counter_thread(p.cnt.down_done, num_blocks * plan.wait_down_done_per_block, w, task)) {
        return -1;
      }
      const bool shared = d.shared_inter > 0 && p.context_only == 0;
      if (shared && !wait_counter_thread(p.cnt.token_shared_done + tb, plan.wait_token_shared_done, w, task)) return -1;
      job.kind = kFwdCombine;
      job.a = q;
      return 1;
    }
    return 0;
  }

  // Dispatch through the ring (one GPU; staged_rows.cuh).
  __device__ uint32_t stage_rows(const pipe::Job& job, int stage, uint32_t dst, uint32_t bar) const {
    return rows::issue_stage(p.sched, p.dims, p.x, p.err, job.a, stage, rows::Stages::of(p.dims.hidden), dst, bar);
  }

  // ---- workers -------------------------------------------------------------------------------------
  __device__ static bool in_turns(const pipe::Job&) { return false; }
  __device__ bool run(const pipe::Job& job, const pipe::Shared& s, wg::PipeState& ps, float (&acc)[pipe::kAccRegs],
                      int consumer, const MbarWaitCtx& w, const pipe::Turns&) const {
    const MoEDims& d = p.dims;
    const pipe::Frag f = pipe::Frag::of(consumer);
    switch (job.kind) {
      case kFwdPush:
        tasks.push(job.a);
        return true;
      case kFwdDispatch: {
        if (job.gemm != pipe::kLoadRows) {
          tasks.dispatch_body(job.a);
          return true;
        }
        const bool ok = rows::copy_block(s, ps, p.sched, d, job.a, nullptr,
                                         p.ctx.x_routed + (size_t)job.a * kBlockM * d.hidden, w);
        if (!ok) return false;
        signal_counter(p.cnt.block_ready + job.a);
        return true;
      }
      case kFwdCombine:
        tasks.combine_body(job.a);
        return true;
      case kFwdSharedGU: {
        if (!pipe::gemm<wg::kKMajor, wg::kKMajor>(s, ps, acc, job.k_tiles, consumer, w)) return false;
        const int t0 = job.a * kBlockM;
        swiglu_epilogue_regs(acc, f, min_int(kBlockM, d.tokens - t0), p.ctx.sgu + (size_t)t0 * 2 * d.shared_inter,
                             p.ctx.sact + (size_t)t0 * d.shared_inter, d.shared_inter, job.b * kTmaGateUpCols,
                             make_swiglu(d));
        signal_counter(p.cnt.token_sact_ready + job.a);
        return true;
      }
      case kFwdRoutedGU: {
        if (!pipe::gemm<wg::kKMajor, wg::kKMajor>(s, ps, acc, job.k_tiles, consumer, w, job.e)) return false;
        const size_t row0 = (size_t)job.a * kBlockM;
        swiglu_epilogue_regs(acc, f, kBlockM, p.ctx.gu + row0 * 2 * d.inter, p.ctx.act + row0 * d.inter, d.inter,
                             job.b * kTmaGateUpCols, make_swiglu(d));
        signal_counter(p.cnt.block_act_ready + job.a);
        return true;
      }
      case kFwdSharedDown: {
        if (!pipe::gemm<wg::kKMajor, wg::kKMajor>(s, ps, acc, job.k_tiles, consumer, w)) return false;
        const int t0 = job.a * kBlockM, h0 = job.b * pipe::kBN;
        pipe::store_f32<false>(acc, f, p.shared_y + (size_t)t0 * d.hidden + h0, d.hidden, min_int(kBlockM, d.tokens - t0),
                      min_int(pipe::kBN, d.hidden - h0), false);
        signal_counter(p.cnt.token_shared_done + job.a);
        return true;
      }
      case kFwdRoutedDown: {
        if (!pipe::gemm<wg::kKMajor, wg::kKMajor>(s, ps, acc, job.k_tiles, consumer, w, job.e)) return false;
        store_routed_tile(acc, f, p.sched, p.peers, d, p.err, job.a * kBlockM, job.b * pipe::kBN, p.ctx.y_slot,
                          p.cnt.down_done);
        return true;
      }
      default:
        return false;
    }
  }
};

}  // namespace mok
