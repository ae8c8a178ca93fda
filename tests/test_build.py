"""``python -m mok_rt.build`` in an installed package (no sources) and reproducible cubins."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mok_rt import build

PACKAGE = Path(build.__file__).resolve().parent
REPO = PACKAGE.parent


def _installed_copy(tmp_path: Path) -> Path:
    """The package as pip installs it: mok_rt/ with its cubins, no cuda_src next to it."""
    site = tmp_path / "site-packages"
    shutil.copytree(PACKAGE, site / "mok_rt",
                    ignore=shutil.ignore_patterns("__pycache__", ".staging_*"))
    assert not (site / "cuda_src").exists()
    return site


def _run_build(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-m", "mok_rt.build", *args], cwd=site, env=env,
                          capture_output=True, text=True, timeout=300)


def _snapshot(cubins: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(cubins.iterdir())}


def test_build_without_sources_changes_nothing(tmp_path):
    site = _installed_copy(tmp_path)
    cubins = site / "mok_rt" / "cubins"
    before = _snapshot(cubins)
    assert any(name.endswith(".cubin") for name in before)
    res = _run_build(site)
    assert res.returncode != 0
    assert "nothing to build from" in res.stderr
    assert "source checkout" in res.stderr
    assert _snapshot(cubins) == before
    assert json.loads((cubins / "manifest.json").read_text())["cubins"]


def test_check_without_sources_verifies_hashes(tmp_path):
    site = _installed_copy(tmp_path)
    res = _run_build(site, "--check")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no longer exists" not in res.stdout
    assert "sha256" in res.stdout

    cubin = next((site / "mok_rt" / "cubins").glob("*.cubin"))
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cubin.write_bytes(bytes(data))
    res = _run_build(site, "--check")
    assert res.returncode == 1
    assert f"{cubin.name}: file does not match its manifest sha256" in res.stdout
    assert "reinstall" in res.stdout
    assert "rebuild" not in res.stdout


def test_check_without_sources_reports_a_missing_cubin(tmp_path):
    site = _installed_copy(tmp_path)
    cubin = next((site / "mok_rt" / "cubins").glob("*.cubin"))
    cubin.unlink()
    res = _run_build(site, "--check")
    assert res.returncode == 1
    assert f"{cubin.name}: listed in the manifest but missing" in res.stdout


def _nvcc():
    try:
        return build.find_nvcc()
    except build.BuildError:
        return None


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (needed to rebuild a cubin)")
def test_cubin_rebuild_is_reproducible_elsewhere(tmp_path):
    # Another checkout, at another path, deeper than this one: no path may leak into the cubin.
    other = tmp_path / "elsewhere" / "checkout"
    shutil.copytree(REPO / "cuda_src", other / "cuda_src")
    (other / "mok_rt").mkdir()
    shutil.copy(PACKAGE / "build.py", other / "mok_rt" / "build.py")
    res = subprocess.run([sys.executable, str(other / "mok_rt" / "build.py"),
                          "--only", "symm_kernels"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    manifest = json.loads(build.MANIFEST.read_text())
    entry = next(e for e in manifest["cubins"] if e["cubin"] == "symm_kernels.sm_90a.cubin")
    rebuilt = other / "mok_rt" / "cubins" / entry["cubin"]
    assert str(tmp_path).encode() not in rebuilt.read_bytes()
    assert str(REPO).encode() not in rebuilt.read_bytes()
    if build.nvcc_version(build.find_nvcc()) != entry["nvcc_version"]:
        pytest.skip(f"the committed cubin was built by nvcc {entry['nvcc_version']}")
    assert hashlib.sha256(rebuilt.read_bytes()).hexdigest() == entry["sha256"]
    # --only touches nothing but its own entry.
    built = json.loads((other / "mok_rt" / "cubins" / "manifest.json").read_text())
    assert [e["cubin"] for e in built["cubins"]] == [entry["cubin"]]
    assert built["cubins"][0]["sources"] == entry["sources"]


def test_only_rejects_an_unknown_kernel():
    with pytest.raises(build.BuildError, match="no kernel source named nope"):
        build.build(only=("nope",))
