// The order in which the MoE kernels grab the plan's tasks (a permutation of the plan: same tasks,
// same results).
#pragma once
#include "moe/params.cuh"
#include "moe/tasks/task_graph.cuh"

namespace mok {
namespace pipe {

// The plans put every row block's dispatch (memory-bound) before the first GEMM tile that needs
// one, so all SMs copy rows at once and the tensor cores wait.  The TMA kernels walk that part
// of the index space in another order (a permutation: same tasks, same results):
//   [lead GEMMs (shared expert)] [dispatch 0 .. D-1]
//   [dispatch b + D, GEMM tiles of block b] for each block b  (the last D blocks: tiles only)
//   [trail (tasks nothing waits on)]
// D blocks ahead, so that a block's rows are in place before its tiles are grabbed: at least
// kAheadWaves waves of tasks (ceil(waves * grid / (per_block + 1)) blocks), and with kDispatchWave
// at least one block per CTA.  bf16: two waves (its dispatch task is half a gate|up tile long).
// FP8: a dispatch task runs as long as 1.7 gate|up tiles (deepseek-v3 slice: 95 vs 56 us); two
// waves left ~18 SMs waiting on dispatch throughout the gate|up phase (bench/NOTES-FP8-2.md round
// 14), four still left the start waiting on the first D blocks.  With a block per CTA every SM
// copies rows first (together near HBM bandwidth), and since four waves are fewer blocks than CTAs
// wherever a block has 3 or more tiles, D = grid then holds for the whole phase: at the slice's
// 16 tiles per block that is 17 waves ahead.
// A later row-block GEMM phase (`tiled`: the forward's down, the backward's dX) is walked in
// block groups (BlockGroups).  Every task still comes after everything it waits on (tiles of b
// after dispatch b; the lead, trail and tiled phases wait only on earlier phases), so the
// task-graph argument holds unchanged.
//
// Row blocks of one expert share their weight (B) tiles, but in plan order (block-major) the
// copies of one tile are a block's worth of grabs apart, long enough for L2 to drop the tile
// between its readers.  A group of kBlockGroup consecutive blocks is walked tile-major instead:
// the tasks that stream one B tile are grabbed together, and each block's A rows are re-read
// `group` grabs apart.  That suits the down and dX phases (short A rows per block); the gate|up /
// dA phase after dispatch re-reads long A rows (H wide, 1.8 MB a block at deepseek-v3 sizes)
// across a group's whole walk, so it walks each expert's own blocks instead (ExpertWalk).
constexpr int kBlockGroup = 8;

struct BlockGroups {
  int blocks, per_block, group;
  // The j-th task of the walk -> its index in the phase (block * per_block + tile).
  __device__ int map(int j) const {
    const int span = group * per_block, gi = j / span, w = j - gi * span;
    const int first = gi * group, size = min_int(group, blocks - first);
    const int tile = w / size;
    return (first + (w - tile * size)) * per_block + tile;
  }
};

// The GEMM phase right after dispatch (gate|up, dA) has a long K (H) and one weight tile per
// (expert, column tile): block-major, the row blocks of one expert read each tile a block's worth
// of grabs apart (deepseek-v3: 17 grabs, ~15 us), and L2 (turned over every ~15 us by the 3 TB/s
// stream) dropped it in between: the forward read 46 GB from HBM for 22.5 GB of weights.  Here
// the tiles of one expert's m row blocks are walked tile-major instead: tile n of all m blocks in
// consecutive grabs, each block's A rows re-read m grabs apart.  The tile slots of blocks
// [s, s + m) are permuted among themselves, so a tile of block b' lands in a slot of some block
// b >= s, b' < s + m: it still comes after dispatch b' when m <= ahead + 1 (AheadOrder puts
// dispatch b + ahead before the slots of block b; larger experts keep block-major, and so do
// experts of more blocks than two waves' worth, whose A rows would not stay in L2).  Reads the
// schedule (block_expert, expert_offset, expert_count) per grab: three loads on the producer.
struct ExpertWalk {
  const int* block_expert;
  const int* expert_offset;
  const int* expert_count;
  int experts, num_blocks, max_blocks;  // max_blocks: the longest expert walked tile-major
  // q = block-major index (block * per_block + tile) -> the tile walked at slot q.
  __device__ int map(int q, int per_block) const {
    const int b = q / per_block;
    if (b >= num_blocks) return q;
    const int e = block_expert[b];
    if (e < 0 || e >= experts) return q;  // a corrupt schedule: the task's own check reports it
    const int s = expert_offset[e] / kBlockM, m = ceil_div(expert_count[e], kBlockM);
    if (m <= 1 || m > max_blocks || b < s || b >= s + m) return q;
    const int j = q - s * per_block, n = j / m;
    return (s + (j - n * m)) * per_block + n;
  }
};

// Expert parallelism: the row blocks are taken in the schedule's block order (block_order:
// position -> block, sorted by the latest readiness chunk a block needs; schedule_block_order in
// schedule.cu), so the blocks whose rows arrive first are dispatched first and their GEMM tiles
// start under the rest of the push.  Block position i stands for block order[i] everywhere: its
// dispatch, its gate|up / dA tiles and its down / dX tiles (the same permutation of blocks in
// every phase, so each task still comes after what it waits on).  The sort is stable over a
// coarse key (the wave of chunks), so an expert's blocks of one wave stay adjacent and share its
// weight tiles; the expert walk, which reads an expert's block range, is off.
// Where block position i points: itself (one GPU, the FP8 kernels), or the schedule's block order.
struct PlanBlocks {
  static constexpr bool kOrdered = false;
  __device__ void set_order(const int*, int) {}
  __device__ int block_at(int i) const { return i; }
};
struct ScheduledBlocks {
  static constexpr bool kOrdered = true;
  const int* order;  // null: plan order; else [max_blocks] position -> row block
  int order_blocks;  // positions below it are permuted (the blocks in use)
  __device__ void set_order(const int* o, int n) { order = o; order_blocks = n; }
  // The row block at position i (a corrupt entry falls back to i: the tasks then check the block).
  __device__ int block_at(int i) const {
    if (order == nullptr || i >= order_blocks) return i;
    const int b = order[i];
    return b >= 0 && b < order_blocks ? b : i;
  }
};

constexpr int kWalkWaves = 2;  // ExpertWalk: the longest expert walked tile-major, in waves of tasks

template <class Blocks, int kAheadWaves, bool kDispatchWave>
struct AheadOrderOf : Blocks {
  int begin, end;                // the reordered index range (contiguous phases)
  PhaseRange lead, dispatch, gemm, trail, tiled;
  int per_block, ahead;
  BlockGroups tiled_walk;
  ExpertWalk gemm_walk;

