// The "fp8_block" backward's task set (TmaBackwardFp8; docs/FP8_BACKWARD.md): the bf16
// backward's phases and waits (tasks/backward.cuh) with FP8 operands.  Phases, in plan order (one
// GPU; mok_rt/kernels/moe_plan.py backward_plan(..., precision="fp8_block")):
//   P  token_prep    token block:            dq = Q(d_out) in token order + dq_bf = bf16(deq(dq)); then
//                                            xq_bf = bf16(deq(xq)), sact = bf16(deq(saq)) (wgrad operands)
//   B0 dispatch      row block:              dyq = Q(d_out[token]) + dy_routed = bf16(tw * deq(dyq))
//   B1 d_weights     token block:            d_topk_weights = <d_out, y_slot> (fp8b::d_weights)
//   B2 shared dA     token block x I_s/256:  dq * shared_down_t -> dSwiGLU(sgu) -> dsguq + dsgu
//   B3 routed dA     row block x I/256:      dyq * down_t[e], * tw -> dSwiGLU(gu) -> dguq + dgu
//   B4 shared dX     token block x H/256:    dsguq * [shared_gate_t | shared_up_t] -> dx_shared (fp32)
//   B5 routed dX     row block x H/256:      dguq * [gate_t[e] | up_t[e]] -> dx_slot[route] (bf16)
//   W  widen         row block:              x_routed = bf16(deq(xrq)), act = bf16(deq(aq)) (wgrad operands)
//   B6 wgrad down    expert x H/128 x I/256: dW_down[e] = dy_routed_e^T act_e            (bf16 GEMMs,
//   B7 wgrad gate|up expert x {g,u} x I/128 x H/256: dW_{gate,up}[e] = dgu_e^T x_routed_e  in turns,
//   B8 shared wgrad  H/128 x I_s/256, then {g,u} x I_s/128 x H/256: dq_bf^T sact, dsgu^T xq_bf; K = T)
//   B9 combine       part of a token block:  the bf16 body
// Waits beyond the bf16 backward's: shared dA on token_dq_ready[tb] (P), the routed wgrads also on
// expert_widen_ready[e] (W), the shared wgrads on prep_done (P).  Each waits only on earlier phases.
// The dA tile is 128 x 256 as two 128-wide sub-tiles = two I blocks, so each sub-tile's dG and dU
// rows are whole quantisation blocks, quantised from registers in the epilogue (fp8b::da_tile).
// With expert parallelism (tasks/ep_fp8.cuh) the order is the bf16 EP backward's:
//   Bp push          token block tb:  P's first half (dq, dq_bf of tb; token_dq_ready), the E4M3 rows,
//                                     scales and routing weights to every route's destination, then
//                                     P's second half (prep_done; P itself is empty);
//   Bp' notify, B1, B2, B0 receive (wait for every source;
//   routed region -> dyq, rs, dy_routed), B3 (tw from the region), B4, B5 (bf16 rows return to the
//   source's slot rows = dx_slot), B5' notify, W, B6-B8, B9 (wait for every destination).
#pragma once
#include "moe/pipeline/spread.cuh"
#include "moe/pipeline/task_order.cuh"
#include "moe/tasks/backward_fp8_bodies.cuh"
#include "moe/tasks/ep_fp8.cuh"

