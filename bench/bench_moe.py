#!/usr/bin/env python3
"""Benchmark mok_rt's MoE layer against the PyTorch pipeline users would run instead.

Both run in the same process, one process per GPU, on the same random inputs and weights:

    python bench/bench_moe.py                                  # one GPU (EP = 1)
    torchrun --nproc-per-node=8 bench/bench_moe.py             # expert parallel over 8 GPUs
    mpirun -np 2 python bench/bench_moe.py                     # same, launched by MPI
    python bench/bench_moe.py --quick                          # small shapes: a smoke test

A step is timed with CUDA events on torch's current stream (mok_rt is handed that stream), each
iteration on its own after warm-up, and the median over iterations is reported (the slowest
rank's median with EP > 1).  "fwd" = routing schedule + forward; "fwd+bwd" = schedule + forward
+ backward (weight, input and router-weight gradients).  TFLOP/s per GPU count the routed
experts' 6*T*k*H*I (+ the shared expert's 6*T*H*I_s) per forward and 3x that per forward +
backward, T = tokens per rank.  Before timing, one fwd+bwd of each side is compared
(relative Frobenius error); mok_rt figures that fail the check are withheld.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench_procs import _attempt, _launcher_env, _log, _Ranks
from bench_report import _commit, _machine, _results_path, _versions, _write, format_table
from bench_timing import _time

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent
TOLERANCE = 2e-2          # relative Frobenius error of mok_rt vs the baseline
SCHEMA = 1


@dataclass(frozen=True)
class Shape:
    """One MoE layer shape; ``tokens`` is per rank."""

    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tokens: int
    shared: int = 0
    swiglu_limit: float | None = None

    def forward_flops(self, tokens: int) -> int:
        return 6 * tokens * (self.top_k * self.hidden * self.intermediate + self.hidden * self.shared)


SHAPES = {s.name: s for s in (
    Shape("qwen3-30b-a3b", 2048, 768, 128, 8, 16384),
    Shape("deepseek-v3", 7168, 2048, 256, 8, 8192),
    Shape("deepseek-v3-shared", 7168, 2048, 256, 8, 8192, shared=2048),
    # deepseek-v3 as one GPU of an EP = 8 group holds it: 32 local experts (routing over them only).
    Shape("deepseek-v3-ep8-slice", 7168, 2048, 32, 8, 8192),
    Shape("qwen3-235b-a22b", 4096, 1536, 128, 8, 8192),
    Shape("glm-4.5-air", 4096, 1408, 128, 8, 8192, shared=1408),
    Shape("gpt-oss-120b", 2880, 2880, 128, 4, 8192, swiglu_limit=7.0),
    # --quick: small enough to run in seconds, still several experts per rank on 8 GPUs
    Shape("quick", 512, 256, 16, 4, 2048),
    Shape("quick-shared", 512, 256, 16, 4, 2048, shared=256),
)}
DEFAULT_SHAPES = ("qwen3-30b-a3b", "deepseek-v3", "deepseek-v3-shared")
QUICK_SHAPES = ("quick", "quick-shared")
_GRAD_NAMES = ("dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Time mok_rt's MoE layer against the PyTorch baseline (grouped_mm pipeline) on the same "
                    "inputs; write a JSON of every figure.",
        epilog=f"shapes: {', '.join(SHAPES)}.  EP size = number of processes (torchrun / mpirun), one GPU each.")
    ap.add_argument("--shapes", default=None,
                    help=f"comma-separated shape names or 'all' (default: {','.join(DEFAULT_SHAPES)}; "
                         f"with --quick: {','.join(QUICK_SHAPES)})")
    ap.add_argument("--tokens", default=None,
                    help="tokens per rank for every shape (overrides the shape's); a comma list sweeps them")
    ap.add_argument("--quick", action="store_true", help="small shapes and short warm-up: a smoke test")
    ap.add_argument("--ep", type=int, default=None,
                    help="expected expert-parallel size; must equal the number of launched processes")
    ap.add_argument("--impl", choices=("both", "mok", "torch"), default="both", help="what to run (default both)")
    ap.add_argument("--iters", type=int, default=30, help="timed iterations per figure (>= 20; default 30)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 5, --quick 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timing", choices=("pipelined", "serial", "graph"), default="pipelined",
                    help="pipelined (default): calls enqueued back to back, the host ahead of the GPU as in "
                         "training; serial: the host waits for each call (adds its enqueue latency); graph: "
                         "one call captured in a CUDA graph, its replays timed (mok_rt; the baseline gets the "
                         "better of graph replay, where it captures, and pipelined)")
    ap.add_argument("--grad-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="mok_rt's weight-gradient buffers: bfloat16 (default; what the baseline's autograd "
                         "produces for its bf16 weights) or float32 (a trainer's fp32 main grads)")
    ap.add_argument("--comm-sms", type=int, default=None,
                    help="MoEConfig.comm_sms with EP (tasks that push this rank's rows; default: the config's)")
    ap.add_argument("--out", default=None, help="directory for the results JSON (default bench/results)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="self-test of the harness without a GPU: torch on the CPU (gloo between processes), "
                         "mok_rt's NumPy reference backend, wall-clock timing; the figures mean nothing")
    ap.add_argument("--commit", default=os.environ.get("MOK_BENCH_COMMIT"),
                    help="commit id to record when the tree has no git metadata (env MOK_BENCH_COMMIT)")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.quick = True
        if args.tokens is None:
            args.tokens = "256"   # the float64 reference backend is slow
    names = args.shapes.split(",") if args.shapes else list(QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    if names == ["all"]:
        names = [n for n in SHAPES if n not in QUICK_SHAPES]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    args.shape_list = [SHAPES[n] for n in names]
    try:
        args.token_list = [None] if args.tokens is None else [int(t) for t in str(args.tokens).split(",")]
    except ValueError:
        ap.error(f"--tokens: expected positive ints separated by commas, got {args.tokens!r}")
    if any(t is not None and t <= 0 for t in args.token_list):
        ap.error("--tokens must be positive")
    args.tokens = None
    if args.iters < 20:
        ap.error("--iters must be >= 20 (medians of fewer iterations are too noisy to quote)")
    if args.warmup is None:
        args.warmup = 2 if args.quick else 5
    if args.ep is not None and args.ep < 1:
        ap.error("--ep must be >= 1")
    return args


# -- inputs ----------------------------------------------------------------------------------------
class _Inputs:
    """One rank's random inputs and weights in mok_rt's layout (never zeros)."""

    def __init__(self, torch, shape: Shape, tokens: int, ranks: _Ranks, seed: int):
        dev = ranks.dev
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed * 1_000_003 + ranks.rank)   # each rank: its own tokens and experts
        shared_gen = torch.Generator(device=dev)
        shared_gen.manual_seed(seed * 1_000_003 + 999_983)   # the shared expert: replicated, as in training
        h, i, e, k, s = shape.hidden, shape.intermediate, shape.experts, shape.top_k, shape.shared
        if e % ranks.size:
            raise ValueError(f"{e} experts do not split over {ranks.size} ranks")
        el = e // ranks.size

        def randn(*dims, scale=1.0, g=gen):
            t = torch.randn(dims, device=dev, dtype=torch.bfloat16, generator=g)
            return t.mul_(scale) if scale != 1.0 else t

        self.w_gate = randn(el, i, h, scale=h ** -0.5)
        self.w_up = randn(el, i, h, scale=h ** -0.5)
        self.w_down = randn(el, h, i, scale=i ** -0.5)
        self.ws_gate = self.ws_up = self.ws_down = None
        if s:
            self.ws_gate = randn(s, h, scale=h ** -0.5, g=shared_gen)
            self.ws_up = randn(s, h, scale=h ** -0.5, g=shared_gen)
            self.ws_down = randn(h, s, scale=s ** -0.5, g=shared_gen)
        # Router: random logits -> softmax -> top-k, weights renormalised over the k.
        probs = torch.randn((tokens, e), device=dev, generator=gen).softmax(dim=-1)
        top_w, top_i = probs.topk(k, dim=-1)
        self.topk_ids = top_i                                   # int64, the baseline's index type
        self.topk_ids32 = top_i.to(torch.int32).contiguous()    # what mok_rt is handed
        tw = (top_w / top_w.sum(dim=-1, keepdim=True)).float().contiguous()
        x = randn(tokens, h)
        self.d_out = randn(tokens, h)
        # Leaves for the baseline's autograd; detached aliases (same memory) for DLPack export.
        self.x = x.requires_grad_(True)
        self.topk_weights = tw.requires_grad_(True)
        self.x_plain, self.topk_weights_plain = x.detach(), tw.detach()

    def mok_weights(self) -> tuple:
        """(w_gate, w_up, w_down, ws_gate, ws_up, ws_down); the shared ones None without a shared expert."""
        return (self.w_gate, self.w_up, self.w_down, self.ws_gate, self.ws_up, self.ws_down)

    def clear_grads(self) -> None:
        self.x.grad = None
        self.topk_weights.grad = None


def rel_fro(torch, got, want) -> float:
    """||got - want||_F / ||want||_F in float64, in slices so big weight gradients need no big
    temporaries.  NaN (an unwritten poisoned element) propagates and fails every check."""
    if tuple(got.shape) != tuple(want.shape):
        return math.inf
    a, b = got.reshape(got.shape[0], -1), want.reshape(want.shape[0], -1)
    step = max(1, (1 << 25) // max(1, a.shape[1]))
    num = torch.zeros((), dtype=torch.float64, device=b.device)
    den = torch.zeros((), dtype=torch.float64, device=b.device)
    for r in range(0, a.shape[0], step):
        ad, bd = a[r:r + step].double(), b[r:r + step].double()
        num += (ad - bd).square().sum()
        den += bd.square().sum()
    num, den = num.item(), den.item()
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return math.sqrt(num / den)


_FIGURE_FIELDS = ("ms", "ms_ranks", "ms_min_rank0", "ms_max_rank0", "tflops_per_gpu")


def _figures(ranks: _Ranks, fwd_ms: list[float], fwd_bwd_ms: list[float], flops_fwd: int) -> dict:
    """Per-rank medians gathered; the step takes as long as the slowest rank."""
    mine = {"fwd": statistics.median(fwd_ms), "fwd_bwd": statistics.median(fwd_bwd_ms)}
    every = ranks.gather(mine)
    fig = {}
    for key, flops in (("fwd", flops_fwd), ("fwd_bwd", 3 * flops_fwd)):
        ms = max(r[key] for r in every)
        samples = fwd_ms if key == "fwd" else fwd_bwd_ms
        fig.update({f"{key}_ms": round(ms, 4), f"{key}_ms_ranks": [round(r[key], 4) for r in every],
                    f"{key}_ms_min_rank0": round(min(samples), 4) if ranks.rank == 0 else None,
                    f"{key}_ms_max_rank0": round(max(samples), 4) if ranks.rank == 0 else None,
                    f"{key}_tflops_per_gpu": round(flops / ms / 1e9, 2)})
    return fig


# -- the baseline ----------------------------------------------------------------------------------
def _torch_reference(inp: _Inputs, base) -> dict:
    """One baseline fwd+bwd; its results (kept) are what mok_rt is checked against."""
    inp.clear_grads()
    base.zero_grad()
    out = base(inp.x, inp.topk_ids, inp.topk_weights)
    out.backward(inp.d_out)
    ref = {"out": out.detach(), "dx": inp.x.grad, "d_topk_weights": inp.topk_weights.grad, **base.grads()}
    inp.clear_grads()
    base.zero_grad()
    return {n: v for n, v in ref.items() if v is not None}


def _time_torch(torch, ranks, inp: _Inputs, base, args) -> tuple[list[float], list[float]]:
    def fwd():
        return base(inp.x, inp.topk_ids, inp.topk_weights)

    def fwd_bwd():
        inp.clear_grads()
        base.zero_grad()
        base(inp.x, inp.topk_ids, inp.topk_weights).backward(inp.d_out)

    def best(fn):
        t = _time(torch, ranks, fn, iters=args.iters, warmup=args.warmup,
                  timing="pipelined" if args.timing == "graph" else args.timing)
        if args.timing == "graph":   # where the pipeline captures (no host sync), its replays may be faster
            try:
                g = _time(torch, ranks, fn, iters=args.iters, warmup=args.warmup, timing="graph")
                t = min(t, g, key=statistics.median)
            except Exception as ex:  # noqa: BLE001 -- a host sync in the pipeline: it does not capture
                _log(ranks, f"   baseline does not capture in a CUDA graph ({type(ex).__name__}); pipelined")
                torch.cuda.synchronize()
        return t

    f, fb = best(fwd), best(fwd_bwd)
    inp.clear_grads()
    base.zero_grad()
    return f, fb, _torch_step_memory(torch, ranks, fwd_bwd)


def _torch_step_memory(torch, ranks, step) -> dict | None:
    """The baseline's peak memory of one fwd+bwd above what it held before (activations,
    gradients and temporaries from torch's allocator); None on the CPU."""
    if ranks.cpu:
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return {"step_peak_gib": round((torch.cuda.max_memory_allocated() - before) / 2 ** 30, 3)}


