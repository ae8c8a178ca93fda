// The warp-specialised persistent loop of the MoE kernels (moe_layer.cu): the ring, the Job queue,
// the producer and worker loops and the wgmma tile GEMM of the workers.
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
#include "moe/pipeline/gemm_wgmma.cuh"
#include "moe/pipeline/task_order.cuh"
#include "moe/tasks/task_graph.cuh"

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
static_assert(sizeof(Job) == 36, "Job layout (kSmemBytes and mok_rt/kernels/moe_params.py TMA_SMEM_BYTES count it)");

constexpr int kQueueBarrierBytes = 2 * kQueue * 8;
// Dynamic shared memory: ring (1024-aligned, + slack) + ring barriers + queue barriers + Jobs.
constexpr int kSmemBytes = Geometry::kRingBytes + 1024 + Geometry::kBarrierBytes + kQueueBarrierBytes +
                           kQueue * static_cast<int>(sizeof(Job));
static_assert(kSmemBytes == 197800, "mok_rt/kernels/moe_params.py TMA_SMEM_BYTES mirrors this");
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
// Limitation: verdicts are per warpgroup here, and named barriers do not time out.  If only one
// warpgroup fails (a ring wait of one, or a take() timeout just before a Job in turns) it leaves
// while the other waits at a hand-over or at the next vote of both: a hang instead of
// kErrTimeout.  Both need a bug to happen; mbarrier hand-overs (bounded waits) and a failed
// warpgroup that keeps taking Jobs until the next vote of both would close it.
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

}  // namespace pipe
}  // namespace mok
