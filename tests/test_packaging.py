"""The license ships with the package; the training sample runs and reports its loss."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def test_license_is_the_full_apache_text():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text


def test_pyproject_ships_the_license():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert "LICENSE" in project["license-files"]


def test_train_sample_draws_fresh_batches_and_summarises():
    res = subprocess.run([sys.executable, str(REPO / "samples" / "train_moe.py"),
                          "--backend", "reference", "--steps", "3"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len([ln for ln in lines if ln.startswith("step ")]) == 3
    assert re.fullmatch(r"done: loss \S+ -> \S+ over 3 steps \(backend=reference\)", lines[-1]), lines[-1]
    source = (REPO / "samples" / "train_moe.py").read_text()
    assert "step % " not in source  # no cycling through a fixed set of batches


def test_train_sample_runs_fp8_on_the_reference_backend():
    res = subprocess.run([sys.executable, str(REPO / "samples" / "train_moe.py"), "--backend", "reference",
                          "--precision", "fp8_block", "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "precision=fp8_block" in res.stdout.splitlines()[0]
    losses = [float(ln.split()[3]) for ln in res.stdout.splitlines() if ln.startswith("step ")]
    assert len(losses) == 2 and all(np.isfinite(losses)), res.stdout
