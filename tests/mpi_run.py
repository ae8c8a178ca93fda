"""Runs one of the MPI check scripts (mpi_*_check.py) under `mpirun -np 2` for the GPU tests:
skips where there is no mpirun or mpi4py (fails instead under MOK_RT_REQUIRE_GPU=1), asserts that every rank passed every check."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

from _gpu import skip_or_fail

HERE = os.path.dirname(os.path.abspath(__file__))


def run_mpi_script(script: str, *, timeout: float, min_passes: int) -> None:
    """``script`` in tests/; ``min_passes``: PASS lines expected over both ranks."""
    mpirun = shutil.which("mpirun")
    if mpirun is None or importlib.util.find_spec("mpi4py") is None:
        skip_or_fail("needs mpirun and mpi4py")   # MOK_RT_REQUIRE_GPU=1: fails instead
    cmd = [mpirun, "-np", "2", "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, os.path.join(HERE, script)]
    env = dict(os.environ, OMPI_MCA_btl_vader_single_copy_mechanism="none")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    text = out.stdout + out.stderr
    print(text)
    assert out.returncode == 0, text
    assert "ALL PASS" in text and "FAIL " not in text
    assert text.count("PASS ") >= min_passes
