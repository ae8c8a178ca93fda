// The warp-specialised persistent loop of the TMA + wgmma MoE kernels (moe_layer_tma.cu).
//
// CTA: 384 threads.  Warpgroup 0 gives its registers away (setmaxnreg.dec) and keeps one thread,
// the producer: it grabs task indices, decodes each into a Job, does every dependency wait of
// the task (acquire, then fence.proxy.async.global because TMA reads through the async proxy),
// publishes the Job in a 2-entry queue in shared memory and, for a GEMM, issues the TMA loads of
// all its k-tiles into the 4-slot ring (moe/gemm_wgmma.cuh).  Warpgroups 1-2 are the workers
// (kThreads = 256, the task bodies' thread count): they take Jobs in order, run wgmma over the
// ring plus a fused epilogue straight from the accumulator registers, or a non-GEMM body, and
// signal the task's counters.  So the producer fetches task t+1's operands during task t's
// epilogue, and dependency spins never hold the tensor cores' warps.
//
// Deadlock freedom (as in task_graph.cuh): a task waits only on tasks grabbed earlier (lower
// positions of the order below).  The producer has issued everything of task t before it waits
// on the dependencies of the task it grabbed next, and the workers need nothing more from the
// producer to finish t, so every grabbed task completes, whichever CTA holds it.
//
// Failure: only the producer's dependency waits look at the error word (they fail fast and the
// producer publishes a stop Job, kind 0).  Queue and ring waits depend on this CTA alone, so they never
// give up on someone else's error (watch_err = false): a GEMM that was published is always
// drained, and no CTA exits with a TMA load in flight.  They are still bounded (a bug reports
// kErrTimeout instead of hanging); every worker decision is made uniform with workers_any.
#pragma once
#include <climits>
#include "common/mma.cuh"
#include "moe/gemm_wgmma.cuh"
#include "moe/task_graph.cuh"

