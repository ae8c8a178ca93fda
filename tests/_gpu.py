"""What GPU tests need beyond a GPU, found when a test runs (never at collection).

A module-level ``pytest.importorskip("cupy")`` skipped a whole GPU module at collection, before
its ``gpu`` marker applied, so on a GPU machine without CuPy the kernel tests vanished from the
run.  Here a missing CuPy skips each test with a reason -- or, with ``MOK_RT_REQUIRE_GPU=1``,
fails it.
"""
from __future__ import annotations

import importlib
import os

import pytest

REQUIRE_ENV = "MOK_RT_REQUIRE_GPU"
CUPY_MISSING = "CuPy is not installed (pip install -e '.[test]' brings cupy-cuda13x)"


def require_gpu() -> bool:
    """Whether a GPU test that cannot run must fail instead of skipping."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def skip_or_fail(reason: str) -> None:
    if require_gpu():
        pytest.fail(f"{reason} [{REQUIRE_ENV}=1: not skipped]", pytrace=False)
    pytest.skip(reason)


def need_cupy():
    try:
        return importlib.import_module("cupy")
    except ImportError:
        skip_or_fail(CUPY_MISSING)


class _LazyCupy:
    """Stands in for the ``cupy`` module; imports it at first use, inside a test."""

    def __getattr__(self, name):
        return getattr(need_cupy(), name)


cp = _LazyCupy()


def median_launch_ms(launch, stream, *, warmup: int = 3, iters: int = 20) -> float:
    """Kernel timing of the GEMM probes: ``warmup`` launches, then ``iters`` back-to-back launches
    with an event after each (the stream stays busy, so host launch overhead does not show in the
    intervals); the median interval in ms."""
    import numpy as np
    for _ in range(warmup):
        launch(stream)
    events = [cp.cuda.Event() for _ in range(iters + 1)]
    events[0].record(stream)
    for i in range(iters):
        launch(stream)
        events[i + 1].record(stream)
    events[-1].synchronize()
    return float(np.median([cp.cuda.get_elapsed_time(events[i], events[i + 1]) for i in range(iters)]))


# ---- one child process per risky GPU test ---------------------------------------------------------
ISOLATE_ENV = "MOK_RT_GPU_ISOLATE"   # "0": run the isolated tests in this process (faster, less robust)
CHILD_ENV = "MOK_RT_GPU_CHILD"       # set in the child: the test runs there
ECHO = ("FP8ERR", "FP8PROBE", "FP8WGRAD", "FP8WIDE", "BF16WGRAD")  # output lines of a child passed on (print and return)


def run_isolated(request, *, env: dict | None = None, timeout: float = 300.0) -> list[str] | None:
    """Runs the calling test again in a child pytest process; returns the child's ECHO lines, or
    None when the test is to run here (this is the child, or MOK_RT_GPU_ISOLATE=0).  Use:
    ``if (lines := run_isolated(request)) is not None: return``.

    Why: a kernel fault (illegal instruction, illegal address, a trap) kills the CUDA context of
    its process, so every later test of that process fails too, with unrelated errors (the FP8
    branch's first GPU run: one illegal instruction, then 40 failures, CURAND init among them).
    In a child the fault fails its own test only, under its own name, with the child's output."""
    import re
    import subprocess
    import sys

    if os.environ.get(CHILD_ENV) or os.environ.get(ISOLATE_ENV, "1") == "0":
        return None
    nodeid = request.node.nodeid
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-rs", "-p", "no:cacheprovider", nodeid]
    try:
        res = subprocess.run(cmd, cwd=str(request.config.rootpath), capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, CHILD_ENV: "1", **(env or {})})
    except subprocess.TimeoutExpired as ex:
        out = (ex.stdout or b"").decode(errors="replace") if isinstance(ex.stdout, bytes) else (ex.stdout or "")
        pytest.fail(f"{nodeid}: its child process ran past {timeout:.0f} s (a hang?)\n{out[-4000:]}", pytrace=False)
    out = res.stdout + res.stderr
    lines = [ln for ln in out.splitlines() if ln.startswith(ECHO)]
    for ln in lines:
        print(ln)
    if res.returncode != 0:
        pytest.fail(f"{nodeid} failed in its own process (rc {res.returncode}); its output:\n{out[-8000:]}",
                    pytrace=False)
    if not re.search(r"\b1 passed\b", out):
        m = re.search(r"SKIPPED \[\d+\] [^\n]*?: ([^\n]*)", out)
        if m:
            skip_or_fail(f"(in the child) {m.group(1)}")
        pytest.fail(f"{nodeid}: the child reported no pass; its output:\n{out[-4000:]}", pytrace=False)
    return lines
