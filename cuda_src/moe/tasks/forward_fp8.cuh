// The "fp8_block" forward's task set (TmaForwardFp8; docs/FP8_DESIGN.md, docs/SEMANTICS.md §10),
// one GPU: the bf16 forward's phases (tasks/forward.cuh) with FP8 operands.
//   Fq quant_x       token block:              xq = Q(x) in token order (only with a shared expert)
//   F0 dispatch      row block b:              xrq[b] = Q(x[route's token]) (zeros for padding)
//   F1 shared g|u    token block x I_s/128:    [xq | Wq_shared_gate; Wq_shared_up] -> sgu, saq = Q(swiglu)
//   F2 routed g|u    row block x I/128:        [xrq | Wq_gate[e]; Wq_up[e]] -> gu, aq = Q(swiglu)
//   F3 shared down   token block x H/256:      saq * Wq_shared_down^T -> shared_y (fp32)
//   F4 routed down   row block x H/256:        aq * Wq_down[e]^T -> y_slot[route] (bf16, unweighted)
//   F5 combine       part of a token block:    out = shared_y + sum_j w[t,j] y_slot[t*k+j] (the bf16 body)
// Every GEMM is 128 x 256 tiles of 128-deep K blocks, two 128-wide sub-tiles on one A stage
// (pipeline/gemm_fp8.cuh).  A gate|up task covers one 128-column I block: sub-tile 0 = I columns
// i0 .. i0+63, sub-tile 1 = i0+64 .. i0+127, each B = 64 gate rows | 64 up rows; both sub-tiles'
// totals are in registers at the end, so the row's amax over the whole I block is taken from
// registers and aq is quantised in the epilogue.  A sub-tile wholly past N (I an odd multiple of
// 64; H not a multiple of 256) is neither loaded nor computed (Job d = 1); its a is zero, which the
// quantiser never takes as the max.
// Waits are the bf16 forward's, plus: F1 tile of token block tb waits for Fq of tb.
// With expert parallelism (tasks/ep_fp8.cuh) the order is the bf16 EP forward's:
//   Fp push          token block tb:           xq[tb] = Q(x) (as Fq), then its E4M3 rows and scales
//                                              to every route's destination (Fq is empty: Fp
//                                              signals token_xq_ready), Fp' notify "rows sent",
//   F1, F0 receive (wait for every source; routed region -> xrq / xrq_s), F2, F3,
//   F4 (bf16 rows return to their source's slot rows), F4' notify "outputs returned",
//   F5 (wait for every destination; the bf16 body reads the slot rows).
#pragma once
#include "common/fp8.cuh"
#include "moe/pipeline/signaler.cuh"
#include "moe/pipeline/task_order.cuh"
#include "moe/tasks/ep_fp8.cuh"
#include "moe/tasks/forward_fp8_bodies.cuh"

namespace mok {

enum Fp8ForwardJob : int {
  kF8Stop = 0,
  kF8QuantX,      // a = token block
  kF8Dispatch,    // a = row block
  kF8SharedGU,    // a = token block, b = I block, d = sub-tiles (1 or 2)
  kF8RoutedGU,    // a = row block, b = I block, c = expert, d = sub-tiles, e = upper half idle
  kF8SharedDown,  // a = token block, b = hidden tile (256 columns), d = sub-tiles
  kF8RoutedDown,  // a = row block, b = hidden tile, c = expert, d = sub-tiles, e = upper half idle
  kF8Combine,     // a = combine task
  kF8Push,        // a = push task = token block (EP)
};

// The kernel's plan in shared memory: the bf16 forward's struct (FP8 tile counts) + the FP8 extras.
struct Fp8Plans {
  MoEForwardPlan f;
  MoEFp8Plan x;
};

__device__ __forceinline__ int k_blocks(int k) { return (k + fp8g::kBK - 1) / fp8g::kBK; }

// kStaged: the gate|up tiles' g, u go through shared memory and the signaler's TMA stores
// (pipeline/staged_tile.cuh; the kernel moe_forward_fp8_staged, chosen by the host where K is long).
template <bool kStaged>
struct TmaForwardFp8 {
  const MoEFp8ForwardMaps& maps;
  const MoEFp8StagedMaps& staged_maps;  // read by the staged kernel only
  const MoEFp8ForwardParams& q;
  const Fp8Plans& plan;
  const ForwardTasks& tasks;  // the combine body
  const pipe::AheadOrder& order;
  int num_blocks;