# -- mok_rt ----------------------------------------------------------------------------------------
class _Mok:
    """mok_rt, its process group, and why it cannot run (``error``) if it cannot."""

    def __init__(self, ranks: _Ranks, want: bool):
        self.mod = self.group = self.error = None
        if not want:
            self.error = "not requested (--impl torch)"
            return

        def load():
            if str(_ROOT) not in sys.path:
                sys.path.insert(0, str(_ROOT))
            import mok_rt as mok
            missing = [n for n in ("MoEConfig", "Workspace", "SingleProcessGroup", "CallableGroup", "ExpertWeights",
                                   "schedule", "forward", "backward") if not hasattr(mok, n)]
            if missing:
                raise ImportError(f"mok_rt {getattr(mok, '__version__', '?')} lacks {', '.join(missing)}")
            if ranks.size == 1:
                group = mok.SingleProcessGroup(devices=[ranks.device])
            else:   # one process per rank over torch.distributed's collectives
                group = mok.CallableGroup(rank=ranks.rank, size=ranks.size, device_id=ranks.device,
                                          all_gather=ranks.gather, barrier=ranks.barrier)
            return mok, group

        value, self.error = _attempt(ranks, "mok_rt setup", load)
        if value is not None:
            self.mod, self.group = value


def _as_torch(torch, t):
    return t if isinstance(t, torch.Tensor) else torch.from_dlpack(t)