namespace mok {

enum Fp8BackwardJob : int {
  kB8Stop = 0,
  kB8TokenPrep,  // a = token block
  kB8Dispatch,   // a = row block, b = expert
  kB8SharedDA,   // a = token block, b = I tile (256), d = sub-tiles (1 or 2)
  kB8RoutedDA,   // a = row block, b = I tile, c = expert, d = sub-tiles, e = upper half idle
  kB8SharedDX,   // a = token block, b = hidden tile (256), d = sub-tiles
  kB8RoutedDX,   // a = row block, b = hidden tile, c = expert, d = sub-tiles, e = upper half idle
  kB8DWeights,   // a = token block
  kB8Widen,      // a = row block, b = expert
  // The bf16 wgrads (kLoadRows, see wgrad_stage): a = A's first M row (down: h; gate|up: (up) I + i),
  // b = B's first N row (down: i; gate|up: h), c / d = A's / B's first K row, e = expert (routed)
  kB8WgradDown,          // A = dy_mn, B = act_mn
  kB8WgradGateUp,        // A = dgu_mn, B = x_mn
  kB8SharedWgradDown,    // A = dy_mn, B = sact_mn
  kB8SharedWgradGateUp,  // A = dsgu_mn, B = x_mn
  kB8Combine,    // a = combine task
  kB8Push,       // a = push task = token block (EP)
};

// The kernel's plan in shared memory: the bf16 backward's struct (FP8 tile counts) + the FP8 extras.
struct Fp8BwdPlans {
  MoEBackwardPlan b;
  MoEFp8BackwardPlan x;
};

namespace fp8b {

__device__ __forceinline__ int k_blocks(int k) { return (k + fp8g::kBK - 1) / fp8g::kBK; }

// One stage of a backward FP8 GEMM (the forward's fp8g::load_stage, down form, with the row and
// K-block coordinates of A, its scales and B given apart): the routed rows of dq sit token_rows
// below their scales' columns (one A map for both row sets: the 4 KB parameter budget), and dX's
// A scales start H/128 K blocks into rs / ts.  Same slot layout and byte count as the forward's.
__device__ __forceinline__ uint32_t load_stage(uint32_t dst, uint32_t bar, const TensorMap* a, int a_row,
                                               const TensorMap* sa, int sa_row, int sa_kb, int kb, const TensorMap* b,
                                               int b_kb, int n0, int group, int subtiles) {
  tma_load_2d(dst, a, bar, kb * fp8g::kBK, a_row);
  tma_load_2d(fp8g::a_scales(fp8g::slot_of_full_barrier(bar)), sa, bar, sa_row, sa_kb);  // sa_row % 128 == 0
  dst += fp8g::kABytes;
  tma_load_3d(dst, b, bar, b_kb * fp8g::kBK, n0, group);
  if (subtiles > 1) tma_load_3d(dst + fp8g::kSubBBytes, b, bar, b_kb * fp8g::kBK, n0 + fp8g::kBN, group);
  return fp8g::kABytes + (subtiles > 1 ? 2 * fp8g::kSubBBytes : fp8g::kSubBBytes) + fp8g::kScaleBytes;
}

// dX's B scales (fp8g::mainloop's SB): K blocks [0, left) from the gate weights' scale rows (lo),
// then the up weights' (hi; mainloop<false> never reads hi itself): dX's K is [dG | dU], 2 Ip, with
// B = gate_t, then up_t.  Sub-tile 1's row is `step` further (the next hidden block) in both.
struct BScalesKSwitch {
  const float* lo;
  const float* hi;
  int step;
  int left;
  __device__ __forceinline__ void advance() {
    ++lo;
    if (--left == 0) lo = hi;
  }
};

}  // namespace fp8b

struct TmaBackwardFp8 {
  const MoEFp8BackwardMaps& maps;
  const MoEFp8BackwardParams& q;
  const Fp8BwdPlans& plan;
  const BackwardTasks& tasks;  // the bf16 bodies and helpers (combine_body, expert_rows)
  const pipe::AheadOrder& order;
  int num_blocks;

  // The bf16 backward's one-GPU order.  The permuted range is [dispatch, d_weights, shared_da,
  // routed_da] (contiguous in the FP8 plan too); token_prep lies before it (grabbed first, as the
  // forward's quant_x) and widen after routed_dx, both in plan order.
  // With EP the bf16 backward's EP order (d_weights and shared dA in front, covering the rows' travel).
  __device__ static pipe::AheadOrder make_order(const MoEBackwardPlan& f, const MoEBackwardParams& p, int num_blocks) {
    if (f.push_notify.count > 0)
      return pipe::AheadOrder::make(PhaseRange{f.d_weights.begin, f.d_weights.count + f.shared_da.count}, f.dispatch,
                                    f.routed_da, PhaseRange{f.dispatch.begin, 0}, f.i_tiles, f.routed_dx, f.h_tiles,
                                    p.sched, p.dims.local_experts, num_blocks);
    return pipe::AheadOrder::make(f.shared_da, f.dispatch, f.routed_da, f.d_weights, f.i_tiles, f.routed_dx, f.h_tiles,
                                  p.sched, p.dims.local_experts, num_blocks);
  }

  // One GPU: widen spread through the dX tiles, a widen task after every h_tiles of them (it
  // reads only the forward's context and waits on nothing; after the dX phase its 544 tasks kept
  // every SM on HBM-bound copies for ~0.9 ms at the slice), and the combine through the first half
  // of the wgrad tiles (it waits on dX; as the last phase it left SMs idle ~0.4 ms at the end):
  // pipeline/spread.cuh.  With EP plan order: dx_notify lies between dX and widen, and the
  // combine waits on the peers' returns.
  __device__ int plan_task(int grabbed) const {
    const MoEBackwardPlan& f = plan.b;
    if (f.push_notify.count > 0) return order.map(grabbed);
    const pipe::Spread widen = pipe::Spread::of(f.routed_dx.begin, plan.x.widen.begin, plan.x.widen.count, f.h_tiles);
    const pipe::Spread combine = pipe::Spread::early(f.wgrad_down.begin, f.combine.begin, f.combine.count);
    return order.map(widen.map(combine.map(grabbed)));
  }
  __device__ unsigned long long* trace() const { return q.p.trace; }
  // The wait contexts.  The ratio of ep::local_timeout_ns is kept the other way round: with EP the
  // host passes dims.timeout_ns = kLocalTimeoutFactor x the peer deadline (kernels/moe_fp8_bwd.py),
  // local waits use it as it is and peer waits divide.  Why: a deadline read straight from the
  // parameter struct takes no register, and one computed in the task decoder (ep::local_wait_ctx)
  // cost the 40-register producer a spill.
  __device__ WaitCtx wait_ctx() const { return WaitCtx{q.p.err, q.p.dims.timeout_ns, q.p.dims.rank}; }
  __device__ static long long peer_timeout_ns(const MoEBackwardParams& p) {
    return ep::enabled(p.peers) ? p.dims.timeout_ns / ep::kLocalTimeoutFactor : p.dims.timeout_ns;
  }
  __device__ static WaitCtx peer_wait_ctx(const MoEBackwardParams& p) {
    return WaitCtx{p.err, peer_timeout_ns(p), p.dims.rank};
  }
  // The wgrads run in turns, as the bf16 backward's (pipeline.cuh "GEMMs in turns").
  __device__ static bool in_turns(const pipe::Job& job) {
    return job.kind >= kB8WgradDown && job.kind <= kB8SharedWgradGateUp;
  }