  __device__ static pipe::AheadOrder make_order(const MoEForwardPlan& f, const MoEForwardParams& p, int num_blocks) {
    return pipe::AheadOrder::make(f.shared_gu, f.dispatch, f.routed_gu, PhaseRange{f.dispatch.begin, 0}, f.gu_tiles,
                                  f.routed_down, f.h_tiles, p.sched, p.dims.local_experts, num_blocks);
  }

  __device__ int plan_task(int grabbed) const { return order.map(grabbed); }
  __device__ unsigned long long* trace() const { return q.p.trace; }
  __device__ static bool in_turns(const pipe::Job&) { return false; }

  // ---- producer -----------------------------------------------------------------------------------
  __device__ int prepare(int grabbed, pipe::Job& job, pipe::LoadSrc&, pipe::LoadSrc&) const {
    const int task = order.map(grabbed);
    const MoEForwardParams& p = q.p;
    const MoEForwardPlan& f = plan.f;
    const MoEDims& d = p.dims;
    const WaitCtx w = ep::local_wait_ctx(p);  // local waits (ep::local_timeout_ns); peer waits: ep::peer_wait_ctx
    const bool ep_on = ep::enabled(p.peers);
    job = pipe::Job{};
    if (f.push.has(task)) {
      job.kind = kF8Push;
      job.a = f.push.local(task);
      return 1;
    }
    if (f.push_notify.has(task)) {
      if (!wait_counter_thread(p.cnt.push_done, f.wait_push_done, w, task)) return -1;
      ep::notify_all(p.peers, kFlagFwdRows);
      return 0;
    }
    if (plan.x.quant_x.has(task)) {
      job.kind = kF8QuantX;
      job.a = plan.x.quant_x.local(task);
      return 1;
    }
    if (f.dispatch.has(task)) {
      const int blk = f.dispatch.local(task);
      if (blk >= num_blocks) return 0;
      if (ep_on && !ep::wait_all_thread(p.peers, kFlagFwdRows, -1, ep::peer_wait_ctx(p), ep::kStageFwdRows)) return -1;
      job.kind = kF8Dispatch;
      job.a = blk;
      if (!ep_on) rows::use_ring(job, rows::Stages::of(d.hidden).count);  // quantize_block_ring
      return 1;
    }
    if (f.shared_gu.has(task)) {
      const int t = f.shared_gu.local(task), tb = t / f.sgu_tiles, n = t % f.sgu_tiles;
      if (!wait_counter_thread(q.token_xq_ready + tb, plan.x.wait_token_xq_ready, w, task)) return -1;
      const int subtiles = n * 128 + 64 < d.shared_inter ? 2 : 1;
      job = pipe::Job{kF8SharedGU, pipe::kLoadRows, k_blocks(d.hidden), tb, n, 0, subtiles, 0};
      prefetch_b_scales(job);
      return 1;
    }
    if (f.routed_gu.has(task)) {
      const int t = f.routed_gu.local(task), blk = t / f.gu_tiles, n = t % f.gu_tiles;
      if (blk >= num_blocks) return 0;
      const int e = p.sched.block_expert[blk];
      if (!valid_expert(e, blk, d, p.err)) return -1;
      const int idle = pipe::upper_half_idle(p.sched, blk, e);
      if (!wait_counter_thread(p.cnt.block_ready + blk, f.wait_block_ready, w, task)) return -1;
      const int subtiles = n * 128 + 64 < d.inter ? 2 : 1;
      job = pipe::Job{kF8RoutedGU, pipe::kLoadRows, k_blocks(d.hidden), blk, n, e, subtiles, idle};
      prefetch_b_scales(job);
      return 1;
    }
    if (f.shared_down.has(task)) {
      const int t = f.shared_down.local(task), tb = t / f.h_tiles, h = t % f.h_tiles;
      if (!wait_counter_thread(p.cnt.token_sact_ready + tb, f.wait_token_sact_ready, w, task)) return -1;
      job = pipe::Job{kF8SharedDown, pipe::kLoadRows, k_blocks(d.shared_inter), tb, h, 0, down_subtiles(h, d)};
      prefetch_b_scales(job);
      return 1;
    }
    if (f.routed_down.has(task)) {
      const int t = f.routed_down.local(task), blk = t / f.h_tiles, h = t % f.h_tiles;
      if (blk >= num_blocks) return 0;
      const int e = p.sched.block_expert[blk];
      if (!valid_expert(e, blk, d, p.err)) return -1;
      const int idle = pipe::upper_half_idle(p.sched, blk, e);
      if (!wait_counter_thread(p.cnt.block_act_ready + blk, f.wait_block_act_ready, w, task)) return -1;
      job = pipe::Job{kF8RoutedDown, pipe::kLoadRows, k_blocks(d.inter), blk, h, e, down_subtiles(h, d), idle};
      prefetch_b_scales(job);
      return 1;
    }
    if (f.down_notify.has(task)) {
      if (!wait_counter_thread(p.cnt.down_done, num_blocks * f.wait_down_done_per_block, w, task)) return -1;
      ep::notify_all(p.peers, kFlagFwdReturn);
      return 0;
    }
    if (f.combine.has(task)) {
      const int t = f.combine.local(task), tb = t / f.combine_parts;
      if (ep_on) {
        if (!ep::wait_all_thread(p.peers, kFlagFwdReturn, kFlagFwdRows, ep::peer_wait_ctx(p), ep::kStageFwdReturn))
          return -1;
      } else if (!wait_counter_thread(p.cnt.down_done, num_blocks * f.wait_down_done_per_block, w, task)) {
        return -1;
      }
      const bool shared = d.shared_inter > 0 && p.context_only == 0;
      if (shared && !wait_counter_thread(p.cnt.token_shared_done + tb, f.wait_token_shared_done, w, task)) return -1;
      job.kind = kF8Combine;
      job.a = t;
      return 1;
    }
    return 0;
  }

