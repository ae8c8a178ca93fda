// The "fp8_block" forward's task set (TmaForwardFp8; docs/FP8_DESIGN.md, docs/SEMANTICS.md §10),
// one GPU: the bf16 forward's phases (tasks/forward.cuh) with FP8 operands.
//   Fq quant_x       token block:              xq = Q(x) in token order (only with a shared expert)
//   F0 dispatch      row block b:              xrq[b] = Q(x[route's token]) (zeros for padding)
//   F1 shared g|u    token block x I_s/128:    [xq | Wq_shared_gate; Wq_shared_up] -> sgu, saq = Q(swiglu)
//   F2 routed g|u    row block x I/128:        [xrq | Wq_gate[e]; Wq_up[e]] -> gu, aq = Q(swiglu)
//   F3 shared down   token block x H/128:      saq * Wq_shared_down^T -> shared_y (fp32)
//   F4 routed down   row block x H/128:        aq * Wq_down[e]^T -> y_slot[route] (bf16, unweighted)
//   F5 combine       part of a token block:    out = shared_y + sum_j w[t,j] y_slot[t*k+j] (the bf16 body)
// Every GEMM is 128 x 128 tiles of 128-deep K blocks (pipeline/gemm_fp8.cuh).  A gate|up task
// covers one 128-column I block in two sub-tiles (I columns i0 .. i0+63, then i0+64 .. i0+127;
// B = 64 gate rows | 64 up rows each): the first sub-tile's a stays in fp32 registers until the
// second is done, so the row's amax over the whole I block is taken from registers and aq is
// quantised in the epilogue (the design note's plan).  A sub-tile wholly past I (I an odd
// multiple of 64) is skipped and its a is zero, which the quantiser never takes as the max.
// Waits are the bf16 forward's, plus: F1 tile of token block tb waits for Fq of tb.
#pragma once
#include "moe/pipeline/task_order.cuh"
#include "moe/tasks/forward_fp8_bodies.cuh"

namespace mok {

enum Fp8ForwardJob : int {
  kF8Stop = 0,
  kF8QuantX,      // a = token block
  kF8Dispatch,    // a = row block
  kF8SharedGU,    // a = token block, b = I block, d = sub-tiles (1 or 2)
  kF8RoutedGU,    // a = row block, b = I block, c = expert, d = sub-tiles, e = upper half idle
  kF8SharedDown,  // a = token block, b = hidden tile (128 columns)
  kF8RoutedDown,  // a = row block, b = hidden tile, c = expert, e = upper half idle
  kF8Combine,     // a = combine task
};

// The kernel's plan in shared memory: the bf16 forward's struct (FP8 tile counts) + the FP8 extras.
struct Fp8Plans {
  MoEForwardPlan f;
  MoEFp8Plan x;
};

__device__ __forceinline__ int k_blocks(int k) { return (k + fp8g::kBK - 1) / fp8g::kBK; }

struct TmaForwardFp8 {
  const MoEFp8ForwardMaps& maps;
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
    const WaitCtx w{p.err, d.timeout_ns, d.rank};
    job = pipe::Job{};
    if (plan.x.quant_x.has(task)) {
      job.kind = kF8QuantX;
      job.a = plan.x.quant_x.local(task);
      return 1;
    }
    if (f.dispatch.has(task)) {
      const int blk = f.dispatch.local(task);
      if (blk >= num_blocks) return 0;
      job.kind = kF8Dispatch;
      job.a = blk;
      return 1;
    }
    if (f.shared_gu.has(task)) {
      const int t = f.shared_gu.local(task), tb = t / f.sgu_tiles, n = t % f.sgu_tiles;
      if (!wait_counter_thread(q.token_xq_ready + tb, plan.x.wait_token_xq_ready, w, task)) return -1;
      const int subtiles = n * 128 + 64 < d.shared_inter ? 2 : 1;
      job = pipe::Job{kF8SharedGU, pipe::kLoadRows, subtiles * k_blocks(d.hidden), tb, n, 0, subtiles, 0};
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
      job = pipe::Job{kF8RoutedGU, pipe::kLoadRows, subtiles * k_blocks(d.hidden), blk, n, e, subtiles, idle};
      return 1;
    }
    if (f.shared_down.has(task)) {
      const int t = f.shared_down.local(task), tb = t / f.h_tiles, h = t % f.h_tiles;
      if (!wait_counter_thread(p.cnt.token_sact_ready + tb, f.wait_token_sact_ready, w, task)) return -1;
      job = pipe::Job{kF8SharedDown, pipe::kLoadRows, k_blocks(d.shared_inter), tb, h};
      return 1;
    }
    if (f.routed_down.has(task)) {
      const int t = f.routed_down.local(task), blk = t / f.h_tiles, h = t % f.h_tiles;
      if (blk >= num_blocks) return 0;
      const int e = p.sched.block_expert[blk];
      if (!valid_expert(e, blk, d, p.err)) return -1;
      const int idle = pipe::upper_half_idle(p.sched, blk, e);
      if (!wait_counter_thread(p.cnt.block_act_ready + blk, f.wait_block_act_ready, w, task)) return -1;
      job = pipe::Job{kF8RoutedDown, pipe::kLoadRows, k_blocks(d.inter), blk, h, e, 0, idle};
      return 1;
    }
    if (f.combine.has(task)) {
      const int t = f.combine.local(task), tb = t / f.combine_parts;
      if (!wait_counter_thread(p.cnt.down_done, num_blocks * f.wait_down_done_per_block, w, task)) return -1;
      const bool shared = d.shared_inter > 0 && p.context_only == 0;
      if (shared && !wait_counter_thread(p.cnt.token_shared_done + tb, f.wait_token_shared_done, w, task)) return -1;
      job.kind = kF8Combine;
      job.a = t;
      return 1;
    }
    return 0;  // push, notify: empty without expert parallelism
  }