  // Sub-tiles of dA tile n: the second I block only where it starts inside I.
  __device__ static int da_subtiles(int n, int inter) { return n * fp8g::kTileN + fp8g::kBN < inter ? 2 : 1; }

  // ---- producer -----------------------------------------------------------------------------------
  __device__ int prepare(int grabbed, pipe::Job& job, pipe::LoadSrc&, pipe::LoadSrc&) const {
    const int task = plan_task(grabbed);
    const MoEBackwardParams& p = q.p;
    const MoEBackwardPlan& f = plan.b;
    const MoEDims& d = p.dims;
    job = pipe::Job{};
    if (f.push.has(task)) {
      job = pipe::Job{kB8Push, pipe::kLoadNone, 0, f.push.local(task)};
      return 1;
    }
    if (f.push_notify.has(task)) {
      if (!wait_counter_thread(p.cnt.push_done, f.wait_push_done, wait_ctx(), task)) return -1;
      ep::notify_all(p.peers, kFlagBwdRows);
      return 0;
    }
    if (plan.x.token_prep.has(task)) {
      job.kind = kB8TokenPrep;
      job.a = plan.x.token_prep.local(task);
      return 1;
    }
    if (f.dispatch.has(task)) {
      const int blk = f.dispatch.local(task);
      if (blk >= num_blocks) return 0;
      const int e = p.sched.block_expert[blk];
      if (!valid_expert(e, blk, d, p.err)) return -1;
      if (ep::enabled(p.peers) && !ep::wait_all_thread(p.peers, kFlagBwdRows, -1, peer_wait_ctx(p), ep::kStageBwdRows)) return -1;
      job = pipe::Job{kB8Dispatch, pipe::kLoadNone, 0, blk, e};
      return 1;
    }
    if (f.shared_da.has(task)) {
      const int t = f.shared_da.local(task), tb = t / f.si_tiles, n = t % f.si_tiles;
      if (!wait_counter_thread(q.token_dq_ready + tb, plan.x.wait_token_dq_ready, wait_ctx(), task)) return -1;
      job = pipe::Job{kB8SharedDA, pipe::kLoadRows, fp8b::k_blocks(d.hidden), tb, n, 0, da_subtiles(n, d.shared_inter)};
      prefetch_b_scales(job);
      return 1;
    }
    if (f.routed_da.has(task)) {
      const int t = f.routed_da.local(task), blk = t / f.i_tiles, n = t % f.i_tiles;
      if (blk >= num_blocks) return 0;
      const int e = p.sched.block_expert[blk];
      if (!valid_expert(e, blk, d, p.err)) return -1;
      const int idle = pipe::upper_half_idle(p.sched, blk, e);
      if (!wait_counter_thread(p.cnt.block_dy_ready + blk, f.wait_block_dy_ready, wait_ctx(), task)) return -1;
      job = pipe::Job{kB8RoutedDA, pipe::kLoadRows, fp8b::k_blocks(d.hidden), blk, n, e, da_subtiles(n, d.inter), idle};
      prefetch_b_scales(job);
      return 1;
    }
    if (f.shared_dx.has(task)) {
      const int t = f.shared_dx.local(task), tb = t / f.h_tiles, h = t % f.h_tiles;
      if (!wait_counter_thread(p.cnt.token_dsgu_ready + tb, f.wait_token_dsgu_ready, wait_ctx(), task)) return -1;
      job = pipe::Job{kB8SharedDX, pipe::kLoadRows, 2 * plan.x.ips_blocks, tb, h, 0, da_subtiles(h, d.hidden)};
      prefetch_dx_scales(job);
      return 1;
    }
    if (f.routed_dx.has(task)) {
      const int t = f.routed_dx.local(task), blk = t / f.h_tiles, h = t % f.h_tiles;
      if (blk >= num_blocks) return 0;
      const int e = p.sched.block_expert[blk];
      if (!valid_expert(e, blk, d, p.err)) return -1;
      const int idle = pipe::upper_half_idle(p.sched, blk, e);
      if (!wait_counter_thread(p.cnt.block_dgu_ready + blk, f.wait_block_dgu_ready, wait_ctx(), task)) return -1;
      job = pipe::Job{kB8RoutedDX, pipe::kLoadRows, 2 * plan.x.ip_blocks, blk, h, e, da_subtiles(h, d.hidden), idle};
      prefetch_dx_scales(job);
      return 1;
    }
    if (f.dx_notify.has(task)) {
      if (!wait_counter_thread(p.cnt.dx_done, num_blocks * f.wait_dx_done_per_block, wait_ctx(), task)) return -1;
      ep::notify_all(p.peers, kFlagBwdReturn);
      return 0;
    }
    if (f.combine.has(task)) {
      const int t = f.combine.local(task), tb = t / f.combine_parts;
      if (ep::enabled(p.peers)) {
        if (!ep::wait_all_thread(p.peers, kFlagBwdReturn, kFlagBwdRows, peer_wait_ctx(p), ep::kStageBwdReturn))
          return -1;
      } else if (!wait_counter_thread(p.cnt.dx_done, num_blocks * f.wait_dx_done_per_block, wait_ctx(), task)) {
        return -1;
      }
      if (d.shared_inter > 0 && !wait_counter_thread(p.cnt.token_dxs_ready + tb, f.wait_token_dxs_ready, wait_ctx(), task))
        return -1;
      job = pipe::Job{kB8Combine, pipe::kLoadNone, 0, t};
      return 1;
    }
    if (f.d_weights.has(task)) {
      job = pipe::Job{kB8DWeights, pipe::kLoadNone, 0, f.d_weights.local(task)};
      return 1;
    }
    if (plan.x.widen.has(task)) {
      const int blk = plan.x.widen.local(task);
      if (blk >= num_blocks) return 0;
      const int e = p.sched.block_expert[blk];
      if (!valid_expert(e, blk, d, p.err)) return -1;
      job = pipe::Job{kB8Widen, pipe::kLoadNone, 0, blk, e};
      return 1;
    }
    if (f.wgrad_down.has(task)) {  // dW_down[e] = dy_routed_e^T act_e
      const int t = f.wgrad_down.local(task), per_e = f.h_rows * f.i_tiles;
      const int e = t / per_e, rem = t % per_e, h = rem / f.i_tiles, n = rem % f.i_tiles;
      const BackwardTasks::ExpertRows er = tasks.expert_rows(e);
      if (er.count == 0 && p.accumulate) return 0;  // adding zero: leave the caller's buffer alone
      if (er.blocks > 0 &&
          (!wait_counter_thread(p.cnt.expert_dy_ready + e, er.blocks * f.wait_expert_dy_ready_per_block, wait_ctx(), task) ||
           !wait_counter_thread(q.expert_widen_ready + e, er.blocks * plan.x.wait_expert_widen_ready_per_block, wait_ctx(),
                                task)))
        return -1;
      // dy_mn holds the token-order rows first: routed row r is its row token_rows + r
      job = pipe::Job{kB8WgradDown, pipe::kLoadRows, wgrad_k_tiles(er.count), h * kBlockM, n * pipe::kBN,
                      plan.x.token_rows + er.first, er.first, e};
      return 1;
    }
    if (f.wgrad_gate_up.has(task)) {  // dW_{gate,up}[e] = dG_e^T / dU_e^T x_routed_e
      const int t = f.wgrad_gate_up.local(task), per_up = f.i_rows * f.h_tiles, per_e = 2 * per_up;
      const int e = t / per_e, rem = t % per_e, up = rem / per_up, rem2 = rem % per_up;
      const int n = rem2 / f.h_tiles, h = rem2 % f.h_tiles;
      const BackwardTasks::ExpertRows er = tasks.expert_rows(e);
      if (er.count == 0 && p.accumulate) return 0;
      if (er.blocks > 0 &&
          (!wait_counter_thread(p.cnt.expert_dgu_ready + e, er.blocks * f.wait_expert_dgu_ready_per_block, wait_ctx(), task) ||
           !wait_counter_thread(q.expert_widen_ready + e, er.blocks * plan.x.wait_expert_widen_ready_per_block, wait_ctx(),
                                task)))
        return -1;
      // gate tile rows past I read up columns: garbage in rows the epilogue drops (x_mn: as dy_mn)
      job = pipe::Job{kB8WgradGateUp, pipe::kLoadRows, wgrad_k_tiles(er.count), up * d.inter + n * kBlockM,
                      h * pipe::kBN, er.first, plan.x.token_rows + er.first, e};
      return 1;
    }
    if (f.shared_wgrad.has(task)) {  // K = the tokens; every operand of P's (prep_done)
      if (d.tokens == 0 && p.accumulate) return 0;
      if (!wait_counter_thread(q.prep_done, plan.x.wait_prep_done, wait_ctx(), task)) return -1;
      int t = f.shared_wgrad.local(task);
      const int down_tiles = f.h_rows * f.si_tiles;
      if (t < down_tiles) {  // dWs_down[h, i] = sum_t dq_bf[t, h] * sact[t, i]
        job = pipe::Job{kB8SharedWgradDown, pipe::kLoadRows, wgrad_k_tiles(d.tokens), t / f.si_tiles * kBlockM,
                        t % f.si_tiles * pipe::kBN};
        return 1;
      }
      t -= down_tiles;  // dWs_{gate,up}[i, h] = sum_t dsgu[t, (up) i] * xq_bf[t, h]
      const int per_up = f.si_rows * f.h_tiles, up = t / per_up, rem = t % per_up;
      if (!wait_counter_thread(p.cnt.dsgu_done, f.wait_dsgu_done, wait_ctx(), task)) return -1;
      job = pipe::Job{kB8SharedWgradGateUp, pipe::kLoadRows, wgrad_k_tiles(d.tokens),
                      up * d.shared_inter + rem / f.h_tiles * kBlockM, rem % f.h_tiles * pipe::kBN};
      return 1;
    }
    return 0;
  }