  // Sub-tiles of down tile h: the second one only where it starts inside H.
  __device__ static int down_subtiles(int h, const MoEDims& d) {
    return h * fp8g::kTileN + fp8g::kBN < d.hidden ? 2 : 1;
  }

  // The B scales of a GEMM Job (weights' [e, N block, K block] arrays): gate|up, the gate and up
  // rows of (expert, I block); down, the rows of (expert, hidden blocks 2b and 2b + 1).
  __device__ fp8g::BScales b_scales(const pipe::Job& job) const {
    const MoEDims& d = q.p.dims;
    switch (job.kind) {
      case kF8SharedGU:
      case kF8RoutedGU: {
        const bool shared = job.kind == kF8SharedGU;
        const int kbs = k_blocks(d.hidden);
        const size_t at = ((size_t)job.c * k_blocks(shared ? d.shared_inter : d.inter) + job.b) * kbs;
        return fp8g::BScales{(shared ? q.wq.shared_gate_s : q.wq.gate_s) + at, (shared ? q.wq.shared_up_s : q.wq.up_s) + at,
                             0};
      }
      default: {
        const bool shared = job.kind == kF8SharedDown;
        const int kbs = k_blocks(shared ? d.shared_inter : d.inter);
        const float* lo = (shared ? q.wq.shared_down_s : q.wq.down_s) +
                          ((size_t)job.c * k_blocks(d.hidden) + (size_t)job.b * fp8g::kSubTiles) * kbs;
        return fp8g::BScales{lo, lo, job.d > 1 ? kbs : 0};
      }
    }
  }

