"""The mok_rt side of bench_moe.py: loading mok_rt and its process group, and one shape's check
run (against the baseline's results) and timed runs."""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench_procs import _attempt, _free, _Ranks
from bench_timing import _FIGURE_FIELDS, _figures, _time

if TYPE_CHECKING:
    from bench_moe import Shape, _Inputs

_ROOT = Path(__file__).resolve().parent.parent
# The correctness gate: relative Frobenius error of mok_rt vs the baseline, per precision.  bf16
# lands at ~4e-3 (docs/SEMANTICS.md §9).  FP8's own rounding costs ~6.5% against the exact layer
# (§10) and the bf16 baseline is within bf16 rounding of exact, so fp8_block is held to 0.1: above
# its rounding, far below what a broken kernel produces (errors of order 1, or NaN).
TOLERANCES = {"bf16": 2e-2, "fp8_block": 1e-1}
TOLERANCE = TOLERANCES["bf16"]
_GRAD_NAMES = ("dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")


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


def _quantize_does_not_fit(torch, ranks, nbytes: int, *, sets: int) -> str | None:
    """Why quantize_weights cannot be timed here, or None.  Its timed calls make ``sets`` more sets
    of quantised weights beside the step's (a graph-timed run: the eager warm-up's and the
    capture's); deepseek-v3's are 21 GiB each, which an 80 GB card holding the step has no room
    for (2026-12-07, bench/NOTES-FP8-3.md round 24).  Better not to try: a failed allocation can
    leave the pool fragmented for what follows."""
    need = sets * nbytes + 2 ** 30
    free = min(ranks.gather(torch.cuda.mem_get_info()[0]))
    if free >= need:
        return None
    return f"not timed: needs ~{need / 2 ** 30:.1f} GiB free, {free / 2 ** 30:.1f} GiB free"


def _stream_for_mok(torch, ranks: _Ranks):
    if ranks.cpu:
        return None
    s = torch.cuda.current_stream()
    return s if hasattr(s, "__cuda_stream__") else s.cuda_stream   # older torch: the raw handle


def _not_built(m, ex: Exception, precision: str) -> bool:
    """Whether ``ex`` is mok_rt saying that it does not run ``precision`` here yet (the CUDA FP8
    backward, FP8 with expert parallelism): a figure to mark "not built", not an error."""
    return precision != "bf16" and isinstance(ex, m.ArgumentError) and ex.argument == "precision"


