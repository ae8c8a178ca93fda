"""Ahead-of-time cubin build: ``python -m mok_rt.build``.

Compiles every ``cuda_src/**/*.cu`` into ``mok_rt/cubins/<stem>.<target>.cubin`` and records in
``mok_rt/cubins/manifest.json``, per cubin: its source, target, the nvcc version, the flags, the
cubin's sha256 and the sha256 of every project source file it includes.  ``--check`` (and the
CPU test suite) verifies that the committed cubins match the current sources without needing
nvcc; in an installed package (no ``cuda_src`` next to it) it verifies the cubins against the
manifest's hashes instead.

Cubins are reproducible: the same nvcc gives the same bytes in any checkout.  nvcc runs in the
repository root on relative paths, but cicc still writes absolute paths into the line table
(``.file`` directives) and derives internal-linkage symbol names from the absolute source path,
so the source is compiled to PTX with its path name pinned to the relative one, the repository
root is cut from the PTX's ``.file`` directives, and the PTX is then assembled to the cubin.

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
import tempfile
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


NO_SOURCES_HINT = (
    "there is nothing to build from: no CUDA sources at {src} (an installed mok_rt ships only "
    "its cubins). To rebuild the cubins, use a source checkout: `git clone` the mok_rt "
    "repository, then `pip install -e .` and `python -m mok_rt.build` there. The shipped "
    "cubins were left as they are."
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


def have_sources() -> bool:
    """Whether this is a source checkout (``cuda_src`` next to the package)."""
    return SOURCE_DIR.is_dir() and any(SOURCE_DIR.rglob("*.cu"))


def kernel_sources() -> list[Path]:
    if not have_sources():
        raise BuildError(NO_SOURCES_HINT.format(src=SOURCE_DIR))
    files = sorted(SOURCE_DIR.rglob("*.cu"))
    stems: dict[str, Path] = {}
    for f in files:
        if f.stem in stems:
            raise BuildError(f"two kernel sources share the stem '{f.stem}': {_rel(stems[f.stem])}, {_rel(f)}")
        stems[f.stem] = f
    return files


def project_includes(nvcc: str, source: Path, flags: list[str]) -> list[Path]:
    """The project files ``source`` includes (via ``nvcc -M``), the source itself first."""
    out = subprocess.run([nvcc, "-M", *flags, "-I", _rel(SOURCE_DIR), _rel(source)],
                         capture_output=True, text=True, cwd=REPO_DIR)
    if out.returncode != 0:
        raise BuildError(f"nvcc -M {_rel(source)} failed:\n{out.stderr}")
    deps = out.stdout.replace("\\\n", " ").split(":", 1)[-1].split()
    root = SOURCE_DIR.resolve()
    files = {(REPO_DIR / d).resolve() for d in deps}
    mine = sorted(p for p in files if root in p.parents and p != source.resolve())
    return [source.resolve(), *mine]


@dataclass(frozen=True)
class BuiltCubin:
    entry: dict
    log: str


def _strip_repo_paths(ptx: str) -> str:
    """``.file`` directives made independent of where things are installed: files under the
    repository root relative to it, the toolkit's headers as ``cuda/include/...`` (nvcc names them
    through its own install path, which differs between machines with the same nvcc)."""
    root = REPO_DIR.resolve().as_posix().rstrip("/") + "/"
    pattern = re.compile(r'^(\s*\.file\s+\d+\s+")' + re.escape(root), re.MULTILINE)
    ptx = pattern.sub(r"\1", ptx)
    toolkit = re.compile(r'^(\s*\.file\s+\d+\s+")/[^"]*?/include/', re.MULTILINE)
    return toolkit.sub(r"\1cuda/include/", ptx)


def compile_one(nvcc: str, version: str, source: Path, target: str, out_dir: Path = CUBIN_DIR
                ) -> BuiltCubin:
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = [*BASE_FLAGS, *target_flags(target)]
    out_path = Path(out_dir).resolve() / f"{source.stem}.{target}.cubin"
    rel_src = _rel(source)
    m = re.fullmatch(r"sm_(\d+)(a?)", target)
    virtual = f"compute_{m.group(1)}{m.group(2)}"
    front = [f for f in BASE_FLAGS if f != "-cubin" and not f.startswith("-Xptxas")]
    back = [f for f in BASE_FLAGS if f != "-std=c++17"]
    with tempfile.TemporaryDirectory(prefix="mok_rt_build_") as tmp:
        ptx = Path(tmp) / f"{source.stem}.ptx"
        # cicc names internal-linkage symbols after --orig_src_path_name (absolute by default).
        cmd = [nvcc, "-ptx", *front, f"-gencode=arch={virtual},code={virtual}",
               "-Xcicc", "--orig_src_path_name", "-Xcicc", rel_src,
               "-I", _rel(SOURCE_DIR), rel_src, "-o", str(ptx)]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_DIR)
        if res.returncode != 0:
            raise BuildError(f"nvcc -ptx failed for {rel_src} ({target}):\n{res.stderr}")
        # Same name in every build: the PTX file name must not leak into the cubin either.
        ptx.write_text(_strip_repo_paths(ptx.read_text()))
        cmd = [nvcc, *back, *target_flags(target), "-Xptxas=-v", ptx.name, "-o", str(out_path)]
        res2 = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if res2.returncode != 0:
            raise BuildError(f"ptxas failed for {rel_src} ({target}):\n{res2.stderr}")
    log = res.stderr + res2.stderr
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
    return BuiltCubin(entry=entry, log=log)


def compile_cubin(source: Path, out_dir: Path, target: str = DEFAULT_TARGETS[0]) -> Path:
    """Compiles one source outside the package (the test suite's probes) into ``out_dir`` with the
    package's flags and include path; returns the cubin's path."""
    out_path = Path(out_dir) / f"{Path(source).stem}.{target}.cubin"
    cmd = [find_nvcc(), *BASE_FLAGS, *target_flags(target), "-I", str(SOURCE_DIR), str(source), "-o", str(out_path)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise BuildError(f"nvcc failed for {source} ({target}):\n{res.stderr}")
    return out_path


def build(targets=DEFAULT_TARGETS, *, jobs: int = 2, verbose: bool = False,
          only: tuple[str, ...] = ()) -> dict:
    """Compile the kernels (all of them, or the source stems in ``only``) and update the manifest.

    Nothing in ``mok_rt/cubins`` changes unless every compile succeeds.  A full build drops
    cubins whose source is gone; ``only`` leaves every other cubin and manifest entry alone.
    """
    sources = kernel_sources()  # raises (changing nothing) where there are no sources
    if only:
        by_stem = {f.stem: f for f in sources}
        unknown = sorted(set(only) - set(by_stem))
        if unknown:
            raise BuildError(f"no kernel source named {', '.join(unknown)} (known: "
                             f"{', '.join(sorted(by_stem))})")
        sources = [by_stem[stem] for stem in sorted(set(only))]
    nvcc = find_nvcc()
    version = nvcc_version(nvcc)
    work = [(src, t) for src in sources for t in targets]
    CUBIN_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".staging_", dir=CUBIN_DIR) as staging:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            built = list(pool.map(lambda st: compile_one(nvcc, version, *st, Path(staging)),
                                  work))
        for b in built:
            os.replace(Path(staging) / b.entry["cubin"], CUBIN_DIR / b.entry["cubin"])
    for b in built:
        spills = re.findall(r"(\d+) bytes spill stores", b.log)
        if verbose or any(int(s) for s in spills):
            print(f"--- {b.entry['cubin']}\n{b.log}", file=sys.stderr)
    entries = {b.entry["cubin"]: b.entry for b in built}
    if only:
        old = json.loads(MANIFEST.read_text()).get("cubins", []) if MANIFEST.exists() else []
        entries = {**{e["cubin"]: e for e in old}, **entries}
    else:
        for stale in CUBIN_DIR.glob("*.cubin"):
            if stale.name not in entries:
                stale.unlink()
    manifest = {"format": 1, "nvcc_version": version,
                "cubins": [entries[k] for k in sorted(entries)]}
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def check_manifest() -> list[str]:
    """Problems with the cubins (empty: all good).

    In a source checkout: the cubins against ``cuda_src`` (stale or missing).  In an installed
    package (no sources): each cubin against the manifest's sha256.
    """
    if not MANIFEST.exists():
        return [f"{MANIFEST} is missing: run `python -m mok_rt.build` in a source checkout"]
    data = json.loads(MANIFEST.read_text())
    problems = []
    listed = {}
    sources = have_sources()
    if not data.get("cubins"):
        problems.append(f"{MANIFEST} lists no cubins")
    for e in data.get("cubins", []):
        listed.setdefault(e["source"], set()).add(e["target"])
        cubin = CUBIN_DIR / e["cubin"]
        if not cubin.exists():
            problems.append(f"{e['cubin']}: listed in the manifest but missing")
        elif _sha256(cubin) != e["sha256"]:
            problems.append(f"{e['cubin']}: file does not match its manifest sha256")
        if not sources:
            continue
        for src, digest in e["sources"].items():
            path = REPO_DIR / src
            if not path.exists():
                problems.append(f"{e['cubin']}: source {src} no longer exists")
            elif _sha256(path) != digest:
                problems.append(f"{e['cubin']}: {src} changed since the cubin was built")
    if not sources:
        # An installed package cannot be rebuilt in place: reinstall instead.
        return [p + " (the installed package is damaged: reinstall mok_rt)" for p in problems]
    for src in sorted(SOURCE_DIR.rglob("*.cu")):
        if _rel(src) not in listed:
            problems.append(f"{_rel(src)}: no cubin in the manifest")
    return [p + " (rebuild: python -m mok_rt.build)" for p in problems]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mok_rt.build", description=__doc__.splitlines()[0])
    ap.add_argument("--target", action="append", help="cubin target, e.g. sm_90a (repeatable)")
    ap.add_argument("--check", action="store_true",
                    help="only verify the cubins: against the sources in a source checkout, "
                         "against the manifest's sha256 in an installed package")
    ap.add_argument("--only", action="append", metavar="STEM",
                    help="build only this kernel source (its file stem, e.g. symm_kernels; "
                         "repeatable); other cubins and manifest entries are kept")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("-v", "--verbose", action="store_true", help="print ptxas resource usage")
    args = ap.parse_args(argv)
    if args.check:
        problems = check_manifest()
        for p in problems:
            print(p)
        if problems:
            print(f"{len(problems)} problem(s)")
        elif have_sources():
            print("cubins up to date")
        else:
            print(f"no sources at {SOURCE_DIR}: every cubin matches the manifest's sha256")
        return 1 if problems else 0
    try:
        manifest = build(tuple(args.target or DEFAULT_TARGETS), jobs=args.jobs,
                         verbose=args.verbose, only=tuple(args.only or ()))
    except BuildError as ex:
        print(f"error: {ex}", file=sys.stderr)
        return 2
    built = set(args.only or ())
    for e in manifest["cubins"]:
        if not built or Path(e["source"]).stem in built:
            print(f"{e['cubin']:40s} {e['source']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