  // block_order: ScheduledBlocks only (null: plan order).
  __device__ static AheadOrderOf make(const PhaseRange& lead, const PhaseRange& dispatch, const PhaseRange& gemm,
                                      const PhaseRange& trail, int per_block, const PhaseRange& tiled,
                                      int tiled_per_block, const MoESchedule& sc, int experts, int num_blocks,
                                      const int* block_order = nullptr) {
    AheadOrderOf o{{}, 0, 0, lead, dispatch, gemm, trail, tiled, per_block, 0, {}, {}};
    o.begin = min_int(min_int(lead.begin, dispatch.begin), trail.count > 0 ? trail.begin : dispatch.begin);
    o.end = o.begin + lead.count + dispatch.count + gemm.count + trail.count;
    const int grid = static_cast<int>(gridDim.x);
    const int waves = ceil_div(kAheadWaves * grid, per_block + 1);
    o.ahead = min_int(dispatch.count, kDispatchWave && grid > waves ? grid : waves);
    o.tiled_walk = BlockGroups{tiled_per_block > 0 ? tiled.count / tiled_per_block : 0, tiled_per_block, kBlockGroup};
    o.gemm_walk = ExpertWalk{sc.block_expert, sc.expert_offset, sc.expert_count, experts,
                             min_int(num_blocks, dispatch.count),
                             min_int(o.ahead, ceil_div(kWalkWaves * grid, per_block + 1)) + 1};
    o.set_order(block_order, min_int(num_blocks, dispatch.count));
    return o;
  }
  __device__ bool ordered() const {
    if constexpr (Blocks::kOrdered) return this->order != nullptr;
    return false;
  }
  // Index q = position * per + tile of a row-block phase -> the same tile of block_at(position).
  __device__ int permuted(int q, int per) const {
    if (!ordered()) return q;
    const int i = q / per;
    return this->block_at(i) * per + (q - i * per);
  }
  // The gate|up / dA tile at block-major slot q: the expert walk, or with a block order the slot's block.
  __device__ int gemm_tile(int q, int per) const { return ordered() ? permuted(q, per) : gemm_walk.map(q, per); }
  // The plan index of the task grabbed at position t.
  __device__ int map(int t) const {
    if (tiled.has(t)) return tiled.begin + permuted(tiled_walk.map(tiled.local(t)), tiled_walk.per_block);
    if (t < begin || t >= end) return t;
    int u = t - begin;
    if (u < lead.count) return lead.begin + u;
    u -= lead.count;
    const int blocks = dispatch.count, g = per_block, d = ahead;
    if (u < d) return dispatch.begin + this->block_at(u);
    u -= d;
    const int mid = (blocks - d) * (g + 1);
    if (u < mid) {
      const int b = u / (g + 1), r = u - b * (g + 1);
      return r == 0 ? dispatch.begin + this->block_at(b + d) : gemm.begin + gemm_tile(b * g + (r - 1), g);
    }
    u -= mid;
    if (u < d * g) return gemm.begin + gemm_tile((blocks - d) * g + u, g);
    return trail.begin + (u - d * g);
  }
};

// The FP8 kernels: plan block order, D = max(grid, four waves).  The bf16 kernels (one GPU or EP):
// the schedule's block order with EP, two waves ahead.
using AheadOrder = AheadOrderOf<PlanBlocks, 4, true>;
using ScheduledOrder = AheadOrderOf<ScheduledBlocks, 2, false>;

}  // namespace pipe
}  // namespace mok