namespace mok {
namespace pipe {

constexpr int kBN = 256;                       // tile: 128 rows x 256 columns
constexpr int kStages = 4;                     // 4 x 48 KB ring
constexpr int kCtaThreads = 128 + kThreads;    // producer warpgroup + workers
static_assert(kCtaThreads == wg::kThreads, "the engine's CTA layout");
constexpr int kAccRegs = kBN / 2;              // fp32 accumulators per worker thread
constexpr int kQueue = 2;                      // Jobs in flight between producer and workers
// Register split (setmaxnreg): the producer decodes tasks (~50 live values in the backward), the
// workers need 128 accumulators + an epilogue (ptxas uses ~200).  At launch the CTA holds
// 384 x 168 registers (__launch_bounds__(384, 1)); the split must fit in that pool or
// setmaxnreg.inc waits forever.
constexpr int kProducerRegs = 56;
constexpr int kWorkerRegs = 224;
static_assert(128 * kProducerRegs + kThreads * kWorkerRegs <= 384 * 168, "the CTA's register pool");

template <int kAMajor, int kBMajor>
using Engine = wg::Engine<kBN, kStages, kAMajor, kBMajor>;
using Geometry = Engine<wg::kKMajor, wg::kKMajor>;  // the ring's layout does not depend on the majors

// A decoded task (kind 0 = stop).  The meaning of a..d is per kind (see the kernels' headers);
// e = 1 on a routed row block whose rows 64..127 are padding (see gemm()).
struct Job {
  int kind;
  int gemm;     // what the producer streams into the ring: kLoadNone, kLoadGemm or kLoadRows
  int k_tiles;
  int a, b, c, d, e;
  int slot;     // the task's grab position (its trace record)
};
// Job::gemm: nothing; the k_tiles stages of a GEMM (prepare's LoadSrc a, b); or k_tiles stages of
// whole rows (K::stage_rows, moe/staged_rows.cuh).
enum JobLoads : int { kLoadNone = 0, kLoadGemm = 1, kLoadRows = 2 };
static_assert(sizeof(Job) == 36, "Job layout (kSmemBytes and mok_rt/_moe_params.py TMA_SMEM_BYTES count it)");

constexpr int kQueueBarrierBytes = 2 * kQueue * 8;
// Dynamic shared memory: ring (1024-aligned, + slack) + ring barriers + queue barriers + Jobs.
constexpr int kSmemBytes = Geometry::kRingBytes + 1024 + Geometry::kBarrierBytes + kQueueBarrierBytes +
                           kQueue * static_cast<int>(sizeof(Job));
static_assert(kSmemBytes == 197800, "mok_rt/_moe_params.py TMA_SMEM_BYTES mirrors this");
static_assert(kSmemBytes <= 227 * 1024, "fits the opt-in shared memory of sm_90");

struct Shared {
  Geometry::Ring ring;
  uint32_t queue_bars;  // job_full[q] at +8q, job_empty[q] at +8(kQueue + q)
  Job* jobs;
  __device__ __forceinline__ uint32_t job_full(int q) const { return queue_bars + 8u * q; }
  __device__ __forceinline__ uint32_t job_empty(int q) const { return queue_bars + 8u * (kQueue + q); }
};

__device__ __forceinline__ Shared layout(unsigned char* smem) {
  Shared s;
  s.ring = Geometry::ring(smem);
  s.queue_bars = s.ring.bars + Geometry::kBarrierBytes;
  s.jobs = reinterpret_cast<Job*>(smem + (s.queue_bars + kQueueBarrierBytes - smem_u32(smem)));
  return s;
}

// Thread 0 initialises every barrier; the caller then passes __syncthreads before any use.
__device__ __forceinline__ void init(const Shared& s) {
  if (threadIdx.x == 0) {
    for (int q = 0; q < kQueue; ++q) {
      mbar_init(s.job_full(q), 1);
      mbar_init(s.job_empty(q), kThreads / 32);  // one arrival per worker warp
    }
  }
  Geometry::init(s.ring);  // thread 0; ends with fence.mbarrier_init
}

// ---- operand loads (producer) -------------------------------------------------------------------
// Where the k-tiles of one operand come from.  K-major: one box of `kRows` rows from `map`, or,
// with map2, two boxes of kRows/2 rows (gate rows from map, up rows from map2, same row0) into
// the two halves of the tile.  MN-major: kRows/64 panels of 64 rows; k-tiles [0, k_switch) from
// `map`, the later ones from `map2` restarting at k0 (dX's K = [gate | up]).
struct LoadSrc {
  const TensorMap* map;
  const TensorMap* map2;
  int row0;      // first tile row (M for A, N for B) inside the group
  int k0;        // K coordinate of k-tile 0 (a wgrad's first row of the expert)
  int group;     // outermost map coordinate (the expert)
  int k_switch;
  int major;     // wg::kKMajor or wg::kMNMajor
};

__device__ __forceinline__ LoadSrc kmajor(const TensorMap* m, int row0, int group = 0, const TensorMap* m2 = nullptr) {
  return LoadSrc{m, m2, row0, 0, group, INT_MAX, wg::kKMajor};
}
__device__ __forceinline__ LoadSrc mnmajor(const TensorMap* m, int row0, int k0 = 0, int group = 0,
                                           const TensorMap* m2 = nullptr, int k_switch = INT_MAX) {
  return LoadSrc{m, m2, row0, k0, group, k_switch, wg::kMNMajor};
}

// The maps' addresses are constants (parameter space): left alone, the compiler hoists every one
// of them out of the producer loop and spills them from its 56 registers.  Taking the maps
// through this empty asm in each iteration keeps one base address live instead.
template <class Maps>
__device__ __forceinline__ const Maps& late(const Maps& m) {
  const Maps* p = &m;
  asm volatile("" : "+l"(p));
  return *p;
}

template <int kRows>
__device__ __forceinline__ void load_tile(const LoadSrc& s, int kt, uint32_t dst, uint32_t bar) {
  if (s.major == wg::kKMajor) {
    const int k = s.k0 + kt * wg::kBK;
    if (s.map2 == nullptr) {
      tma_load_3d(dst, s.map, bar, k, s.row0, s.group);
    } else {
      tma_load_3d(dst, s.map, bar, k, s.row0, s.group);
      tma_load_3d(dst + (kRows / 2) * wg::kLineBytes, s.map2, bar, k, s.row0, s.group);
    }
  } else {
    const bool first = kt < s.k_switch;
    const TensorMap* m = first ? s.map : s.map2;
    const int k = s.k0 + (first ? kt : kt - s.k_switch) * wg::kBK;
#pragma unroll
    for (int p = 0; p < kRows / 64; ++p) tma_load_3d(dst + p * wg::kPanelBytes, m, bar, s.row0 + 64 * p, k, s.group);
  }
}

// Issues the k_tiles stages of a Job of rows: K::stage_rows(job, stage, slot address, full barrier)
// issues the stage's copies and returns their bytes.
template <class K>
__device__ __forceinline__ bool produce_rows(const K& k, const Shared& s, wg::PipeState& ps, const Job& job,
                                             const MbarWaitCtx& w) {
  for (int st = 0; st < job.k_tiles; ++st) {
    if (!mbar_wait(s.ring.empty(ps.slot), ps.phase ^ 1u, w)) return false;
    const uint32_t full = s.ring.full(ps.slot);
    mbar_arrive_expect_tx(full, k.stage_rows(job, st, s.ring.a_tile(ps.slot), full));
    ps.advance(kStages);
  }
  return true;
}

// Issues the k_tiles stages of one GEMM (every box credits its full size, zero-filled or not).
__device__ __forceinline__ bool produce(const Shared& s, wg::PipeState& ps, const LoadSrc& a, const LoadSrc& b,
                                        int k_tiles, const MbarWaitCtx& w) {
  for (int kt = 0; kt < k_tiles; ++kt) {
    if (!mbar_wait(s.ring.empty(ps.slot), ps.phase ^ 1u, w)) return false;
    const uint32_t full = s.ring.full(ps.slot);
    mbar_arrive_expect_tx(full, Geometry::kStageBytes);
    load_tile<wg::kBM>(a, kt, s.ring.a_tile(ps.slot), full);
    load_tile<kBN>(b, kt, s.ring.b_tile(ps.slot), full);
    ps.advance(kStages);
  }
  return true;
}

// ---- the Job queue ---------------------------------------------------------------------------------
struct QueueState {
  int slot = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++slot == kQueue) { slot = 0; phase ^= 1u; }
  }
};

