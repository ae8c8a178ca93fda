#!/usr/bin/env python3
"""Host cost of one training step of the layer: how long schedule + forward + backward take to
enqueue (not to run), and where that time goes (cProfile).

    python bench/host_profile.py [--tokens 2048] [--steps 50] [--burst 10] [--profile] [--null-driver]
                                 [--producer-stream]

The host clock covers the enqueue path alone (the median over steps; the first steps are
warm-up).  ``--burst N`` (default 10) enqueues N steps back to back before the host waits for the
GPU, as a trainer's pipelined loop does; ``--burst 1`` waits after every step (the figures up to
2026-12-02 were taken that way: each step then starts on a thread that has just sat in a wait).  ``--null-driver`` runs
the same steps on any machine against bench/null_driver.py (every driver call succeeds at once,
inputs are fake device pointers): the Python cost alone, plus the Python calls per step.
``--producer-stream`` runs the calls on CuPy's current stream (``stream=``, the user guide's
advice) instead of the workspace's: then no import needs an event (under the null driver, a
fixed fake handle).

``--instructions``: no timing; after 20 warm-up steps each of ``--steps`` steps runs inside
``functools.reduce``, so that callgrind counts the instructions of the steps alone (the VM's
wall clock is noisy, this count is not)::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --toggle-collect=functools_reduce \
        --callgrind-out-file=/dev/null python bench/host_profile.py --null-driver --instructions --steps 200
    # "Collected : N"; N / 200 instructions per step
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import statistics
import time

import ml_dtypes
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--precision", choices=("bf16", "fp8_block"), default="bf16",
                    help="fp8_block: on weights quantised once (mok.quantize_weights) before the timed steps")
    ap.add_argument("--profile", action="store_true", help="print the top cProfile entries")
    ap.add_argument("--null-driver", action="store_true",
                    help="no GPU: time the Python path against bench/null_driver.py")
    ap.add_argument("--instructions", action="store_true",
                    help="no timing: run the steps inside functools.reduce, for callgrind (see the docstring)")
    ap.add_argument("--burst", type=int, default=10,
                    help="steps enqueued back to back before the host waits for the GPU (default 10: the "
                         "pipelined loop of a trainer; 1: wait after every step, so each step starts on a host "
                         "thread that sat in a wait, which at large T costs it tens of per cent)")
    ap.add_argument("--producer-stream", action="store_true",
                    help="run the calls on the inputs' producer stream (CuPy's current) instead of the workspace's")
    a = ap.parse_args()
    if a.null_driver:
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from null_driver import null_driver
        with null_driver():
            run(a, null=True)
    else:
        run(a, null=False)


def run(a, *, null: bool) -> None:
    import mok_rt as mok
    T, H, I, E, k = a.tokens, a.hidden, a.intermediate, a.experts, a.top_k
    bf = ml_dtypes.bfloat16
    shapes = dict(x=((T, H), bf), d_out=((T, H), bf), ids=((T, k), np.int32), tw=((T, k), np.float32),
                  gate=((E, I, H), bf), up=((E, I, H), bf), down=((E, H, I), bf))
    if null:
        from null_driver import FakeDeviceArray
        base = 1 << 44
        t = {}
        for n, (shape, dt) in shapes.items():
            t[n] = FakeDeviceArray(shape, dt, ptr=base)
            base += -(-int(np.prod(shape)) * np.dtype(dt).itemsize // 4096) * 4096
    else:
        import cupy as cp
        rng = np.random.default_rng(0)
        t = dict(x=rng.standard_normal((T, H)).astype(bf), d_out=rng.standard_normal((T, H)).astype(bf),
                 ids=np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32),
                 tw=rng.random((T, k)).astype(np.float32),
                 **{n: (rng.standard_normal(shapes[n][0]) * 0.02).astype(bf) for n in ("gate", "up", "down")})
        t = {n: cp.asarray(v) for n, v in t.items()}
    x, d_out, ids, tw = t["x"], t["d_out"], t["ids"], t["tw"]
    experts = mok.ExpertWeights(t["gate"], t["up"], t["down"])
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k, precision=a.precision)
    stream = None
    if a.producer_stream:
        stream = 0x5000 if null else cp.cuda.get_current_stream().ptr
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=T) as ws:
        if a.precision != "bf16":   # quantised once per optimizer step, outside the timed steps
            experts = mok.quantize_weights(ws, experts, stream=stream)

        def step():
            sched = mok.schedule(ws, ids, stream=stream)
            out, ctx = mok.forward(ws, sched, x, tw, experts, stream=stream)
            return mok.backward(ws, ctx, d_out, stream=stream)

        if a.instructions:
            for _ in range(20):
                step()
                ws.synchronize()
            for _ in range(a.steps):   # what callgrind --toggle-collect=functools_reduce counts
                functools.reduce(lambda acc, _: step(), (0,), None)
                ws.synchronize()
            return
        times = []
        burst = max(1, a.burst)
        for i in range(a.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            if (i + 1) % burst == 0:
                ws.synchronize()
        ws.synchronize()
        warm = times[5:] or times
        where = (" (null driver: Python only)" if null else "") + (" on the producer's stream" if stream is not None
                                                                   else "")
        where += f", {burst} steps per wait"
        print(f"host enqueue of schedule+forward+backward, T={T}{where}: median "
              f"{statistics.median(warm) * 1e3:.3f} ms, min {min(warm) * 1e3:.3f} ms over {len(warm)} steps")
        prof = cProfile.Profile()
        for _ in range(20):
            prof.enable()
            step()
            prof.disable()
            ws.synchronize()
        stats = pstats.Stats(prof)
        print(f"Python function calls per step: {stats.total_calls / 20:.0f}")
        if a.profile:
            stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