  // One stage of a GEMM Job: its A, B (one or two boxes) and A-scale loads (pipeline/gemm_fp8.cuh).
  __device__ uint32_t stage_rows(const pipe::Job& job, int stage, uint32_t dst, uint32_t bar) const {
    const MoEFp8ForwardMaps& m = pipe::late(maps);
    const int row0 = job.a * kBlockM;
    switch (job.kind) {
      case kF8SharedGU:
      case kF8RoutedGU: {
        const int kbs = k_blocks(q.p.dims.hidden), s = stage / kbs, kb = stage - s * kbs;
        const int n0 = job.b * 128 + 64 * s;
        return job.kind == kF8SharedGU
                   ? fp8g::load_stage(dst, bar, &m.xq_k, &m.xq_s, row0, kb, &m.shared_gate_k, &m.shared_up_k, n0, 0)
                   : fp8g::load_stage(dst, bar, &m.xrq_k, &m.xrq_s, row0, kb, &m.gate_k, &m.up_k, n0, job.c);
      }
      case kF8SharedDown:
        return fp8g::load_stage(dst, bar, &m.saq_k, &m.saq_s, row0, stage, &m.shared_down_k, nullptr, job.b * 128, 0);
      default:  // kF8RoutedDown
        return fp8g::load_stage(dst, bar, &m.aq_k, &m.aq_s, row0, stage, &m.down_k, nullptr, job.b * 128, job.c);
    }
  }

  // ---- workers -------------------------------------------------------------------------------------
  // A gate|up task: two sub-tiles (or one), a in registers, then aq and its scales.
  // The gate|up task's output pointers, rebuilt after each sub-tile's mainloop (kept live across
  // the second mainloop they made the workers spill: 64 + 64 + 32 accumulators are already there).
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