  // Producer: pulls the first 128-byte line of each B-scale row of a GEMM Job into this SM's L1,
  // where the workers read them with __ldg (else each task's first K block waits for an L2 round
  // trip after its MMAs; the line covers 32 K blocks).
  __device__ void prefetch_b_scales(const pipe::Job& job) const {
    const fp8g::BScales sb = b_scales(job);
    fp8g::prefetch_l1(sb.lo);
    fp8g::prefetch_l1(sb.hi + sb.step);
  }

  // One stage (K block) of a GEMM Job: its A, B (per sub-tile one box or two halves) and A-scale
  // loads (pipeline/gemm_fp8.cuh).
  __device__ uint32_t stage_rows(const pipe::Job& job, int stage, uint32_t dst, uint32_t bar) const {
    const MoEFp8ForwardMaps& m = pipe::late(maps);
    const int row0 = job.a * kBlockM;
    switch (job.kind) {
      case kF8Dispatch:  // the block's source rows, whole (quantize_block_ring)
        return rows::issue_stage(q.p.sched, q.p.dims, q.p.x, q.p.err, job.a, stage, rows::Stages::of(q.p.dims.hidden),
                                 dst, bar);
      case kF8SharedGU:
        return fp8g::load_stage(dst, bar, &m.xq_k, &m.xq_s, row0, stage, &m.shared_gate_k, &m.shared_up_k,
                                job.b * 128, 0, job.d);
      case kF8RoutedGU:
        return fp8g::load_stage(dst, bar, &m.xrq_k, &m.xrq_s, row0, stage, &m.gate_k, &m.up_k, job.b * 128, job.c,
                                job.d);
      case kF8SharedDown:
        return fp8g::load_stage(dst, bar, &m.saq_k, &m.saq_s, row0, stage, &m.shared_down_k, nullptr,
                                job.b * fp8g::kTileN, 0, job.d);
      default:  // kF8RoutedDown
        return fp8g::load_stage(dst, bar, &m.aq_k, &m.aq_s, row0, stage, &m.down_k, nullptr, job.b * fp8g::kTileN,
                                job.c, job.d);
    }
  }

  // ---- workers -------------------------------------------------------------------------------------
  // The gate|up task's output pointers, rebuilt after the mainloop (kept live across it they would
  // compete with the 192 accumulators).
  struct GateUpOut {
    bf16* gu;      // the tile's row 0 of gu / sgu
    int rows, inter;
  };
  __device__ __forceinline__ GateUpOut gate_up_out(const pipe::Job& job) const {
    const MoEDims& d = q.p.dims;
    const bool shared = job.kind == kF8SharedGU;
    const int inter = shared ? d.shared_inter : d.inter, row0 = job.a * kBlockM;
    return GateUpOut{(shared ? q.p.ctx.sgu : q.p.ctx.gu) + (size_t)row0 * 2 * inter,
                     shared ? min_int(kBlockM, d.tokens - row0) : kBlockM, inter};
  }

