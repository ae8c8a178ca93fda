// Parameter structs of the fused MoE forward/backward kernels (one GPU, or one rank of an
// expert-parallel group: MoEPeers).
// Mirrored field for field by mok_rt/kernels/moe_params.py (its buffer table names every pointer field):
// change both together.  Sizes and offsets are asserted on both sides with the same numbers
// (_moe_params.LAYOUT).  All pointers are device pointers; every struct is 8-byte aligned with
// pointers first, then 32-bit fields, so the C and ctypes layouts agree without packing rules.
#pragma once
#include <stddef.h>
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
static_assert(sizeof(MoESchedule) == 8 * 8, "MoESchedule layout: update mok_rt/kernels/moe_params.py");
static_assert(offsetof(MoESchedule, route_rank) == 56, "MoESchedule layout");

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
static_assert(sizeof(MoEDims) == 8 + 12 * 4, "MoEDims layout: update mok_rt/kernels/moe_params.py");
static_assert(offsetof(MoEDims, tokens) == 8 && offsetof(MoEDims, swiglu_limit) == 48, "MoEDims layout");

struct MoEWeights {
  const bf16* w_gate;   // [E_l, I, H]
  const bf16* w_up;     // [E_l, I, H]
  const bf16* w_down;   // [E_l, H, I]
  const bf16* shared_gate;  // [I_s, H]   (null when I_s = 0)
  const bf16* shared_up;    // [I_s, H]
  const bf16* shared_down;  // [H, I_s]
};
static_assert(sizeof(MoEWeights) == 6 * 8, "MoEWeights layout: update mok_rt/kernels/moe_params.py");
static_assert(offsetof(MoEWeights, shared_gate) == 24, "MoEWeights layout");

// Forward context: written by the forward, read by the backward.
struct MoEContext {
  bf16* x_routed;  // [max_rows, H] token rows by expert (padding rows zero)
  bf16* gu;        // [max_rows, 2I] pre-activation gate | up (unclamped)
  bf16* act;       // [max_rows, I] SwiGLU output
  bf16* y_slot;    // [T*k, H] unweighted expert output of each route
  bf16* sgu;       // [T, 2I_s] shared expert gate | up
  bf16* sact;      // [T, I_s] shared expert activation
};
static_assert(sizeof(MoEContext) == 6 * 8, "MoEContext layout: update mok_rt/kernels/moe_params.py");
static_assert(offsetof(MoEContext, sgu) == 32, "MoEContext layout");

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
static_assert(sizeof(MoEForwardCounters) == 8 * 8, "MoEForwardCounters layout: update mok_rt/kernels/moe_params.py");
static_assert(offsetof(MoEForwardCounters, ctas_done) == 56, "MoEForwardCounters layout");

// Expert parallelism: where this rank reaches every rank's
// symmetric block.  Every block has the same layout (offsets below).  Peers write a block's
// routed rows, slot rows and flags; everything else the kernels use is this rank's own memory.
// Flags hold epochs (host-counted per launch, the same on every rank): flags[kind][s] = e means
// "rank s finished its part of `kind` for epoch e" (st.release.sys by s, ld.acquire.sys here);
// they only grow, so nothing peers signal is ever reset.
// Right after them (flags_offset + kChunkFlagsOffset) come the readiness chunks' flags, int32
// [chunks][kChunkKinds][kMaxEpRanks]: chunk_flag[c][kind][s] = e means "rank s stored every row
// of its tokens [c * chunk_tokens, (c + 1) * chunk_tokens) for `kind` in epoch e" (ep.cuh); the
// host sizes the region (mok_rt/dist/ep.py HeapLayout: chunks = ceil(max_tokens / chunk_tokens)).
constexpr int kMaxEpRanks = 64;
enum PeerFlag : int {
  kFlagFwdRows = 0,     // forward: the source pushed its token rows
  kFlagFwdReturn = 1,   // forward: the destination returned its expert outputs
  kFlagBwdRows = 2,     // backward: the source pushed its weighted d_out rows
  kFlagBwdReturn = 3,   // backward: the destination returned its input gradients
  kNumPeerFlags = 4,
};
constexpr int kChunkKinds = 2;  // readiness chunks of kFlagFwdRows (0) and kFlagBwdRows (1)
constexpr unsigned long long kChunkFlagsOffset = kNumPeerFlags * kMaxEpRanks * 4;  // bytes after flags_offset

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
  int chunk_tokens;                      // source tokens per readiness chunk (the same on every rank, >= 1)
};
static_assert(sizeof(MoEPeers) == kMaxEpRanks * 8 + 5 * 8 + 6 * 4, "MoEPeers layout: update mok_rt/kernels/moe_params.py");
static_assert(sizeof(MoEPeers) == 576 && offsetof(MoEPeers, base_array) == 512 && offsetof(MoEPeers, num_ranks) == 552 &&
                  offsetof(MoEPeers, chunk_tokens) == 572,
              "MoEPeers layout");