// Producer thread: wait for a free entry, write the Job, release it (mbarrier arrive = release.cta).
__device__ __forceinline__ bool publish(const Shared& s, QueueState& qs, const Job& job, const MbarWaitCtx& w) {
  if (!mbar_wait(s.job_empty(qs.slot), qs.phase ^ 1u, w)) return false;
  s.jobs[qs.slot] = job;
  mbar_arrive(s.job_full(qs.slot));
  qs.advance();
  return true;
}

// Workers: the next Job (try_wait acquires the producer's writes); kind 0 on a timeout, for the
// whole warpgroup.  worker_loop makes the verdict uniform over both warpgroups, except for Jobs
// they run in turns (below), which must not hold one warpgroup at the other's barrier.
__device__ __forceinline__ Job take(const Shared& s, QueueState& qs, const MbarWaitCtx& w, int consumer) {
  const bool ok = mbar_wait(s.job_full(qs.slot), qs.phase, w);
  Job job = s.jobs[qs.slot];
  __syncwarp();  // every lane has read the entry before lane 0 frees it
  if ((threadIdx.x & 31) == 0) mbar_arrive(s.job_empty(qs.slot));
  qs.advance();
  if (wg::warpgroup_any(!ok, consumer)) job.kind = 0;
  return job;
}