  // A gate|up task: both sub-tiles over one pass of K (t0, t1), then g, u, a and aq with its scales.
  // Staged, g and u go to the boxes and the signaler stores them to gu; aq is stored here either
  // way (the down GEMM's TMA reads it in this launch, and its release must not wait for gu's
  // stores, which only the backward reads).
  __device__ bool gate_up(const pipe::Job& job, const pipe::Shared& s, wg::PipeState& ps, int consumer,
                          const MbarWaitCtx& w) const {
    const MoEDims& d = q.p.dims;
    const bool shared = job.kind == kF8SharedGU;
    const int kbs = k_blocks(d.hidden);
    const fp8g::BScales sb = b_scales(job);
    const bool idle = job.e != 0 && consumer == 1, two = job.d > 1;
    float act[fp8g::kRegs];
    {
      float t0[fp8g::kRegs], t1[fp8g::kRegs];
#pragma unroll
      for (int i = 0; i < fp8g::kRegs; ++i) t0[i] = 0.f, t1[i] = 0.f;
      if (!fp8g::mainloop<true, kStaged>(s, ps, t0, t1, kbs, consumer, w, idle, two, sb)) return false;
      if constexpr (kStaged) {
        if (!pipe::Signals::of().begin_staged(w)) return false;
        const pipe::Frag f = pipe::Frag::of(consumer);
        const pipe::Staging st = pipe::Staging::of(s, pipe::held_slot(ps));
        fp8f::gate_up_subtile_staged<0>(t0, f, st, make_swiglu(d), act);
        if (two) {
          fp8f::gate_up_subtile_staged<1>(t1, f, st, make_swiglu(d), act);
        } else {
          fp8f::zero_upper_half(act);
        }
      } else {
        // (The statements in this order: the zeroing after the if, or the fragment before
        // gate_up_out, cost ptxas spills or extra instructions here.)
        const GateUpOut o = gate_up_out(job);
        const pipe::Frag f = pipe::Frag::of(consumer);
        fp8f::gate_up_subtile<0>(t0, f, o.rows, o.gu, o.inter, job.b * 128, make_swiglu(d), act);
        if (two) {
          fp8f::gate_up_subtile<1>(t1, f, o.rows, o.gu, o.inter, job.b * 128 + 64, make_swiglu(d), act);
        } else {
          fp8f::zero_upper_half(act);
        }
      }
    }
    const GateUpOut o = gate_up_out(job);
    const int row0 = job.a * kBlockM, i0 = job.b * 128;
    const pipe::Frag f = pipe::Frag::of(consumer);
    uint8_t* const aq = (shared ? q.qctx.saq : q.qctx.aq) + (size_t)row0 * o.inter;
    fp8f::store_act_quantized(act, f, o.rows, aq, shared ? q.qctx.saq_s : q.qctx.aq_s,
                              shared ? (size_t)q.plan8.token_ld : (size_t)d.max_rows, row0, o.inter, i0);
    int* const ready = (shared ? q.p.cnt.token_sact_ready : q.p.cnt.block_act_ready) + job.a;
    if constexpr (kStaged) {
      const MoEFp8StagedMaps& m = pipe::late(staged_maps);
      const pipe::StagedStore st{pipe::held_slot(ps), shared ? &m.sgu_st : &m.gu_st, i0, o.inter + i0, row0, job.d};
      pipe::post_staged(pipe::Signals::of(), ready, st, w);  // aq (TMA-read) is fenced with the boxes
    } else {
      pipe::signal_posted<true>(pipe::Signals::of(), ready, w);  // aq is the down GEMM's A (TMA): fenced against the async proxy
    }
    return true;
  }