// ---- the task plan (built by the host: mok_rt/kernels/moe_plan.py) ------------------------------------
// The task index space is a fixed sequence of phases, each a contiguous range [begin, begin + count)
// sized from host-known bounds (max_blocks, token blocks, tile counts); tasks past the device's
// routing counts are skipped.  The plan also holds the tile counts the task decoders need and, for
// every dependency counter, how many signals a waiter expects (per row block in use where the
// producer count depends on routing; the device multiplies by num_blocks or an expert's blocks).
struct PhaseRange {
  int begin, count;
  __device__ __forceinline__ bool has(int task) const { return task >= begin && task < begin + count; }
  __device__ __forceinline__ int local(int task) const { return task - begin; }
};

struct MoEForwardPlan {
  PhaseRange push, push_notify, dispatch, shared_gu, routed_gu, shared_down, routed_down, down_notify, combine;
  int total;                     // tasks in the launch
  int token_blocks;
  int gu_tiles;                  // gate|up tiles per row block (128 intermediate columns each)
  int sgu_tiles;                 // shared gate|up tiles per token block
  int h_tiles;                   // down tiles per row / token block (256 hidden columns each)
  int combine_parts;             // combine tasks per token block
  int wait_block_ready;          // block_ready[b]: dispatch tasks of the block
  int wait_block_act_ready;      // block_act_ready[b]: gate|up tiles of the block
  int wait_token_sact_ready;     // token_sact_ready[tb]: shared gate|up tiles of the token block
  int wait_token_shared_done;    // token_shared_done[tb]: shared down tiles of the token block
  int wait_down_done_per_block;  // down_done: down tiles per row block in use
  int wait_push_done;            // push_done: push tasks
};
static_assert(sizeof(MoEForwardPlan) == 30 * 4, "MoEForwardPlan layout: update mok_rt/kernels/moe_params.py");
static_assert(offsetof(MoEForwardPlan, total) == 72 && offsetof(MoEForwardPlan, wait_block_ready) == 96 &&
                  offsetof(MoEForwardPlan, wait_push_done) == 116,
              "MoEForwardPlan layout");

