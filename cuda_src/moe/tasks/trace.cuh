// Optional per-task timeline of the MoE megakernels (Workspace(trace=True); mok_rt/kernels/trace.py
// decodes it).  Record g describes the g-th task grabbed in the launch: when it was grabbed, when
// its waits were done, when its work was done (its counters signalled), and which plan task on
// which SM.  Plain stores, one writer at a time per word (`ready`: the producer, then worker 0
// after the Job hand-off orders them); with a null trace pointer (the default) each hook
// is one uniform branch per task.
#pragma once
#include "common/ptx.cuh"

namespace mok {

struct TraceRec {
  unsigned long long grab;   // %globaltimer ns
  unsigned long long ready;  // work starts: the workers took the task (its producer waited before)
  unsigned long long end;    // counters signalled, or their release posted to the signaler
                             // (pipeline/signaler.cuh); 0: the task did not finish (an error stopped it)
  unsigned long long info;   // plan task << 32 | SM id
};
static_assert(sizeof(TraceRec) == 32, "mok_rt/kernels/trace.py reads 4 x u64 per record");

__device__ __forceinline__ void trace_grab(unsigned long long* tr, int g, int task) {
  if (tr == nullptr) return;
  TraceRec* r = reinterpret_cast<TraceRec*>(tr) + g;
  const unsigned long long now = globaltimer_ns();
  r->grab = now;
  r->ready = now;
  r->info = (static_cast<unsigned long long>(static_cast<unsigned>(task)) << 32) | smid();
}
__device__ __forceinline__ void trace_ready(unsigned long long* tr, int g) {
  if (tr != nullptr) reinterpret_cast<TraceRec*>(tr)[g].ready = globaltimer_ns();
}
__device__ __forceinline__ void trace_end(unsigned long long* tr, int g) {
  if (tr != nullptr) reinterpret_cast<TraceRec*>(tr)[g].end = globaltimer_ns();
}

}  // namespace mok
