"""How bench_moe.py times a call: CUDA events around each iteration, enqueued back to back
(pipelined), one at a time (serial), or as replays of a captured CUDA graph; and the figures
quoted from those times."""
from __future__ import annotations

import statistics
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


# -- figures ---------------------------------------------------------------------------------------
_FIGURE_FIELDS = ("ms", "ms_ranks", "ms_min_rank0", "ms_max_rank0", "tflops_per_gpu")


def _figures(ranks, times: dict[str, list[float]], flops_fwd: int) -> dict:
    """Per-rank medians gathered; the step takes as long as the slowest rank.  ``times``: the
    samples of "fwd" and (where it ran) "fwd_bwd"."""
    every = ranks.gather({key: statistics.median(samples) for key, samples in times.items()})
    fig = {}
    for key, samples in times.items():
        ms = max(r[key] for r in every)
        flops = flops_fwd if key == "fwd" else 3 * flops_fwd
        fig.update({f"{key}_ms": round(ms, 4), f"{key}_ms_ranks": [round(r[key], 4) for r in every],
                    f"{key}_ms_min_rank0": round(min(samples), 4) if ranks.rank == 0 else None,
                    f"{key}_ms_max_rank0": round(max(samples), 4) if ranks.rank == 0 else None,
                    f"{key}_tflops_per_gpu": round(flops / ms / 1e9, 2)})
    return fig