struct MoEBackwardPlan {
  PhaseRange push, push_notify, dispatch, d_weights, shared_da, routed_da, shared_dx, routed_dx, dx_notify,
      wgrad_down, wgrad_gate_up, shared_wgrad, combine;
  int total;
  int token_blocks;
  int i_tiles, si_tiles, h_tiles;        // 256-column tiles of I, I_s, H (dA, dX, wgrad columns)
  int h_rows, i_rows, si_rows;           // 128-row tiles of H, I, I_s (wgrad rows)
  int combine_parts;
  int wait_block_dy_ready;               // block_dy_ready[b]: dispatch tasks of the block
  int wait_block_dgu_ready;              // block_dgu_ready[b]: dA tiles of the block
  int wait_expert_dy_ready_per_block;    // expert_dy_ready[e]: dispatch tasks per row block of the expert
  int wait_expert_dgu_ready_per_block;   // expert_dgu_ready[e]: dA tiles per row block of the expert
  int wait_token_dsgu_ready;             // token_dsgu_ready[tb]: shared dA tiles of the token block
  int wait_token_dxs_ready;              // token_dxs_ready[tb]: shared dX tiles of the token block
  int wait_dsgu_done;                    // dsgu_done: shared dA tiles
  int wait_dx_done_per_block;            // dx_done: dX tiles per row block in use
  int wait_push_done;                    // push_done: push tasks
};
static_assert(sizeof(MoEBackwardPlan) == 44 * 4, "MoEBackwardPlan layout: update mok_rt/kernels/moe_params.py");
static_assert(offsetof(MoEBackwardPlan, total) == 104 && offsetof(MoEBackwardPlan, wait_block_dy_ready) == 140 &&
                  offsetof(MoEBackwardPlan, wait_push_done) == 172,
              "MoEBackwardPlan layout");

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
  unsigned long long* trace;  // null, or one TraceRec per task of the plan (trace.cuh)
  MoEDims dims;
  MoEForwardPlan plan;
  int context_only;           // 1: build the context only (no shared down, no output)
  int pad_;
  MoEPeers peers;
};
static_assert(sizeof(MoEForwardParams) == 1032 && offsetof(MoEForwardParams, w) == 64 &&
                  offsetof(MoEForwardParams, ctx) == 112 && offsetof(MoEForwardParams, cnt) == 160 &&
                  offsetof(MoEForwardParams, x) == 224 && offsetof(MoEForwardParams, err) == 256 &&
                  offsetof(MoEForwardParams, dims) == 272 && offsetof(MoEForwardParams, plan) == 328 &&
                  offsetof(MoEForwardParams, context_only) == 448 && offsetof(MoEForwardParams, peers) == 456,
              "MoEForwardParams layout: update mok_rt/kernels/moe_params.py");

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
static_assert(sizeof(MoEBackwardCounters) == 11 * 8, "MoEBackwardCounters layout: update mok_rt/kernels/moe_params.py");
static_assert(offsetof(MoEBackwardCounters, ctas_done) == 80, "MoEBackwardCounters layout");

// fp32, or bf16 when MoEBackwardParams::grad_bf16 (the caller's buffers decide); overwritten, or
// added to when accumulate = 1.
struct MoEWeightGrads {
  void* dw_gate;   // [E_l, I, H]
  void* dw_up;     // [E_l, I, H]
  void* dw_down;   // [E_l, H, I]
  void* d_shared_gate;  // [I_s, H]
  void* d_shared_up;    // [I_s, H]
  void* d_shared_down;  // [H, I_s]
};
static_assert(sizeof(MoEWeightGrads) == 6 * 8, "MoEWeightGrads layout: update mok_rt/kernels/moe_params.py");
static_assert(offsetof(MoEWeightGrads, d_shared_gate) == 24, "MoEWeightGrads layout");

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
  unsigned long long* trace;  // null, or one TraceRec per task of the plan (trace.cuh)
  MoEDims dims;
  MoEBackwardPlan plan;
  int accumulate;             // 1: add weight gradients into the existing contents
  int grad_bf16;              // 1: the weight gradients are bf16 (one rounding of the fp32 sum), 0: fp32
  MoEPeers peers;
};
static_assert(sizeof(MoEBackwardParams) == 1208 && offsetof(MoEBackwardParams, w) == 64 &&
                  offsetof(MoEBackwardParams, ctx) == 112 && offsetof(MoEBackwardParams, cnt) == 160 &&
                  offsetof(MoEBackwardParams, grads) == 248 && offsetof(MoEBackwardParams, x) == 296 &&
                  offsetof(MoEBackwardParams, err) == 376 && offsetof(MoEBackwardParams, dims) == 392 &&
                  offsetof(MoEBackwardParams, plan) == 448 && offsetof(MoEBackwardParams, accumulate) == 624 &&
                  offsetof(MoEBackwardParams, grad_bf16) == 628 &&
                  offsetof(MoEBackwardParams, peers) == 632,
              "MoEBackwardParams layout: update mok_rt/kernels/moe_params.py");

// Tiling shared by the kernels and the host (mok_rt/kernels/moe_params.py mirrors these).
constexpr int kBlockM = 128;       // rows per row block / token block (= GEMM tile height)
constexpr int kThreads = 256;      // worker threads per CTA (the two consumer warpgroups)

}  // namespace mok