def _stream_for_mok(torch, ranks: _Ranks):
    if ranks.cpu:
        return None
    s = torch.cuda.current_stream()
    return s if hasattr(s, "__cuda_stream__") else s.cuda_stream   # older torch: the raw handle


def _run_mok(torch, ranks, mok: _Mok, shape: Shape, tokens: int, inp: _Inputs, refs: dict,
             flops: int, args) -> tuple[dict, dict]:
    """Check one mok_rt fwd+bwd against the baseline's (``refs["ref"]``, popped once used so
    its memory is free while timing), then time fwd and fwd+bwd.  Returns (figures or error, check)."""
    m = mok.mod
    ref = refs.pop("ref", None)
    ref_names = set(ref or ())
    state: dict[str, Any] = {}
    result: dict[str, Any] = {}
    check: dict[str, Any] = {"tolerance": TOLERANCE}
    x, tw, ids = inp.x_plain, inp.topk_weights_plain, inp.topk_ids32
    weights = inp.mok_weights()
    experts = m.ExpertWeights(*weights[:3])
    shared = None if weights[3] is None else m.ExpertWeights(*weights[3:])

    def setup():
        knobs = {} if args.comm_sms is None else {"comm_sms": args.comm_sms}
        cfg = m.MoEConfig(hidden=shape.hidden, intermediate=shape.intermediate, num_experts=shape.experts,
                          top_k=shape.top_k, shared_intermediate=shape.shared, swiglu_limit=shape.swiglu_limit,
                          **knobs)
        state["ws"] = m.Workspace(cfg, mok.group, max_tokens=tokens, backend="reference" if ranks.cpu else "cuda",
                                  stream=_stream_for_mok(torch, ranks))
        # Caller-owned weight-gradient buffers (a trainer's .grad) in --grad-dtype, poisoned so
        # that an element the kernel never writes fails the check.
        gdt = getattr(torch, args.grad_dtype)
        bufs = [None if w is None else torch.full(tuple(w.shape), math.nan, device=x.device, dtype=gdt)
                for w in weights]
        state["bufs"] = {"dw": m.ExpertWeights(*bufs[:3]),
                         "dw_shared": None if bufs[3] is None else m.ExpertWeights(*bufs[3:])}

    def fwd():
        ws, s = state["ws"], _stream_for_mok(torch, ranks)
        sched = m.schedule(ws, ids, stream=s)
        out, _ = m.forward(ws, sched, x, tw, experts, shared=shared, stream=s)
        return out

    def fwd_bwd():
        ws, s = state["ws"], _stream_for_mok(torch, ranks)
        sched = m.schedule(ws, ids, stream=s)
        out, ctx = m.forward(ws, sched, x, tw, experts, shared=shared, stream=s)
        g = m.backward(ws, ctx, inp.d_out, **state["bufs"], stream=s)
        return out, g

    def check_run():
        out, g = fwd_bwd()
        state["ws"].synchronize()   # raises what a kernel reported
        got = {"out": out, "dx": g.dx, "d_topk_weights": g.d_topk_weights,
               **dict(zip(_GRAD_NAMES, (*g.dw, *(g.dw_shared or (None,) * 3))))}
        got = {n: _as_torch(torch, v) for n, v in got.items() if v is not None}
        # Clones: mok_rt may hand out workspace memory that the next call overwrites.
        state["first"] = {n: got[n].clone() for n in ("out", "dx", "d_topk_weights")}
        if ref is None:
            return {}
        return {n: rel_fro(torch, got[n], want) for n, want in ref.items() if n in got}

    def release_ref():
        nonlocal ref
        ref = None
        _free(torch)

    def timed():
        last = {}
        f = _time(torch, ranks, lambda: last.__setitem__("fwd", fwd()), iters=args.iters, warmup=args.warmup,
                  timing=args.timing)
        state["ws"].synchronize()
        same = torch.equal(_as_torch(torch, last.pop("fwd")), state["first"]["out"])
        fb = _time(torch, ranks, lambda: last.__setitem__("fb", fwd_bwd()), iters=args.iters, warmup=args.warmup,
                   timing=args.timing)
        state["ws"].synchronize()
        out, g = last.pop("fb")
        for name, t in (("out", out), ("dx", g.dx), ("d_topk_weights", g.d_topk_weights)):
            same = same and torch.equal(_as_torch(torch, t), state["first"][name])
        return f, fb, same

    def step_memory():
        """After the check run (the fresh workspace's first, eager, step): mok_rt's high-water
        mark (scratch and result blocks; later eager steps reuse both) plus the caller's gradient
        buffers, which the baseline's step allocates itself."""
        mem = state["ws"].memory_bytes()
        grads = sum(b.numel() * b.element_size() for part in state["bufs"].values() if part is not None
                    for b in part)
        gib = lambda n: round(n / 2 ** 30, 3)  # noqa: E731
        result["memory"] = {"workspace_peak_gib": gib(mem["peak"]), "scratch_gib": gib(mem["scratch"]),
                            "grad_buffers_gib": gib(grads), "step_peak_gib": gib(mem["peak"] + grads)}

    try:
        _, err = _attempt(ranks, "mok_rt workspace", setup)
        if err:
            return {"error": err}, {"error": "mok_rt did not run"}
        errors, err = _attempt(ranks, "mok_rt check run", check_run)
        if not err and not ranks.cpu:
            step_memory()
        release_ref()
        if err:
            return {"error": err}, {"error": "mok_rt did not run"}
        if not ref_names:
            check["error"] = "no baseline result to compare with (--impl mok or the baseline failed)"
            passed_fwd = passed_bwd = False
        else:
            worst = {}   # the worst rank's error per tensor; NaN (unwritten, poisoned) counts as inf
            for r_errors in ranks.gather(errors):
                for n, v in r_errors.items():
                    worst[n] = max(worst.get(n, 0.0), math.inf if math.isnan(v) else v)
            check["rel_fro"] = {n: (v if math.isfinite(v) else str(v)) for n, v in worst.items()}
            passed_fwd = worst.get("out", math.nan) < TOLERANCE
            passed_bwd = passed_fwd and set(worst) == ref_names and all(v < TOLERANCE for v in worst.values())
        check["passed_fwd"], check["passed_fwd_bwd"] = passed_fwd, passed_bwd
        times, err = _attempt(ranks, "mok_rt timing", timed)
        if err:
            return {"error": err}, check
        f, fb, same = times
        fig = _figures(ranks, f, fb, flops)
        result["deterministic"] = all(ranks.gather(bool(same)))
        # A figure that failed the check is kept for the developers but never quoted.
        for key, ok in (("fwd", passed_fwd), ("fwd_bwd", passed_bwd)):
            part = {k: v for k, v in fig.items() if k.removeprefix(key + "_") in _FIGURE_FIELDS}
            if ok:
                result.update(part)
            else:
                result.setdefault("unverified", {}).update(part)
                result[f"{key}_tflops_per_gpu"] = None
                result.setdefault("withheld", {})[key] = "failed check" if ref_names else "unchecked"
        return result, check
    finally:
        ws = state.pop("ws", None)
        state.clear()
        if ws is not None:
            try:
                ws.close()
            except Exception as ex:   # closing after a device error must not end the run
                print(f"[rank {ranks.rank}] closing the workspace: {ex!r}", file=sys.stderr)