  __device__ static int wgrad_k_tiles(int rows) { return ceil_div(rows, wg::kBK); }

  // The B scales of a dA Job (down_t_s [e, I block, H block]): sub-tile s reads I block 2b + s's row
  // of H blocks (step = H/128 apart; 0 without sub-tile 1).
  __device__ fp8g::BScales b_scales(const pipe::Job& job) const {
    const MoEDims& d = q.p.dims;
    const bool shared = job.kind == kB8SharedDA;
    const int hb = fp8b::k_blocks(d.hidden), ib = fp8b::k_blocks(shared ? d.shared_inter : d.inter);
    const float* lo = (shared ? q.wt.shared_down_t_s : q.wt.down_t_s) +
                      ((size_t)job.c * ib + (size_t)job.b * fp8g::kSubTiles) * hb;
    return fp8g::BScales{lo, lo, job.d > 1 ? hb : 0};
  }

  // As the forward's: the first line of each B-scale row into this SM's L1 before the workers need it.
  __device__ void prefetch_b_scales(const pipe::Job& job) const {
    const fp8g::BScales sb = b_scales(job);
    fp8g::prefetch_l1(sb.lo);
    fp8g::prefetch_l1(sb.hi + sb.step);
  }

  // The B scales of a dX Job's gate (up = false) or up half of K (gate_t_s / up_t_s [e, H block,
  // I block]): sub-tile s reads hidden block 2b + s's row of I blocks (Ip / 128 = ceil(I / 128)).
  __device__ fp8g::BScales dx_scales(const pipe::Job& job, bool up) const {
    const bool shared = job.kind == kB8SharedDX;
    const int hb = fp8b::k_blocks(q.p.dims.hidden), ib = shared ? q.plan8.ips_blocks : q.plan8.ip_blocks;
    const size_t at = ((size_t)job.c * hb + (size_t)job.b * fp8g::kSubTiles) * ib;
    const float* lo =
        (shared ? (up ? q.wt.shared_up_t_s : q.wt.shared_gate_t_s) : (up ? q.wt.up_t_s : q.wt.gate_t_s)) + at;
    return fp8g::BScales{lo, lo, job.d > 1 ? ib : 0};
  }
  __device__ void prefetch_dx_scales(const pipe::Job& job) const {
    for (int up = 0; up < 2; ++up) {
      const fp8g::BScales sb = dx_scales(job, up != 0);
      fp8g::prefetch_l1(sb.lo);
      fp8g::prefetch_l1(sb.lo + sb.step);
    }
  }

