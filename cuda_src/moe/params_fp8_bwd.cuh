// Parameter struct of the "fp8_block" backward megakernel (docs/FP8_BACKWARD.md): the bf16
// backward's MoEBackwardParams, unchanged, followed by what FP8 adds.  Mirrored by
// mok_rt/kernels/moe_params_fp8_bwd.py (sizes and offsets asserted on both sides with the same
// numbers).  Read by moe_backward_fp8 (filled by mok_rt/kernels/moe_fp8_bwd.py).
//
// Why the bf16 struct stays whole: the phases the FP8 backward keeps (d_weights, the bf16 wgrads,
// the dX epilogue, combine) are the bf16 bodies or their arithmetic (tasks/backward_bodies.cuh,
// backward.cuh, backward_fp8.cuh), on a MoEBackwardParams.  Of it the FP8 backward uses sched, cnt, grads, x (null: never read),
// topk_weights, d_out (unquantised, for d_weights), dx, d_topk_weights, dx_slot, dx_shared, err,
// trace, dims, plan (FP8 tile counts), accumulate, grad_bf16 and:
//   ctx.gu, ctx.sgu, ctx.y_slot   the FP8 forward's bf16 context (g, u rounded as the oracle's)
//   ctx.x_routed, ctx.act         bf16(deq(xrq)), bf16(deq(aq)): wgrad operands, written by the
//   ctx.sact                      backward (phases W and P), not by the forward; bf16(deq(saq))
//   dy_routed                     bf16(tw * deq(dyq)), written by the dispatch (A of wgrad down)
//   dgu, dsgu                     bf16(deq(dguq)), bf16(deq(dsguq)), written by the dA epilogue
// w is null: the GEMMs read the transposed E4M3 copies below.
//
// Row layouts shared by one tensor map (the 4 KB parameter budget, see the maps below): `dq` holds
// the token-order rows [0, T) and the routed rows [token_rows, token_rows + R); so do the bf16
// wgrad operands `dq_bf` (then dy_routed == dq_bf + token_rows * H) and `xq_bf` (then ctx.x_routed
// == xq_bf + token_rows * H).  token_rows = token_blocks * 128 with a shared expert or expert
// parallelism (the push tasks quantise d_out there: tasks/ep_fp8.cuh), else 0.
//
// Scale layouts: activations fp32 [K blocks, ld] (rows contiguous, as the forward's): `rs` holds the
// routed rows' scales, H/128 blocks of dyq then 2 Ip/128 of dguq (ld R); `ts` the token-order rows',
// H/128 of dq then 2 Ips/128 of dsguq (ld token_ld).  Ip = ceil(I/128) * 128: dguq is [R, 2 Ip] with
// the gate columns at 0 and the up columns at Ip (zero past I), so no K block mixes gate and up.
#pragma once
#include "common/tma.cuh"
#include "moe/params.cuh"
#include "moe/params_fp8.cuh"

