// Expert parallelism inside the MoE megakernels: pushing token rows to the ranks that own their
// experts, returning expert rows to the ranks that own their tokens, the epoch flags that say a
// peer is done, and the end-of-launch group barrier.  See MoEPeers (params.cuh) for the layout.
//
// Ordering across GPUs: a task that wrote peer memory fences at system scope on every thread,
// then its CTA releases a local counter at system scope; one "notify" task acquires that counter
// once every such task is done and stores the epoch into every rank's flag (st.release.sys); the
// consumer's thread 0 acquires the flag (ld.acquire.sys) and its CTA reads the rows through L2.
// Reuse of the symmetric buffers across launches is safe because every EP launch ends with a
// group barrier: no rank starts its next launch before every rank has finished this one.
#pragma once
#include "comm/barrier.cuh"
#include "common/mma.cuh"
#include "moe/params.cuh"
#include "moe/tasks/row_copy.cuh"
#include "moe/tasks/task_graph.cuh"

namespace mok {
namespace ep {

// What a peer wait reports in the timeout's third info word.
enum WaitStage : int { kStageFwdRows = 1, kStageFwdReturn = 2, kStageBwdRows = 3, kStageBwdReturn = 4 };

__device__ __forceinline__ bool enabled(const MoEPeers& pe) { return pe.num_ranks > 1; }

__device__ __forceinline__ bf16* routed_rows(const MoEPeers& pe, int r) {
  return reinterpret_cast<bf16*>(pe.base[r] + pe.routed_offset);
}
__device__ __forceinline__ bf16* slot_rows(const MoEPeers& pe, int r) {
  return reinterpret_cast<bf16*>(pe.base[r] + pe.slot_offset);
}
__device__ __forceinline__ int* flags(const MoEPeers& pe, int r, int kind) {
  return reinterpret_cast<int*>(pe.base[r] + pe.flags_offset) + kind * kMaxEpRanks;
}

__device__ __forceinline__ int atom_add_acq_rel_gpu(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// After the workers' peer stores: counter += 1, released at system scope.  All workers call it.
__device__ __forceinline__ void signal_counter_sys(int* counter) {
  fence_acq_rel_sys();  // this thread's stores to peer memory are ordered before the CTA's release
  proxy_fence_for_tma();
  workers_sync();
  if (worker_tid() == 0) red_release_sys(counter, 1);
}

// One thread: tell every rank (this one included) that this rank finished `kind` for the epoch.
__device__ __forceinline__ void notify_all(const MoEPeers& pe, int kind) {
  fence_acq_rel_sys();
  for (int r = 0; r < pe.num_ranks; ++r) st_release_sys(flags(pe, r, kind) + pe.rank, pe.epoch);
}

// Deadlines.  A peer wait gives up after timeout_ns and names the peer.  A wait on this rank's
// own work (a task counter, this rank's own flag) gives up only after kLocalTimeoutFactor times
// that: whatever it waits on is, at worst, blocked by a peer wait that started no later (tasks
// are grabbed in index order and wait only on lower indices), which then reports first, naming
// the peer, instead of a local wait reporting "unknown rank" (-1) in a race with it.
constexpr long long kLocalTimeoutFactor = 2;
__device__ __forceinline__ long long local_timeout_ns(const MoEPeers& pe, long long timeout_ns) {
  return enabled(pe) ? kLocalTimeoutFactor * timeout_ns : timeout_ns;
}

// The two wait contexts of a task set over its parameters (forward or backward): local waits
// (task counters, this rank's own flag) get the longer deadline, peer waits timeout_ns.
template <class Params>
__device__ __forceinline__ WaitCtx local_wait_ctx(const Params& p) {
  return WaitCtx{p.err, local_timeout_ns(p.peers, p.dims.timeout_ns), p.dims.rank};
}
template <class Params>
__device__ __forceinline__ WaitCtx peer_wait_ctx(const Params& p) {
  return WaitCtx{p.err, p.dims.timeout_ns, p.dims.rank};
}

// The peer to name when a wait for `kind` times out: the first rank (not this one) whose `kind`
// flag is behind, preferring one that is also behind on `earlier` (the same launch's earlier
// flag, -1: none) -- a rank that never even pushed its rows is the cause, while a live rank
// can be behind on its return only because it waits for that one (P > 2).
__device__ __forceinline__ int peer_to_blame(const MoEPeers& pe, int kind, int earlier) {
  const int* f = flags(pe, pe.rank, kind);
  int first = -1;
  for (int s = 0; s < pe.num_ranks; ++s) {
    if (s == pe.rank || epoch_reached(ld_acquire_sys(f + s), pe.epoch)) continue;
    if (first < 0) first = s;
    if (earlier < 0 || !epoch_reached(ld_acquire_sys(flags(pe, pe.rank, earlier) + s), pe.epoch)) return s;
  }
  return first;
}

// One thread: true once every rank's `kind` flag in this rank's block reached the epoch; false
// when the error word is set or a deadline passed.  The peers are awaited first, against the peer
// deadline (kErrTimeout info: this rank, the peer to blame, `stage`); then this rank's own flag,
// which only this rank's own tasks set, against the local deadline (peer -1).
__device__ __forceinline__ bool wait_all_thread(const MoEPeers& pe, int kind, int earlier, const WaitCtx& w,
                                                int stage) {
  const int* f = flags(pe, pe.rank, kind);
  const uint64_t start = globaltimer_ns();
  unsigned backoff = 32;
  int s = 0;  // ranks below s have arrived (flags only grow)
  for (;;) {
    while (s < pe.num_ranks && (s == pe.rank || epoch_reached(ld_acquire_sys(f + s), pe.epoch))) ++s;
    if (s == pe.num_ranks) break;
    if (error_set(w.err)) return false;
    if (globaltimer_ns() - start > static_cast<uint64_t>(w.timeout_ns)) {
      const int who = peer_to_blame(pe, kind, earlier);
      if (who >= 0) {  // (else the last one arrived just now)
        set_error(w.err, kErrTimeout, pe.rank, who, stage);
        return false;
      }
    }
    nanosleep(backoff);
    backoff = backoff < 1024 ? backoff * 2 : 1024;
  }
  const uint64_t local_ns = static_cast<uint64_t>(local_timeout_ns(pe, w.timeout_ns));
  while (!epoch_reached(ld_acquire_sys(f + pe.rank), pe.epoch)) {
    if (error_set(w.err)) return false;
    if (globaltimer_ns() - start > local_ns) {
      set_error(w.err, kErrTimeout, pe.rank, -1, stage);
      return false;
    }
    nanosleep(backoff);
    backoff = backoff < 1024 ? backoff * 2 : 1024;
  }
  return true;
}

// Push this rank's token rows [t0, t1) to the routed buffers of their destinations: route
// (t, j) goes to rank route_rank[t*k+j], row route_row[t*k+j], scaled by weights[t*k+j] in fp32
// when given (as the one-GPU gather does).  16-byte stores, a token's chunks on adjacent threads;
// each source row is read once for its k routes.
__device__ __forceinline__ void push_token_rows(const MoESchedule& s, const MoEDims& d, const MoEPeers& pe, int t0,
                                                int t1, const bf16* src, const float* weights, int* err) {
  const int chunks = d.hidden / 8;
  const long long n = static_cast<long long>(t1 - t0) * chunks;
  // Source chunks in batches (row_copy.cuh); per chunk, its token's routes kCopyBatch at a time
  // (destinations, rows and weights loaded together), then the stores.
  batched_chunks(
      n, [&](long long idx) {
        const int t = t0 + static_cast<int>(idx / chunks), c = static_cast<int>(idx % chunks) * 8;
        return *reinterpret_cast<const uint4*>(src + (size_t)t * d.hidden + c);
      },
      [&](long long idx, const uint4& v) {
        const int t = t0 + static_cast<int>(idx / chunks), c = static_cast<int>(idx % chunks) * 8;
        for (int j0 = 0; j0 < d.top_k; j0 += kCopyBatch) {
          int dst[kCopyBatch], row[kCopyBatch];
          float w[kCopyBatch];
#pragma unroll
          for (int u = 0; u < kCopyBatch; ++u) {
            const int slot = t * d.top_k + j0 + u;
            const bool in = j0 + u < d.top_k;
            dst[u] = in ? s.route_rank[slot] : -1;
            row[u] = in ? s.route_row[slot] : -1;
            w[u] = in && weights != nullptr ? weights[slot] : 1.f;
          }
#pragma unroll
          for (int u = 0; u < kCopyBatch; ++u) {
            if (j0 + u >= d.top_k) break;
            if (dst[u] < 0 || dst[u] >= pe.num_ranks || row[u] < 0 || row[u] >= d.max_rows) {
              set_error(err, kErrInternal, __LINE__, t * d.top_k + j0 + u, row[u]);  // corrupt schedule: never write past a buffer
              continue;
            }
            uint4 out = v;
            if (weights != nullptr) {
              float f[8];
              unpack_bf16x8(v, f);
#pragma unroll
              for (int i = 0; i < 8; ++i) f[i] *= w[u];
              out = pack_bf16x8(f);
            }
            *reinterpret_cast<uint4*>(routed_rows(pe, dst[u]) + (size_t)row[u] * d.hidden + c) = out;
          }
        }
      });
}

// ---- readiness chunks -------------------------------------------------------------------------
// The push is cut into chunks of chunk_tokens source tokens (the same constant on every rank, so
// a destination computes a row's chunk from its slot alone: slot / (chunk_tokens * k)).  Once a
// chunk's rows are stored, its source releases the chunk's flag in every rank's block (epochs,
// like the other flags); a row block's dispatch waits only on the chunks of its own rows.  The
// schedule lays a block's rows out in global route order (source rank, token, k), so its rows
// from one source are a contiguous token range: a few consecutive chunks.

// Flag of chunk `chunk` of source `src` for `kind` (kFlagFwdRows or kFlagBwdRows) in rank r's block.
__device__ __forceinline__ int* chunk_flag(const MoEPeers& pe, int r, int kind, int chunk, int src) {
  int* base = reinterpret_cast<int*>(pe.base[r] + pe.flags_offset + kChunkFlagsOffset);
  return base + (static_cast<size_t>(chunk) * kChunkKinds + (kind == kFlagBwdRows ? 1 : 0)) * kMaxEpRanks + src;
}

// All workers, after their stores of chunk `chunk`: release it to every rank (this one included).
// Each thread orders its peer stores before the barrier (system scope, and for the TMA readers
// of the backward's routed rows), then worker r stores the epoch into rank r's flag.
__device__ __forceinline__ void release_chunk(const MoEPeers& pe, int kind, int chunk) {
  fence_acq_rel_sys();
  proxy_fence_for_tma();
  workers_sync();
  for (int r = worker_tid(); r < pe.num_ranks; r += kThreads) st_release_sys(chunk_flag(pe, r, kind, chunk, pe.rank), pe.epoch);
}

// Push task `task`: chunks task, task + push_tasks, task + 2 push_tasks, ... of this rank's
// tokens, each released as soon as it is stored.  The push tasks run side by side, so chunks
// complete roughly in token order: a destination block that needs only early tokens of every
// source starts first.  Tokens past d.tokens (a rank with fewer tokens) have no chunk.
__device__ __forceinline__ void push_chunks(const MoESchedule& s, const MoEDims& d, const MoEPeers& pe, int task,
                                            const bf16* src, const float* weights, int* err, int kind) {
  const int n = ceil_div(d.tokens, pe.chunk_tokens);
  for (int c = task; c < n; c += pe.push_tasks) {
    const int t0 = c * pe.chunk_tokens;
    push_token_rows(s, d, pe, t0, min_int(d.tokens, t0 + pe.chunk_tokens), src, weights, err);
    release_chunk(pe, kind, c);
  }
}

// One thread: until *f reaches the epoch (relaxed polls; the caller fences once after all its
// flags: relaxed read + fence.acq_rel = acquire).  A peer's chunk gives up after the peer deadline
// and names that peer (its push waits on nothing, so a missing chunk means that peer is missing
// or stuck); this rank's own chunk after the local deadline (peer -1, see local_timeout_ns).
__device__ __forceinline__ bool wait_chunk_thread(const MoEPeers& pe, const int* f, int src, uint64_t start,
                                                  const WaitCtx& w, int stage) {
  if (epoch_reached(ld_relaxed_sys(f), pe.epoch)) return true;
  const bool own = src == pe.rank;
  const uint64_t limit = static_cast<uint64_t>(own ? local_timeout_ns(pe, w.timeout_ns) : w.timeout_ns);
  unsigned backoff = 32;
  while (!epoch_reached(ld_relaxed_sys(f), pe.epoch)) {
    if (error_set(w.err)) return false;
    if (globaltimer_ns() - start > limit) {
      set_error(w.err, kErrTimeout, pe.rank, own ? -1 : src, stage);
      return false;
    }
    nanosleep(backoff);
    backoff = backoff < 1024 ? backoff * 2 : 1024;
  }
  return true;
}

// One thread (a dispatch's producer): true once every row of row block `b` arrived, i.e. for
// each source with rows in the block, the chunks from its first row's token to its last row's
// (the chunks between hold no row of the block or are awaited anyway: a source releases all of
// its chunks whatever they hold).  A source's last row is found by binary search (rows ascend by
// source, padding rows -1 last), so the scan costs a few loads per source, not one per row.
// `w`: the peer wait context (this rank's own chunks get the local deadline).
__device__ __forceinline__ bool wait_block_rows_thread(const MoESchedule& sc, const MoEDims& d, const MoEPeers& pe,
                                                       int b, int kind, const WaitCtx& w, int stage) {
  const int* src = sc.row_src_rank + static_cast<size_t>(b) * kBlockM;
  const int* slot = sc.row_slot + static_cast<size_t>(b) * kBlockM;
  const int per_chunk = pe.chunk_tokens * d.top_k;  // route slots per chunk
  const uint64_t start = globaltimer_ns();
  int r = 0;
  while (r < kBlockM) {
    const int s = src[r];
    if (s < 0) break;  // padding rows: the rest of the block
    int end = kBlockM - 1;
    if (src[end] != s) {
      int hi = end;  // src[r] == s, src[hi] != s
      end = r;
      while (hi - end > 1) {
        const int mid = (end + hi) >> 1;
        if (src[mid] == s) end = mid; else hi = mid;
      }
    }
    const int first = slot[r], last = slot[end];
    if (s >= pe.num_ranks || first < 0 || last < first || last >= pe.slot_rows) {
      set_error(w.err, kErrInternal, __LINE__, b, r);  // corrupt schedule: never index past the flags
      return false;
    }
    // The latest chunk first: the others were pushed earlier and are then usually in.
    for (int c = last / per_chunk; c >= first / per_chunk; --c)
      if (!wait_chunk_thread(pe, chunk_flag(pe, pe.rank, kind, c, s), s, start, w, stage)) return false;
    r = end + 1;
  }
  fence_acq_rel_sys();
  return true;
}

// Where a row block's output row goes with EP: the slot of its route on its source rank
// (nullptr for padding rows).
__device__ __forceinline__ bf16* return_row_ptr(const MoESchedule& s, const MoEPeers& pe, const MoEDims& d, int row,
                                                int col0, int* err) {
  const int slot = s.row_slot[row];
  if (slot < 0) return nullptr;
  const int src = s.row_src_rank[row];
  if (src < 0 || src >= pe.num_ranks || slot >= pe.slot_rows) {
    set_error(err, kErrInternal, __LINE__, row, slot);
    return nullptr;
  }
  return slot_rows(pe, src) + (size_t)slot * d.hidden + col0;
}

// After the task loop (all workers of every CTA): the last CTA to finish meets every rank at a
// group barrier, so that no rank's next launch reuses the symmetric buffers while a peer still
// reads or writes them.  On an error the barrier is skipped (the peers time out naming us).
__device__ __forceinline__ void end_of_launch(const MoEPeers& pe, int* ctas_done, int* err,
                                              long long timeout_ns) {
  __shared__ int last;
  workers_sync();  // the CTA's earlier writes come before warp 0's release in the barrier
  if (worker_tid() == 0) last = atom_add_acq_rel_gpu(ctas_done, 1) == static_cast<int>(gridDim.x) - 1;
  workers_sync();
  if (!last) return;
  const GroupBarrier b{pe.base_array, err, pe.end_pad_offset, static_cast<unsigned long long>(timeout_ns), pe.rank,
                       pe.num_ranks};
  if (worker_tid() < 32) warp_group_barrier(b);
}

}  // namespace ep
}  // namespace mok