  // One k-tile (64 rows of the operands) of a bf16 wgrad tile: the bf16 backward's MN-major loads
  // (pipe::produce), A's 128 M rows as two 64-wide panels, B's 256 N rows as four; the coordinates
  // come ready in the Job (no LoadSrc pair held from prepare to the loads).  The panel coordinates
  // are the same in every stage, so the compiler computed them once before pipe::produce_rows's
  // stage loop, next to the FP8 stages' invariants (it hoists from every branch of the loop body):
  // the 40-register producer spilled 16-20 bytes.  The empty asm makes them per-stage values.
  __device__ uint32_t wgrad_stage(const pipe::Job& job, int stage, uint32_t dst, uint32_t bar) const {
    const MoEFp8BackwardMaps& m = pipe::late(maps);
    int a0 = job.a, b0 = job.b, k = stage * wg::kBK;
    asm volatile("" : "+r"(a0), "+r"(b0));  // not hoisted out of the stage loop (see above)
    const bool down = job.kind == kB8WgradDown || job.kind == kB8SharedWgradDown;
    const TensorMap* a = down ? &m.dy_mn : job.kind == kB8WgradGateUp ? &m.dgu_mn : &m.dsgu_mn;
    const TensorMap* b = down ? (job.kind == kB8WgradDown ? &m.act_mn : &m.sact_mn) : &m.x_mn;
#pragma unroll
    for (int i = 0; i < wg::kBM / 64; ++i) tma_load_3d(dst + i * wg::kPanelBytes, a, bar, a0 + 64 * i, job.c + k, 0);
    dst += pipe::Geometry::kABytes;
#pragma unroll
    for (int i = 0; i < pipe::kBN / 64; ++i) tma_load_3d(dst + i * wg::kPanelBytes, b, bar, b0 + 64 * i, job.d + k, 0);
    return pipe::Geometry::kStageBytes;
  }