namespace mok {

// The input-gradient copies made by mok.quantize_weights(for_backward=True)
// (cuda_src/fp8/quantize_weights.cu): K-major for the dgrad GEMMs, as FP8 wgmma needs.
struct MoEFp8WeightsT {
  const uint8_t* gate_t;         // e4m3 [E_l, H, I]   B of dX, K blocks < Ip/128   (n = h, k = i)
  const uint8_t* up_t;           // e4m3 [E_l, H, I]   B of dX, K blocks >= Ip/128
  const uint8_t* down_t;         // e4m3 [E_l, I, H]   B of dA                       (n = i, k = h)
  const uint8_t* shared_gate_t;  // e4m3 [H, I_s]      (null without a shared expert)
  const uint8_t* shared_up_t;    // e4m3 [H, I_s]
  const uint8_t* shared_down_t;  // e4m3 [I_s, H]
  const float* gate_t_s;         // [E_l, H/128, I/128]
  const float* up_t_s;           // [E_l, H/128, I/128]
  const float* down_t_s;         // [E_l, I/128, H/128]
  const float* shared_gate_t_s;  // [H/128, I_s/128]
  const float* shared_up_t_s;    // [H/128, I_s/128]
  const float* shared_down_t_s;  // [I_s/128, H/128]
};
static_assert(sizeof(MoEFp8WeightsT) == 12 * 8 && offsetof(MoEFp8WeightsT, gate_t_s) == 48,
              "MoEFp8WeightsT layout: update mok_rt/kernels/moe_params_fp8_bwd.py");

// What the FP8 backward quantises (E4M3 + scales) and the bf16 copies only it needs.
struct MoEFp8BackwardScratch {
  uint8_t* dq;       // [token_rows + R, H] Q(d_out): token order (shared dA's A), then the routed rows
  uint8_t* dyq;      // == dq + token_rows * H: the routed rows (dispatch; padding rows zero, scale 0)
  uint8_t* dguq;     // [R, 2 Ip] Q(dG) | Q(dU) of the routed rows (dA epilogue; A of dX)
  uint8_t* dsguq;    // [T, 2 Ips] the shared expert's (null without one)
  float* rs;         // [H/128 + 2 Ip/128, R] scales of dyq, then of dguq
  float* ts;         // [H/128 + 2 Ips/128, token_ld] scales of dq's token rows, then of dsguq
  bf16* dq_bf;       // [token_rows + R, H] bf16(deq(dq)) token order (A of shared wgrad down), then dy_routed
  bf16* xq_bf;       // [token_rows + R, H] bf16(deq(xq)) token order (B of shared wgrad gate|up), then x_routed
};
static_assert(sizeof(MoEFp8BackwardScratch) == 8 * 8 && offsetof(MoEFp8BackwardScratch, rs) == 32,
              "MoEFp8BackwardScratch layout: update mok_rt/kernels/moe_params_fp8_bwd.py");

// What the FP8 backward plan adds (phases outside pipe::AheadOrder's permuted range, like the
// forward's quant_x):
//   P token_prep  token block (only with a shared expert): dq's token rows + scales, dq_bf, xq_bf,
//                 ctx.sact; before everything that reads them (shared dA, shared wgrads)
//   W widen       row block: ctx.x_routed, ctx.act for the routed wgrads; after routed dA in the
//                 grab order (off the dA -> dX critical path)
struct MoEFp8BackwardPlan {
  PhaseRange token_prep;
  PhaseRange widen;
  int wait_token_dq_ready;                 // token_dq_ready[tb]: P tasks of the token block (1)
  int wait_expert_widen_ready_per_block;   // expert_widen_ready[e]: W tasks per row block of the expert (1)
  int wait_prep_done;                      // prep_done: P tasks (shared wgrads read every token)
  int token_ld;                            // ld of ts (multiple of 4, >= T)
  int token_rows;                          // the token-order rows in front of the routed ones (0 or a multiple of 128)
  int ip_blocks;                           // Ip / 128: dX's K blocks from gate_t, then as many from up_t
  int ips_blocks;                          // Ips / 128 (shared)
  int pad_;
};
static_assert(sizeof(MoEFp8BackwardPlan) == 48 && offsetof(MoEFp8BackwardPlan, wait_token_dq_ready) == 16,
              "MoEFp8BackwardPlan layout: update mok_rt/kernels/moe_params_fp8_bwd.py");

struct MoEFp8BackwardParams {
  MoEBackwardParams p;
  MoEFp8WeightsT wt;
  MoEFp8Context qctx;          // the forward's quantised context (read-only): xq, xrq, aq, saq
  MoEFp8BackwardScratch q;
  int* token_dq_ready;         // counter [token_blocks]
  int* expert_widen_ready;     // counter [E_l]
  int* prep_done;              // counter [1]
  MoEFp8BackwardPlan plan8;
};
static_assert(sizeof(MoEFp8BackwardParams) == 1504 && offsetof(MoEFp8BackwardParams, wt) == 1208 &&
                  offsetof(MoEFp8BackwardParams, qctx) == 1304 && offsetof(MoEFp8BackwardParams, q) == 1368 &&
                  offsetof(MoEFp8BackwardParams, token_dq_ready) == 1432 &&
                  offsetof(MoEFp8BackwardParams, plan8) == 1456,
              "MoEFp8BackwardParams layout: update mok_rt/kernels/moe_params_fp8_bwd.py");

// 17 maps (2,176 B) + the struct fit the classic 4 KB parameter limit with ~380 B to spare;
// separate maps for the token-order and routed rows would be 21 and not fit.
//   A (e4m3, 2D {K, rows}, box {128, 128}, SWIZZLE_128B); A scales (fp32, 2D {rows, K blocks}, box
//   {128, 1}); B (e4m3, 3D {K, N, E}, box {128, 128, 1}, SWIZZLE_128B); wgrad operands (bf16,
//   MN-major as the bf16 backward's *_mn maps: 3D {MN, K = rows, 1}, box {64, 64, 1},
//   SWIZZLE_128B; the kernel's loads give coordinates (mn, row, 0)).
struct MoEFp8BackwardMaps {
  TensorMap dq_k;             // dq [token_rows + R, H]    A of shared dA (rows 0..), routed dA (rows token_rows..)
  TensorMap dguq_k;           // dguq [R, 2 Ip]            A of routed dX
  TensorMap dsguq_k;          // dsguq [T, 2 Ips]          A of shared dX
  TensorMap rs_s;             // rs [H/128 + 2 Ip/128, R]  routed A scales (dA's K blocks, then dX's)
  TensorMap ts_s;             // ts [.., token_ld]         token-order A scales
  TensorMap down_t_k;         // wt.down_t [E_l, I, H]     B of routed dA
  TensorMap gate_t_k;         // wt.gate_t [E_l, H, I]     B of routed dX, K blocks < ip_blocks
  TensorMap up_t_k;           // wt.up_t [E_l, H, I]       B of routed dX, K blocks >= ip_blocks
  TensorMap shared_down_t_k;  // wt.shared_down_t [I_s, H]
  TensorMap shared_gate_t_k;  // wt.shared_gate_t [H, I_s]
  TensorMap shared_up_t_k;    // wt.shared_up_t [H, I_s]
  TensorMap dy_mn;            // dq_bf [token_rows + R, H]  A of wgrad down (routed: k0 = token_rows + first row)
  TensorMap x_mn;             // xq_bf [token_rows + R, H]  B of wgrad gate|up (likewise)
  TensorMap act_mn;           // ctx.act [R, I]             B of routed wgrad down
  TensorMap sact_mn;          // ctx.sact [T, I_s]          B of shared wgrad down
  TensorMap dgu_mn;           // dgu [R, 2I]                A of routed wgrad gate|up
  TensorMap dsgu_mn;          // dsgu [T, 2I_s]             A of shared wgrad gate|up
};
static_assert(sizeof(MoEFp8BackwardMaps) == 17 * 128, "MoEFp8BackwardMaps layout: update mok_rt/kernels/moe_params_fp8_bwd.py");

struct MoEFp8BackwardTmaParams {
  MoEFp8BackwardMaps maps;
  MoEFp8BackwardParams p;
};
static_assert(sizeof(MoEFp8BackwardTmaParams) == 3712 && offsetof(MoEFp8BackwardTmaParams, p) == 2176,
              "MoEFp8BackwardTmaParams layout: update mok_rt/kernels/moe_params_fp8_bwd.py");
static_assert(sizeof(MoEFp8BackwardTmaParams) <= 4096, "the classic kernel parameter limit");

}  // namespace mok