# -- one shape -------------------------------------------------------------------------------------
def run_shape(torch, ranks: _Ranks, mok: _Mok, shape: Shape, args) -> dict:
    from torch_baseline import TorchMoEBaseline
    tokens = args.tokens or shape.tokens
    flops = shape.forward_flops(tokens)
    rec: dict[str, Any] = {"shape": shape.name, **{k: v for k, v in asdict(shape).items()
                                                   if k not in ("name", "tokens")},
                           "tokens_per_rank": tokens, "ep": ranks.size,
                           "flops_fwd_per_gpu": flops, "flops_fwd_bwd_per_gpu": 3 * flops,
                           "torch": None, "mok": None, "check": None, "ratio": None, "error": None}
    want_torch = args.impl in ("both", "torch")
    want_mok = args.impl in ("both", "mok")
    state: dict[str, Any] = {}

    def setup():
        inp = _Inputs(torch, shape, tokens, ranks, args.seed)
        state["inp"] = inp
        state["base"] = TorchMoEBaseline(w_gate=inp.w_gate, w_up=inp.w_up, w_down=inp.w_down,
                                         num_experts=shape.experts, ws_gate=inp.ws_gate, ws_up=inp.ws_up,
                                         ws_down=inp.ws_down, swiglu_limit=shape.swiglu_limit, group=ranks.group)
    try:
        _, err = _attempt(ranks, "inputs", setup)
        if err:
            rec["error"] = err
            return rec
        inp, base = state["inp"], state["base"]
        refs = {}   # the baseline's fwd+bwd results, handed over (not kept) for mok_rt's check
        if want_mok and mok.mod is not None and want_torch:
            refs["ref"], err = _attempt(ranks, "baseline check run", lambda: _torch_reference(inp, base))
            if err:
                rec["torch"] = {"error": err}
        if want_mok:
            if mok.mod is None:
                rec["mok"] = {"error": mok.error}
            else:
                rec["mok"], rec["check"] = _run_mok(torch, ranks, mok, shape, tokens, inp, refs, flops, args)
        refs.clear()
        _free(torch)
        if want_torch and rec["torch"] is None:
            times, err = _attempt(ranks, "baseline timing", lambda: _time_torch(torch, ranks, inp, base, args))
            rec["torch"] = {"error": err} if err else {**_figures(ranks, *times[:2], flops), "memory": times[2]}
        rec["ratio"] = _ratios(rec)
        return rec
    finally:
        state.clear()
        _free(torch)