  // A down task: 128 rows x 256 hidden columns (two sub-tiles, or one at the end of H).
  __device__ bool down(const pipe::Job& job, const pipe::Shared& s, wg::PipeState& ps, int consumer,
                       const MbarWaitCtx& w) const {
    const MoEForwardParams& p = q.p;
    const MoEDims& d = p.dims;
    const bool shared = job.kind == kF8SharedDown, two = job.d > 1;
    const int kbs = k_blocks(shared ? d.shared_inter : d.inter), h0 = job.b * fp8g::kTileN;
    float t0[fp8g::kRegs], t1[fp8g::kRegs];
#pragma unroll
    for (int i = 0; i < fp8g::kRegs; ++i) t0[i] = 0.f, t1[i] = 0.f;
    if (!fp8g::mainloop<false>(s, ps, t0, t1, kbs, consumer, w, job.e != 0 && consumer == 1, two, b_scales(job)))
      return false;
    const pipe::Frag f = pipe::Frag::of(consumer);
    const int row0 = job.a * kBlockM, cols0 = min_int(fp8g::kBN, d.hidden - h0);
    const int cols1 = two ? min_int(fp8g::kBN, d.hidden - h0 - fp8g::kBN) : 0;
    if (shared) {
      float* const y = p.shared_y + (size_t)row0 * d.hidden + h0;
      const int rows = min_int(kBlockM, d.tokens - row0);
      fp8g::store_f32(t0, f, y, d.hidden, rows, cols0);
      if (two) fp8g::store_f32(t1, f, y + fp8g::kBN, d.hidden, rows, cols1);
      pipe::signal_posted<false>(pipe::Signals::of(), p.cnt.token_shared_done + job.a, w);  // the combine's ld.cg reads
    } else {
      // With EP straight into the source rank's slot rows (ep::return_row_ptr), as the bf16 down.
      const bool ep_on = ep::enabled(p.peers);
      const auto row_ptr = [&](int r, int col0) {
        return ep_on ? ep::return_row_ptr(p.sched, p.peers, d, row0 + r, col0, p.err)
                     : route_row_ptr(p.sched, d, p.ctx.y_slot, row0 + r, col0);
      };
      fp8g::store_rows_bf16(t0, f, kBlockM, cols0, [&](int r) { return row_ptr(r, h0); });
      if (two) fp8g::store_rows_bf16(t1, f, kBlockM, cols1, [&](int r) { return row_ptr(r, h0 + fp8g::kBN); });
      if (ep_on) {
        ep::signal_counter_sys(p.cnt.down_done);
      } else {
        pipe::signal_posted<false>(pipe::Signals::of(), p.cnt.down_done, w);  // read by the combine's ld.cg only
      }
    }
    return true;
  }

  __device__ bool run(const pipe::Job& job, const pipe::Shared& s, wg::PipeState& ps, float (&)[pipe::kAccRegs],
                      int consumer, const MbarWaitCtx& w, const pipe::Turns&) const {
    switch (job.kind) {
      case kF8QuantX:
      case kF8Dispatch:
      case kF8Push:
        // With EP the dispatch receives rows quantised by their source's push (ep_fp8.cuh); on one
        // GPU it quantises the rows the producer streamed into the ring (quantize_block_ring).  The
        // register quantiser keeps one call site, quantize_x (it is inlined where called).
        if (job.kind == kF8Dispatch && ep::enabled(q.p.peers)) {
          ep8::receive_block(q, job.a);
          return true;
        }
        if (job.kind == kF8Dispatch && job.gemm == pipe::kLoadRows) {
          if (!fp8f::quantize_block_ring(s, ps, q.p.sched, q.p.dims, job.a, q.qctx.xrq, q.qctx.xrq_s,
                                         (size_t)q.p.dims.max_rows, w))
            return false;
          signal_counter(q.p.cnt.block_ready + job.a);
          return true;
        }
        fp8f::quantize_x(q, job.kind == kF8Dispatch, job.a);
        if (job.kind == kF8Push)
          ep8::push_quantized(
              q.p.sched, q.p.dims, q.p.peers, job.a, [&] { return q.qctx.xq; },
              [&](int kb, int t) { return q.qctx.xq_s + (size_t)kb * q.plan8.token_ld + t; }, nullptr,
              q.p.cnt.push_done, q.p.err);
        return true;
      case kF8Combine:
        tasks.combine_body(job.a);
        return true;
      case kF8SharedGU:
      case kF8RoutedGU:
        return gate_up(job, s, ps, consumer, w);
      case kF8SharedDown:
      case kF8RoutedDown:
        return down(job, s, ps, consumer, w);
      default:
        return false;
    }
  }
};

}  // namespace mok
