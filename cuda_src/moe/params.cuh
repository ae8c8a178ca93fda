// Parameter structs of the fused MoE forward/backward kernels (one GPU, or one rank of an
// expert-parallel group: MoEPeers).
// Mirrored field for field by mok_rt/_moe_params.py: change both together (sizes are asserted
// on both sides).  All pointers are device pointers; every struct is 8-byte aligned with
// pointers first, then 32-bit fields, so the C and ctypes layouts agree without packing rules.
#pragma once
#include <stdint.h>
#include <cuda_bf16.h>

namespace mok {

using bf16 = __nv_bfloat16;

// Routing schedule (produced on the device by the schedule kernel, read-only here).  Counts
// that depend on routing are read only on the device.
struct MoESchedule {
  const int* expert_count;   // [E_l] rows per local expert (unpadded)
  const int* expert_offset;  // [E_l + 1] padded row offsets (multiples of kBlockM)
  const int* num_blocks;     // [1] row blocks in use (= expert_offset[E_l] / kBlockM)
  const int* block_expert;   // [max_blocks] local expert of each row block
  const int* row_src_rank;   // [max_rows] source rank of each padded row, -1 for padding
  const int* row_slot;       // [max_rows] slot t*k + j of the route in each row, -1 for padding
  const int* route_row;      // [T * k] row of each route in its destination's row space
  const int* route_rank;     // [T * k] destination rank of each route (read only with expert parallelism)
};
static_assert(sizeof(MoESchedule) == 8 * 8, "MoESchedule layout: update mok_rt/_moe_params.py");

// Host-known sizes and options shared by both kernels.
struct MoEDims {
  long long timeout_ns;      // a dependency wait longer than this sets kErrTimeout
  int tokens;                // T
  int hidden;                // H  (multiple of 64)
  int inter;                 // I  (multiple of 64)
  int shared_inter;          // I_s (0: no shared expert; else multiple of 64)
  int top_k;                 // k
  int local_experts;         // E_l
  int max_rows;              // capacity of the padded row space (multiple of kBlockM)
  int max_blocks;            // max_rows / kBlockM
  int rank;                  // this rank (reported in error words)
  int has_limit;             // 1: swiglu_limit applies
  float swiglu_limit;
  int pad_;
};
static_assert(sizeof(MoEDims) == 8 + 12 * 4, "MoEDims layout: update mok_rt/_moe_params.py");

struct MoEWeights {
  const bf16* w_gate;   // [E_l, I, H]
  const bf16* w_up;     // [E_l, I, H]
  const bf16* w_down;   // [E_l, H, I]
  const bf16* ws_gate;  // [I_s, H]   (null when I_s = 0)
  const bf16* ws_up;    // [I_s, H]
  const bf16* ws_down;  // [H, I_s]
};
static_assert(sizeof(MoEWeights) == 6 * 8, "MoEWeights layout: update mok_rt/_moe_params.py");

// Forward context: written by the forward, read by the backward.
struct MoEContext {
  bf16* x_routed;  // [max_rows, H] token rows by expert (padding rows zero)
  bf16* gu;        // [max_rows, 2I] pre-activation gate | up (unclamped)
  bf16* act;       // [max_rows, I] SwiGLU output
  bf16* y_slot;    // [T*k, H] unweighted expert output of each route
  bf16* sgu;       // [T, 2I_s] shared expert gate | up
  bf16* sact;      // [T, I_s] shared expert activation
};
static_assert(sizeof(MoEContext) == 6 * 8, "MoEContext layout: update mok_rt/_moe_params.py");

// Dependency counters, zeroed by the host (one memset) before each launch.
struct MoEForwardCounters {
  int* task_next;          // [1] next task index to grab
  int* down_done;          // [1] F4 tasks finished
  int* block_ready;        // [max_blocks] F0 done for the row block
  int* block_act_ready;    // [max_blocks] F2 tiles done for the row block
  int* token_sact_ready;   // [token_blocks] F1 tiles done for the token block
  int* token_shared_done;  // [token_blocks] F3 tiles done for the token block
  int* push_done;          // [1] EP: push tasks finished
  int* ctas_done;          // [1] EP: CTAs that left the task loop (the last one runs the end barrier)
};
static_assert(sizeof(MoEForwardCounters) == 8 * 8, "MoEForwardCounters layout: update mok_rt/_moe_params.py");

// Expert parallelism (DESIGN.md §3 "Dispatch", "combine"): where this rank reaches every rank's
// symmetric block.  Every block has the same layout (offsets below).  Peers write a block's
// routed rows, slot rows and flags; everything else the kernels use is this rank's own memory.
// Flags hold epochs (host-counted per launch, the same on every rank): flags[kind][s] = e means
// "rank s finished its part of `kind` for epoch e" (st.release.sys by s, ld.acquire.sys here);
// they only grow, so nothing peers signal is ever reset.
constexpr int kMaxEpRanks = 64;
enum PeerFlag : int {
  kFlagFwdRows = 0,     // forward: the source pushed its token rows
  kFlagFwdReturn = 1,   // forward: the destination returned its expert outputs
  kFlagBwdRows = 2,     // backward: the source pushed its weighted d_out rows
  kFlagBwdReturn = 3,   // backward: the destination returned its input gradients
  kNumPeerFlags = 4,
};

struct MoEPeers {
  unsigned long long base[kMaxEpRanks];  // every rank's block base, in this rank's address space
  const unsigned long long* base_array;  // the same bases as a device array (the group barrier's)
  unsigned long long routed_offset;      // bytes: [max_rows, H] bf16 rows received (x, then weighted d_out)
  unsigned long long slot_offset;        // bytes: [slot_rows, H] bf16 rows returned per route (y, then dx)
  unsigned long long flags_offset;       // bytes: int32 [kNumPeerFlags][kMaxEpRanks]
  unsigned long long end_pad_offset;     // bytes: signal pad of the end-of-launch group barrier
  int num_ranks;                         // 1: no expert parallelism (the rest is unused)
  int rank;
  int epoch;
  int push_tasks;                        // tasks that push this rank's token rows (>= 1 with EP)
  int slot_rows;                         // max_tokens * top_k
  int pad_;
};
static_assert(sizeof(MoEPeers) == kMaxEpRanks * 8 + 5 * 8 + 6 * 4, "MoEPeers layout: update mok_rt/_moe_params.py");

struct MoEForwardParams {
  MoESchedule sched;
  MoEWeights w;
  MoEContext ctx;
  MoEForwardCounters cnt;
  const bf16* x;              // [T, H]
  const float* topk_weights;  // [T, k]
  bf16* out;                  // [T, H]
  float* shared_y;            // [T, H] scratch: shared expert output
  int* err;                   // error word int32[4]
  unsigned long long* trace;  // null, or one TraceRec per task (trace.cuh)
  MoEDims dims;
  int context_only;           // 1: build the context only (no shared down, no output)
  int trace_tasks;            // records behind `trace` (the host's count of the plan's tasks)
  MoEPeers peers;
};
static_assert(sizeof(MoEForwardParams) ==
                  8 * 8 + 6 * 8 + 6 * 8 + 8 * 8 + 6 * 8 + sizeof(MoEDims) + 8 + sizeof(MoEPeers),
              "MoEForwardParams layout: update mok_rt/_moe_params.py");

struct MoEBackwardCounters {
  int* task_next;          // [1]
  int* dx_done;            // [1] B5 tasks finished
  int* dsgu_done;          // [1] B2 tasks finished
  int* block_dy_ready;     // [max_blocks] B0 done for the row block
  int* block_dgu_ready;    // [max_blocks] B3 tiles done for the row block
  int* expert_dy_ready;    // [E_l] B0 blocks done for the expert
  int* expert_dgu_ready;   // [E_l] B3 tiles done for the expert
  int* token_dsgu_ready;   // [token_blocks] B2 tiles done for the token block
  int* token_dxs_ready;    // [token_blocks] B4 tiles done for the token block
  int* push_done;          // [1] EP: push tasks finished
  int* ctas_done;          // [1] EP: CTAs that left the task loop
};
static_assert(sizeof(MoEBackwardCounters) == 11 * 8, "MoEBackwardCounters layout: update mok_rt/_moe_params.py");

struct MoEWeightGrads {  // fp32; overwritten, or added to when accumulate = 1
  float* dw_gate;   // [E_l, I, H]
  float* dw_up;     // [E_l, I, H]
  float* dw_down;   // [E_l, H, I]
  float* dws_gate;  // [I_s, H]
  float* dws_up;    // [I_s, H]
  float* dws_down;  // [H, I_s]
};
static_assert(sizeof(MoEWeightGrads) == 6 * 8, "MoEWeightGrads layout: update mok_rt/_moe_params.py");

struct MoEBackwardParams {
  MoESchedule sched;
  MoEWeights w;
  MoEContext ctx;             // read-only here
  MoEBackwardCounters cnt;
  MoEWeightGrads grads;
  const bf16* x;              // [T, H]
  const float* topk_weights;  // [T, k]
  const bf16* d_out;          // [T, H]
  bf16* dx;                   // [T, H]
  float* d_topk_weights;      // [T, k]
  bf16* dy_routed;            // [max_rows, H] scratch: weighted d_out rows by expert (EP: this rank's routed rows)
  bf16* dgu;                  // [max_rows, 2I] scratch: d gate | d up
  bf16* dx_slot;              // [T*k, H] scratch: input gradient of each route (EP: this rank's slot rows)
  bf16* dsgu;                 // [T, 2I_s] scratch: shared d gate | d up
  float* dx_shared;           // [T, H] scratch: shared expert input gradient
  int* err;                   // error word int32[4]
  unsigned long long* trace;  // null, or one TraceRec per task (trace.cuh)
  MoEDims dims;
  int accumulate;             // 1: add weight gradients into the existing fp32 contents
  int trace_tasks;            // records behind `trace` (the host's count of the plan's tasks)
  MoEPeers peers;
};
static_assert(sizeof(MoEBackwardParams) ==
                  8 * 8 + 6 * 8 + 6 * 8 + 11 * 8 + 6 * 8 + 12 * 8 + sizeof(MoEDims) + 8 + sizeof(MoEPeers),
              "MoEBackwardParams layout: update mok_rt/_moe_params.py");

// Tiling shared by the kernels and the host (mok_rt/_moe_params.py mirrors these).
constexpr int kBlockM = 128;       // rows per row block / token block (= GEMM tile height)
// The combines (F5, B9) run last and read k rows per token: each token block is split into
// combine_parts(token_blocks) tasks so that the tail fills a 132-SM GPU (H100 / H200) without
// adding tasks where one per block already does: 128+ blocks: 1 (qwen3, 16384 tokens: splitting in
// 4 cost its forward 2.5 %), 64+: 2 (deepseek-v3, 8192 tokens), fewer: 4.  Divides kBlockM.
// mok_rt/_moe_params.py combine_parts mirrors it.
constexpr int kMaxCombineParts = 4;
__host__ __device__ constexpr int combine_parts(int token_blocks) {
  return token_blocks >= 128 ? 1 : token_blocks >= 64 ? 2 : kMaxCombineParts;
}
constexpr int kThreads = 256;      // threads per CTA
constexpr int kGateUpCols = 64;    // SwiGLU columns per fused gate|up forward tile

}  // namespace mok