  __device__ uint32_t stage_rows(const pipe::Job& job, int stage, uint32_t dst, uint32_t bar) const {
    if (in_turns(job)) return wgrad_stage(job, stage, dst, bar);
    const MoEFp8BackwardMaps& m = pipe::late(maps);
    const int row0 = job.a * kBlockM, n0 = job.b * fp8g::kTileN;
    if (job.kind == kB8SharedDX || job.kind == kB8RoutedDX) {
      // K = [dG | dU] (2 Ip columns of dguq); its A scales follow dA's H/128 K blocks in rs / ts;
      // B switches from gate_t to up_t at K block Ip / 128 (both maps have I columns: TMA
      // zero-fills [I, Ip), where dguq is zero too).
      const bool shared = job.kind == kB8SharedDX;
      const int ipb = shared ? q.plan8.ips_blocks : q.plan8.ip_blocks, hb = fp8b::k_blocks(q.p.dims.hidden);
      const bool up = stage >= ipb;
      const TensorMap* b = shared ? (up ? &m.shared_up_t_k : &m.shared_gate_t_k) : (up ? &m.up_t_k : &m.gate_t_k);
      return fp8b::load_stage(dst, bar, shared ? &m.dsguq_k : &m.dguq_k, row0, shared ? &m.ts_s : &m.rs_s, row0,
                              hb + stage, stage, b, up ? stage - ipb : stage, n0, job.c, job.d);
    }
    if (job.kind == kB8SharedDA)  // token-order rows of dq: rows 0 .. of the map, scales in ts
      return fp8b::load_stage(dst, bar, &m.dq_k, row0, &m.ts_s, row0, stage, stage, &m.shared_down_t_k, stage, n0, 0,
                              job.d);
    // kB8RoutedDA: the routed rows follow the token_rows token-order rows in dq; their scales in rs
    return fp8b::load_stage(dst, bar, &m.dq_k, q.plan8.token_rows + row0, &m.rs_s, row0, stage, stage, &m.down_t_k, stage,
                            n0, job.c, job.d);
  }

  // ---- workers -------------------------------------------------------------------------------------
  // The dA epilogue's destinations, rebuilt after the mainloop (kept live across it they would
  // compete with the 192 accumulators).
  __device__ __forceinline__ fp8b::DaOut da_out(const pipe::Job& job) const {
    const MoEBackwardParams& p = q.p;
    const MoEDims& d = p.dims;
    const int row0 = job.a * kBlockM, hb = fp8b::k_blocks(d.hidden);
    if (job.kind == kB8SharedDA) {
      const int ips = q.plan8.ips_blocks * fp8::kBlock;
      const size_t off = (size_t)row0 * 2 * d.shared_inter;
      return fp8b::DaOut{p.ctx.sgu + off, p.dsgu + off, q.q.dsguq + (size_t)row0 * 2 * ips, q.q.ts,
                         (size_t)q.plan8.token_ld, row0, min_int(kBlockM, d.tokens - row0), d.shared_inter, ips, hb};
    }
    const int ip = q.plan8.ip_blocks * fp8::kBlock;
    const size_t off = (size_t)row0 * 2 * d.inter;
    return fp8b::DaOut{p.ctx.gu + off, p.dgu + off, q.q.dguq + (size_t)row0 * 2 * ip, q.q.rs, (size_t)d.max_rows, row0,
                       kBlockM, d.inter, ip, hb};
  }

