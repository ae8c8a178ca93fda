// Parameter structs of the MoE kernels (moe_layer.cu): the structs of params.cuh preceded by one
// TMA tensor map per operand view.
// Mirrored by mok_rt/kernels/moe_params.py (sizes asserted on both sides); the maps are encoded by
// mok_rt/kernels/moe_maps.py.  Every map is 3D {inner, outer, group} (mok_rt/_tensormap.gemm_operand):
//   K-major  (ends _k):  dims {K, rows, groups}, box {64, R, 1}; R = 128 for A, 128 for a gate|up
//                        half of B, 256 for a whole B tile.
//   MN-major (ends _mn): dims {rows, K, groups}, box {64, 64, 1}; loaded one 64-row panel at a time.
// R = max_rows (routed row space), T = tokens; a map over a buffer the launch never reads (no
// shared expert, T = 0) is all zeros.
#pragma once
#include "common/tma.cuh"
#include "moe/params.cuh"

namespace mok {

struct MoEForwardMaps {
  TensorMap x_k;         // x [T, H]             A of F1
  TensorMap x_routed_k;  // x_routed [R, H]      A of F2
  TensorMap sact_k;      // sact [T, I_s]        A of F3
  TensorMap act_k;       // act [R, I]           A of F4
  TensorMap w_gate_k;    // w_gate [E_l, I, H]   B of F2, gate half (box rows 128)
  TensorMap w_up_k;      // w_up [E_l, I, H]     B of F2, up half
  TensorMap w_down_k;    // w_down [E_l, H, I]   B of F4 (box rows 256)
  TensorMap shared_gate_k;   // shared_gate [I_s, H]     B of F1, gate half
  TensorMap shared_up_k;     // shared_up [I_s, H]       B of F1, up half
  TensorMap shared_down_k;   // shared_down [H, I_s]     B of F3 (box rows 256)
};
static_assert(sizeof(MoEForwardMaps) == 10 * 128, "MoEForwardMaps layout: update mok_rt/kernels/moe_params.py");

struct MoEBackwardMaps {
  TensorMap dy_routed_k;   // dy_routed [R, H]     A of B3
  TensorMap d_out_k;       // d_out [T, H]         A of B2
  TensorMap dgu_k;         // dgu [R, 2I]          A of B5
  TensorMap dsgu_k;        // dsgu [T, 2I_s]       A of B4
  TensorMap w_down_mn;     // w_down [E_l, H, I]   B of B3: (n = i, k = h)
  TensorMap shared_down_mn;    // shared_down [H, I_s]     B of B2
  TensorMap w_gate_mn;     // w_gate [E_l, I, H]   B of B5, k < I: (n = h, k = i)
  TensorMap w_up_mn;       // w_up [E_l, I, H]     B of B5, k >= I
  TensorMap shared_gate_mn;    // shared_gate [I_s, H]     B of B4, k < I_s
  TensorMap shared_up_mn;      // shared_up [I_s, H]       B of B4, k >= I_s
  TensorMap dy_routed_mn;  // dy_routed [R, H]     A of B6 (m = h, k = row)
  TensorMap act_mn;        // act [R, I]           B of B6 (n = i)
  TensorMap dgu_mn;        // dgu [R, 2I]          A of B7 (m = gate or up column)
  TensorMap x_routed_mn;   // x_routed [R, H]      B of B7 (n = h)
  TensorMap d_out_mn;      // d_out [T, H]         A of B8 down
  TensorMap sact_mn;       // sact [T, I_s]        B of B8 down
  TensorMap dsgu_mn;       // dsgu [T, 2I_s]       A of B8 gate|up
  TensorMap x_mn;          // x [T, H]             B of B8 gate|up
};
static_assert(sizeof(MoEBackwardMaps) == 18 * 128, "MoEBackwardMaps layout: update mok_rt/kernels/moe_params.py");

// Maps first: the struct is 64-byte aligned and the maps need it.  The tail is padded to 64.
struct MoEForwardTmaParams {
  MoEForwardMaps maps;
  MoEForwardParams p;
};
static_assert(sizeof(MoEForwardTmaParams) == 2368 && offsetof(MoEForwardTmaParams, p) == 1280, "MoEForwardTmaParams layout: update mok_rt/kernels/moe_params.py");

struct MoEBackwardTmaParams {
  MoEBackwardMaps maps;
  MoEBackwardParams p;
};
static_assert(sizeof(MoEBackwardTmaParams) == 3520 && offsetof(MoEBackwardTmaParams, p) == 2304, "MoEBackwardTmaParams layout: update mok_rt/kernels/moe_params.py");
static_assert(sizeof(MoEBackwardTmaParams) <= 4096, "the classic kernel parameter limit");

}  // namespace mok