def _ratios(rec: dict) -> dict | None:
    t, m = rec.get("torch") or {}, rec.get("mok") or {}
    out = {}
    for key in ("fwd", "fwd_bwd"):   # same FLOPs on both sides: the ratio of times (verified figures only)
        verified = m.get(f"{key}_tflops_per_gpu") is not None
        a, b = m.get(f"{key}_ms"), t.get(f"{key}_ms")
        out[key] = round(b / a, 3) if verified and a and b else None
    return out if any(out.values()) else None


def _free(torch) -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- main ------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    if str(_HERE) not in sys.path:
        sys.path.insert(0, str(_HERE))
    try:
        import torch   # a benchmark-only dependency: imported here so --help works without it
    except ImportError:
        print("bench_moe.py needs PyTorch (pip install 'mok_rt[bench]')", file=sys.stderr)
        return 2
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench_moe.py needs a CUDA GPU (--cpu-smoke tests the harness without one)", file=sys.stderr)
        return 2
    rank, size, local_rank = _launcher_env()
    if args.ep is not None and args.ep != size:
        print(f"--ep {args.ep}, but {size} process(es) were launched: start one process per GPU "
              f"(torchrun --nproc-per-node={args.ep} ... or mpirun -np {args.ep} ...)", file=sys.stderr)
        return 2
    if not args.cpu_smoke:
        torch.cuda.set_device(local_rank)
    ranks = _Ranks(torch, rank=rank, size=size, local_rank=local_rank, cpu=args.cpu_smoke)
    mok = _Mok(ranks, want=args.impl in ("both", "mok"))
    now = datetime.datetime.now(datetime.timezone.utc)
    doc = {"schema": SCHEMA, "date": now.isoformat(timespec="seconds"), "date_stamp": now.strftime("%Y-%m-%dT%H%M%SZ"),
           "machine": _machine(torch, ranks), "commit": _commit(args.commit), "versions": _versions(torch, mok),
           "argv": sys.argv[1:], "ep": size, "iters": args.iters, "warmup": args.warmup, "seed": args.seed,
           "quick": args.quick, "cpu_smoke": args.cpu_smoke, "impl": args.impl, "tolerance": TOLERANCE,
           "comm_sms": args.comm_sms, "grad_dtype": args.grad_dtype,
           "mok_error": mok.error, "complete": False,
           "timed": {"fwd": "schedule + forward", "fwd_bwd": "schedule + forward + backward",
                     "statistic": "median over iterations, max over ranks", "timing": args.timing,
                     "clock": "wall clock (cpu-smoke)" if args.cpu_smoke else "CUDA events, torch stream"},
           "flops": "fwd = 6*T*k*H*I + 6*T*H*I_s per GPU (T tokens per rank); fwd_bwd = 3 * fwd",
           "results": []}
    _log(ranks, f"EP={size}  GPU: {doc['machine']['gpu']}  commit: {doc['commit']['short']}  "
                f"torch {torch.__version__}  mok_rt {doc['versions']['mok_rt']}"
                + (f"\nmok_rt unavailable: {mok.error}" if mok.error and args.impl != "torch" else ""))
    path = None
    if rank == 0:
        if args.out:
            out_dir = Path(args.out)
        else:   # smoke-test results are not measurements: keep them out of the tree
            out_dir = Path(tempfile.gettempdir()) / "mok_bench" if args.cpu_smoke else _HERE / "results"
        path = _results_path(doc, out_dir)
    for shape, args.tokens in ((sh, t) for sh in args.shape_list for t in args.token_list):
        _log(ranks, f"-- {shape.name} (T={args.tokens or shape.tokens}/rank) ...")
        rec = run_shape(torch, ranks, mok, shape, args)
        _free(torch)
        doc["results"].append(rec)
        _log(ranks, "\n".join(format_table({"results": [rec]}).splitlines()[2:]))
        if path is not None:
            _write(doc, path)
    if rank == 0:
        doc["complete"] = True
        _write(doc, path)
        print(f"\nresults: {path}\n")
        print(format_table(doc), flush=True)
    ranks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
