"""Shared pytest configuration: GPU markers skip cleanly where there is no GPU (or fail, with
MOK_RT_REQUIRE_GPU=1), and the run ends with one line on how many GPU tests ran."""
from __future__ import annotations

import collections
import os

import pytest

from _gpu import CUPY_MISSING, REQUIRE_ENV, require_gpu, skip_or_fail

# Never let anything a test starts create NVLink multicast objects on shared machines.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
# JAX would otherwise take 75% of the GPU's memory as soon as a test imports it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _gpu_count() -> int:
    try:
        import mok_rt as mok
        return mok.device_count()
    except Exception:
        return 0


GPU_COUNT = _gpu_count()


NO_GPU = "needs a CUDA GPU (none found)"
FEW_GPUS = f"needs two or more CUDA GPUs (found {GPU_COUNT})"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # At setup rather than as collection-time skip marks, so MOK_RT_REQUIRE_GPU=1 can fail them.
    if "multigpu" in item.keywords and GPU_COUNT < 2:
        skip_or_fail(FEW_GPUS)
    elif "gpu" in item.keywords and GPU_COUNT < 1:
        skip_or_fail(NO_GPU)


def _kind(report) -> str | None:
    if "multigpu" in report.keywords:
        return "multi-GPU"
    if "gpu" in report.keywords:
        return "GPU"
    return None


def _reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    for known, short in ((NO_GPU, "no GPU found"), (FEW_GPUS, "fewer than 2 GPUs"),
                         (CUPY_MISSING, "CuPy missing")):
        if known in text:
            return short
    return "other: " + text.removeprefix("Skipped: ").strip().splitlines()[-1][:80]


def _why(reasons: collections.Counter) -> str:
    if len(reasons) == 1:
        return f" ({next(iter(reasons))})"
    top = ", ".join(f"{n} {r}" for r, n in reasons.most_common(3))
    more = f", {len(reasons) - 3} more reason(s)" if len(reasons) > 3 else ""
    return f" ({top}{more})" if reasons else ""


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line: how many GPU / multi-GPU tests ran, were skipped or could not run, and why, and
    why other tests were skipped (an optional dependency such as torch missing)."""
    ran = collections.Counter()
    skipped = {"GPU": collections.Counter(), "multi-GPU": collections.Counter()}
    blocked = {"GPU": collections.Counter(), "multi-GPU": collections.Counter()}
    other = collections.Counter()  # CPU tests skipped (an optional dependency missing, ...)
    for outcome, reports in terminalreporter.stats.items():
        if outcome not in ("passed", "failed", "error", "skipped"):
            continue   # e.g. "deselected" holds test items, not reports
        for report in reports:
            kind = _kind(report) if hasattr(report, "keywords") else None
            if kind is None:
                if outcome == "skipped" and hasattr(report, "keywords"):
                    other[_reason(report).removeprefix("other: ")] += 1
                continue
            if outcome == "skipped":
                skipped[kind][_reason(report)] += 1
                continue
            if outcome in ("error", "failed"):
                reason = _reason(report)
                if not reason.startswith("other"):  # failed instead of skipping (MOK_RT_REQUIRE_GPU)
                    blocked[kind][reason] += 1
                    continue
            if report.when == "call":
                ran[kind] += 1
    parts = []
    for kind in ("GPU", "multi-GPU"):
        part = f"{kind} tests: {ran[kind]} ran, {sum(skipped[kind].values())} skipped"
        part += _why(skipped[kind])
        if blocked[kind]:
            part += f", {sum(blocked[kind].values())} failed to run{_why(blocked[kind])}"
        parts.append(part)
    if other:
        parts.append(f"other tests: {sum(other.values())} skipped{_why(other)}")
    note = f" [{REQUIRE_ENV}=1]" if require_gpu() else ""
    terminalreporter.write_line("; ".join(parts) + note)
