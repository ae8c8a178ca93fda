// Thread-block cluster primitives (sm_90): a CTA's rank in its cluster, the cluster barrier,
// shared-memory addresses of a peer CTA (distributed shared memory), remote mbarrier arrivals
// and stores, and the multicast TMA load that lands the same box in several CTAs at once.
//
// Facts used (PTX ISA 8.x, "Distributed shared memory", "mapa", "mbarrier", "cp.async.bulk.tensor"):
//   * mapa.shared::cluster maps a shared::cta address of this CTA to the address of the same
//     variable in CTA `rank` of the cluster (a shared::cluster address, 32-bit).
//   * mbarrier.arrive.release.cluster on a shared::cluster address arrives on a peer's barrier;
//     a waiter that observes the phase with try_wait ... acquire.cluster sees the arriver's
//     earlier writes (st.shared::cluster included).
//   * A .multicast::cluster TMA load writes the box at the same CTA-relative offset in every CTA
//     of ctaMask and performs complete_tx on the mbarrier at the same offset in each of them.
#pragma once
#include <stdint.h>
#include "common/tma.cuh"

namespace mok {

__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster (none may have exited): release / acquire at cluster scope.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The same for threads that may be a subset of their warps (not .aligned); threads that exited
// count as arrived (PTX ISA, exit).
__device__ __forceinline__ void cluster_arrive_wait() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

__device__ __forceinline__ uint32_t mapa_shared(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}

// One arrival on a barrier of another CTA of the cluster (address from mapa_shared).
__device__ __forceinline__ void mbar_arrive_remote(uint32_t cluster_bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" :: "r"(cluster_bar) : "memory");
}

__device__ __forceinline__ void st_shared_remote(uint32_t cluster_addr, int v) {
  asm volatile("st.shared::cluster.u32 [%0], %1;" :: "r"(cluster_addr), "r"(v) : "memory");
}

// try_wait with cluster-scope acquire: for barriers that peers arrive on with data to publish.
__device__ __forceinline__ bool mbar_try_wait_cluster(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}

// The box lands at `dst` in every CTA of `cta_mask` and completes tx on `bar` (same offsets) in each.
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const TensorMap* m, uint32_t bar, int c0, int c1,
                                                      int c2, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;"
      :: "r"(dst), "l"(tmap_addr(m)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask) : "memory");
}

}  // namespace mok
