// Device-side error word: the one way a kernel reports what only the device can see.
//
// Layout (int32[4] in device memory owned by the workspace, runtime/errorword.py):
//   [0] code (first error wins; 0 = none)   [1..3] details, meaning per code below.
// A kernel that finds the word set does no further work and returns: no trap, no hang.
#pragma once
#include "ptx.cuh"

namespace mok {

enum ErrorCode : int {
  kErrNone = 0,
  kErrExpertId = 1,    // info: rank, token, expert id
  kErrCapacity = 2,    // info: rank, rows needed, capacity
  kErrTimeout = 3,     // info: waiting rank, peer rank (-1 unknown), what was awaited
  kErrTokens = 4,      // info: rank, tokens, max tokens
  kErrInternal = 5,    // info: line, a, b
};

// Records the first error; later ones are dropped.  Safe from any thread.
__device__ __forceinline__ void set_error(int* err, int code, int a, int b, int c) {
  if (atomicCAS(err, 0, code) == 0) {
    err[1] = a; err[2] = b; err[3] = c;
    __threadfence_system();
  }
}

__device__ __forceinline__ bool error_set(const int* err) {
  return ld_relaxed_sys(err) != 0;
}

}  // namespace mok
