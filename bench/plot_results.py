#!/usr/bin/env python3
"""Turn bench_moe.py results into a bar chart (PNG) and a Markdown table.

    python bench/plot_results.py bench/results/<run>.json [more.json ...] [--png chart.png]

The chart shows TFLOP/s per GPU of the PyTorch baseline and mok_rt, forward and forward +
backward, per shape (and EP size), with mok_rt's speed-up written above its bars; runs with
``--precision`` add mok_rt's FP8 bars (lines with ``--sweep``).  The Markdown
table goes to stdout (for the README).  Figures that failed the correctness check or errored are
shown as such, never as numbers.  Needs matplotlib for the PNG only (``--no-png`` skips it).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from bench_report import PRECISIONS, mok_key

_BARS = (("torch", "fwd", "PyTorch fwd", "#9ecae1"), ("mok", "fwd", "mok_rt fwd", "#08519c"),
         ("torch", "fwd_bwd", "PyTorch fwd+bwd", "#fdae6b"), ("mok", "fwd_bwd", "mok_rt fwd+bwd", "#a63603"))
# mok_rt in the other precisions, where a run has them (bench_moe.py --precision)
_PRECISION_BARS = {"fp8_block": (("fwd", "mok_rt fp8_block fwd", "#41ab5d"),
                                 ("fwd_bwd", "mok_rt fp8_block fwd+bwd", "#005a32"))}


def load(paths: list[str]) -> list[dict]:
    docs = []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        if "results" not in doc or "machine" not in doc:
            raise SystemExit(f"{p}: not a bench_moe.py results file")
        docs.append(doc)
    return docs


def _rows(docs: list[dict]) -> list[tuple[dict, dict]]:
    return [(doc, r) for doc in docs for r in doc["results"]]


def _extra(docs: list[dict]) -> list[str]:
    """The precisions other than bf16 that any record holds (none in bf16-only runs)."""
    return [p for p in PRECISIONS if p != "bf16" and any(mok_key("mok", p) in r for _, r in _rows(docs))]


def _bars(docs: list[dict]) -> list[tuple[str, str, str, str]]:
    """(record key, figure, legend, colour) per bar: _BARS, each precision's next to mok_rt's."""
    bars = []
    for impl, key, name, color in _BARS:
        bars.append((impl, key, name, color))
        if impl == "mok":
            bars += [(mok_key("mok", p), k, n, c) for p in _extra(docs) for k, n, c in _PRECISION_BARS[p] if k == key]
    return bars


def _tflops(r: dict, impl: str, key: str) -> float | None:
    v = (r.get(impl) or {}).get(f"{key}_tflops_per_gpu")
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _status(r: dict, impl: str, key: str) -> str:
    """Why a figure is missing: 'error', 'check failed', 'unchecked', 'not built' or 'not run'."""
    part = r.get(impl)
    if r.get("error") or (part or {}).get("error"):
        return "error"
    why = ((part or {}).get("withheld") or {}).get(key)
    if why:
        return "check failed" if why == "failed check" else why
    return "not run"


def _label(r: dict) -> str:
    return f"{r['shape']}\nEP={r['ep']}  T={r['tokens_per_rank']}/GPU"


def markdown(docs: list[dict]) -> str:
    out = []
    for doc in docs:
        m, c = doc["machine"], doc["commit"]
        out.append(f"{m['gpus_used']} × {m['gpu']} (driver {m.get('driver') or '?'}), commit {c.get('short')}, "
                   f"{doc['date']}, torch {doc['versions'].get('torch')}, median of {doc['iters']} iterations")
    out.append("")
    out.append("| shape | EP | tokens/GPU | PyTorch fwd | mok_rt fwd | speed-up | PyTorch fwd+bwd | mok_rt fwd+bwd "
               "| speed-up | check (rel. error) |")
    out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for _, r in _rows(docs):
        cells = [r["shape"], str(r["ep"]), str(r["tokens_per_rank"])]
        for key in ("fwd", "fwd_bwd"):
            for impl in ("torch", "mok"):
                tf = _tflops(r, impl, key)
                ms = (r.get(impl) or {}).get(f"{key}_ms")
                cells.append(f"{ms:.2f} ms, {tf:.0f} TFLOP/s" if tf is not None else _status(r, impl, key))
            ratio = (r.get("ratio") or {}).get(key)
            cells.append(f"{ratio:.2f}×" if ratio else "–")
        cells.append(_check(r.get("check")))
        out.append("| " + " | ".join(cells) + " |")
        for p in _extra(docs):
            if mok_key("mok", p) in r:
                out.append("| " + " | ".join(_precision_cells(r, p)) + " |")
    out.append("")
    out.append("TFLOP/s per GPU: forward 6·T·k·H·I (+ 6·T·H·I_s shared), forward+backward 3×; "
               "timed: routing schedule + layer, CUDA events.")
    if _extra(docs):
        out.append("FP8 rows: the same FLOP count; speed-up over the baseline of the row above (× over mok_rt "
                   "bf16 in brackets); weights quantised once per optimizer step, outside the timed steps "
                   "(quantize_weights time in the check column); checked with their own tolerance.")
    return "\n".join(out)


def _check(check: dict | None) -> str:
    check = check or {}
    errs = check.get("rel_fro") or {}
    if not errs:
        return check.get("error") or "–"
    worst = max(float(v) for v in errs.values())
    verdict = ("pass" if check.get("passed_fwd_bwd") else
               "fwd pass (bwd not built)" if check.get("backward") == "not built" and check.get("passed_fwd") else
               "fwd only (bwd FAIL)" if check.get("passed_fwd") else "FAIL")
    tol = f", tolerance {check['tolerance']:g}" if "precision" in check else ""
    return f"{verdict} (out {float(errs.get('out', math.nan)):.1e}, worst {worst:.1e}{tol})"


def _precision_cells(r: dict, precision: str) -> list[str]:
    """The Markdown row of mok_rt in ``precision``: its figures under the record's row."""
    impl, fig = mok_key("mok", precision), r.get(mok_key("mok", precision)) or {}
    cells = [f"↳ mok_rt {precision}", "", ""]
    for key in ("fwd", "fwd_bwd"):
        tf = _tflops(r, impl, key)
        cells += ["", f"{fig[f'{key}_ms']:.2f} ms, {tf:.0f} TFLOP/s" if tf is not None else _status(r, impl, key)]
        ratio = (r.get(mok_key("ratio", precision)) or {}).get(key)
        vs = (r.get(mok_key("ratio", precision) + "_vs_bf16") or {}).get(key)
        cells.append((f"{ratio:.2f}×" if ratio else "–") + (f" ({vs:.2f}× bf16)" if vs else ""))
    q = fig.get("quantize_weights_ms")
    cells.append(_check(r.get(mok_key("check", precision))) + (f"; quantize_weights {q:.3f} ms" if q else ""))
    return cells


