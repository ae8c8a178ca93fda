// Thin named wrappers over the PTX synchronisation primitives that the kernels share:
// scoped loads/stores (relaxed, acquire, release), fences and the global timer.
// GEMM-specific primitives (cp.async, ldmatrix, mma, wgmma, TMA) live in their own headers.
#pragma once
#include <stdint.h>

namespace mok {

// ---- scoped loads / stores on 32-bit words --------------------------------------------------
__device__ __forceinline__ int ld_relaxed_gpu(const int* p) {
  int v; asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v; asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ int ld_relaxed_sys(const int* p) {
  int v; asm volatile("ld.relaxed.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v; asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(int* p, int v) {
  asm volatile("st.release.sys.global.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(int* p, int v) {
  asm volatile("st.relaxed.sys.global.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
// Atomic add with release semantics: publishes everything this thread (and, after a CTA
// barrier, its CTA) wrote before it.
__device__ __forceinline__ void red_release_gpu(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_release_sys(int* p, int v) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int atom_add_relaxed_gpu(int* p, int v) {
  int old; asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// ---- predicated 16-byte accesses -----------------------------------------------------------------
// Predicated instructions, not branches: epilogues stay straight-line (fewer live registers).
// Loads give zeros where `pred` is false.  Stores with kStreaming use the .cs cache operator
// (evict-first in L2): for results nothing in the launch reads again (the weight gradients), so
// that they do not push operands other tiles share out of L2.
__device__ __forceinline__ float4 ld_global_f4_if(bool pred, const float* p) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %5, 0;\n\t"
               "@q ld.global.v4.f32 {%0, %1, %2, %3}, [%4];\n\t}"
               : "+f"(v.x), "+f"(v.y), "+f"(v.z), "+f"(v.w) : "l"(p), "r"(static_cast<uint32_t>(pred)) : "memory");
  return v;
}
template <bool kStreaming>
__device__ __forceinline__ void st_global_f4_if(bool pred, float* p, float4 v) {
  if constexpr (kStreaming) {
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %5, 0;\n\t@q st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};\n\t}"
                 :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(static_cast<uint32_t>(pred)) : "memory");
  } else {
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %5, 0;\n\t@q st.global.v4.f32 [%0], {%1, %2, %3, %4};\n\t}"
                 :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(static_cast<uint32_t>(pred)) : "memory");
  }
}

// The same as 4 x 32-bit words (8 bf16): bf16 weight gradients.
__device__ __forceinline__ uint4 ld_global_u4_if(bool pred, const void* p) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %5, 0;\n\t"
               "@q ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
               : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w) : "l"(p), "r"(static_cast<uint32_t>(pred)) : "memory");
  return v;
}
template <bool kStreaming>
__device__ __forceinline__ void st_global_u4_if(bool pred, void* p, uint4 v) {
  if constexpr (kStreaming) {
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %5, 0;\n\t@q st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};\n\t}"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(static_cast<uint32_t>(pred)) : "memory");
  } else {
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %5, 0;\n\t@q st.global.v4.u32 [%0], {%1, %2, %3, %4};\n\t}"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(static_cast<uint32_t>(pred)) : "memory");
  }
}

// ---- shared memory ----------------------------------------------------------------------------
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}

// ---- named barriers -----------------------------------------------------------------------------
// `count` threads take part: sync waits for all of them, arrive counts itself and goes on (the
// producer / consumer handoff between two warpgroups).
__device__ __forceinline__ void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");
}

// ---- fences -----------------------------------------------------------------------------------
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// ---- time ---------------------------------------------------------------------------------------
// Nanoseconds; coarse (about a microsecond) but common to all SMs, which is what timeouts need.
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t;
}

// The SM this thread runs on (for timelines; read at each record: %smid may change after a preemption).
__device__ __forceinline__ uint32_t smid() {
  uint32_t r; asm volatile("mov.u32 %0, %smid;" : "=r"(r)); return r;
}

__device__ __forceinline__ void nanosleep(unsigned ns) { asm volatile("nanosleep.u32 %0;" :: "r"(ns)); }

}  // namespace mok
