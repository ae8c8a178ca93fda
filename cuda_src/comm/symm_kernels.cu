// Kernels over a symmetric heap: the group barrier, and a pair of test kernels that prove every
// rank can write every peer's block (a rank-tagged pattern) and read what its peers wrote.
#include <stdint.h>

#include "comm/barrier.cuh"
#include "common/errors.cuh"

namespace mok {

// Mirrored by the Python tests (same order and types).  The heap's user region of each block is
// split into `size` slots of `slot_words` uint32 words starting at `slot_offset`; rank s writes
// slot s of every rank's block.
struct PatternParams {
  const unsigned long long* peer_bases;  // [size] every rank's block base, in this rank's address space
  unsigned* result;                      // verify: [0] mismatches, [1] first bad word (set 0, ~0u before)
  unsigned long long slot_offset;        // bytes
  unsigned long long slot_words;
  int rank;
  int size;
  unsigned seed;
  int unused;
};
static_assert(sizeof(PatternParams) == 48, "PatternParams layout is mirrored in Python");

// The word rank `src` writes at index `i` of its slot in rank `dst`'s block (tests compute the
// same in NumPy).  A mix so that a word from the wrong rank, slot or run cannot pass.
__device__ __forceinline__ unsigned pattern_word(unsigned seed, unsigned src, unsigned dst, unsigned i) {
  unsigned x = seed ^ (src * 0x9E3779B1u) ^ (dst * 0x85EBCA77u) ^ (i * 0xC2B2AE3Du);
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 12;
  return x;
}

}  // namespace mok

using namespace mok;

// One warp per rank; see barrier.cuh.
extern "C" __global__ void __launch_bounds__(32) symm_barrier(const __grid_constant__ GroupBarrier p) {
  warp_group_barrier(p);
}

// Grid-stride over (peer, word): this rank's slot in every rank's block.
extern "C" __global__ void symm_write_pattern(const __grid_constant__ PatternParams p) {
  const unsigned long long total = p.slot_words * static_cast<unsigned long long>(p.size);
  for (unsigned long long k = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
    const int dst = static_cast<int>(k / p.slot_words);
    const unsigned long long i = k % p.slot_words;
    unsigned* slot = reinterpret_cast<unsigned*>(p.peer_bases[dst] + p.slot_offset) + p.rank * p.slot_words;
    slot[i] = pattern_word(p.seed, p.rank, dst, static_cast<unsigned>(i));
  }
}

// Checks every slot of this rank's own block; counts mismatches and records the first bad word
// (flat index over slots).  Integer atomics only: the count does not depend on the order.
extern "C" __global__ void symm_verify_pattern(const __grid_constant__ PatternParams p) {
  const unsigned long long total = p.slot_words * static_cast<unsigned long long>(p.size);
  const unsigned* own = reinterpret_cast<const unsigned*>(p.peer_bases[p.rank] + p.slot_offset);
  unsigned bad = 0, first = ~0u;
  for (unsigned long long k = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
    const int src = static_cast<int>(k / p.slot_words);
    const unsigned long long i = k % p.slot_words;
    if (own[k] != pattern_word(p.seed, src, p.rank, static_cast<unsigned>(i))) {
      ++bad;
      first = min(first, static_cast<unsigned>(k));
    }
  }
  if (bad) {
    atomicAdd(p.result, bad);
    atomicMin(p.result + 1, first);
  }
}
