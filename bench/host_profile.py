#!/usr/bin/env python3
"""Host cost of one training step of the layer: how long schedule + forward + backward take to
enqueue (not to run), and where that time goes (cProfile).

    python bench/host_profile.py [--tokens 2048] [--steps 50] [--profile]

The GPU work of each step is waited for after the host clock stops, so the figure is the
enqueue path alone (the median over steps; the first steps are warm-up).
"""
from __future__ import annotations

import argparse
import cProfile
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
    ap.add_argument("--profile", action="store_true", help="print the top cProfile entries")
    a = ap.parse_args()

    import cupy as cp
    import mok_rt as mok
    T, H, I, E, k = a.tokens, a.hidden, a.intermediate, a.experts, a.top_k
    rng = np.random.default_rng(0)
    bf = ml_dtypes.bfloat16
    dev = lambda v: cp.asarray(v)  # noqa: E731
    x = dev(rng.standard_normal((T, H)).astype(bf))
    d_out = dev(rng.standard_normal((T, H)).astype(bf))
    ids = dev(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
    tw = dev(rng.random((T, k)).astype(np.float32))
    experts = mok.ExpertWeights(*(dev((rng.standard_normal(s) * 0.02).astype(bf))
                                  for s in ((E, I, H), (E, I, H), (E, H, I))))
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k)
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=T) as ws:
        def step():
            sched = mok.schedule(ws, ids)
            out, ctx = mok.forward(ws, sched, x, tw, experts)
            return mok.backward(ws, ctx, d_out)

        times = []
        for i in range(a.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            ws.synchronize()
        warm = times[5:] or times
        print(f"host enqueue of schedule+forward+backward, T={T}: median {statistics.median(warm) * 1e3:.3f} ms, "
              f"min {min(warm) * 1e3:.3f} ms over {len(warm)} steps")
        if a.profile:
            prof = cProfile.Profile()
            for _ in range(20):
                prof.enable()
                step()
                prof.disable()
                ws.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
