"""How bench_moe.py times a call: CUDA events around each iteration, enqueued back to back
(pipelined), one at a time (serial), or as replays of a captured CUDA graph."""
from __future__ import annotations

import time
from typing import Any, Callable


# -- timing ----------------------------------------------------------------------------------------
def _time(torch, ranks, fn: Callable[[], Any], *, iters: int, warmup: int,
          timing: str = "pipelined") -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn`` (CUDA events on the current stream).

    "pipelined": the calls are enqueued back to back, an event pair around each, and the host
    synchronises once at the end -- as in a training step, where the host runs ahead of the GPU,
    so an iteration's time is its device time (launch gaps included only where the host falls
    behind).  "serial": the ranks meet at a barrier and the host waits for each call before the
    next, so each time also holds the host's enqueue latency of that call."""
    for _ in range(warmup):
        fn()
    ranks.synchronize()
    if ranks.cpu:
        out = []
        for _ in range(iters):
            ranks.barrier()
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    if timing == "graph":
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # torch's rule: warm up on a side stream before capturing
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        ranks.barrier()
        for start, end in pairs:
            start.record()
            graph.replay()
            end.record()
        pairs[-1][1].synchronize()
        del graph
        return [start.elapsed_time(end) for start, end in pairs]
    if timing == "pipelined":
        ranks.barrier()
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        pairs[-1][1].synchronize()
        return [start.elapsed_time(end) for start, end in pairs]
    out = []
    for start, end in pairs:
        ranks.barrier()   # ranks start together, so no rank's time includes another's lag
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out
