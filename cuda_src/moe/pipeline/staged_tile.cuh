// Staged gate|up tile stores (the FP8 forward's `moe_forward_fp8_staged` kernel, chosen where K is
// long): g and u (bf16, 128 rows x 256 columns, 64 KB) go from registers to shared memory, and the
// signaler (pipeline/signaler.cuh) stores them to gu with four 2D TMA stores while the workers run
// the next tile.  Stored from registers, they hold both warpgroups (and so the tensor cores) for
// ~3 us of a gate|up task; written to shared memory they take a few hundred cycles.  The price is
// the ring slot the boxes borrow: the next tile's last stage cannot be loaded until the stores have
// read it, which costs more than it saves where the mainloop is short (qwen3's 16 K blocks:
// -1.2 %, the deepseek-v3 slice's 56: +1.8 %; bench/NOTES-FP8-2.md round 16).  Per-row bulk
// copies (256 a tile) were slower than the register stores: the SM's one TMA unit runs them one by
// one, ahead of the producer's loads.
//
// Where: four boxes of 128 rows x 64 columns (128 bytes a row, 128B-swizzled like the operand
// tiles: 16-byte chunk c of row r at chunk c ^ (r mod 8), so a warp's 8 rows x 64 bytes take the
// minimum 4 wavefronts): gate columns [0, 64) and [64, 128) of the I block, then the same up
// columns.  Boxes 0-2 lie in the task's last ring slot, which the mainloop then does not release
// (gemm_fp8.cuh kHold); the signaler hands it back once the stores have read it.  Box 3 lies in a
// static buffer, one per CTA: a task waits until the previous staged task's stores have read it
// (Signals::begin_staged, normally long complete).
#pragma once
#include "common/mbarrier.cuh"
#include "moe/pipeline/pipeline.cuh"

namespace mok {
namespace pipe {

struct Staging {
  static constexpr int kBoxBytes = 128 * 128;
  static constexpr int kBoxes = 4;
  static constexpr int kSlotBoxes = Geometry::kStageBytes / kBoxBytes;
  static_assert(kSlotBoxes == 3 && Geometry::kStageBytes % 1024 == 0, "three boxes in a ring slot, 1024-aligned");

  uint32_t slot_base;  // the held ring slot
  uint32_t extra;      // box 3

  __device__ __forceinline__ static Staging of(const Shared& s, int slot) {
    __shared__ __align__(1024) unsigned char extra_box[(kBoxes - kSlotBoxes) * kBoxBytes];
    return Staging{s.ring.a_tile(slot), smem_u32(extra_box)};
  }
  __device__ __forceinline__ uint32_t box(int b) const {
    return b < kSlotBoxes ? slot_base + static_cast<uint32_t>(b * kBoxBytes) : extra;
  }
  // 16-byte chunk c (columns 8c .. 8c + 7) of row r of box b.
  __device__ __forceinline__ uint32_t chunk(int b, int r, int c) const {
    return box(b) + static_cast<uint32_t>(r * 128 + ((c ^ (r & 7)) << 4));
  }
};

// The ring slot of the task's last K block, once a mainloop over k_blocks >= 1 stages has left ps
// at the next one.
__device__ __forceinline__ int held_slot(const wg::PipeState& ps) { return (ps.slot + kStages - 1) % kStages; }

__device__ __forceinline__ void st_shared_v4(uint32_t addr, const uint4& v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" :: "r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

}  // namespace pipe
}  // namespace mok
