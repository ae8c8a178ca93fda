#!/usr/bin/env python3
"""Accuracy of FP8 weight gradients, on the CPU (issue 18: "the weight-gradient GEMMs may run in
FP8 (token-direction scales) or BF16 — measure both").

For each case, the oracle's ``fp8_block`` layer (mok_rt/reference/fp8.py) is run once forward and
three times backward, with the weight-gradient GEMMs in

* ``bf16``         (what the kernels ship): the quantised operands, read without a second rounding;
* ``fp8_requant``  (a): those operands quantised again in 128 × 1 blocks along the tokens;
* ``fp8_source``   (b): the unquantised operands quantised once in 128 × 1 blocks along the tokens;
* ``fp8_mixed``    (c): routed x and dy as (a) (with expert parallelism they reach the expert's rank as
  E4M3 rows only), a, dg, du and the shared expert as (b),

and every result is compared with the exact float64 layer (``reference.forward/backward`` with
``precision="bf16"``, which is float64 throughout): relative Frobenius error ``|got - exact| /
|exact|``.  A second table isolates what the FP8 wgrad GEMM adds on top of today's FP8 backward:
``|dW(mode) - dW(bf16)| / |dW(bf16)|``.

    python bench/fp8_wgrad_numerics.py                 # the table of docs/FP8_DESIGN.md (< 2 min)
    python bench/fp8_wgrad_numerics.py --seeds 0 1 2 --cases skewed_shared
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mok_rt import reference as ref  # noqa: E402
from mok_rt.reference import fp8  # noqa: E402

MODES = fp8.WGRAD_MODES
WGRADS = ("dw_gate", "dw_up", "dw_down")
SHARED_WGRADS = ("dws_gate", "dws_up", "dws_down")

# name: (H, I, E, k, T, shared I (0 = none), swiglu_limit, routing, outlier channels in x)
CASES = {
    "base": (256, 128, 8, 4, 512, 0, None, "uniform", False),
    "shared_limit": (256, 128, 8, 4, 512, 128, 0.75, "uniform", False),
    "skewed_e16": (512, 256, 16, 4, 768, 0, None, "skewed", False),
    "skewed_shared": (512, 384, 8, 2, 768, 256, None, "skewed", False),
    "k8_limit": (768, 256, 16, 8, 384, 0, 1.0, "uniform", False),
    "wide": (1024, 512, 4, 2, 768, 512, None, "skewed", False),
    "outliers": (512, 256, 8, 4, 768, 256, None, "uniform", True),
    "outliers_skewed": (1024, 256, 16, 6, 512, 0, 7.0, "skewed", True),
}


def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).astype(np.float64)


def _routing(rng, tokens: int, experts: int, k: int, kind: str) -> np.ndarray:
    """k distinct experts per token: uniform, or skewed (Zipf-like popularity: a few hot experts,
    some that receive a handful of rows or none, so partial and empty row blocks occur)."""
    if kind == "uniform":
        prob = np.full(experts, 1.0 / experts)
    else:
        pop = 1.0 / np.arange(1, experts + 1) ** 1.5
        prob = rng.permutation(pop / pop.sum())
    return np.stack([rng.choice(experts, size=k, replace=False, p=prob) for _ in range(tokens)]).astype(np.int64)


def make_problem(seed: int, H: int, I: int, E: int, k: int, T: int, Is: int, routing: str, outliers: bool):
    """bf16-representable inputs of a trained-layer-like scale: unit x and d_out, weights ~ 1/sqrt(fan-in),
    softmax-like routing weights.  ``outliers``: 1 % of x's channels ×30 and 2 % of tokens ×4 (the
    "massive activation" channels of LLMs, which favour per-column scales, and loud tokens, which
    do not)."""
    r = np.random.default_rng(seed)
    x = r.standard_normal((T, H))
    if outliers:
        x[:, r.choice(H, max(1, H // 100), replace=False)] *= 30.0
        x[r.choice(T, max(1, T // 50), replace=False)] *= 4.0
    logits = r.standard_normal((T, k))
    tw = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    p = dict(x=_bf16(x), ids=_routing(r, T, E, k, routing), tw=tw.astype(np.float32).astype(np.float64),
             w_gate=_bf16(r.standard_normal((E, I, H)) * H ** -0.5), w_up=_bf16(r.standard_normal((E, I, H)) * H ** -0.5),
             w_down=_bf16(r.standard_normal((E, H, I)) * I ** -0.5), d_out=_bf16(r.standard_normal((T, H))),
             shared=(None, None, None))
    if Is:
        p["shared"] = (_bf16(r.standard_normal((Is, H)) * H ** -0.5), _bf16(r.standard_normal((Is, H)) * H ** -0.5),
                       _bf16(r.standard_normal((H, Is)) * Is ** -0.5))
    return p


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def measure(p, limit, precision: str = "fp8_block") -> dict:
    """{"out": e, "dx": e, (mode, grad): e vs exact, ("inc", mode, grad): e vs the bf16 wgrad}."""
    sg, su, sd = p["shared"]
    args = (p["x"], p["ids"], p["tw"], p["w_gate"], p["w_up"], p["w_down"])
    kw = dict(ws_gate=sg, ws_up=su, ws_down=sd, swiglu_limit=limit)
    out0, ctx0 = ref.forward(*args, **kw)
    g0 = ref.backward(ctx0, p["d_out"])
    out8, ctx8 = ref.forward(*args, precision=precision, **kw)
    names = WGRADS + (SHARED_WGRADS if sg is not None else ())
    res = {"out": _rel(out8, out0)}
    by_mode = {m: fp8.backward_fp8(ctx8, p["d_out"], wgrad=m) for m in MODES}
    res["dx"] = _rel(by_mode["bf16"].dx, g0.dx)
    for m, g in by_mode.items():
        for n in names:
            res[m, n] = _rel(getattr(g, n), getattr(g0, n))
            if m != "bf16":
                res["inc", m, n] = _rel(getattr(g, n), getattr(by_mode["bf16"], n))
    return res


def _mean(rows: list, key) -> float:
    return float(np.mean([r[key] for r in rows]))


def tables(results: dict) -> str:
    """Two markdown tables (means over the seeds)."""
    head = ("| case (H, I, E, k, T, Is, limit, routing) | out | dx | dW_gate | dW_up | dW_down "
            "| shared dW (worst of 3) |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    lines = [head]
    inc = ["| case | dW_gate | dW_up | dW_down | shared dW (worst of 3) |\n| --- | ---: | ---: | ---: | ---: |\n"]
    for name, rows in results.items():
        H, I, E, k, T, Is, limit, routing, outl = CASES[name]
        desc = f"{name} ({H}, {I}, {E}, {k}, {T}, {Is or '–'}, {limit or '–'}, {routing}{', outliers' if outl else ''})"
        cells = [f"{_mean(rows, 'out'):.4f}", f"{_mean(rows, 'dx'):.4f}"]
        icells = []
        for n in WGRADS:
            cells.append(" / ".join(f"{_mean(rows, (m, n)):.4f}" for m in MODES))
            icells.append(" / ".join(f"{_mean(rows, ('inc', m, n)):.4f}" for m in MODES[1:]))
        if Is:
            cells.append(" / ".join(f"{max(_mean(rows, (m, n)) for n in SHARED_WGRADS):.4f}" for m in MODES))
            icells.append(" / ".join(f"{max(_mean(rows, ('inc', m, n)) for n in SHARED_WGRADS):.4f}"
                                     for m in MODES[1:]))
        else:
            cells.append("–")
            icells.append("–")
        lines.append(f"| {desc} | " + " | ".join(cells) + " |\n")
        inc.append(f"| {name} | " + " | ".join(icells) + " |\n")
    return "".join(lines) + "\n" + "".join(inc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1])
    ap.add_argument("--precision", default="fp8_block", choices=fp8.PRECISIONS[1:])
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    results = {}
    for name in a.cases:
        H, I, E, k, T, Is, limit, routing, outl = CASES[name]
        results[name] = [measure(make_problem(s, H, I, E, k, T, Is, routing, outl), limit, a.precision)
                         for s in a.seeds]
        print(f"# {name}: done at {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(f"Relative Frobenius error against the exact float64 layer ({a.precision}; mean over seeds "
          f"{a.seeds}); a weight-gradient cell is bf16 (today) / (a) fp8_requant / (b) fp8_source / "
          f"(c) fp8_mixed; the second table is |dW(mode) - dW(bf16)| / |dW(bf16)| for (a) / (b) / (c).\n")
    print(tables(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
