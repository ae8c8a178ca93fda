"""Where does a layer call's time go?  Host enqueue time per API call, device time per step.

    python bench/profile_layer.py --shape quick            # prints host/device split
    ncu --clock-control none --print-summary per-kernel python bench/profile_layer.py --iters 2
    python bench/profile_layer.py --shape deepseek-v3 --iters 3 --trace ds.json   # per-task timeline
    python bench/profile_layer.py --shape qwen3-30b-a3b --precision fp8_block --trace fp8.json   # forward only
    python bench/profile_layer.py --shape qwen3-30b-a3b --precision fp8_block --fp8-backward    # and moe_backward_fp8
    python bench/profile_layer.py --shape qwen3-30b-a3b --ep 2 --tokens 4096 --trace ep.json
        # expert parallelism, 2 ranks sharing GPU 0 (one process): per-rank timelines on one clock,
        # and per rank how long its GEMM tiles ran under its own push (trace.LaunchTrace.push_overlap)

Kernel durations come from ncu (or from the device-time column when the host is not the limit),
or, with ``--kernels``, from PyTorch's profiler (CUPTI: every kernel and memset of the process,
whoever launched it): per kind its device time, and per iteration the device's span and gaps.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

# The checkout's mok_rt first (as bench_moe.py does): a run from a clone needs no install.
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

SHAPES = {  # name: (H, I, E, k, T, I_s)
    "quick": (512, 256, 16, 4, 2048, 0),
    "qwen3-30b-a3b": (2048, 768, 128, 8, 16384, 0),
    "deepseek-v3": (7168, 2048, 256, 8, 8192, 0),
    "deepseek-v3-ep8-slice": (7168, 2048, 32, 8, 8192, 0),   # one EP = 8 rank's experts (bench_moe's shape)
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="quick", choices=sorted(SHAPES))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--trace", default=None, metavar="PATH",
                    help="record per-task timelines (Workspace(trace=True)); print the last iteration's "
                         "per-phase summary and write it as a Chrome trace (chrome://tracing, ui.perfetto.dev)")
    ap.add_argument("--kernels", action="store_true",
                    help="time every kernel and memset on the device (torch.profiler, needs PyTorch) and print "
                         "them by name, with the device's span, busy and idle time")
    ap.add_argument("--pipelined", type=int, default=0, metavar="N",
                    help="after the iterations, N more enqueued back to back (as bench_moe.py times them): "
                         "the host time of each call (a call that waits for the device shows it), and with "
                         "--kernels the device activity of those N")
    ap.add_argument("--tokens", type=int, default=None, help="tokens (default: the shape's)")
    ap.add_argument("--grad-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype of the weight gradients (caller buffers)")
    ap.add_argument("--precision", choices=("bf16", "fp8_block"), default="bf16",
                    help="fp8_block: the forward only (unless --fp8-backward), on weights quantised once by "
                         "mok.quantize_weights")
    ap.add_argument("--fp8-backward", action="store_true",
                    help="fp8_block: the backward too (moe_backward_fp8; its kernel may still be incomplete)")
    ap.add_argument("--ep", type=int, default=1, metavar="P",
                    help="P > 1: P expert-parallel ranks sharing GPU 0 in this process (bf16; --tokens per "
                         "rank); with --trace, the ranks' timelines on one clock and the push/GEMM overlap")
    ap.add_argument("--comm-sms", type=int, default=None, help="--ep: MoEConfig.comm_sms (push tasks)")
    ap.add_argument("--devices", default=None, metavar="D0,D1,...",
                    help="--ep: the ranks' GPUs (default: all on GPU 0), e.g. 0,1 on a two-GPU machine")
    args = ap.parse_args()
    if args.iters < 1 or args.pipelined < 0:
        ap.error("--iters must be >= 1 and --pipelined >= 0")
    if args.ep > 1 and (args.kernels or args.pipelined):
        ap.error("--kernels and --pipelined are one-rank options (not with --ep)")
    if args.kernels and args.iters < 2 and not args.pipelined:
        print("note: --kernels profiles the last iteration; with --iters 1 that is the cold first one", flush=True)
    if args.ep > 1:
        return run_ep(args)
    import cupy as cp
    import mok_rt as mok
    H, I, E, k, T, Is = SHAPES[args.shape]
    T = args.tokens if args.tokens is not None else T
    rng = np.random.default_rng(0)
    bf = ml_dtypes.bfloat16
    cp.random.seed(0)

    def randn(shape, scale=1.0):
        # On the device (the deepseek-v3 weights are 11e9 values): fp32 normal, bf16 by truncation.
        f = cp.random.standard_normal(shape, dtype=cp.float32) * cp.float32(scale)
        bits = (f.view(cp.uint32) >> 16).astype(cp.uint16)
        try:
            return bits.view(bf)
        except (TypeError, ValueError):   # a CuPy without bfloat16 views: through the host
            return cp.asarray(cp.asnumpy(bits).view(bf))

    x = randn((T, H))
    ids = cp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
    tw = cp.asarray(rng.random((T, k)).astype(np.float32))
    wg, wu = randn((E, I, H), H ** -0.5), randn((E, I, H), H ** -0.5)
    wd = randn((E, H, I), I ** -0.5)
    dout = randn((T, H))
    experts = mok.ExpertWeights(gate=wg, up=wu, down=wd)
    gdt = bf if args.grad_dtype == "bfloat16" else np.float32
    dw = mok.ExpertWeights(*(cp.zeros(w.shape, dtype=gdt) for w in (wg, wu, wd)))
    fp8 = args.precision == "fp8_block"
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k, shared_intermediate=Is,
                        precision=args.precision)
    flops = cfg.forward_flops(T)
    last = []
    prof = _kernel_profiler() if args.kernels else None
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=T, trace=bool(args.trace)) as ws:
        stream = ws.stream
        weights = mok.quantize_weights(ws, experts) if fp8 else experts
        for it in range(args.iters):
            if prof is not None and it == args.iters - 1 and not args.pipelined:
                prof.start()   # the device is idle: the last iteration synchronised at its end
            cp.cuda.runtime.deviceSynchronize()
            t0 = time.perf_counter()
            sched = mok.schedule(ws, ids)
            t1 = time.perf_counter()
            out, ctx = mok.forward(ws, sched, x, tw, weights)
            t2 = time.perf_counter()
            stream.sync()
            t3 = time.perf_counter()
            if fp8 and not args.fp8_backward:
                print(f"iter {it}: host schedule {1e3 * (t1 - t0):.3f} ms, forward {1e3 * (t2 - t1):.3f} ms, "
                      f"sched+fwd done {1e3 * (t3 - t0):.3f} ms ({flops / (t3 - t0) / 1e12:.1f} TF/s)", flush=True)
                del out, ctx
                if args.trace:
                    last = ws.take_traces()
                continue
            g = mok.backward(ws, ctx, dout, dw=dw)
            t4 = time.perf_counter()
            ws.synchronize()
            t5 = time.perf_counter()
            print(f"iter {it}: host schedule {1e3 * (t1 - t0):.3f} ms, forward {1e3 * (t2 - t1):.3f} ms, "
                  f"sched+fwd done {1e3 * (t3 - t0):.3f} ms ({flops / (t3 - t0) / 1e12:.1f} TF/s); "
                  f"host backward {1e3 * (t4 - t3):.3f} ms, backward done {1e3 * (t5 - t3):.3f} ms "
                  f"({2 * flops / (t5 - t3) / 1e12:.1f} TF/s)", flush=True)
            del out, ctx, g
            if args.trace:
                last = ws.take_traces()   # tracing adds ~30 us per launch (a memset and the records)
        if args.pipelined:
            _pipelined(ws, steps=args.pipelined, prof=prof, schedule=lambda: mok.schedule(ws, ids),
                       forward=lambda sched: mok.forward(ws, sched, x, tw, weights),
                       backward=None if fp8 and not args.fp8_backward else (lambda ctx: mok.backward(ws, ctx, dout, dw=dw)))
        elif prof is not None:
            prof.stop()
            print(_kernel_table(prof))
    if args.trace:
        from mok_rt.kernels.trace import write_chrome_trace
        for t in last:
            print(t.summary())
            print(t.gaps_summary())
            print(t.worst_window_summary())
        write_chrome_trace(args.trace, last)
        print(f"chrome trace: {args.trace}")
    return 0


def _pipelined(ws, *, steps, prof, schedule, forward, backward) -> None:
    """``steps`` steps enqueued back to back, one synchronisation at the end: the host time of
    each call, and (``prof``, or None) the device's activity over the steps.  ``backward``: None
    for forward-only steps."""
    ws.synchronize()
    if prof is not None:
        prof.start()
    host, keep = [], []
    t_start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        sched = schedule()
        t1 = time.perf_counter()
        out, ctx = forward(sched)
        t2 = time.perf_counter()
        g = backward(ctx) if backward is not None else None
        t3 = time.perf_counter()
        host.append((t1 - t0, t2 - t1, t3 - t2))
        keep = [out, ctx, g]   # the previous step's results die here, as in a training loop
    t_enq = time.perf_counter()
    ws.synchronize()
    t_end = time.perf_counter()
    del keep
    med = [1e3 * float(np.median([h[i] for h in host])) for i in range(3)]
    bwd = "-" if backward is None else f"{med[2]:.3f}"
    print(f"pipelined, {steps} steps: host per step schedule {med[0]:.3f} / forward {med[1]:.3f} / backward "
          f"{bwd} ms (median; max forward {1e3 * max(h[1] for h in host):.3f}); enqueue of all "
          f"{1e3 * (t_enq - t_start):.2f} ms, until done {1e3 * (t_end - t_start):.2f} ms "
          f"({1e3 * (t_end - t_start) / steps:.3f} ms per step)", flush=True)
    if prof is not None:
        prof.stop()
        print(_kernel_table(prof, label=f"the {steps} pipelined steps"))


def _kernel_profiler():
    """A torch.profiler that records the device's kernels and memsets (CUPTI sees the driver-API
    launches of mok_rt and CuPy too)."""
    import torch
    torch.cuda.init()
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])


def _kernel_table(prof, *, label: str = "the last iteration") -> str:
    """The device activity of what ``prof`` recorded: per name, calls and device us; then the span from the
    first start to the last end and the idle time between activities inside it."""
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
    if not evs:
        return "no device activity recorded"
    by: dict[str, list[float]] = {}
    for e in evs:
        by.setdefault(e.name, []).append(e.time_range.elapsed_us())
    iv = sorted((e.time_range.start, e.time_range.end) for e in evs)
    busy, end, gaps = 0.0, iv[0][0], 0.0
    for a, b in iv:
        if a > end:
            gaps += a - end
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    lines = [f"device activity of {label}: span {end - iv[0][0]:.1f} us, busy {busy:.1f} us, "
             f"idle between activities {gaps:.1f} us",
             f"  {'us':>10} {'calls':>6}  name"]
    for name, ts in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"  {sum(ts):>10.1f} {len(ts):>6}  {name[:90]}")
    return "\n".join(lines)


def run_ep(args) -> int:
    """``--ep P``: P ranks of one group (on GPU 0, or on ``--devices``), each with its own tokens and
    E / P experts."""
    import cupy as cp
    import mok_rt as mok
    from mok_rt.kernels.trace import write_chrome_trace
    H, I, E, k, T, Is = SHAPES[args.shape]
    T = args.tokens if args.tokens is not None else T
    P = args.ep
    if E % P or args.precision != "bf16":
        raise SystemExit(f"--ep {P}: needs bf16 and experts ({E}) divisible by the ranks")
    devices = [0] * P if args.devices is None else [int(d) for d in args.devices.split(",")]
    if len(devices) != P:
        raise SystemExit(f"--devices: {P} devices expected, got {args.devices!r}")
    rng = np.random.default_rng(0)
    cp.random.seed(0)

    def randn(shape, scale=1.0):
        f = cp.random.standard_normal(shape, dtype=cp.float32) * cp.float32(scale)
        return (f.view(cp.uint32) >> 16).astype(cp.uint16).view(ml_dtypes.bfloat16)

    extra = {} if args.comm_sms is None else {"comm_sms": args.comm_sms}
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k, shared_intermediate=Is, **extra)
    el = E // P
    per = []
    for dev in devices:   # each rank's tensors on its own GPU
        with cp.cuda.Device(dev):
            per.append(dict(x=randn((T, H)), dout=randn((T, H)),
                            ids=cp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)),
                            tw=cp.asarray(rng.random((T, k)).astype(np.float32)),
                            w=mok.ExpertWeights(randn((el, I, H), H ** -0.5), randn((el, I, H), H ** -0.5),
                                                randn((el, H, I), I ** -0.5))))
    gpus = len(set(devices))
    flops = cfg.forward_flops(T)   # per rank (its tokens' routes); the GPU runs P of them
    last = []
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=devices), max_tokens=T, trace=bool(args.trace)) as ws:
        ranks = [ws.rank(r) for r in range(P)]
        for it in range(args.iters):
            ws.synchronize()
            t0 = time.perf_counter()
            scheds = [mok.schedule(ranks[r], d["ids"]) for r, d in enumerate(per)]   # every rank's, then
            fw = [mok.forward(ranks[r], scheds[r], d["x"], d["tw"], d["w"]) for r, d in enumerate(per)]
            ws.synchronize()
            t1 = time.perf_counter()
            gs = [mok.backward(ranks[r], fw[r][1], d["dout"]) for r, d in enumerate(per)]
            ws.synchronize()
            t2 = time.perf_counter()
            print(f"iter {it}: {P} ranks on {gpus} GPU(s): sched+forward {1e3 * (t1 - t0):.3f} ms "
                  f"({P * flops / gpus / (t1 - t0) / 1e12:.1f} TF/s per GPU), backward {1e3 * (t2 - t1):.3f} ms "
                  f"({2 * P * flops / gpus / (t2 - t1) / 1e12:.1f} TF/s per GPU)", flush=True)
            del fw, gs, scheds
            if args.trace:
                last = ws.take_traces()
    if args.trace:
        for t in sorted(last, key=lambda t: (t.kind, t.rank)):
            print(t.summary())
            print(t.gaps_summary())
            print(t.worst_window_summary())
        for t in sorted(last, key=lambda t: (t.kind, t.rank)):
            print(t.overlap_summary())
        write_chrome_trace(args.trace, sorted(last, key=lambda t: (t.kind, t.rank)), aligned=True)
        print(f"chrome trace (the ranks' launches on one clock): {args.trace}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
