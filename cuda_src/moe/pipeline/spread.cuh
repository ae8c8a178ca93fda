// Spreading one phase's tasks through the tasks before it in the grab order (a permutation of
// positions: same tasks, same results).  Host and device code (tests/test_task_spread.py runs it
// on the host).
//
// Why: a phase of memory-bound tasks run as a phase of its own keeps every SM on HBM-bound copies
// while the tensor cores idle (the FP8 backward's widen after the dX tiles: ~0.9 ms at the
// deepseek-v3 slice), and where it is the launch's last phase its few long tasks leave most SMs
// idle at the end (the backward's combine: 256 tasks of ~190 us after ~43,000 wgrad tiles of
// ~28 us, SMs idle for ~0.4 ms on average).  Spread through compute-bound tiles, a few of them
// run at a time, under the tiles.
#pragma once

namespace mok {
namespace pipe {

// Positions [begin, begin + host + guest) hold, in plan order, `host` tasks (one or more phases)
// and right after them the `guest` phase's tasks.  They are walked as `stride` host tasks, one
// guest task, ... (guest times), then the remaining host tasks in order.  Valid where no guest
// task waits on a host task: a guest may now come before every host task (a host task never waits
// on a guest: in plan order every task waits only on earlier phases).  stride = 0: plan order.
struct Spread {
  int begin = 0, host = 0, guest = 0, stride = 0;

  // The guest phase [guest_begin, + guest_count) right after [host_begin, guest_begin): at most
  // `stride` host tasks per guest (fewer where the host range is too short).  Plan order where the
  // guest does not follow the host range directly or either is empty.
  __host__ __device__ static Spread of(int host_begin, int guest_begin, int guest_count, int stride) {
    const int host = guest_begin - host_begin;
    if (guest_count <= 0 || host <= 0 || stride <= 0) return Spread{};
    const int most = host / guest_count;
    return Spread{host_begin, host, guest_count, stride < most ? stride : most};
  }
  // The guests through the first half of the host range, so that the last guest (a long task)
  // ends well before the host tasks do.
  __host__ __device__ static Spread early(int host_begin, int guest_begin, int guest_count) {
    return of(host_begin, guest_begin, guest_count, guest_count > 0 ? (guest_begin - host_begin) / (2 * guest_count) : 0);
  }
  // The plan position of the task grabbed at position t.
  __host__ __device__ int map(int t) const {
    const int u = t - begin;
    if (stride <= 0 || u < 0 || u >= host + guest) return t;
    const int k = u / (stride + 1);
    if (k >= guest) return t - guest;  // past the last guest: the remaining host tasks
    const int r = u - k * (stride + 1);
    return r < stride ? begin + k * stride + r : begin + host + k;
  }
};

}  // namespace pipe
}  // namespace mok
