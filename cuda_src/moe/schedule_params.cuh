// Parameters of the routing-schedule kernels (mirrored by mok_rt/kernels/schedule_params.py).
#pragma once
#include <stdint.h>

namespace mok {

// Routes are ordered globally by (source rank, token, slot j).  For the destination rank
// `rank`, rows are laid out by local expert, each expert's rows padded to `block_m`, and
// within an expert by that global route order.  Everything routing-dependent is computed here,
// on the device: the host never reads a count.
constexpr int kScheduleChunk = 4096;   // routes per CTA in the count and place passes
constexpr int kScheduleThreads = 1024;
constexpr int kMaxRanks = 64;          // source ranks whose routing one schedule can take

struct ScheduleParams {
  int* err;                    // error word, int32[4]
  int* chunk_count;            // scratch [max_chunks, num_experts]: per-chunk counts, then exclusive bases
  int* expert_total;           // scratch [num_experts]: routes per global expert
  int* expert_row_base;        // scratch [num_experts]: first row of each global expert in its rank's space
  int* expert_count;           // out [experts_per_rank]: rows per local expert (unpadded)
  int* expert_offset;          // out [experts_per_rank + 1]: padded row offsets
  int* totals;                 // out [2]: number of row blocks, number of padded rows
  int* block_expert;           // out [max_rows / block_m]: local expert of each row block
  int* row_src_rank;           // out [max_rows]: source rank of the route in each row, -1 for padding
  int* row_slot;               // out [max_rows]: slot t*top_k + j on the source, -1 for padding
  int* route_row;              // out [T_rank * top_k]: row of each of this rank's routes in its destination's space
  int* route_rank;             // out [T_rank * top_k]: destination rank of each of this rank's routes (may be null)
  int num_ranks;
  int rank;
  int num_experts;
  int experts_per_rank;
  int top_k;
  int block_m;
  int max_rows;                // capacity of this rank's padded row space (multiple of block_m)
  int max_chunks;
  int ids_int64;               // 1: topk_ids are int64, 0: int32
  int tokens_on_device;        // 1: read each source's token count at src_tokens_at[s] (expert parallelism)
  uint64_t src_ids[kMaxRanks];  // device pointer to each source rank's topk_ids [T_src, top_k]
  int src_tokens[kMaxRanks];    // tokens of each source rank (tokens_on_device = 0)
  uint64_t src_tokens_at[kMaxRanks];  // device pointer to each source rank's int32 token count (tokens_on_device = 1)
};
static_assert(sizeof(ScheduleParams) == 12 * 8 + 10 * 4 + kMaxRanks * 20,
              "ScheduleParams layout changed: update the ctypes mirror");

// Expert parallelism: before the three passes, every rank publishes its routing into its own
// symmetric block (the routing area: int32 token count at +0, int32 ids [T, k] at +16, ids
// saturated to int32 so that a bad int64 id stays out of range) and meets every peer at a group
// barrier; the passes then read every rank's area through the peer pointers.
constexpr int kRoutingIdsOffset = 16;

struct ExchangeParams {
  const unsigned long long* peer_bases;  // [num_ranks] every rank's block base, in this rank's address space
  const void* ids;                       // this rank's topk_ids [tokens, top_k] (int32 or int64)
  int* err;                              // this rank's error word
  unsigned long long area_offset;        // bytes from a block base to this call's routing area
  unsigned long long pad_offset;         // bytes from a block base to the exchange barrier's signal pad
  unsigned long long timeout_ns;
  int tokens;
  int top_k;
  int ids_int64;
  int rank;
  int num_ranks;
  int pad_;
};
static_assert(sizeof(ExchangeParams) == 6 * 8 + 6 * 4, "ExchangeParams layout changed: update the ctypes mirror");

// Expert parallelism, after the three passes: the order in which a layer launch takes this
// rank's row blocks (schedule_block_order).  A block's key is the wave of readiness chunks that
// brings its last row: max over its rows of row_slot / wave_routes, a wave being one chunk per push
// task (the push tasks push chunks i, i + P, ... side by side, on every rank alike, so the wave
// stands for an arrival time).  The blocks are sorted by key, stably: within a wave they keep
// block order, so an expert's blocks stay adjacent and share its weight tiles in L2 (a finer key,
// the chunk itself, would interleave the experts: every tile would read its weights from HBM).
// Positions past the blocks in use map to themselves.
constexpr int kOrderKeys = 256;  // keys are clamped below this (4 waves with moe_plan.CHUNKS_PER_PUSH_TASK)

struct BlockOrderParams {
  const int* row_slot;   // [max_blocks * block_m] the schedule's row_slot
  const int* totals;     // [2] the schedule's totals (row blocks in use first)
  int* block_order;      // out [max_blocks]: position -> row block
  int max_blocks;
  int block_m;
  int wave_routes;       // route slots per wave of readiness chunks: chunk_tokens * push tasks * top_k
  int keyed;             // 1: sort (key[] fits the dynamic shared memory), 0: identity order
};
static_assert(sizeof(BlockOrderParams) == 3 * 8 + 4 * 4, "BlockOrderParams layout changed: update the ctypes mirror");

}  // namespace mok