// ---- GEMMs in turns ---------------------------------------------------------------------------------
// A weight-gradient tile has a short K (an expert's rows, ~4 k-tiles) and a long fp32 epilogue
// (128 KB): with both warpgroups in step the tensor cores idle through every epilogue.  For those
// Jobs (K::in_turns) the warpgroups take turns instead: warpgroup 0 runs its 64 rows' MMAs, hands
// the tensor cores to warpgroup 1 (named barrier kTurnTo1) and stores while warpgroup 1 runs its
// MMAs, which hands them back (kTurnTo0) before warpgroup 0's next tile.  Both still read every
// ring stage (a slot is refilled when both released it), so warpgroup 0 cannot run more than
// kStages k-tiles ahead of warpgroup 1: it hands over after min(K, kStages) k-tiles (for
// K > kStages the two then share the tensor cores for the rest; the hand-over must come before
// warpgroup 0 waits for a slot that only warpgroup 1 can free, or neither moves).  Each
// warpgroup arrives on its hand-over barrier once per mainloop, failed or not, so the other never
// waits for a turn that does not come; warpgroup 0 waits for warpgroup 1's hand-back lazily
// (`owed`): before its next mainloop, or before the first Job not run in turns.
// Known gap (review): verdicts are per warpgroup here, and named barriers do not time out.  If
// only one warpgroup fails (a ring wait of one, or a take() timeout just before a Job in turns)
// it leaves while the other waits at a hand-over or at the next vote of both: a hang instead of
// kErrTimeout.  Both need a bug to happen; the fix is mbarrier hand-overs (bounded waits) and a
// failed warpgroup that keeps taking Jobs until the next vote of both.
constexpr int kTurnTo0 = 4;  // named barriers (0: __syncthreads, 1-2: warpgroup votes, 3: workers)
constexpr int kTurnTo1 = 5;

// Warpgroup 0's `owed` flag lives in shared memory (every thread of warpgroup 0 writes the same
// value, each reads back its own write): a register held across run() made the backward spill.
struct Turns {
  volatile int* owed;  // warpgroup 0: warpgroup 1 still hands the tensor cores back once
  __device__ __forceinline__ void settle(int consumer) const {
    if (consumer == 0 && *owed != 0) {
      named_bar_sync(kTurnTo0, kThreads);
      *owed = 0;
    }
  }
};

// ---- task order ----------------------------------------------------------------------------------
// The plans put every row block's dispatch (memory-bound) before the first GEMM tile that needs
// one, so all SMs copy rows at once and the tensor cores wait.  The TMA kernels walk that part
// of the index space in another order (a permutation: same tasks, same results):
//   [lead GEMMs (shared expert)] [dispatch 0 .. D-1]
//   [dispatch b + D, GEMM tiles of block b] for each block b  (the last D blocks: tiles only)
//   [trail (tasks nothing waits on)]
// D = two waves of tasks ahead, so a block's rows are in place before its tiles are grabbed.
// A later row-block GEMM phase (`tiled`: the forward's down, the backward's dX) is walked in
// block groups (BlockGroups).  Every task still comes after everything it waits on (tiles of b
// after dispatch b; the lead, trail and tiled phases wait only on earlier phases), so the
// task-graph argument holds unchanged.
//
// Row blocks of one expert share their weight (B) tiles, but in plan order (block-major) the
// copies of one tile are a block's worth of grabs apart, long enough for L2 to drop the tile
// between its readers.  A group of kBlockGroup consecutive blocks is walked tile-major instead:
// the tasks that stream one B tile are grabbed together, and each block's A rows are re-read
// `group` grabs apart.  Measured on deepseek-v3 (bench/NOTES.md): the down and dX phases got
// faster; the gate|up phase after dispatch got slower that way (its A rows, 1.8 MB a block, are
// re-read across the group's whole walk): it walks each expert's own blocks instead (ExpertWalk).
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
// dispatch b + ahead before the slots of block b; larger experts keep block-major).  Reads the
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

struct AheadOrder {
  int begin, end;                // the reordered index range (contiguous phases)
  PhaseRange lead, dispatch, gemm, trail, tiled;
  int per_block, ahead;
  BlockGroups tiled_walk;
  ExpertWalk gemm_walk;

