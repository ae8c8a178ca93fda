"""GPU tests skip with a reason (or fail under MOK_RT_REQUIRE_GPU=1) and the run says so."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SAMPLE = '''
import sys
import pytest
from _gpu import cp

@pytest.mark.gpu
def test_one_gpu():
    pass

@pytest.mark.gpu
def test_uses_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # as if CuPy were not installed
    cp.zeros(3)

@pytest.mark.multigpu
def test_two_gpus():
    pass

def test_cpu():
    pass
'''


def _gpu_count() -> int:
    try:
        from mok_rt.runtime.driver import device_count
        return device_count()
    except Exception:
        return 0


def _run(tmp_path: Path, require: bool) -> subprocess.CompletedProcess:
    for name in ("conftest.py", "_gpu.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {k: v for k, v in os.environ.items() if k != "MOK_RT_REQUIRE_GPU"}
    if require:
        env["MOK_RT_REQUIRE_GPU"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider",
                           "-W", "ignore::pytest.PytestUnknownMarkWarning",
                           "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("require", [False, True], ids=["default", "require_gpu"])
def test_gpu_skip_reasons_and_summary(tmp_path, require):
    n = _gpu_count()
    res = _run(tmp_path, require)
    out = res.stdout
    # What cannot run here: no GPU -> both GPU tests; else the one without CuPy.
    gpu_out, gpu_why = (2, "no GPU found") if n == 0 else (1, "CuPy missing")
    multi_out = 0 if n >= 2 else 1
    verb = "failed to run" if require else "skipped"
    gpu = f"GPU tests: {2 - gpu_out if n else 0} ran"
    assert gpu in out, out
    assert f"{gpu_out} {verb} ({gpu_why})" in out, out
    if multi_out:
        assert f"multi-GPU tests: 0 ran" in out and f"1 {verb} (fewer than 2 GPUs)" in out, out
    else:
        assert "multi-GPU tests: 1 ran, 0 skipped" in out, out
    if require:
        assert res.returncode == 1, out
        assert "MOK_RT_REQUIRE_GPU=1: not skipped" in out
        assert "[MOK_RT_REQUIRE_GPU=1]" in out
    else:
        assert res.returncode == 0, out
        assert "failed" not in out.splitlines()[-1], out