  // A gate|up task: two sub-tiles (or one), a in registers, then aq and its scales.
  __device__ bool gate_up(const pipe::Job& job, const pipe::Shared& s, wg::PipeState& ps, int consumer,
                          const MbarWaitCtx& w) const {
    const MoEDims& d = q.p.dims;
    const bool shared = job.kind == kF8SharedGU;
    const int kbs = k_blocks(d.hidden);
    const size_t scale0 = ((size_t)job.c * k_blocks(shared ? d.shared_inter : d.inter) + job.b) * kbs;  // [e, i block, 0]
    const fp8g::BScales sb{(shared ? q.wq.shared_gate_s : q.wq.gate_s) + scale0,
                           (shared ? q.wq.shared_up_s : q.wq.up_s) + scale0};
    const bool idle = job.e != 0 && consumer == 1;
    float act[fp8g::kRegs];
    {
      float t[fp8g::kRegs];
#pragma unroll
      for (int i = 0; i < fp8g::kRegs; ++i) t[i] = 0.f;
      if (!fp8g::mainloop(s, ps, t, kbs, consumer, w, idle, sb)) return false;
      const GateUpOut o = gate_up_out(job);
      fp8f::gate_up_subtile<0>(t, pipe::Frag::of(consumer), o.rows, o.gu, o.inter, job.b * 128, make_swiglu(d), act);
    }
    if (job.d > 1) {
      float t[fp8g::kRegs];
#pragma unroll
      for (int i = 0; i < fp8g::kRegs; ++i) t[i] = 0.f;
      if (!fp8g::mainloop(s, ps, t, kbs, consumer, w, idle, sb)) return false;
      const GateUpOut o = gate_up_out(job);
      fp8f::gate_up_subtile<1>(t, pipe::Frag::of(consumer), o.rows, o.gu, o.inter, job.b * 128 + 64, make_swiglu(d),
                               act);
    } else {
#pragma unroll
      for (int i = fp8g::kRegs / 2; i < fp8g::kRegs; ++i) act[i] = 0.f;
    }
    const GateUpOut o = gate_up_out(job);
    const int row0 = job.a * kBlockM, i0 = job.b * 128;
    const pipe::Frag f = pipe::Frag::of(consumer);
    if (shared) {
      fp8f::store_act_quantized(act, f, o.rows, q.qctx.saq + (size_t)row0 * o.inter, q.qctx.saq_s, q.plan8.token_ld,
                                row0, o.inter, i0);
      signal_counter(q.p.cnt.token_sact_ready + job.a);
    } else {
      fp8f::store_act_quantized(act, f, o.rows, q.qctx.aq + (size_t)row0 * o.inter, q.qctx.aq_s, d.max_rows, row0,
                                o.inter, i0);
      signal_counter(q.p.cnt.block_act_ready + job.a);
    }
    return true;
  }

  __device__ bool down(const pipe::Job& job, const pipe::Shared& s, wg::PipeState& ps, int consumer,
                       const MbarWaitCtx& w) const {
    const MoEForwardParams& p = q.p;
    const MoEDims& d = p.dims;
    const bool shared = job.kind == kF8SharedDown;
    const int kbs = k_blocks(shared ? d.shared_inter : d.inter), h0 = job.b * 128;
    const float* sb = (shared ? q.wq.shared_down_s : q.wq.down_s) + ((size_t)job.c * k_blocks(d.hidden) + job.b) * kbs;
    const pipe::Frag f = pipe::Frag::of(consumer);
    float t[fp8g::kRegs];
#pragma unroll
    for (int i = 0; i < fp8g::kRegs; ++i) t[i] = 0.f;
    if (!fp8g::mainloop(s, ps, t, kbs, consumer, w, job.e != 0 && consumer == 1, fp8g::BScales{sb, sb})) return false;
    const int row0 = job.a * kBlockM, cols = min_int(fp8g::kBN, d.hidden - h0);
    if (shared) {
      fp8g::store_f32(t, f, p.shared_y + (size_t)row0 * d.hidden + h0, d.hidden, min_int(kBlockM, d.tokens - row0), cols);
      signal_counter(p.cnt.token_shared_done + job.a);
    } else {
      fp8g::store_rows_bf16(t, f, kBlockM, cols,
                            [&](int r) { return route_row_ptr(p.sched, d, p.ctx.y_slot, row0 + r, h0); });
      signal_counter(p.cnt.down_done);
    }
    return true;
  }

  __device__ bool run(const pipe::Job& job, const pipe::Shared& s, wg::PipeState& ps, float (&)[pipe::kAccRegs],
                      int consumer, const MbarWaitCtx& w, const pipe::Turns&) const {
    switch (job.kind) {
      case kF8QuantX:
      case kF8Dispatch:
        fp8f::quantize_x(q, job.kind == kF8Dispatch, job.a);
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