  __device__ static AheadOrder make(const PhaseRange& lead, const PhaseRange& dispatch, const PhaseRange& gemm,
                                    const PhaseRange& trail, int per_block, const PhaseRange& tiled,
                                    int tiled_per_block, const MoESchedule& sc, int experts, int num_blocks) {
    AheadOrder o{0, 0, lead, dispatch, gemm, trail, tiled, per_block, 0, {}, {}};
    o.begin = min_int(min_int(lead.begin, dispatch.begin), trail.count > 0 ? trail.begin : dispatch.begin);
    o.end = o.begin + lead.count + dispatch.count + gemm.count + trail.count;
    o.ahead = min_int(dispatch.count, ceil_div(2 * static_cast<int>(gridDim.x), per_block + 1));
    o.tiled_walk = BlockGroups{tiled_per_block > 0 ? tiled.count / tiled_per_block : 0, tiled_per_block, kBlockGroup};
    o.gemm_walk = ExpertWalk{sc.block_expert, sc.expert_offset, sc.expert_count, experts,
                             min_int(num_blocks, dispatch.count), o.ahead + 1};
    return o;
  }
  // The plan index of the task grabbed at position t.
  __device__ int map(int t) const {
    if (tiled.has(t)) return tiled.begin + tiled_walk.map(tiled.local(t));
    if (t < begin || t >= end) return t;
    int u = t - begin;
    if (u < lead.count) return lead.begin + u;
    u -= lead.count;
    const int blocks = dispatch.count, g = per_block, d = ahead;
    if (u < d) return dispatch.begin + u;
    u -= d;
    const int mid = (blocks - d) * (g + 1);
    if (u < mid) {
      const int b = u / (g + 1), r = u - b * (g + 1);
      return r == 0 ? dispatch.begin + b + d : gemm.begin + gemm_walk.map(b * g + (r - 1), g);
    }
    u -= mid;
    if (u < d * g) return gemm.begin + gemm_walk.map((blocks - d) * g + u, g);
    return trail.begin + (u - d * g);
  }
};

// ---- the two roles -----------------------------------------------------------------------------------
// K (the kernel's task set) provides
//   int  prepare(int task, Job&, LoadSrc& a, LoadSrc& b) const   producer: decode + wait;
//        1 = publish the Job, 0 = nothing for the workers (done or skipped), -1 = stop (error)
//   uint32_t stage_rows(const Job&, int stage, uint32_t dst, uint32_t bar) const
//        producer, Jobs with gemm = kLoadRows: issue that stage's row copies, return their bytes
//   int  plan_task(int task) const   the plan index of the task grabbed at position `task`
//   unsigned long long* trace() const   the launch's trace records (trace.cuh), or null
//   bool run(const Job&, const Shared&, wg::PipeState&, float (&acc)[kAccRegs], int consumer,
//            const MbarWaitCtx&, const Turns&) const
//        workers: false = stop (every worker returns the same verdict; per warpgroup for Jobs in turns)
//   bool in_turns(const Job&) const   whether the warpgroups run this Job's GEMM in turns (gemm_in_turns)
// k.trace() (trace.cuh, may be null): record g = the task grabbed at position g.  Read from the
// parameter space where it is used, so that it holds no producer register.
template <class K>
__device__ __forceinline__ void producer_loop(const K& k, const Shared& s, int* task_next, int num_tasks,
                                              const WaitCtx& wc) {
  const MbarWaitCtx w{wc.err, wc.timeout_ns, wc.rank, -1, false};
  wg::PipeState ps;
  QueueState qs;
  // The next index is grabbed (and the error word read) before the current GEMM's loads are
  // issued, so those round trips overlap the streaming (the CTA then holds one more task: the
  // argument above still holds).
  int next = atom_add_relaxed_gpu(task_next, 1);
  bool failed = error_set(wc.err);
  for (;;) {
    const int task = failed ? num_tasks : next;
    if (task >= num_tasks) break;
    if (k.trace() != nullptr) trace_grab(k.trace(), task, k.plan_task(task));
    Job job;
    LoadSrc a, b;
    const int r = k.prepare(task, job, a, b);
    if (r < 0) break;
    trace_ready(k.trace(), task);
    next = atom_add_relaxed_gpu(task_next, 1);
    failed = error_set(wc.err);
    if (r == 0) {  // the producer did all of it (a notify), or there was nothing to do
      trace_end(k.trace(), task);
      continue;
    }
    job.slot = task;
    if (!publish(s, qs, job, w)) return;
    if (job.gemm != kLoadNone && job.k_tiles > 0) {
      fence_proxy_async_global();  // what the waits acquired (generic-proxy writes) -> TMA reads
      MbarWaitCtx wt = w;
      wt.what = task;
      if (!(job.gemm == kLoadRows ? produce_rows(k, s, ps, job, wt) : produce(s, ps, a, b, job.k_tiles, wt))) return;
    }
  }
  Job stop{};
  publish(s, qs, stop, w);
}