def _run_mok(torch, ranks, mok: _Mok, shape: Shape, tokens: int, inp: _Inputs, refs: dict,
             flops: int, args, precision: str = "bf16") -> tuple[dict, dict]:
    """Check one mok_rt fwd+bwd in ``precision`` against the baseline's (``refs["ref"]``, popped
    once used so its memory is free while timing), then time fwd and fwd+bwd.  Returns (figures
    or error, check).  FP8: the weights are quantised once per workspace, outside the timed steps
    (as a trainer does once per optimizer step), and that call is timed on its own; where mok_rt
    refuses the FP8 backward (ArgumentError "precision") the fwd+bwd figures are "not built"."""
    m = mok.mod
    ref = refs.pop("ref", None)
    ref_names = set(ref or ())
    tolerance = TOLERANCES[precision]
    fp8 = precision != "bf16"
    state: dict[str, Any] = {}
    result: dict[str, Any] = {}
    check: dict[str, Any] = {"tolerance": tolerance, **({"precision": precision} if fp8 else {})}
    x, tw, ids = inp.x_plain, inp.topk_weights_plain, inp.topk_ids32
    weights = inp.mok_weights()
    experts = m.ExpertWeights(*weights[:3])
    shared = None if weights[3] is None else m.ExpertWeights(*weights[3:])

    def setup():
        knobs = {} if args.comm_sms is None else {"comm_sms": args.comm_sms}
        cfg = m.MoEConfig(hidden=shape.hidden, intermediate=shape.intermediate, num_experts=shape.experts,
                          top_k=shape.top_k, shared_intermediate=shape.shared, swiglu_limit=shape.swiglu_limit,
                          **knobs, **({"precision": precision} if fp8 else {}))
        try:
            ws = m.Workspace(cfg, mok.group, max_tokens=tokens, backend="reference" if ranks.cpu else "cuda",
                             stream=_stream_for_mok(torch, ranks))
        except Exception as ex:   # noqa: BLE001 -- re-raised unless it is "not built"
            if not _not_built(m, ex, precision):
                raise
            state["not_built"] = {"fwd": str(ex), "fwd_bwd": str(ex)}
            return
        state["ws"] = ws
        # Caller-owned weight-gradient buffers (a trainer's .grad) in --grad-dtype, poisoned so
        # that an element the kernel never writes fails the check.
        gdt = getattr(torch, args.grad_dtype)
        bufs = [None if w is None else torch.full(tuple(w.shape), math.nan, device=x.device, dtype=gdt)
                for w in weights]
        state["bufs"] = {"dw": m.ExpertWeights(*bufs[:3]),
                         "dw_shared": None if bufs[3] is None else m.ExpertWeights(*bufs[3:])}
        state["layer_weights"] = {"experts": experts, "shared": shared}
        if fp8:
            held = ws.memory_bytes()["results"] if not ranks.cpu else 0
            qw = m.quantize_weights(ws, experts, shared, stream=_stream_for_mok(torch, ranks))
            state["layer_weights"] = {"experts": qw}   # the shared expert's weights are inside
            if not ranks.cpu:
                state["quantized_bytes"] = ws.memory_bytes()["results"] - held

    def fwd():
        ws, s = state["ws"], _stream_for_mok(torch, ranks)
        sched = m.schedule(ws, ids, stream=s)
        out, _ = m.forward(ws, sched, x, tw, **state["layer_weights"], stream=s)
        return out

    def fwd_bwd():
        ws, s = state["ws"], _stream_for_mok(torch, ranks)
        sched = m.schedule(ws, ids, stream=s)
        out, ctx = m.forward(ws, sched, x, tw, **state["layer_weights"], stream=s)
        g = m.backward(ws, ctx, inp.d_out, **state["bufs"], stream=s)
        return out, g

    def check_run():
        ws, s = state["ws"], _stream_for_mok(torch, ranks)
        sched = m.schedule(ws, ids, stream=s)
        out, ctx = m.forward(ws, sched, x, tw, **state["layer_weights"], stream=s)
        try:
            g = m.backward(ws, ctx, inp.d_out, **state["bufs"], stream=s)
        except Exception as ex:   # noqa: BLE001 -- re-raised unless it is "not built"
            if not _not_built(m, ex, precision):
                raise
            g = None
            state["not_built"] = {"fwd_bwd": str(ex)}
        ws.synchronize()   # raises what a kernel reported
        got = {"out": out}
        if g is not None:
            got.update({"dx": g.dx, "d_topk_weights": g.d_topk_weights,
                        **dict(zip(_GRAD_NAMES, (*g.dw, *(g.dw_shared or (None,) * 3))))})
        got = {n: _as_torch(torch, v) for n, v in got.items() if v is not None}
        # Clones: mok_rt may hand out workspace memory that the next call overwrites.
        state["first"] = {n: got[n].clone() for n in ("out", "dx", "d_topk_weights") if n in got}
        if ref is None:
            return {}
        return {n: rel_fro(torch, got[n], want) for n, want in ref.items() if n in got}

    def release_ref():
        nonlocal ref
        ref = None
        _free(torch)

    def timed_quantize():
        ws = state["ws"]
        # The stream is looked up per call, as in fwd(): --timing graph calls it on its side and capture streams.
        q = _time(torch, ranks, lambda: m.quantize_weights(ws, experts, shared, stream=_stream_for_mok(torch, ranks)),
                  iters=args.iters, warmup=args.warmup, timing=args.timing)
        every = ranks.gather(statistics.median(q))
        return {"quantize_weights_ms": round(max(every), 4),
                "quantize_weights_ms_ranks": [round(v, 4) for v in every]}

    def timed():
        last = {}
        times = {"fwd": _time(torch, ranks, lambda: last.__setitem__("fwd", fwd()), iters=args.iters,
                              warmup=args.warmup, timing=args.timing)}
        state["ws"].synchronize()
        same = torch.equal(_as_torch(torch, last.pop("fwd")), state["first"]["out"])
        if "fwd_bwd" not in state.get("not_built", {}):
            times["fwd_bwd"] = _time(torch, ranks, lambda: last.__setitem__("fb", fwd_bwd()), iters=args.iters,
                                     warmup=args.warmup, timing=args.timing)
            state["ws"].synchronize()
            out, g = last.pop("fb")
            for name, t in (("out", out), ("dx", g.dx), ("d_topk_weights", g.d_topk_weights)):
                same = same and torch.equal(_as_torch(torch, t), state["first"][name])
        return times, same

    def step_memory():
        """After the check run (the fresh workspace's first, eager, step): mok_rt's high-water
        mark (scratch and result blocks -- FP8: the quantised weights among them; later eager
        steps reuse both) plus the caller's gradient buffers, which the baseline's step allocates
        itself (none where the backward is not built: then a forward's memory)."""
        mem = state["ws"].memory_bytes()
        grads = 0 if "not_built" in state else sum(
            b.numel() * b.element_size() for part in state["bufs"].values() if part is not None for b in part)
        gib = lambda n: round(n / 2 ** 30, 3)  # noqa: E731
        result["memory"] = {"workspace_peak_gib": gib(mem["peak"]), "scratch_gib": gib(mem["scratch"]),
                            "grad_buffers_gib": gib(grads), "step_peak_gib": gib(mem["peak"] + grads)}
        if "quantized_bytes" in state:
            result["memory"]["quantized_weights_gib"] = gib(state["quantized_bytes"])

    def not_built(key: str, why: str) -> None:
        result.setdefault("withheld", {})[key] = "not built"
        result.setdefault("not_built", {})[key] = why[:600]
        result[f"{key}_tflops_per_gpu"] = None

    try:
        _, err = _attempt(ranks, "mok_rt workspace", setup)
        if err:
            return {"error": err}, {"error": "mok_rt did not run"}
        if "ws" not in state:   # this precision cannot run here: nothing to check or time
            for key, why in state["not_built"].items():
                not_built(key, why)
            return result, {**check, "error": "not built"}
        errors, err = _attempt(ranks, "mok_rt check run", check_run)
        if not err and not ranks.cpu:
            step_memory()
        release_ref()
        if err:
            return {"error": err}, {"error": "mok_rt did not run"}
        if "fwd_bwd" in state.get("not_built", {}):
            not_built("fwd_bwd", state["not_built"]["fwd_bwd"])
            check["backward"] = "not built"
        if not ref_names:
            check["error"] = "no baseline result to compare with (--impl mok or the baseline failed)"
            passed_fwd = passed_bwd = False
        else:
            worst = {}   # the worst rank's error per tensor; NaN (unwritten, poisoned) counts as inf
            for r_errors in ranks.gather(errors):
                for n, v in r_errors.items():
                    worst[n] = max(worst.get(n, 0.0), math.inf if math.isnan(v) else v)
            check["rel_fro"] = {n: (v if math.isfinite(v) else str(v)) for n, v in worst.items()}
            passed_fwd = worst.get("out", math.nan) < tolerance
            passed_bwd = passed_fwd and set(worst) == ref_names and all(v < tolerance for v in worst.values())
        check["passed_fwd"], check["passed_fwd_bwd"] = passed_fwd, passed_bwd
        timing, err = _attempt(ranks, "mok_rt timing", timed)
        # After the step's figures, so that a quantisation that does not fit costs only its own figure.
        if fp8:
            why = None if ranks.cpu else _quantize_does_not_fit(
                torch, ranks, state.get("quantized_bytes", 0), sets=2 if args.timing == "graph" else 1)
            if why:
                result["quantize_weights_skipped"] = why
            else:
                quantize, q_err = _attempt(ranks, "mok_rt quantize_weights timing", timed_quantize)
                result.update(quantize or {"quantize_weights_error": q_err})
        if err:
            return {**result, "error": err}, check
        times, same = timing
        fig = _figures(ranks, times, flops)
        result["deterministic"] = all(ranks.gather(bool(same)))
        # A figure that failed the check is kept for the developers but never quoted.
        for key, ok in (("fwd", passed_fwd), ("fwd_bwd", passed_bwd)):
            if key not in times:
                continue
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
