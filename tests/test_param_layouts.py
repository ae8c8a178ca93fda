"""Every field of the parameter structs the host packs with ctypes sits where the CUDA side reads it.

The kernels take their parameters as C++ structs (cuda_src/moe/params*.cuh, schedule_params.cuh,
comm/barrier.cuh); mok_rt.kernels / mok_rt.dist mirror them as ctypes.Structure.  Sizes alone
(tests/test_moe_tma.py) would miss two fields of one type swapped, or a field moved into padding.
This test walks every ctypes field (nested structs included), compiles a host program that prints
offsetof / sizeof of the same path in the C++ struct, and compares the two lists.  Needs nvcc (the
headers use CUDA qualifiers); skipped without it, like the cubin rebuild test.  (fp8q::Params lives
in quantize_weights.cu, not a header: its layout is pinned there by static_asserts.)
"""
from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from mok_rt import build
from mok_rt.dist import barrier as BR
from mok_rt.kernels import moe_params as P
from mok_rt.kernels import moe_params_fp8 as F
from mok_rt.kernels import moe_params_fp8_bwd as B
from mok_rt.kernels import schedule_params as S

REPO = Path(__file__).resolve().parents[1]

# C++ type -> its ctypes mirror.
STRUCTS = {
    "mok::MoEForwardTmaParams": P.MoEForwardTmaParams,
    "mok::MoEBackwardTmaParams": P.MoEBackwardTmaParams,
    "mok::MoEFp8ForwardTmaParams": F.MoEFp8ForwardTmaParams,
    "mok::MoEFp8BackwardTmaParams": B.MoEFp8BackwardTmaParams,
    "mok::ScheduleParams": S.ScheduleParams,
    "mok::ExchangeParams": S.ExchangeParams,
    "mok::BlockOrderParams": S.BlockOrderParams,
    "mok::GroupBarrier": BR._BarrierParams,
}
HEADERS = ("moe/params_tma.cuh", "moe/params_fp8_bwd.cuh", "moe/schedule_params.cuh", "comm/barrier.cuh")


def _nvcc():
    try:
        return build.find_nvcc()
    except build.BuildError:
        return None


def _is_padding(name: str) -> bool:
    # Host-only names for bytes the C++ struct leaves to the compiler (or names differently).
    return name.endswith("pad_") or name.endswith("tail_")


def _fields(cls, prefix="", base=0):
    """(path, offset, size) of every named field of a ctypes struct, nested structs expanded."""
    out = []
    for f in cls._fields_:
        name, typ = f[0], f[1]
        d = getattr(cls, name)
        path = prefix + name
        out.append((path, base + d.offset, d.size))
        if isinstance(typ, type) and issubclass(typ, ctypes.Structure):
            out.extend(_fields(typ, path + ".", base + d.offset))
    return out


def _program() -> tuple[str, list[str]]:
    lines = ["#include <cstdio>", "#include <cstddef>", *(f'#include "{h}"' for h in HEADERS), "int main() {"]
    want = []
    for cpp, cls in STRUCTS.items():
        lines.append(f'  printf("{cpp} SIZE %zu\\n", sizeof({cpp}));')
        want.append(f"{cpp} SIZE {ctypes.sizeof(cls)}")
        for path, off, size in _fields(cls):
            if _is_padding(path):
                continue
            lines.append(f'  printf("{cpp} {path} %zu %zu\\n", offsetof({cpp}, {path}), '
                         f"sizeof((({cpp}*)0)->{path}));")
            want.append(f"{cpp} {path} {off} {size}")
    lines.append("  return 0;\n}")
    return "\n".join(lines) + "\n", want


def test_the_walk_sees_nested_fields():
    # The comparison below is only as good as the walk: it must reach into nested structs.
    paths = [p for p, _, _ in _fields(P.MoEForwardTmaParams)]
    assert any("." in p for p in paths), paths[:10]
    assert len(paths) > 20


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (needed to compile the layout probe)")
def test_ctypes_mirrors_match_the_cuda_structs(tmp_path):
    src, want = _program()
    (tmp_path / "layout.cu").write_text(src)
    exe = tmp_path / "layout"
    res = subprocess.run([_nvcc(), "-std=c++17", "-I", str(REPO / "cuda_src"), "-o", str(exe),
                          str(tmp_path / "layout.cu")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    got = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True).stdout.split("\n")
    got = [line for line in got if line]
    diff = [(w, g) for w, g in zip(want, got) if w != g]
    assert len(got) == len(want) and not diff, f"ctypes vs C++ (first 10): {diff[:10]}"