  // The routing weight of tile row r (0 for padding rows): dA = tw * (dyq . W_down).  With EP the
  // source sent it with the row (the routed region's weights, ep_fp8.cuh).
  __device__ __forceinline__ float route_weight(const pipe::Job& job, int r) const {
    if (job.kind == kB8SharedDA) return 1.f;
    const int row = job.a * kBlockM + r;
    if (ep::enabled(q.p.peers)) return ep8::routed_weight(q.p.sched, q.p.dims, q.p.peers, row);
    const int slot = q.p.sched.row_slot[row];
    return slot >= 0 ? __ldg(q.p.topk_weights + slot) : 0.f;
  }

  // A dA task: both I blocks over one pass of K = H, then per sub-tile the dSwiGLU + quantising epilogue.
  __device__ bool da(const pipe::Job& job, const pipe::Shared& s, wg::PipeState& ps, int consumer,
                     const MbarWaitCtx& w) const {
    const MoEBackwardParams& p = q.p;
    const MoEDims& d = p.dims;
    const bool shared = job.kind == kB8SharedDA, two = job.d > 1;
    float t0[fp8g::kRegs], t1[fp8g::kRegs];
#pragma unroll
    for (int i = 0; i < fp8g::kRegs; ++i) t0[i] = 0.f, t1[i] = 0.f;
    if (!fp8g::mainloop<false>(s, ps, t0, t1, fp8b::k_blocks(d.hidden), consumer, w, job.e != 0 && consumer == 1, two,
                               b_scales(job)))
      return false;
    const pipe::Frag f = fp8b::frag_here();
    const float tw0 = route_weight(job, f.row0), tw1 = route_weight(job, f.row0 + 8);
    const int i0 = job.b * fp8g::kTileN;
    fp8b::da_tile(t0, t1, two, f, da_out(job), i0, tw0, tw1, make_swiglu(d));
    if (shared)
      signal_counters(p.cnt.token_dsgu_ready + job.a, p.cnt.dsgu_done);
    else
      signal_counters(p.cnt.block_dgu_ready + job.a, p.cnt.expert_dgu_ready + job.c);
    return true;
  }

  // A dX task: 128 rows x 256 hidden columns (two sub-tiles, or one at the end of H), K = 2 Ip;
  // the epilogues of the forward's down tasks (dx_slot rows by route, fp32 dx_shared).  One
  // mainloop over both halves of K, its B scales switching arrays at K block Ip / 128.
  __device__ bool dx(const pipe::Job& job, const pipe::Shared& s, wg::PipeState& ps, int consumer,
                     const MbarWaitCtx& w) const {
    const MoEBackwardParams& p = q.p;
    const MoEDims& d = p.dims;
    const bool shared = job.kind == kB8SharedDX, two = job.d > 1;
    const int ipb = shared ? q.plan8.ips_blocks : q.plan8.ip_blocks, h0 = job.b * fp8g::kTileN;
    const bool idle = job.e != 0 && consumer == 1;
    float t0[fp8g::kRegs], t1[fp8g::kRegs];
#pragma unroll
    for (int i = 0; i < fp8g::kRegs; ++i) t0[i] = 0.f, t1[i] = 0.f;
    const fp8g::BScales g = dx_scales(job, false), u = dx_scales(job, true);
    const fp8b::BScalesKSwitch sb{g.lo, u.lo, g.step, ipb};
    if (!fp8g::mainloop<false>(s, ps, t0, t1, 2 * ipb, consumer, w, idle, two, sb)) return false;
    const pipe::Frag f = fp8b::frag_here();
    const int row0 = job.a * kBlockM, cols0 = min_int(fp8g::kBN, d.hidden - h0);
    const int cols1 = two ? min_int(fp8g::kBN, d.hidden - h0 - fp8g::kBN) : 0;
    if (shared) {
      float* const y = p.dx_shared + (size_t)row0 * d.hidden + h0;
      const int rows = min_int(kBlockM, d.tokens - row0);
      fp8g::store_f32(t0, f, y, d.hidden, rows, cols0);
      if (two) fp8g::store_f32(t1, f, y + fp8g::kBN, d.hidden, rows, cols1);
      signal_counter(p.cnt.token_dxs_ready + job.a);
    } else {
      // With EP straight into the source rank's slot rows (ep::return_row_ptr), as the bf16 dX.
      const bool ep_on = ep::enabled(p.peers);
      const auto row_ptr = [&](int r, int col0) {
        return ep_on ? ep::return_row_ptr(p.sched, p.peers, d, row0 + r, col0, p.err)
                     : route_row_ptr(p.sched, d, p.dx_slot, row0 + r, col0);
      };
      fp8g::store_rows_bf16(t0, f, kBlockM, cols0, [&](int r) { return row_ptr(r, h0); });
      if (two) fp8g::store_rows_bf16(t1, f, kBlockM, cols1, [&](int r) { return row_ptr(r, h0 + fp8g::kBN); });
      if (ep_on) {
        ep::signal_counter_sys(p.cnt.dx_done);
      } else {
        signal_counter(p.cnt.dx_done);
      }
    }
    return true;
  }

