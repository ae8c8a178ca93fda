"""Ahead-of-time cubin build: ``python -m mok_rt.build``.

Compiles every ``cuda_src/**/*.cu`` into ``mok_rt/cubins/<stem>.<target>.cubin`` and records in
``mok_rt/cubins/manifest.json``, per cubin: its source, target, the nvcc version, the flags, the
cubin's sha256 and the sha256 of every project source file it includes.  ``--check`` (and the
CPU test suite) verifies that the committed cubins match the current sources without needing
nvcc.

nvcc is taken from ``$NVCC``, then ``PATH``, then PyPI's ``cuda-toolkit[nvcc,cccl]`` wheels.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
SOURCE_DIR = REPO_DIR / "cuda_src"
CUBIN_DIR = PACKAGE_DIR / "cubins"
MANIFEST = CUBIN_DIR / "manifest.json"

DEFAULT_TARGETS = ("sm_90a",)
BASE_FLAGS = ("-cubin", "-O3", "-std=c++17", "-lineinfo", "-Xptxas=-warn-spills")

INSTALL_HINT = (
    "mok_rt.build needs CUDA's nvcc (13.x) and a host C++ compiler. Either install the CUDA "
    "toolkit and put nvcc on PATH (or set $NVCC), or install PyPI's wheels: "
    "`pip install 'mok_rt[build]'` (i.e. `pip install \"cuda-toolkit[nvcc,cccl]>=13,<14\"`). "
    "Users who only run mok_rt need neither: the cubins ship with the package."
)


class BuildError(RuntimeError):
    pass


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _rel(path: Path) -> str:
    return path.resolve().relative_to(REPO_DIR).as_posix()


def find_nvcc() -> str:
    env = os.environ.get("NVCC")
    if env:
        if not Path(env).exists():
            raise BuildError(f"$NVCC={env} does not exist. {INSTALL_HINT}")
        return env
    found = shutil.which("nvcc")
    if found:
        return found
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    for root in roots:
        for pattern in ("nvidia/cu*/bin/nvcc", "nvidia/cuda_nvcc/bin/nvcc", "nvidia/*/bin/nvcc"):
            hits = sorted(glob.glob(os.path.join(root, pattern)))
            if hits:
                return hits[-1]
    raise BuildError(f"nvcc not found. {INSTALL_HINT}")


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def target_flags(target: str) -> list[str]:
    m = re.fullmatch(r"sm_(\d+)(a?)", target)
    if not m:
        raise BuildError(f"unknown target {target!r} (expected e.g. sm_90a)")
    return [f"-gencode=arch=compute_{m.group(1)}{m.group(2)},code={target}"]


def kernel_sources() -> list[Path]:
    files = sorted(SOURCE_DIR.rglob("*.cu"))
    stems: dict[str, Path] = {}
    for f in files:
        if f.stem in stems:
            raise BuildError(f"two kernel sources share the stem '{f.stem}': {_rel(stems[f.stem])}, {_rel(f)}")
        stems[f.stem] = f
    return files


def project_includes(nvcc: str, source: Path, flags: list[str]) -> list[Path]:
    """The project files ``source`` includes (via ``nvcc -M``), the source itself first."""
    out = subprocess.run([nvcc, "-M", *flags, "-I", str(SOURCE_DIR), str(source)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise BuildError(f"nvcc -M {_rel(source)} failed:\n{out.stderr}")
    deps = out.stdout.replace("\\\n", " ").split(":", 1)[-1].split()
    root = SOURCE_DIR.resolve()
    files = {Path(d).resolve() for d in deps}
    mine = sorted(p for p in files if root in p.parents and p != source.resolve())
    return [source.resolve(), *mine]


@dataclass(frozen=True)
class BuiltCubin:
    entry: dict
    log: str


def compile_one(nvcc: str, version: str, source: Path, target: str) -> BuiltCubin:
    CUBIN_DIR.mkdir(parents=True, exist_ok=True)
    flags = [*BASE_FLAGS, *target_flags(target)]
    out_path = CUBIN_DIR / f"{source.stem}.{target}.cubin"
    cmd = [nvcc, *flags, "-Xptxas=-v", "-I", str(SOURCE_DIR), str(source), "-o", str(out_path)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise BuildError(f"nvcc failed for {_rel(source)} ({target}):\n{res.stderr}")
    includes = project_includes(nvcc, source, list(target_flags(target)))
    entry = {
        "cubin": out_path.name,
        "source": _rel(source),
        "target": target,
        "nvcc_version": version,
        "flags": flags,
        "sha256": _sha256(out_path),
        "sources": {_rel(p): _sha256(p) for p in includes},
    }
    return BuiltCubin(entry=entry, log=res.stderr)


def compile_cubin(source: Path, out_dir: Path, target: str = DEFAULT_TARGETS[0]) -> Path:
    """Compiles one source outside the package (the test suite's probes) into ``out_dir`` with the
    package's flags and include path; returns the cubin's path."""
    out_path = Path(out_dir) / f"{Path(source).stem}.{target}.cubin"
    cmd = [find_nvcc(), *BASE_FLAGS, *target_flags(target), "-I", str(SOURCE_DIR), str(source), "-o", str(out_path)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise BuildError(f"nvcc failed for {source} ({target}):\n{res.stderr}")
    return out_path


def build(targets=DEFAULT_TARGETS, *, jobs: int = 2, verbose: bool = False) -> dict:
    nvcc = find_nvcc()
    version = nvcc_version(nvcc)
    work = [(src, t) for src in kernel_sources() for t in targets]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        built = list(pool.map(lambda st: compile_one(nvcc, version, *st), work))
    for b in built:
        spills = re.findall(r"(\d+) bytes spill stores", b.log)
        if verbose or any(int(s) for s in spills):
            print(f"--- {b.entry['cubin']}\n{b.log}", file=sys.stderr)
    entries = sorted((b.entry for b in built), key=lambda e: e["cubin"])
    keep = {e["cubin"] for e in entries}
    for stale in CUBIN_DIR.glob("*.cubin"):
        if stale.name not in keep:
            stale.unlink()
    manifest = {"format": 1, "nvcc_version": version, "cubins": entries}
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def check_manifest() -> list[str]:
    """Problems that make the committed cubins stale against ``cuda_src`` (empty: up to date)."""
    if not MANIFEST.exists():
        return [f"{_rel(MANIFEST)} is missing: run `python -m mok_rt.build`"]
    data = json.loads(MANIFEST.read_text())
    problems = []
    listed = {}
    for e in data.get("cubins", []):
        listed.setdefault(e["source"], set()).add(e["target"])
        cubin = CUBIN_DIR / e["cubin"]
        if not cubin.exists():
            problems.append(f"{e['cubin']}: listed in the manifest but missing")
        elif _sha256(cubin) != e["sha256"]:
            problems.append(f"{e['cubin']}: file does not match its manifest sha256")
        for src, digest in e["sources"].items():
            path = REPO_DIR / src
            if not path.exists():
                problems.append(f"{e['cubin']}: source {src} no longer exists")
            elif _sha256(path) != digest:
                problems.append(f"{e['cubin']}: {src} changed since the cubin was built")
    if SOURCE_DIR.exists():
        for src in sorted(SOURCE_DIR.rglob("*.cu")):
            if _rel(src) not in listed:
                problems.append(f"{_rel(src)}: no cubin in the manifest")
    return [p + " (rebuild: python -m mok_rt.build)" for p in problems]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mok_rt.build", description=__doc__.splitlines()[0])
    ap.add_argument("--target", action="append", help="cubin target, e.g. sm_90a (repeatable)")
    ap.add_argument("--check", action="store_true", help="only verify the manifest against the sources")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("-v", "--verbose", action="store_true", help="print ptxas resource usage")
    args = ap.parse_args(argv)
    if args.check:
        problems = check_manifest()
        for p in problems:
            print(p)
        print("cubins up to date" if not problems else f"{len(problems)} problem(s)")
        return 1 if problems else 0
    try:
        manifest = build(tuple(args.target or DEFAULT_TARGETS), jobs=args.jobs, verbose=args.verbose)
    except BuildError as ex:
        print(f"error: {ex}", file=sys.stderr)
        return 2
    for e in manifest["cubins"]:
        print(f"{e['cubin']:40s} {e['source']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
