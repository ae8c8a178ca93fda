#!/usr/bin/env python3
"""Benchmark mok_rt's MoE layer against the PyTorch pipeline users would run instead.

Both run in the same process, one process per GPU, on the same random inputs and weights:

    python bench/bench_moe.py                                  # one GPU (EP = 1)
    torchrun --nproc-per-node=8 bench/bench_moe.py             # expert parallel over 8 GPUs
    mpirun -np 2 python bench/bench_moe.py                     # same, launched by MPI
    python bench/bench_moe.py --quick                          # small shapes: a smoke test
    python bench/bench_moe.py --precision bf16,fp8_block       # mok_rt in bf16 and in FP8, one baseline

A step is timed with CUDA events on torch's current stream (mok_rt is handed that stream), each
iteration on its own after warm-up, and the median over iterations is reported (the slowest
rank's median with EP > 1).  "fwd" = routing schedule + forward; "fwd+bwd" = schedule + forward
+ backward (weight, input and router-weight gradients).  TFLOP/s per GPU count the routed
experts' 6*T*k*H*I (+ the shared expert's 6*T*H*I_s) per forward and 3x that per forward +
backward, T = tokens per rank.  Before timing, one fwd+bwd of each side is compared
(relative Frobenius error); mok_rt figures that fail the check are withheld.  ``--precision``
runs mok_rt once per precision against the same baseline (FP8: bench_mok.py, bench/README.md).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench_mok import TOLERANCE, TOLERANCES, _Mok, _run_mok
from bench_procs import _attempt, _free, _launcher_env, _log, _Ranks
from bench_report import PRECISIONS, _commit, _machine, _results_path, _versions, _write, format_table, mok_key
from bench_timing import _figures, _time

_HERE = Path(__file__).resolve().parent
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
    ap.add_argument("--precision", default="bf16",
                    help="comma list of mok_rt precisions to run, each against the same baseline run: bf16 "
                         "(default) and/or fp8_block (weights quantised once per workspace, outside the timed "
                         "steps, and that call timed on its own; checked with a looser tolerance)")
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
    wanted = args.precision.split(",")
    if not set(wanted) <= set(PRECISIONS):
        ap.error(f"--precision: expected a comma list of {', '.join(PRECISIONS)}, got {args.precision!r}")
    args.precisions = [p for p in PRECISIONS if p in wanted]   # bf16 first: the others are compared with it
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
    for precision in args.precisions:   # bf16 under the keys above; the others suffixed
        if precision != "bf16":
            rec.update({mok_key(part, precision): None for part in ("mok", "check", "ratio")})
            rec[mok_key("ratio", precision) + "_vs_bf16"] = None
    want_torch = args.impl in ("both", "torch")
    want_mok = args.impl in ("both", "mok")
    state: dict[str, Any] = {}

    def setup():
        inp = _Inputs(torch, shape, tokens, ranks, args.seed)
        state["inp"] = inp
        # Only where the baseline runs: its module holds a concatenated copy of gate|up (14 GiB at
        # deepseek-v3) that a mok_rt-only run on an 80 GB card has no room for.
        state["base"] = None
        if want_torch:
            state["base"] = TorchMoEBaseline(w_gate=inp.w_gate, w_up=inp.w_up, w_down=inp.w_down,
                                             num_experts=shape.experts, ws_gate=inp.ws_gate, ws_up=inp.ws_up,
                                             ws_down=inp.ws_down, swiglu_limit=shape.swiglu_limit, group=ranks.group)
    try:
        _, err = _attempt(ranks, "inputs", setup)
        if err:
            rec["error"] = err
            return rec
        inp, base = state["inp"], state["base"]
        for precision in args.precisions:
            # The baseline's fwd+bwd results, handed over (not kept) for mok_rt's check: made again
            # for each precision rather than held through the timed runs of the others.
            refs = {}
            if want_mok and mok.mod is not None and want_torch and rec["torch"] is None:
                refs["ref"], err = _attempt(ranks, "baseline check run", lambda: _torch_reference(inp, base))
                if err:
                    rec["torch"] = {"error": err}
            if want_mok:
                if mok.mod is None:
                    rec[mok_key("mok", precision)] = {"error": mok.error}
                else:
                    rec[mok_key("mok", precision)], rec[mok_key("check", precision)] = _run_mok(
                        torch, ranks, mok, shape, tokens, inp, refs, flops, args, precision)
            refs.clear()
            _free(torch)
        if want_torch and rec["torch"] is None:
            times, err = _attempt(ranks, "baseline timing", lambda: _time_torch(torch, ranks, inp, base, args))
            rec["torch"] = {"error": err} if err else {**_figures(ranks, {"fwd": times[0], "fwd_bwd": times[1]},
                                                                  flops), "memory": times[2]}
        for precision in args.precisions:
            rec[mok_key("ratio", precision)] = _ratios(rec["torch"], rec[mok_key("mok", precision)])
            if precision != "bf16":
                rec[mok_key("ratio", precision) + "_vs_bf16"] = _ratios(rec["mok"], rec[mok_key("mok", precision)])
        return rec
    finally:
        state.clear()
        _free(torch)


def _ratios(slow: dict | None, fast: dict | None) -> dict | None:
    """Time of ``slow`` over time of ``fast`` for fwd and fwd+bwd: the same FLOPs on both sides,
    so the speed-up of ``fast``; verified figures only (a withheld one has no TFLOP/s)."""
    out = {}
    for key in ("fwd", "fwd_bwd"):
        a, b = fast or {}, slow or {}
        verified = a.get(f"{key}_tflops_per_gpu") is not None and b.get(f"{key}_tflops_per_gpu") is not None
        out[key] = round(b[f"{key}_ms"] / a[f"{key}_ms"], 3) if verified and a[f"{key}_ms"] else None
    return out if any(out.values()) else None


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
           "precisions": args.precisions, "tolerances": {p: TOLERANCES[p] for p in args.precisions},
           "comm_sms": args.comm_sms, "grad_dtype": args.grad_dtype,
           "mok_error": mok.error, "complete": False,
           "timed": {"fwd": "schedule + forward", "fwd_bwd": "schedule + forward + backward",
                     "statistic": "median over iterations, max over ranks", "timing": args.timing,
                     "clock": "wall clock (cpu-smoke)" if args.cpu_smoke else "CUDA events, torch stream"},
           "flops": "fwd = 6*T*k*H*I + 6*T*H*I_s per GPU (T tokens per rank); fwd_bwd = 3 * fwd",
           "results": []}
    if "fp8_block" in args.precisions:
        doc["timed"]["quantize_weights"] = ("fp8_block: mok.quantize_weights of the bf16 master weights, once per "
                                            "workspace and outside fwd / fwd_bwd (a trainer: once per optimizer "
                                            "step); timed on its own, same statistic and timing")
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
