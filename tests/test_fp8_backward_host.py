"""Groundwork of the "fp8_block" backward on the CUDA backend, without a GPU (docs/FP8_BACKWARD.md; the
launch itself: tests/test_fp8_backward_null_driver.py): the parameter structs against
cuda_src/moe/params_fp8_bwd.cuh (static_asserts, and the header compiled when nvcc is here) and
against the built kernel's parameter, the FP8 backward plan, and the buffer table's shapes."""
from __future__ import annotations

import ctypes
import re
import struct
import subprocess
from pathlib import Path

import pytest
from _plan_checks import PLAN_DIMS, check_plan_well_formed, small_dims

from mok_rt import build
from mok_rt.kernels import moe_params as P
from mok_rt.kernels import moe_params_fp8 as F
from mok_rt.kernels import moe_params_fp8_bwd as B
from mok_rt.kernels import moe_plan

REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "cuda_src/moe/params_fp8_bwd.cuh"


# ---- structs: one source of truth with the header ---------------------------------------------------
def _kernel_params(cubin: Path, kernel: str) -> tuple[list[int], int]:
    """(sizes of `kernel`'s parameters, its parameter bank's bytes) from the cubin's .nv.info.<kernel>
    section: EIATTR_KPARAM_INFO (0x17; the size in bits 18-31 of its last word) and
    EIATTR_CBANK_PARAM_SIZE (0x19)."""
    elf = cubin.read_bytes()
    assert elf[:5] == b"\x7fELF\x02"
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3a)
    secs = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = secs[shstrndx][4]
    sizes, bank = [], None
    for name_at, _, _, _, off, size in secs:
        name = elf[names + name_at:elf.index(b"\0", names + name_at)].decode()
        if name != ".nv.info." + kernel:
            continue
        at = off
        while at < off + size:
            fmt, attr, v = struct.unpack_from("<BBH", elf, at)
            if fmt == 4:  # EIFMT_SVAL: v payload bytes follow
                if attr == 0x17:
                    sizes.append(struct.unpack_from("<I", elf, at + 4 + 8)[0] >> 18)
                at += 4 + v
            else:
                if attr == 0x19:
                    bank = v
                at += 4
    return sizes, bank


def test_the_built_kernel_takes_the_tma_params():
    """moe_backward_fp8 (mok_rt/cubins) has one parameter, MoEFp8BackwardTmaParams, and its parameter
    bank (the struct after the 64-byte-aligned start) fits the classic 4 KB."""
    sizes, bank = _kernel_params(build.CUBIN_DIR / "moe_backward_fp8.sm_90a.cubin", "moe_backward_fp8")
    assert sizes == [ctypes.sizeof(B.MoEFp8BackwardTmaParams)] == [3712]
    assert bank is not None and 3712 <= bank <= 4096


def test_struct_layouts_match_the_header():
    text = HEADER.read_text()
    sizes = {m.group(1): int(m.group(2)) for m in re.finditer(r"sizeof\((\w+)\) == (\d+)\b(?! \*)", text)}
    offsets = {(m.group(1), m.group(2)): int(m.group(3))
               for m in re.finditer(r"offsetof\((\w+), (\w+)\) == (\d+)", text)}
    classes = {c.__name__: c for c in B.LAYOUT}
    assert {"MoEFp8BackwardParams", "MoEFp8BackwardTmaParams", "MoEFp8BackwardPlan"} <= set(sizes)
    for name, size in sizes.items():
        assert ctypes.sizeof(classes[name]) == size, name
    for (name, field), at in offsets.items():
        assert getattr(classes[name], field).offset == at, (name, field)
    assert "sizeof(MoEFp8WeightsT) == 12 * 8" in text and "sizeof(MoEFp8BackwardScratch) == 8 * 8" in text
    assert "sizeof(MoEFp8BackwardMaps) == 17 * 128" in text
    # The FP8 struct starts with the bf16 backward's, unchanged; the forward's quantised context follows.
    assert B.MoEFp8BackwardParams.p.offset == 0
    assert B.MoEFp8BackwardParams.p.size == ctypes.sizeof(P.MoEBackwardParams)
    assert B.MoEFp8BackwardParams.qctx.size == ctypes.sizeof(F.MoEFp8Context)
    assert ctypes.sizeof(B.MoEFp8BackwardTmaParams) <= 4096
    # Field order: the header's declarations, in order.
    for cls, struct in ((B.MoEFp8WeightsT, "MoEFp8WeightsT"), (B.MoEFp8BackwardScratch, "MoEFp8BackwardScratch"),
                        (B.MoEFp8BackwardMaps, "MoEFp8BackwardMaps")):
        body = text[text.index(f"struct {struct} {{"):]
        body = body[:body.index("};")]
        declared = re.findall(r"^\s+[^/\n]*?(\w+);", body, re.M)
        assert declared == [n for n, _ in cls._fields_], struct
    # The wt fields are DeviceQuantized's *_t names (what the backend will copy over).
    assert [n for n, _ in B.MoEFp8WeightsT._fields_][:6] == [f"{p}_t" for p in
                                                              ("gate", "up", "down", "shared_gate", "shared_up",
                                                               "shared_down")]