def plot(docs: list[dict], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(docs)
    bars = _bars(docs)
    n = len(rows)
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.65 * len(bars) * n + 1.5), 5.0))
    top = max([_tflops(r, impl, key) or 0.0 for _, r in rows for impl, key, _, _ in bars] + [1.0])
    for b, (impl, key, name, color) in enumerate(bars):
        xs = [i + (b - (len(bars) - 1) / 2) * width for i in range(n)]
        vals = [_tflops(r, impl, key) for _, r in rows]
        ax.bar(xs, [v or 0.0 for v in vals], width, label=name, color=color)
        for x, v, (_, r) in zip(xs, vals, rows):
            if v is None:   # say why there is no bar instead of drawing a zero
                why = _status(r, impl, key)
                ax.text(x, top * 0.02, why, rotation=90, ha="center", va="bottom", fontsize=7,
                        color="#666" if why in ("not run", "not built") else "#b00")
            elif impl.startswith("mok"):   # "mok" -> "ratio", "mok_fp8_block" -> "ratio_fp8_block"
                ratio = (r.get(impl.replace("mok", "ratio", 1)) or {}).get(key)
                if ratio:
                    ax.text(x, v + top * 0.01, f"{ratio:.2f}×", ha="center", va="bottom", fontsize=8,
                            fontweight="bold")
    ax.set_xticks(range(n))
    ax.set_xticklabels([_label(r) for _, r in rows], fontsize=8)
    ax.set_ylabel("TFLOP/s per GPU")
    ax.set_ylim(0, top * 1.15)
    m = docs[0]["machine"]
    commits = ", ".join(sorted({d["commit"].get("short") or "?" for d in docs}))
    ax.set_title(f"MoE layer: mok_rt vs PyTorch grouped_mm pipeline — {m['gpu']}, commit {commits}", fontsize=10)
    ax.legend(fontsize=8, ncols=len(bars) // 2, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=130)
    plt.close(fig)


def plot_sweep(docs: list[dict], png: Path) -> None:
    """TFLOP/s per GPU against tokens per GPU (log scale), one panel per shape and EP size: mok_rt
    and the baseline, forward and forward+backward."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list[dict]] = {}
    for _, r in _rows(docs):
        groups.setdefault((r["shape"], r["ep"]), []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, ((shape, ep), recs) in zip(axes[0], groups.items()):
        recs = sorted(recs, key=lambda r: r["tokens_per_rank"])
        xs = [r["tokens_per_rank"] for r in recs]
        for impl, key, name, color in _bars(docs):
            ys = [_tflops(r, impl, key) for r in recs]
            ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", label=name, color=color,
                    linestyle="--" if impl == "torch" else "-" if impl == "mok" else ":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs], fontsize=8)
        ax.set_xlabel("tokens per GPU")
        ax.set_ylabel("TFLOP/s per GPU")
        ax.set_title(f"{shape}, EP={ep}", fontsize=10)
        ax.grid(alpha=0.3)
    m = docs[0]["machine"]
    commits = ", ".join(sorted({d["commit"].get("short") or "?" for d in docs}))
    timing = docs[0].get("timed", {}).get("timing", "?")
    fig.suptitle(f"mok_rt vs PyTorch by token count\n{m['gpu']}, commit {commits}, timing: {timing}", fontsize=9)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Bar chart (PNG) + Markdown table of bench_moe.py results.")
    ap.add_argument("results", nargs="+", help="results JSON file(s) written by bench_moe.py")
    ap.add_argument("--png", default=None, help="where to write the chart (default: the first JSON's path, .png)")
    ap.add_argument("--no-png", action="store_true", help="print the Markdown table only")
    ap.add_argument("--sweep", action="store_true", help="a line chart against tokens per GPU instead of bars")
    args = ap.parse_args(argv)
    docs = load(args.results)
    print(markdown(docs))
    if not args.no_png:
        png = Path(args.png) if args.png else Path(args.results[0]).with_suffix(".png")
        try:
            (plot_sweep if args.sweep else plot)(docs, png)
        except ImportError:
            print("matplotlib is not installed: no chart (pip install matplotlib, or --no-png)", file=sys.stderr)
            return 1
        print(f"\nchart: {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
