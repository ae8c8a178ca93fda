// Named wrappers over the sm_90 Tensor Memory Accelerator (cp.async.bulk.tensor) and the
// proxy fences that order it against ordinary loads and stores.
//
// Facts relied on (PTX ISA "cp.async.bulk.tensor", CUDA driver cuTensorMapEncodeTiled):
//   * The tensor map (CUtensorMap, 128 bytes, 64-byte aligned) is encoded on the host
//     (mok_rt/runtime/tensormap.py) and reaches the kernel as a member of its `const __grid_constant__`
//     parameter struct; the instruction takes the map's generic address.  (A map in global
//     memory would need a fence.proxy.tensormap acquire after it is written.)
//   * Coordinates are element indices, innermost dimension first; elements outside the tensor
//     are filled with zeros and still count toward the mbarrier's complete_tx bytes, so a load
//     always credits the full box (box bytes = product of box dims * 2 for bf16).
//   * With SWIZZLE_128B the box's inner extent must be <= 128 bytes (64 bf16) and the shared
//     destination must be 1024-byte aligned (the XOR pattern is taken from address bits 7-9).
//   * TMA reads global memory through the async proxy: data written with ordinary st.global by
//     another CTA and observed through an acquire must be followed, in the thread that issues
//     the TMA, by fence.proxy.async.global before the load.  Shared memory written with st.shared
//     and then read by wgmma or a TMA store needs fence.proxy.async.shared::cta (plus the usual
//     barrier between the writing and the issuing threads).
#pragma once
#include <stdint.h>

namespace mok {

// Device-side view of a CUtensorMap: opaque, 128 bytes, 64-byte aligned.
struct alignas(64) TensorMap {
  uint64_t opaque[16];
};
static_assert(sizeof(TensorMap) == 128, "CUtensorMap is 128 bytes");

__device__ __forceinline__ uint64_t tmap_addr(const TensorMap* m) { return reinterpret_cast<uint64_t>(m); }

// Pulls the descriptor into the TMA unit's cache ahead of the first load (optional).
__device__ __forceinline__ void tma_prefetch_map(const TensorMap* m) {
  asm volatile("prefetch.tensormap [%0];" :: "l"(tmap_addr(m)) : "memory");
}

// ---- loads: global -> shared, completion reported to an mbarrier as transaction bytes --------
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const TensorMap* m, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];"
      :: "r"(dst), "l"(tmap_addr(m)), "r"(bar), "r"(c0), "r"(c1) : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const TensorMap* m, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];"
      :: "r"(dst), "l"(tmap_addr(m)), "r"(bar), "r"(c0), "r"(c1), "r"(c2) : "memory");
}

// Plain bulk copy (no tensor map): `bytes` contiguous bytes, both addresses and the size multiples
// of 16.  Completion is credited to the mbarrier like a tensor load.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// ---- stores: shared -> global, tracked by bulk async-groups of the issuing thread --------------
__device__ __forceinline__ void tma_store_2d(const TensorMap* m, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];"
               :: "l"(tmap_addr(m)), "r"(src), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void tma_store_3d(const TensorMap* m, uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];"
               :: "l"(tmap_addr(m)), "r"(src), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until at most N committed store groups still read their shared source (smem reusable).
template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
// Waits until at most N committed store groups are incomplete (writes performed).
template <int N>
__device__ __forceinline__ void tma_store_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}

// ---- proxy fences --------------------------------------------------------------------------------
// Generic-proxy global writes (seen through an acquire) -> later async-proxy (TMA) reads.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
// Generic-proxy shared writes (st.shared) -> later async-proxy reads (wgmma operands, TMA store).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Both: generic writes to shared and global memory -> later async-proxy reads of either.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async;" ::: "memory"); }

}  // namespace mok