  // A wgrad tile: the bf16 backward's GEMM in turns and store (fp32 or bf16, overwritten or added),
  // one call site of each for all four kinds (each is inlined once).
  __device__ bool wgrad(const pipe::Job& job, const pipe::Shared& s, wg::PipeState& ps, float (&acc)[pipe::kAccRegs],
                        int consumer, const MbarWaitCtx& w, const pipe::Turns& turns) const {
    if (!pipe::gemm_in_turns<wg::kMNMajor, wg::kMNMajor>(s, ps, acc, job.k_tiles, consumer, w, turns)) return false;
    const MoEBackwardParams& p = q.p;
    const MoEDims& d = p.dims;
    const MoEWeightGrads& g = p.grads;
    void* dst;
    size_t at;
    int ld, rows, cols;
    const bool routed = job.kind == kB8WgradDown || job.kind == kB8WgradGateUp;
    const int inter = routed ? d.inter : d.shared_inter, e = routed ? job.e : 0;
    if (job.kind == kB8WgradDown || job.kind == kB8SharedWgradDown) {  // [h, i]: 128 h rows x 256 i columns
      const int h0 = job.a, i0 = job.b;
      dst = routed ? g.dw_down : g.d_shared_down;
      at = ((size_t)e * d.hidden + h0) * inter + i0;
      ld = inter, rows = min_int(kBlockM, d.hidden - h0), cols = min_int(pipe::kBN, inter - i0);
    } else {  // [i, h]: 128 i rows x 256 h columns; job.a = (up) I + i
      const bool up = job.a >= inter;
      const int i0 = job.a - (up ? inter : 0), h0 = job.b;
      dst = routed ? (up ? g.dw_up : g.dw_gate) : (up ? g.d_shared_up : g.d_shared_gate);
      at = ((size_t)e * inter + i0) * d.hidden + h0;
      ld = d.hidden, rows = min_int(kBlockM, inter - i0), cols = min_int(pipe::kBN, d.hidden - h0);
    }
    const pipe::Frag f = fp8b::frag_here();
    if (p.grad_bf16)  // uniform over the launch; streaming stores: nothing here reads them again
      pipe::store_bf16<true>(acc, f, static_cast<bf16*>(dst) + at, ld, rows, cols, p.accumulate != 0);
    else
      pipe::store_f32<true>(acc, f, static_cast<float*>(dst) + at, ld, rows, cols, p.accumulate != 0);
    return true;
  }

  __device__ bool run(const pipe::Job& job, const pipe::Shared& s, wg::PipeState& ps, float (&acc)[pipe::kAccRegs],
                      int consumer, const MbarWaitCtx& w, const pipe::Turns& turns) const {
    switch (job.kind) {
      case kB8TokenPrep:
      case kB8Dispatch:  // one call: the quantiser inlined once
      case kB8Push: {
        const MoEBackwardParams& p = q.p;
        const bool ep_on = ep::enabled(p.peers);
        if (job.kind == kB8Dispatch && ep_on) {  // the rows were quantised by their source's push
          ep8::receive_dq_block(p.sched, p.dims, p.peers, job.a, q.q.dyq, q.q.rs, p.dy_routed);
          signal_counters(p.cnt.block_dy_ready + job.a, p.cnt.expert_dy_ready + job.b);
          return true;
        }
        fp8b::quantize_dout(q, job.kind == kB8Dispatch, job.a, job.b);
        if (job.kind == kB8Push)  // after its rows left: P's second half does not delay the notify
          ep8::push_quantized(
              p.sched, p.dims, p.peers, job.a, [&] { return q.q.dq; },
              [&](int kb, int t) { return q.q.ts + (size_t)kb * q.plan8.token_ld + t; }, p.topk_weights,
              p.cnt.push_done, p.err);
        // P's second half; with EP in the push (T = 0: one push task and no token block to widen)
        if (job.kind == kB8TokenPrep || (job.kind == kB8Push && p.dims.shared_inter > 0 && job.a * kBlockM < p.dims.tokens))
          fp8b::token_prep_widen(q, job.a);
        return true;
      }
      case kB8Widen:
        fp8b::widen_block(q, job.a, job.b);
        return true;
      case kB8Combine:
        tasks.combine_body(job.a);
        return true;
      case kB8DWeights:
        fp8b::d_weights(q.p, job.a);
        return true;
      case kB8SharedDA:
      case kB8RoutedDA:
        return da(job, s, ps, consumer, w);
      case kB8SharedDX:
      case kB8RoutedDX:
        return dx(job, s, ps, consumer, w);
      case kB8WgradDown:
      case kB8WgradGateUp:
      case kB8SharedWgradDown:
      case kB8SharedWgradGateUp:
        return wgrad(job, s, ps, acc, consumer, w, turns);
      default:
        return false;
    }
  }
};

}  // namespace mok
