// Parameters of the routing-schedule kernels (mirrored by mok_rt/_schedule_params.py).
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
  int num_ranks;
  int rank;
  int num_experts;
  int experts_per_rank;
  int top_k;
  int block_m;
  int max_rows;                // capacity of this rank's padded row space (multiple of block_m)
  int max_chunks;
  int ids_int64;               // 1: topk_ids are int64, 0: int32
  int pad_;
  uint64_t src_ids[kMaxRanks];  // device pointer to each source rank's topk_ids [T_src, top_k]
  int src_tokens[kMaxRanks];    // tokens of each source rank
};
static_assert(sizeof(ScheduleParams) == 11 * 8 + 10 * 4 + kMaxRanks * 12,
              "ScheduleParams layout changed: update the ctypes mirror");

}  // namespace mok
