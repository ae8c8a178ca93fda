"""Provenance (commit, versions, machine) and the results document of bench_moe.py: where it is
written and the table printed from it."""
from __future__ import annotations

import hashlib
import json
import math
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
PRECISIONS = ("bf16", "fp8_block")   # what bench_moe.py --precision takes, in the order it runs them


def mok_key(part: str, precision: str) -> str:
    """Where a result record keeps mok_rt's ``part`` ("mok", "check", "ratio") in ``precision``:
    bf16 under the plain names (as before --precision existed), the others suffixed
    ("mok_fp8_block"), so bf16-only records and their readers are unchanged."""
    return part if precision == "bf16" else f"{part}_{precision}"


# -- provenance ------------------------------------------------------------------------------------
def _run(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _commit(override: str | None) -> dict:
    sha = _run(["git", "rev-parse", "HEAD"])
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    if override and sha and not sha.startswith(override):
        # The tree was copied with someone else's git metadata (a device machine): its HEAD and
        # status say nothing about the given commit.  The cubin manifest hash below still does.
        sha = status = None
    info = {"sha": sha, "dirty": None if status is None or sha is None else bool(status), "given": override}
    manifest = _ROOT / "mok_rt" / "cubins" / "manifest.json"
    if manifest.exists():   # identifies the kernels even where the tree carries no git metadata
        info["cubin_manifest_sha256"] = hashlib.sha256(manifest.read_bytes()).hexdigest()[:16]
    short = (override or sha or "")[:8] or "nogit"
    info["short"] = short + ("-dirty" if info["dirty"] else "")
    return info


def _versions(torch, mok) -> dict:
    from importlib import metadata
    v: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                         "torch_cuda": torch.version.cuda}
    for pkg in ("numpy", "cuda-core", "cuda-bindings", "cupy-cuda13x", "mpi4py"):
        try:
            v[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            v[pkg] = None
    try:
        v["nccl"] = ".".join(str(p) for p in torch.cuda.nccl.version())
    except Exception:
        v["nccl"] = None
    v["mok_rt"] = getattr(mok.mod, "__version__", None)
    return v


def _machine(torch, ranks) -> dict:
    if ranks.cpu:
        return {"gpu": f"CPU ({platform.processor() or platform.machine()}, cpu-smoke)", "gpus_visible": 0,
                "gpus_used": ranks.size, "driver": None, "hostname": socket.gethostname(),
                "platform": platform.platform()}
    props = torch.cuda.get_device_properties(ranks.device)
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    cuda_driver = None
    try:
        from cuda.bindings import driver
        err, ver = driver.cuDriverGetVersion()
        cuda_driver = f"{int(ver) // 1000}.{int(ver) % 1000 // 10}"
    except Exception:
        pass
    return {"gpu": props.name, "gpus_visible": torch.cuda.device_count(), "gpus_used": ranks.size,
            "sm_count": props.multi_processor_count, "memory_gib": round(props.total_memory / 2 ** 30, 1),
            "driver": smi.splitlines()[0] if smi else None, "cuda_driver_api": cuda_driver,
            "hostname": socket.gethostname(), "platform": platform.platform()}


def _machine_slug(machine: dict) -> str:
    name = machine["gpu"].lower().replace("nvidia", "").strip()
    slug = "".join(c if c.isalnum() else "-" for c in name).strip("-") or "gpu"
    while "--" in slug:
        slug = slug.replace("--", "-")
    return f"{slug}x{machine['gpus_used']}"


def _results_path(doc: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{doc['date_stamp']}_{_machine_slug(doc['machine'])}_{doc['commit']['short']}"
    if doc["cpu_smoke"]:
        stem += "_cpusmoke"
    elif doc["quick"]:
        stem += "_quick"
    path, n = out_dir / f"{stem}.json", 2
    while path.exists():
        path, n = out_dir / f"{stem}-{n}.json", n + 1
    return path


def _write(doc: dict, path: Path) -> None:
    # Rewritten after every shape, so a run cut short (time limit, a crashed context) keeps
    # what it measured.
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


# -- report ----------------------------------------------------------------------------------------
def _cell(fig: dict | None, key: str) -> str:
    if not fig:
        return "-"
    if fig.get("error"):
        return "error"
    ms, tf = fig.get(f"{key}_ms"), fig.get(f"{key}_tflops_per_gpu")
    if tf is None:
        why = (fig.get("withheld") or {}).get(key)
        un = fig.get("unverified") or {}
        if why == "unchecked" and un.get(f"{key}_ms") is not None:   # --impl mok: timing only, marked
            return f"{un[f'{key}_ms']:8.3f} {un[f'{key}_tflops_per_gpu']:5.1f}?"
        return {"failed check": "WRONG", "unchecked": "unchecked", "not built": "not built"}.get(why, "-")
    return f"{ms:8.3f} {tf:6.1f}"


def _check_cell(check: dict | None) -> str:
    if not check:
        return "-"
    errs = check.get("rel_fro")
    if not errs:
        return (check.get("error") or "-")[:24]
    worst = max(errs, key=lambda n: float(errs[n]))
    verdict = "ok" if check.get("passed_fwd_bwd") else ("fwd-only" if check.get("passed_fwd") else "FAIL")
    if check.get("backward") == "not built" and check.get("passed_fwd"):
        verdict = "ok fwd (no bwd)"
    cell = f"{verdict} out {float(errs.get('out', math.nan)):.1e} max {worst} {float(errs[worst]):.1e}"
    # A precision other than bf16 has its own tolerance: say which one the verdict used.
    return cell + (f" (tol {check['tolerance']:g})" if "precision" in check else "")


def _precisions(r: dict) -> list[str]:
    """The precisions other than bf16 that a record holds (none in records of bf16-only runs)."""
    return [p for p in PRECISIONS if p != "bf16" and mok_key("mok", p) in r]


def _precision_lines(r: dict, precision: str) -> list[str]:
    """The table row of mok_rt in ``precision`` (under the bf16 row; the baseline's columns are
    the bf16 row's) and a line of what the row has no column for."""
    fig, check = r.get(mok_key("mok", precision)), r.get(mok_key("check", precision))
    ratio = r.get(mok_key("ratio", precision)) or {}
    rx = {k: (f"{ratio[k]:5.2f}" if ratio.get(k) else "  -") for k in ("fwd", "fwd_bwd")}
    lines = [f"{'  + ' + precision:<20}{'':>3}{'':>9}  {'':>17}  {_cell(fig, 'fwd'):>17}{rx['fwd']:>6}  {'':>17}  "
             f"{_cell(fig, 'fwd_bwd'):>17}{rx['fwd_bwd']:>6}  {_check_cell(check)}"]
    fig = fig or {}
    vs = r.get(mok_key("ratio", precision) + "_vs_bf16") or {}
    vs_cells = {k: f"{vs[k]:.2f}x" if vs.get(k) else "-" for k in ("fwd", "fwd_bwd")}
    notes = [f"vs mok_rt bf16: fwd {vs_cells['fwd']}, fwd+bwd {vs_cells['fwd_bwd']}"]
    if fig.get("quantize_weights_ms") is not None:
        notes.append(f"quantize_weights {fig['quantize_weights_ms']:.3f} ms (once per optimizer step, not in the "
                     f"figures)")
    mem = fig.get("memory")
    if mem:
        notes.append(f"step memory {mem['step_peak_gib']:.2f} GiB (quantised weights "
                     f"{mem.get('quantized_weights_gib', 0):.2f})")
    not_built = fig.get("not_built") or {}
    for why in dict.fromkeys(not_built.values()):   # one note per message (EP > 1: fwd and fwd_bwd share it)
        notes.append(f"{' and '.join(k for k, w in not_built.items() if w == why)}: not built ({why[:120]})")
    if fig.get("quantize_weights_skipped"):
        notes.append(f"quantize_weights {fig['quantize_weights_skipped']}")
    for key in ("error", "quantize_weights_error"):
        if fig.get(key):
            notes.append(f"{key.replace('_', ' ')}: {fig[key][:200]}")
    return lines + [f"    {precision}: " + "; ".join(notes)]


def format_table(doc: dict) -> str:
    head = (f"{'shape':<20}{'EP':>3}{'tok/rank':>9}  {'torch fwd ms TF/s':>17}  {'mok fwd ms TF/s':>17}{'x':>6}  "
            f"{'torch f+b ms TF/s':>17}  {'mok f+b ms TF/s':>17}{'x':>6}  check (rel. Frobenius)")
    lines = [head, "-" * len(head)]
    for r in doc["results"]:
        ratio = r.get("ratio") or {}
        rx = {k: (f"{ratio[k]:5.2f}" if ratio.get(k) else "  -") for k in ("fwd", "fwd_bwd")}
        lines.append(f"{r['shape']:<20}{r['ep']:>3}{r['tokens_per_rank']:>9}  {_cell(r['torch'], 'fwd'):>17}  "
                     f"{_cell(r['mok'], 'fwd'):>17}{rx['fwd']:>6}  {_cell(r['torch'], 'fwd_bwd'):>17}  "
                     f"{_cell(r['mok'], 'fwd_bwd'):>17}{rx['fwd_bwd']:>6}  {_check_cell(r['check'])}")
        for precision in _precisions(r):
            lines += _precision_lines(r, precision)
        for part in ("torch", "mok"):
            e = (r.get(part) or {}).get("error")
            if e and not e.startswith("not requested"):
                lines.append(f"    {part}: {e[:200]}")
        if r.get("error"):
            lines.append(f"    error: {r['error'][:200]}")
        tm, mm = (r.get("torch") or {}).get("memory"), (r.get("mok") or {}).get("memory")
        if tm or mm:
            lines.append("    step memory (GiB): " + "  ".join(
                [f"torch {tm['step_peak_gib']:.2f}" if tm else "torch -"] +
                ([f"mok {mm['step_peak_gib']:.2f} (workspace peak {mm['workspace_peak_gib']:.2f} + grad buffers "
                  f"{mm['grad_buffers_gib']:.2f})"] if mm else ["mok -"])))
    return "\n".join(lines)
