// Named wrappers over the sm_90 shared-memory barrier (mbarrier) that the TMA + wgmma pipeline
// synchronises on.  A barrier is a 64-bit word in shared memory, addressed here by its 32-bit
// shared-window address (smem_addr()).
//
// Semantics used (PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier"):
//   * init(count): phase 0, `count` arrivals expected per phase, tx-count 0.
//   * A phase completes when all expected arrivals happened AND the tx-count is back to 0; the
//     barrier then flips to the next phase (parity 0 <-> 1) and re-arms the arrival count.
//   * arrive.expect_tx(bytes) = one arrival + tx-count += bytes; a TMA load with
//     .mbarrier::complete_tx::bytes decrements the tx-count as its bytes land in shared memory.
//   * try_wait.parity(P) is true once the phase with parity P has completed, i.e. while the
//     current phase's parity differs from P.  A fresh barrier is in phase 0, so waiting on
//     parity 1 succeeds at once (how a producer passes its first round over empty slots).
#pragma once
#include <stdint.h>
#include "common/errors.cuh"
#include "common/ptx.cuh"

namespace mok {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

// Makes barrier initialisation visible to the other threads and to the async proxy (TMA
// complete_tx).  Follow it with a CTA barrier before anyone uses the barriers.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.shared::cta.b64 st, [%0];\n\t}" :: "r"(bar) : "memory");
}

// `count` arrivals at once, on behalf of that many arrivers (a thread handing back a slot that
// other warps would have released).
__device__ __forceinline__ void mbar_arrive_count(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

// One arrival plus `bytes` expected from asynchronous (TMA) copies in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

// True once the phase of parity `parity` has completed.  May suspend the thread for a
// hardware-defined while before answering false.
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}

// What a bounded wait reports in the error word on timeout (kErrTimeout info 3: `what`).
struct MbarWaitCtx {
  int* err;
  long long timeout_ns;
  int rank;
  int what;
  // false: a wait whose completion depends only on this CTA (a pipeline that always drains) does
  // not give up when someone else records an error, so no TMA is left in flight at exit.
  bool watch_err = true;
};

// Waits for the phase of parity `parity`; false (on the calling thread only) when the error word
// is set by anyone (unless !w.watch_err) or the wait outlasts timeout_ns (then kErrTimeout is recorded).  The clock and
// the error word are only read after a failed try_wait, so the fast path is one instruction.
__device__ __forceinline__ bool mbar_wait(uint32_t bar, uint32_t parity, const MbarWaitCtx& w) {
  if (mbar_try_wait(bar, parity)) return true;
  const uint64_t start = globaltimer_ns();
  for (;;) {
    if (mbar_try_wait(bar, parity)) return true;
    if (w.watch_err && error_set(w.err)) return false;
    if (globaltimer_ns() - start > static_cast<uint64_t>(w.timeout_ns)) {
      set_error(w.err, kErrTimeout, w.rank, -1, w.what);
      return false;
    }
  }
}

}  // namespace mok