template <class K>
__device__ __forceinline__ void worker_loop(const K& k, const Shared& s, const WaitCtx& wc) {
  const int consumer = worker_tid() >> 7;
  // A producer dependency wait may last up to timeout_ns (twice for some tasks) before it
  // publishes a stop, so the workers' own bound is longer.
  const MbarWaitCtx wq{wc.err, 4 * wc.timeout_ns, wc.rank, -2, false};
  const MbarWaitCtx wr{wc.err, wc.timeout_ns, wc.rank, -3, false};
  wg::PipeState ps;
  QueueState qs;
  float acc[kAccRegs];
  __shared__ int s_turn_owed;
  if (consumer == 0) s_turn_owed = 0;  // read only by warpgroup 0, after its own write
  const Turns turns{&s_turn_owed};
  // Worker 0 parks the Job's trace slot in shared memory: kept in a register across run(), it
  // made the backward's largest task body spill.
  __shared__ int s_trace_slot;
  for (;;) {
    Job job = take(s, qs, wq, consumer);
    if (!k.in_turns(job)) {  // both warpgroups in step again: one verdict for both
      turns.settle(consumer);
      if (workers_any(job.kind == 0)) job.kind = 0;
    }
    if (job.kind == 0) return;
    if (worker_tid() == 0) {
      s_trace_slot = job.slot;
      trace_ready(k.trace(), job.slot);  // the workers start it (the producer's stamp: its waits done)
    }
    if (!k.run(job, s, ps, acc, consumer, wr, turns)) return;
    if (worker_tid() == 0) trace_end(k.trace(), s_trace_slot);  // after the task's signal (a worker barrier)
  }
}

// ---- GEMM + epilogue helpers (workers) -----------------------------------------------------------
// A warpgroup whose 64 tile rows are all padding: acc = 0 without touching the tensor cores (the
// other warpgroup then has them to itself, about twice as fast).  It still waits for each stage
// to land before releasing it, so a slot is refilled only when both warpgroups are done with it.
__device__ __forceinline__ bool drain(const Shared& s, wg::PipeState& ps, float (&acc)[kAccRegs], int k_tiles,
                                      const MbarWaitCtx& w) {
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.f;
  bool failed = false;
  for (int kt = 0; kt < k_tiles; ++kt) {
    if (!failed) failed = !mbar_wait(s.ring.full(ps.slot), ps.phase, w);
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(s.ring.empty(ps.slot));
    ps.advance(kStages);
  }
  return !failed;
}

// acc = this warpgroup's 64 rows of the tile; true for every worker when both warpgroups
// finished (a ring wait can only fail on a bug: then every worker returns false together).
// idle_hi: tile rows 64..127 are padding (an expert's last row block holds <= 64 rows).
template <int kAMajor, int kBMajor>
__device__ __forceinline__ bool gemm(const Shared& s, wg::PipeState& ps, float (&acc)[kAccRegs], int k_tiles,
                                     int consumer, const MbarWaitCtx& w, bool idle_hi = false) {
  using E = Engine<kAMajor, kBMajor>;
  const typename E::Ring r{s.ring.data, s.ring.bars};
  const bool ok = idle_hi && consumer == 1 ? drain(s, ps, acc, k_tiles, w)
                                           : E::consume(r, ps, acc, k_tiles, consumer, w);
  return !workers_any(!ok);
}

