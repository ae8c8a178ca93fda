"""bench_moe.py --precision on the CPU: the fp8_block record (figures, looser tolerance,
quantize_weights time, the vs-bf16 ratio, "not built" where mok_rt refuses the FP8 backward) made
through mok_rt's reference backend, and the report / plot readers on it and on the result files
of earlier (bf16-only) runs.  The figures are wall-clock on the CPU and mean nothing."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(_BENCH))

import bench_moe  # noqa: E402
import bench_report  # noqa: E402
import plot_results  # noqa: E402

# Small enough for the float64 reference backend; the shared expert is quantised too.
TINY = bench_moe.Shape("tiny", hidden=128, intermediate=128, experts=4, top_k=2, tokens=64, shared=128)


def test_precision_flag():
    assert bench_moe.parse_args([]).precisions == ["bf16"]
    assert bench_moe.parse_args(["--precision", "fp8_block,bf16"]).precisions == ["bf16", "fp8_block"]
    with pytest.raises(SystemExit):
        bench_moe.parse_args(["--precision", "fp8"])


@pytest.mark.parametrize("path", sorted((_BENCH / "results").glob("*.json")), ids=lambda p: p.name)
def test_old_results_still_read(path):
    doc = json.loads(path.read_text())
    table, md = bench_report.format_table(doc), plot_results.markdown([doc])
    assert len(table.splitlines()) >= 2 + len(doc["results"])
    if doc.get("precisions", ["bf16"]) == ["bf16"]:
        assert "fp8" not in table + md   # a bf16-only run: no precision rows
    else:
        assert "fp8_block" in table and "fp8_block" in md


class _RefusesFp8:
    """mok_rt as its CUDA backend is today: the FP8 backward refused with ArgumentError("precision")
    (``refuse="backward"``), or, with expert parallelism, the FP8 workspace (``"workspace"``)."""

    def __init__(self, mod, refuse: str):
        self._mod, self._refuse = mod, refuse

    def __getattr__(self, name):
        return getattr(self._mod, name)

    def Workspace(self, config, *a, **kw):  # noqa: N802 -- mok_rt's name
        if self._refuse == "workspace" and config.precision != "bf16":
            raise self._mod.ArgumentError("precision", "FP8 with expert parallelism is not built yet (test)")
        return self._mod.Workspace(config, *a, **kw)

    def backward(self, ws, ctx, *a, **kw):
        if self._refuse == "backward" and ws.config.precision != "bf16":
            raise self._mod.ArgumentError("precision", "the FP8 backward is not built yet (test)")
        return self._mod.backward(ws, ctx, *a, **kw)


def _run(torch, monkeypatch, precisions, *, refuse: str | None = None) -> dict:
    from bench_mok import _Mok
    from bench_procs import _Ranks
    # The baseline's timing is not under test (CPU grouped_mm takes ~0.5 s a call): fixed samples;
    # its check run (the reference mok_rt is compared with) is real.
    monkeypatch.setattr(bench_moe, "_time_torch", lambda *a: ([2.0] * 20, [6.0] * 20, None))
    ranks = _Ranks(torch, rank=0, size=1, local_rank=0, cpu=True)
    mok = _Mok(ranks, want=True)
    assert mok.error is None
    if refuse:
        mok.mod = _RefusesFp8(mok.mod, refuse)
    args = argparse.Namespace(impl="both", precisions=precisions, tokens=None, seed=0, iters=20, warmup=1,
                              timing="pipelined", grad_dtype="bfloat16", comm_sms=None)
    rec = bench_moe.run_shape(torch, ranks, mok, TINY, args)
    json.dumps(rec)   # the record goes into the results JSON as it is
    return rec


def test_fp8_backward_not_built(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    rec = _run(torch, monkeypatch, ["bf16", "fp8_block"], refuse="backward")
    assert rec["error"] is None and rec["check"]["passed_fwd_bwd"], rec
    fp8, check = rec["mok_fp8_block"], rec["check_fp8_block"]
    assert fp8["fwd_tflops_per_gpu"] is not None and fp8["deterministic"] and fp8["quantize_weights_ms"] > 0
    assert fp8["withheld"] == {"fwd_bwd": "not built"} and "fwd_bwd_ms" not in fp8
    assert check["tolerance"] == 0.1 and check["precision"] == "fp8_block" and check["backward"] == "not built"
    assert check["passed_fwd"] and not check["passed_fwd_bwd"] and set(check["rel_fro"]) == {"out"}
    # FP8's own error, well above bf16's and inside the looser gate
    assert rec["check"]["rel_fro"]["out"] < 0.02 < check["rel_fro"]["out"] < 0.1
    assert rec["ratio_fp8_block"]["fwd"] and rec["ratio_fp8_block_vs_bf16"]["fwd"]
    assert rec["ratio_fp8_block"]["fwd_bwd"] is None and rec["ratio_fp8_block_vs_bf16"]["fwd_bwd"] is None
    doc = {"results": [rec], "machine": {"gpu": "CPU", "gpus_used": 1}, "commit": {"short": "test"},
           "date": "-", "versions": {}, "iters": 20}
    table = bench_report.format_table(doc)
    assert "  + fp8_block" in table and "not built" in table and "(tol 0.1)" in table and "quantize_weights" in table
    assert "↳ mok_rt fp8_block" in plot_results.markdown([doc])
    pytest.importorskip("matplotlib")
    plot_results.plot([doc], tmp_path / "bars.png")
    plot_results.plot_sweep([doc], tmp_path / "sweep.png")
    assert (tmp_path / "bars.png").stat().st_size and (tmp_path / "sweep.png").stat().st_size


def test_fp8_with_backward(monkeypatch):
    """Where mok.backward runs FP8 (the reference backend; the CUDA one once built), the harness
    uses it: fwd+bwd figures gated at 0.1 on dx, d_topk_weights and every weight gradient."""
    torch = pytest.importorskip("torch")
    rec = _run(torch, monkeypatch, ["fp8_block"])
    fp8, check = rec["mok_fp8_block"], rec["check_fp8_block"]
    assert rec["mok"] is None and rec["ratio_fp8_block_vs_bf16"] is None   # bf16 not requested
    assert check["passed_fwd_bwd"] and "backward" not in check, check
    assert {"dx", "d_topk_weights", "dw_gate", "dws_down"} <= set(check["rel_fro"])
    assert fp8["fwd_bwd_tflops_per_gpu"] is not None and fp8["deterministic"] and "withheld" not in fp8
    assert rec["ratio_fp8_block"]["fwd_bwd"]


def test_fp8_workspace_refused(monkeypatch):
    """FP8 refused as a whole (the CUDA backend with EP > 1): both figures "not built", no error."""
    torch = pytest.importorskip("torch")
    rec = _run(torch, monkeypatch, ["fp8_block"], refuse="workspace")
    fp8 = rec["mok_fp8_block"]
    assert rec["error"] is None and "error" not in fp8, rec
    assert fp8["withheld"] == {"fwd": "not built", "fwd_bwd": "not built"} and set(fp8["not_built"]) == {"fwd", "fwd_bwd"}
    assert rec["check_fp8_block"]["error"] == "not built" and rec["ratio_fp8_block"] is None
    doc = {"results": [rec]}
    assert bench_report.format_table(doc).count("not built") >= 2


def test_quantize_timing_skipped_where_it_does_not_fit():
    """deepseek-v3's quantised weights (21 GiB) beside its step on an 80 GB card: quantize_weights
    is not timed (its allocation would fail and could fragment the pool for what follows), the
    record says why, and the report prints it."""
    from types import SimpleNamespace

    from bench_mok import _quantize_does_not_fit
    gib = 2 ** 30
    ranks = SimpleNamespace(gather=lambda v: [v, v + 5 * gib])   # the tightest rank decides
    torch = SimpleNamespace(cuda=SimpleNamespace(mem_get_info=lambda: (8 * gib, 80 * gib)))
    why = _quantize_does_not_fit(torch, ranks, 21 * gib, sets=2)
    assert why == "not timed: needs ~43.0 GiB free, 8.0 GiB free"
    assert _quantize_does_not_fit(torch, ranks, 3 * gib, sets=2) is None     # 7 GiB needed, 8 free
    assert _quantize_does_not_fit(torch, ranks, 8 * gib, sets=1) is not None  # 9 GiB needed, 8 free
    lines = bench_report._precision_lines({"mok_fp8_block": {"quantize_weights_skipped": why}}, "fp8_block")
    assert "quantize_weights not timed: needs ~43.0 GiB" in lines[-1]