def _nvcc():
    try:
        return build.find_nvcc()
    except build.BuildError:
        return None


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (the header's static_asserts need a compiler)")
def test_header_compiles_and_its_static_asserts_hold(tmp_path):
    src = tmp_path / "chk.cu"
    src.write_text('#include "moe/params_fp8_bwd.cuh"\n'
                   "__global__ void k(const __grid_constant__ mok::MoEFp8BackwardTmaParams p) {\n"
                   "  if (p.p.plan8.pad_ == 12345) asm volatile(\"trap;\");\n}\n")
    res = subprocess.run([_nvcc(), "-arch=sm_90a", "-std=c++17", "-I", str(REPO / "cuda_src"), "-c", str(src),
                          "-o", str(tmp_path / "chk.o")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


# ---- the plan -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", PLAN_DIMS)
def test_fp8_backward_plan(d):
    plan = moe_plan.backward_plan(d, precision="fp8_block")
    bf = moe_plan.backward_plan(d)
    assert plan.precision == "fp8_block" and bf.precision == "bf16"
    check_plan_well_formed(plan)
    # The bf16 phases, tile counts, waits and counters are all there, unchanged.
    extra = {"token_prep", "widen"}
    assert {ph.name: ph.count for ph in plan.phases if ph.name not in extra} == {ph.name: ph.count for ph in bf.phases}
    assert {k: v for k, v in plan.tiles.items() if k in bf.tiles} == bf.tiles
    assert set(bf.waits) <= set(plan.waits)
    assert [c.name for c in plan.counters][:len(bf.counters)] == [c.name for c in bf.counters]
    assert [c.name for c in plan.counters][len(bf.counters):] == ["token_dq_ready", "expert_widen_ready", "prep_done"]
    shared = d.shared_intermediate > 0
    tp, wd = plan.phase("token_prep"), plan.phase("widen")
    assert tp.count == (d.token_blocks if shared else 0) and wd.count == d.max_blocks
    assert tp.end <= plan.phase("dispatch").begin
    # The kernel's pipe::AheadOrder (TmaBackwardFp8::make_order) permutes [begin, begin + the four
    # phases' counts) from the dispatch on: they must be contiguous, token_prep before, widen after.
    four = [plan.phase(n) for n in ("dispatch", "d_weights", "shared_da", "routed_da")]
    assert all(a.end == b.begin for a, b in zip(four, four[1:]))
    assert plan.phase("routed_dx").end <= wd.begin and wd.end <= plan.phase("wgrad_down").begin
    # The structs: the bf16-shaped part equals the bf16 plan's except for the shifted phases.
    s, x = plan.struct(), plan.fp8_struct()
    assert s.total == plan.total and s.i_tiles == bf.struct().i_tiles
    for ph in plan.phases:
        r = getattr(x, ph.name) if ph.name in extra else getattr(s, ph.name)
        assert (r.begin, r.count) == (ph.begin, ph.count)
    assert x.token_ld % 4 == 0 and x.token_ld >= d.tokens
    assert x.token_rows == (d.token_blocks * 128 if shared else 0)
    assert x.ip_blocks == -(-d.intermediate // 128) and x.ips_blocks == -(-d.shared_intermediate // 128)
    assert x.wait_token_dq_ready == (1 if shared else 0) and x.wait_expert_widen_ready_per_block == 1
    assert x.wait_prep_done == (d.token_blocks if shared else 0)


def test_no_fp8_backward_plan_with_expert_parallelism():
    with pytest.raises(AssertionError):
        moe_plan.backward_plan(small_dims(), push_tasks=4, precision="fp8_block")
    with pytest.raises(AssertionError):
        moe_plan.backward_plan(small_dims(), precision="mxfp8")
    with pytest.raises(AssertionError):
        moe_plan.backward_plan(small_dims()).fp8_struct()


# ---- buffers ------------------------------------------------------------------------------------------
def test_buffer_table_shapes():
    d = small_dims()                            # T = 300 (3 token blocks), H = 320, I = 192 (Ip = 256), Is = 320
    b = {x.name: x for x in B.FP8_BACKWARD_BUFFERS}
    assert b["gate_t"].shape(d) == (5, 320, 192) and b["down_t"].shape(d) == (5, 192, 320)
    assert b["gate_t_s"].shape(d) == (5, 3, 2) and b["shared_down_t_s"].shape(d) == (3, 3)
    assert b["dq"].shape(d) == (384 + 1280, 320) and b["dq_bf"].nbytes(d) == 2 * (384 + 1280) * 320
    assert b["dguq"].shape(d) == (1280, 512)   # [R, 2 Ip]: up at column 256, a whole K block after gate
    assert b["dsguq"].shape(d) == (300, 2 * 384)
    assert b["rs"].shape(d) == (3 + 4, 1280) and b["ts"].shape(d) == (3 + 6, F.token_ld(d))
    assert b["dyq"].role == "view"
    n = small_dims(Is=0)
    assert b["dq"].shape(n) == (1280, 320) and b["ts"].nbytes(n) == 0 and b["dsguq"].nbytes(n) == 0
    assert B.padded_inter(768) == 768 and B.padded_inter(192) == 256 and B.padded_inter(0) == 0
    # The bf16 struct fields reused as FP8-backward scratch exist there.
    for x in B.FP8_BACKWARD_BUFFERS:
        if x.struct == "ctx":
            assert x.name in {f for f, _ in P.MoEContext._fields_}
        elif x.struct == "":
            assert x.name in {f for f, _ in P.MoEBackwardParams._fields_}