// gemm() for a Job in turns (see "GEMMs in turns"): this warpgroup's verdict only; no barrier
// with the other warpgroup except the turn hand-overs.
template <int kAMajor, int kBMajor>
__device__ __forceinline__ bool gemm_in_turns(const Shared& s, wg::PipeState& ps, float (&acc)[kAccRegs], int k_tiles,
                                              int consumer, const MbarWaitCtx& w, const Turns& t) {
  using E = Engine<kAMajor, kBMajor>;
  const typename E::Ring r{s.ring.data, s.ring.bars};
  if (consumer == 0) {
    t.settle(0);
  } else {
    named_bar_sync(kTurnTo1, kThreads);
  }
  // Warpgroup 0 hands over inside the mainloop (after k-tile min(K, kStages) - 1), or after it for K = 0.
  const int hand_over = consumer == 0 ? min_int(k_tiles, kStages) - 1 : -1;
  const bool ok = E::consume(r, ps, acc, k_tiles, consumer, w, hand_over, kTurnTo1);
  if (consumer == 0) {
    if (k_tiles == 0) named_bar_arrive(kTurnTo1, kThreads);
    *t.owed = 1;
  } else {
    named_bar_arrive(kTurnTo0, kThreads);
  }
  return ok;
}

// Producer: whether rows 64..127 of row block b (expert e) are all padding.  A schedule that
// does not add up (never expected) simply gets the full computation.
__device__ __forceinline__ int upper_half_idle(const MoESchedule& sc, int b, int e) {
  const int rows = sc.expert_offset[e] + sc.expert_count[e] - b * kBlockM;
  return rows > 0 && rows <= kBlockM / 2 ? 1 : 0;
}

// Accumulator register 4j + 2h + {0, 1} of a worker holds tile row row(h) = row0 + 8h, columns
// col(j) = col0 + 8j + {0, 1}; col0 = 2 * quad (the lane's place in its quad).
struct Frag {
  int row0, col0, quad;
  __device__ __forceinline__ static Frag of(int consumer) {
    const WgmmaAccCoord c = Geometry::acc_coord(consumer);
    return Frag{c.row0, c.col0, static_cast<int>(threadIdx.x & 3)};
  }
  // Tile column of the chunk this lane owns in group q after a quad transpose.
  __device__ __forceinline__ int chunk_col(int q) const { return 32 * q + 8 * quad; }
};

// ---- 16-byte epilogue accesses ----------------------------------------------------------------------
// In the accumulator layout a quad (4 lanes, one row) holds each 8-column chunk 4 bytes of bf16
// per lane.  Transposing groups of 4 chunks inside the quad gives lane c all of chunk 4q + c: one
// 16-byte access instead of four 4-byte ones (a quad covers 64 contiguous bytes of bf16, 128 of
// fp32, per row), a quarter of the L1 -> L2 requests.  Every lane must take part (shuffles):
// row validity only predicates the memory accesses.  Column validity is per group (32 columns)
// and warp-uniform: H, I and I_s are multiples of 64 and tiles start at multiples of 128.
constexpr int kGroups = kBN / 32;  // groups of 4 chunks per tile row

// w[k] (this lane's word of chunk 4q + k) -> w[i] = lane i's word of chunk 4q + c: the chunk's
// words in column order.  Two butterfly stages: 2x2 blocks with lane ^ 2, then inside them.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4]) {
  constexpr unsigned kAll = 0xffffffffu;
  const bool b1 = (threadIdx.x & 2) != 0, b0 = (threadIdx.x & 1) != 0;
  uint32_t s0 = b1 ? w[0] : w[2], s1 = b1 ? w[1] : w[3];
  s0 = __shfl_xor_sync(kAll, s0, 2);
  s1 = __shfl_xor_sync(kAll, s1, 2);
  if (b1) { w[0] = s0; w[1] = s1; } else { w[2] = s0; w[3] = s1; }
  uint32_t t0 = b0 ? w[0] : w[1], t1 = b0 ? w[2] : w[3];
  t0 = __shfl_xor_sync(kAll, t0, 1);
  t1 = __shfl_xor_sync(kAll, t1, 1);
  if (b0) { w[0] = t0; w[2] = t1; } else { w[1] = t0; w[3] = t1; }
}

