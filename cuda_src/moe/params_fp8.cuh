// Parameter struct of the "fp8_block" forward megakernel (moe_forward_fp8.cu; docs/FP8_DESIGN.md):
// the bf16 forward's MoEForwardParams, unchanged, followed by what FP8 adds.  Mirrored by
// mok_rt/kernels/moe_fp8.py (sizes and offsets asserted on both sides with the same numbers).
//
// Of the bf16 struct the FP8 forward uses sched, ctx.gu / ctx.y_slot / ctx.sgu (bf16, as the
// oracle's context keeps g, u and y), cnt, x, topk_weights, out, shared_y, err, trace, dims, plan
// (h_tiles counts 128-column tiles here), context_only and peers (EP: tasks/ep_fp8.cuh).  w, ctx.x_routed,
// ctx.act and ctx.sact are null: the GEMMs read the E4M3 copies below instead.
//
// Scale layouts (common/fp8.cuh): activations fp32 [ceil(K/128), ld] (rows contiguous: one TMA box
// {128, 1} brings a tile's 128 row scales of one K block); weights fp32 [G, ceil(N/128), ceil(K/128)].
#pragma once
#include "common/tma.cuh"
#include "moe/params.cuh"

namespace mok {

// The forward copies made by mok.quantize_weights (cuda_src/fp8/quantize_weights.cu).
struct MoEFp8Weights {
  const uint8_t* gate;         // e4m3 [E_l, I, H]
  const uint8_t* up;           // e4m3 [E_l, I, H]
  const uint8_t* down;         // e4m3 [E_l, H, I]
  const uint8_t* shared_gate;  // e4m3 [I_s, H]   (null without a shared expert)
  const uint8_t* shared_up;    // e4m3 [I_s, H]
  const uint8_t* shared_down;  // e4m3 [H, I_s]
  const float* gate_s;         // [E_l, I/128, H/128]
  const float* up_s;           // [E_l, I/128, H/128]
  const float* down_s;         // [E_l, H/128, I/128]
  const float* shared_gate_s;  // [I_s/128, H/128]
  const float* shared_up_s;    // [I_s/128, H/128]
  const float* shared_down_s;  // [H/128, I_s/128]
};
static_assert(sizeof(MoEFp8Weights) == 12 * 8 && offsetof(MoEFp8Weights, gate_s) == 48,
              "MoEFp8Weights layout: update mok_rt/kernels/moe_fp8.py");

// The quantised activations (context: what the oracle's FP8Context calls xq and aq, as e4m3 +
// scales, which represent them exactly).
struct MoEFp8Context {
  uint8_t* xq;     // [T, H] x quantised in token order (the shared expert's A; null without one)
  float* xq_s;     // [H/128, token_ld]
  uint8_t* xrq;    // [R, H] the routed rows of xq (padding rows zero, scale 0)
  float* xrq_s;    // [H/128, R]
  uint8_t* aq;     // [R, I] Q(swiglu(g, u)) of the routed rows
  float* aq_s;     // [I/128, R]
  uint8_t* saq;    // [T, I_s] the shared expert's
  float* saq_s;    // [I_s/128, token_ld]
};
static_assert(sizeof(MoEFp8Context) == 8 * 8 && offsetof(MoEFp8Context, aq) == 32,
              "MoEFp8Context layout: update mok_rt/kernels/moe_fp8.py");

// What the FP8 plan adds (mok_rt/kernels/moe_plan.py forward_plan(..., precision="fp8_block")): the
// token blocks quantised in token order for the shared expert, before the dispatch in index order
// (outside the range pipe::AheadOrder permutes, so they are grabbed first).
struct MoEFp8Plan {
  PhaseRange quant_x;
  int wait_token_xq_ready;  // token_xq_ready[tb]: quant_x tasks of the token block (1)
  int token_ld;             // ld of the token-order scale arrays (multiple of 4, >= T)
};
static_assert(sizeof(MoEFp8Plan) == 16, "MoEFp8Plan layout: update mok_rt/kernels/moe_fp8.py");

struct MoEFp8ForwardParams {
  MoEForwardParams p;
  MoEFp8Weights wq;
  MoEFp8Context qctx;
  int* token_xq_ready;      // counter [token_blocks] (in the plan's counter block)
  MoEFp8Plan plan8;
};
static_assert(sizeof(MoEFp8ForwardParams) == 1216 && offsetof(MoEFp8ForwardParams, wq) == 1032 &&
                  offsetof(MoEFp8ForwardParams, qctx) == 1128 && offsetof(MoEFp8ForwardParams, token_xq_ready) == 1192 &&
                  offsetof(MoEFp8ForwardParams, plan8) == 1200,
              "MoEFp8ForwardParams layout: update mok_rt/kernels/moe_fp8.py");

// One map per operand view (mok_rt/kernels/moe_fp8.py encodes them; unused views are zeros):
//   A (e4m3, 2D dims {K, rows}, box {128, 128}, SWIZZLE_128B: one K block of a 128-row tile)
//   A scales (fp32, 2D dims {rows, K/128} with row pitch ld, box {128, 1}, no swizzle)
//   B (e4m3, 3D dims {K, N, E}, SWIZZLE_128B; box {128, 64, 1} for a gate or up half, {128, 128, 1} for down)
struct MoEFp8ForwardMaps {
  TensorMap xq_k;     // xq [T, H]         A of F1 (shared gate|up)
  TensorMap xrq_k;    // xrq [R, H]        A of F2 (routed gate|up)
  TensorMap saq_k;    // saq [T, I_s]      A of F3 (shared down)
  TensorMap aq_k;     // aq [R, I]         A of F4 (routed down)
  TensorMap xq_s;     // xq_s [H/128, token_ld]
  TensorMap xrq_s;    // xrq_s [H/128, R]
  TensorMap saq_s;    // saq_s [I_s/128, token_ld]
  TensorMap aq_s;     // aq_s [I/128, R]
  TensorMap gate_k;   // wq.gate [E_l, I, H]      B of F2, gate half
  TensorMap up_k;     // wq.up [E_l, I, H]        B of F2, up half
  TensorMap down_k;   // wq.down [E_l, H, I]      B of F4
  TensorMap shared_gate_k;  // wq.shared_gate [I_s, H]   B of F1, gate half
  TensorMap shared_up_k;    // wq.shared_up [I_s, H]     B of F1, up half
  TensorMap shared_down_k;  // wq.shared_down [H, I_s]   B of F3
};
static_assert(sizeof(MoEFp8ForwardMaps) == 14 * 128, "MoEFp8ForwardMaps layout: update mok_rt/kernels/moe_fp8.py");

// The staged gate|up tiles' store maps (moe_forward_fp8_staged only; pipeline/staged_tile.cuh).
struct MoEFp8StagedMaps {
  TensorMap gu_st;    // gu [R, 2 I] bf16, box {64, 128}     F2's staged stores
  TensorMap sgu_st;   // sgu [T, 2 I_s] bf16, box {64, 128}  F1's
};

// The staged maps last, so that the direct kernel's parameters sit where they always did.
struct MoEFp8ForwardTmaParams {
  MoEFp8ForwardMaps maps;
  MoEFp8ForwardParams p;
  MoEFp8StagedMaps staged;
};
static_assert(sizeof(MoEFp8ForwardTmaParams) == 3264 && offsetof(MoEFp8ForwardTmaParams, p) == 1792 &&
                  offsetof(MoEFp8ForwardTmaParams, staged) == 3008,
              "MoEFp8ForwardTmaParams layout: update mok_rt/kernels/moe_fp8.py");
static_assert(sizeof(MoEFp8ForwardTmaParams) <= 4096, "the classic kernel parameter limit");

}  // namespace mok
