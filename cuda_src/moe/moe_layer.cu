// The fused MoE layer kernels: one persistent forward and one persistent backward (one GPU, or
// one rank of an expert-parallel group: see ep.cuh).
// Launched with kThreads threads per CTA, gemm::kSmemBytes of dynamic shared memory and a grid
// of about (SMs x CTAs per SM); tasks are pulled from a counter zeroed by the host.
#include "moe/backward_tasks.cuh"

using namespace mok;

extern "C" __global__ void __launch_bounds__(kThreads, 1) moe_forward(const __grid_constant__ MoEForwardParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  if (error_set(p.err)) return;
  const int num_blocks = p.sched.num_blocks[0];
  if (!check_capacity(num_blocks, p.dims, p.err)) return;
  const ForwardPlan plan = ForwardPlan::make(p.dims, p.context_only != 0, p.peers);
  const ForwardTasks tasks{p, plan, num_blocks, smem};
  task_loop(p.cnt.task_next, plan.total, p.err, trace_records(p.trace, p.trace_tasks, plan.total), [&](int task) { tasks.run(task); });
  if (ep::enabled(p.peers)) ep::end_of_launch(p.peers, p.cnt.ctas_done, p.err, p.dims.timeout_ns);
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) moe_backward(const __grid_constant__ MoEBackwardParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  if (error_set(p.err)) return;
  const int num_blocks = p.sched.num_blocks[0];
  if (!check_capacity(num_blocks, p.dims, p.err)) return;
  const BackwardPlan plan = BackwardPlan::make(p.dims, p.peers);
  const BackwardTasks tasks{p, plan, num_blocks, smem};
  task_loop(p.cnt.task_next, plan.total, p.err, trace_records(p.trace, p.trace_tasks, plan.total), [&](int task) { tasks.run(task); });
  if (ep::enabled(p.peers)) ep::end_of_launch(p.peers, p.cnt.ctas_done, p.err, p.dims.timeout_ns);
}