// Group q of row half h: this lane's chunk (Frag::chunk_col) as 8 bf16 ...
__device__ __forceinline__ uint4 group_bf16(const float (&acc)[kAccRegs], int q, int h) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = pack_bf16x2(acc[4 * (4 * q + k) + 2 * h], acc[4 * (4 * q + k) + 2 * h + 1]);
  quad_transpose(w);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ void add_f4(float4& a, const float4& b) {
  a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
}
__device__ __forceinline__ float4 shfl_xor_f4(float4 v, int mask) {
  constexpr unsigned kAll = 0xffffffffu;
  return make_float4(__shfl_xor_sync(kAll, v.x, mask), __shfl_xor_sync(kAll, v.y, mask),
                     __shfl_xor_sync(kAll, v.z, mask), __shfl_xor_sync(kAll, v.w, mask));
}
// ... or as 8 fp32.
__device__ __forceinline__ void group_f32(const float (&acc)[kAccRegs], int q, int h, float (&v)[8]) {
  uint32_t x[4], y[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[k] = __float_as_uint(acc[4 * (4 * q + k) + 2 * h]);
    y[k] = __float_as_uint(acc[4 * (4 * q + k) + 2 * h + 1]);
  }
  quad_transpose(x);
  quad_transpose(y);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(x[i]);
    v[2 * i + 1] = __uint_as_float(y[i]);
  }
}

// Tile rows r < rows to bf16 rows dst_row(r) (nullptr: dropped), columns [0, cols); dst_row
// already points at the tile's column 0 (16-byte aligned).
template <class RowPtr>
__device__ __forceinline__ void store_rows_bf16(const float (&acc)[kAccRegs], const Frag& f, int rows, int cols,
                                                RowPtr&& dst_row) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = f.row0 + 8 * h;
    bf16* d = r < rows ? dst_row(r) : nullptr;
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      if (32 * q >= cols) break;
      const uint4 v = group_bf16(acc, q, h);
      if (d != nullptr) *reinterpret_cast<uint4*>(d + f.chunk_col(q)) = v;
    }
  }
}

// Tile rows r < rows, columns c < cols to fp32 dst[r * ld + c], optionally added to what is
// there (one writer per element: deterministic).  dst and ld keep 32-byte alignment.  kStreaming:
// nothing in the launch reads the result again (weight gradients): its lines leave L2 first.
//
// After group_f32 the quad of row r holds the row's 128 bytes of a group, lane c chunk c (32
// bytes), which takes two 16-byte stores.  The quads of rows 2m and 2m + 1 (lanes l and l ^ 4)
// swap halves so that each store instruction writes whole 128-byte lines (one L2 request of 4
// sectors instead of 4 requests of half sectors): first row 2m, then row 2m + 1.
template <bool kStreaming>
__device__ __forceinline__ void store_f32(const float (&acc)[kAccRegs], const Frag& f, float* dst, int ld, int rows,
                                          int cols, bool accumulate) {
  const bool odd = (f.row0 & 1) != 0;
  const int r_even = f.row0 - (odd ? 1 : 0);  // the pair's even row (h = 0)
  float* const d0 = dst + (size_t)r_even * ld + 8 * f.quad + (odd ? 4 : 0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      if (32 * q >= cols) break;
      float v[8];
      group_f32(acc, q, h, v);
      const float4 lo = make_float4(v[0], v[1], v[2], v[3]), hi = make_float4(v[4], v[5], v[6], v[7]);
      const float4 got = shfl_xor_f4(odd ? lo : hi, 4);
#pragma unroll
      for (int s = 0; s < 2; ++s) {  // row r_even + 8h + s
        const bool ok = r_even + 8 * h + s < rows;
        float4 val = s ? (odd ? hi : got) : (odd ? got : lo);
        float* p = d0 + ((8 * h + s) * ld + 32 * q);  // 32-bit offset: one live 64-bit base
        if (accumulate) add_f4(val, ld_global_f4_if(ok, p));
        st_global_f4_if<kStreaming>(ok, p, val);
      }
    }
  }
}

}  // namespace pipe
}  // namespace mok
