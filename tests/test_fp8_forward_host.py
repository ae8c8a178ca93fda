"""Host side of the "fp8_block" forward on the CUDA backend, without a GPU: the FP8 task plan, the
parameter structs against the header's static_asserts, the buffer table, the tensor maps, the weight
quantiser's job layout, the launch parameters and the validation (docs/FP8_DESIGN.md)."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from _plan_checks import PLAN_DIMS, check_plan_well_formed, small_dims

import mok_rt as mok
from mok_rt.api.validate import check_backend_precision, check_quantized
from mok_rt.kernels import fp8_quantize as Q8
from mok_rt.kernels import moe_fp8 as M8
from mok_rt.kernels import moe_launch as L
from mok_rt.kernels import moe_params as P
from mok_rt.kernels import moe_params_fp8 as F
from mok_rt.runtime.tensormap import Swizzle
from mok_rt.types import QuantizedWeights

REPO = Path(__file__).resolve().parents[1]


# ---- the plan ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", PLAN_DIMS)
@pytest.mark.parametrize("ctx", (False, True))
def test_fp8_plan_phases_waits_and_counters(d, ctx):
    plan = M8.forward_plan(d, context_only=ctx)
    assert plan.precision == "fp8_block"
    check_plan_well_formed(plan)
    # quant_x comes before the range pipe::AheadOrder permutes (dispatch, shared_gu, routed_gu), so
    # it is grabbed before every shared gate|up tile that waits on it.
    qx, disp, sgu = plan.phase("quant_x"), plan.phase("dispatch"), plan.phase("shared_gu")
    assert qx.end <= disp.begin and disp.end == sgu.begin
    assert qx.count == (d.token_blocks if d.shared_intermediate else 0)
    assert plan.tiles["h_tiles"] == -(-d.hidden // 256)              # 128 x 256 FP8 tiles (two sub-tiles)
    assert plan.tiles["gu_tiles"] == -(-d.intermediate // 128)       # one 128-column I block per task
    assert plan.tiles["token_ld"] % 4 == 0 and plan.tiles["token_ld"] >= d.tokens
    names = [c.name for c in plan.counters]
    assert names == [n for n, _ in P.MoEForwardCounters._fields_] + ["token_xq_ready"]
    s, x = plan.struct(), plan.fp8_struct()
    assert s.total == plan.total and s.h_tiles == plan.tiles["h_tiles"]
    for ph in plan.phases:
        r = x.quant_x if ph.name == "quant_x" else getattr(s, ph.name)
        assert (r.begin, r.count) == (ph.begin, ph.count)
    assert x.token_ld == plan.tiles["token_ld"] and x.wait_token_xq_ready == (1 if d.shared_intermediate else 0)


def test_bf16_plan_is_unchanged_by_the_precision_argument():
    d = small_dims()
    a, b = L.forward_plan(d), L.forward_plan(d)
    assert a is b and a.precision == "bf16" and "quant_x" not in {ph.name for ph in a.phases}
    assert a.tiles["h_tiles"] == -(-d.hidden // 256)
    with pytest.raises(AssertionError):
        a.fp8_struct()
    with pytest.raises(AssertionError):   # FP8 with EP: one push task per token block (tests/test_fp8_ep_host.py)
        from mok_rt.kernels import moe_plan
        moe_plan.forward_plan(d, push_tasks=4, precision="fp8_block")


# ---- structs: one source of truth with cuda_src/moe/params_fp8.cuh --------------------------------------
def _header_asserts(path: Path) -> dict:
    text = path.read_text()
    sizes = {m.group(1): int(m.group(2)) for m in re.finditer(r"sizeof\((\w+)\) == (\d+)\b(?! \*)", text)}
    offsets = {(m.group(1), m.group(2)): int(m.group(3)) for m in re.finditer(r"offsetof\((\w+), (\w+)\) == (\d+)", text)}
    return {"sizes": sizes, "offsets": offsets}


def test_struct_layouts_match_the_header():
    h = _header_asserts(REPO / "cuda_src/moe/params_fp8.cuh")
    classes = {c.__name__: c for c in F.LAYOUT}
    for name, size in h["sizes"].items():
        if name in classes:
            assert ctypes.sizeof(classes[name]) == size, name
    for (name, field), at in h["offsets"].items():
        assert getattr(classes[name], field).offset == at, (name, field)
    assert {"MoEFp8ForwardParams", "MoEFp8ForwardTmaParams", "MoEFp8Plan"} <= set(h["sizes"])
    # The FP8 struct starts with the bf16 one, unchanged.
    assert F.MoEFp8ForwardParams.p.offset == 0 and F.MoEFp8ForwardParams.p.size == ctypes.sizeof(P.MoEForwardParams)
    assert ctypes.sizeof(F.MoEFp8ForwardTmaParams) <= 4096
    assert [n for n, _ in F.MoEFp8ForwardMaps._fields_] == list(F.FP8_FORWARD_MAP_NAMES)
    assert [n for n, _ in F.MoEFp8StagedMaps._fields_] == list(F.FP8_STAGED_MAP_NAMES)
    # The staged kernel's maps come after the direct kernel's parameters, which keep their offsets.
    assert F.MoEFp8ForwardTmaParams.staged.offset == F.MoEFp8ForwardTmaParams.p.offset + ctypes.sizeof(F.MoEFp8ForwardParams)


def test_quantizer_params_match_the_kernel():
    text = (REPO / "cuda_src/fp8/quantize_weights.cu").read_text()
    assert f"kMaxJobs = {Q8.MAX_JOBS};" in text and f"kThreads = {Q8.THREADS};" in text
    assert f"sizeof(Job) == {Q8.JOB_BYTES}" in text and ctypes.sizeof(Q8.QuantJob) == Q8.JOB_BYTES == 56
    assert f"sizeof(Params) == kMaxJobs * {Q8.JOB_BYTES} + 8" in text
    assert ctypes.sizeof(Q8.Params) == Q8.MAX_JOBS * Q8.JOB_BYTES + 8
    # The kernel's Job fields, in order (the pointers first, then the ints).
    fields = [n for n, _ in Q8.QuantJob._fields_]
    assert fields == ["w", "q", "s", "qt", "st", "groups", "r", "c", "first_block"]
    body = text[text.index("struct Job {"):text.index("};", text.index("struct Job {"))]
    assert [body.index(f" {n}") for n in ("w;", "q;", "s;", "qt;", "st;")] == sorted(
        body.index(f" {n}") for n in ("w;", "q;", "s;", "qt;", "st;"))


def test_quantizer_params_with_and_without_transposed_copies():
    p, total = Q8.fill_params([(0x1000, (2, 192, 320), 0x2000, 0x3000, 0x4000, 0x5000),
                               (0x6000, (1, 320, 192), 0x7000, 0x8000),
                               (0x9000, (1, 64, 64), 0xA000, 0xB000, 0, 0)])
    assert p.num_jobs == 3 and total == 2 * 2 * 3 + 3 * 2 + 1
    j0, j1, j2 = p.jobs[0], p.jobs[1], p.jobs[2]
    assert (j0.w, j0.q, j0.s, j0.qt, j0.st) == (0x1000, 0x2000, 0x3000, 0x4000, 0x5000)
    assert (j0.groups, j0.r, j0.c, j0.first_block) == (2, 192, 320, 0)
    assert (j1.qt, j1.st, j1.first_block) == (0, 0, 12) and (j2.qt, j2.st, j2.first_block) == (0, 0, 18)
    with pytest.raises(mok.ArgumentError):
        Q8.fill_params([(0x1000, (1, 128, 128), 0x2000, 0x3000, 0x4000, 0)])   # values without scales
    with pytest.raises(mok.ArgumentError):
        Q8.fill_params([(0x1000, (1, 128, 128), 0, 0, 0, 0)])                  # writes nothing
    p, _ = Q8.fill_params([(0x1000, (1, 128, 128), 0, 0, 0x4000, 0x5000)])    # transposed copy only
    assert (p.jobs[0].q, p.jobs[0].s, p.jobs[0].qt, p.jobs[0].st) == (0, 0, 0x4000, 0x5000)
    assert Q8.transposed_shape((5, 192, 320)) == (5, 320, 192) and Q8.transposed_shape((64, 128)) == (128, 64)
    assert Q8.scale_shape(Q8.transposed_shape((5, 192, 320))) == (5, 3, 2)


# ---- buffers and maps --------------------------------------------------------------------------------
def test_buffer_table_sizes():
    d = small_dims()
    b = {x.name: x for x in F.FP8_FORWARD_BUFFERS}
    assert b["gate"].nbytes(d) == 5 * 192 * 320 and b["gate_s"].shape(d) == (5, 2, 3)
    assert b["down_s"].shape(d) == (5, 3, 2) and b["shared_down_s"].shape(d) == (3, 3)
    assert b["xrq"].nbytes(d) == 1280 * 320 and b["xrq_s"].shape(d) == (3, 1280)
    assert b["aq_s"].shape(d) == (2, 1280) and b["xq_s"].shape(d) == (3, 384) and b["saq_s"].shape(d) == (3, 384)
    sizes = M8.forward_buffer_bytes(d)
    assert set(sizes) == {x.name for x in F.FP8_FORWARD_BUFFERS if x.role in ("context", "output", "scratch", "counters")}
    assert sizes["counters"] == 4 * M8.forward_plan(d).counter_words
    n = M8.forward_buffer_bytes(small_dims(Is=0))
    assert n["xq"] == n["xq_s"] == n["saq"] == n["sgu"] == n["shared_y"] == 0
    z = M8.forward_buffer_bytes(small_dims(T=0))
    assert z["xq"] == z["y_slot"] == z["out"] == 0


def _bufs(shared=True):
    v = iter(range(1 << 20, 1 << 34, 1 << 20))
    b = {n: next(v) for n in M8.Fp8ForwardBuffers.__dataclass_fields__}
    if not shared:
        b.update({n: 0 for n in ("shared_gate", "shared_up", "shared_down", "shared_gate_s", "shared_up_s",
                                 "shared_down_s", "sgu", "xq", "xq_s", "saq", "saq_s", "shared_y")})
    return M8.Fp8ForwardBuffers(**b)


def test_map_specs():
    d = small_dims()
    b = _bufs()
    s = M8.map_specs(b, d)
    assert tuple(s) == F.FP8_FORWARD_MAP_NAMES
    assert s["xrq_k"].dims == (320, 1280) and s["xrq_k"].box == (128, 128) and s["xrq_k"].dtype == "u8"
    assert s["xrq_k"].swizzle == Swizzle.B128 and s["xrq_k"].box_bytes == 128 * 128
    assert s["xq_k"].dims == (320, 300)
    assert s["xq_s"].dims == (300, 3) and s["xq_s"].strides == (384 * 4,) and s["xq_s"].box == (128, 1)
    assert s["xq_s"].dtype == "f32" and s["xq_s"].swizzle == Swizzle.NONE and s["xq_s"].box_bytes == 512
    assert s["aq_s"].dims == (1280, 2) and s["aq_s"].strides == (1280 * 4,)
    assert s["gate_k"].dims == (320, 192, 5) and s["gate_k"].box == (128, 64, 1)
    assert s["down_k"].dims == (192, 320, 5) and s["down_k"].box == (128, 128, 1) and s["down_k"].strides == (192, 320 * 192)
    assert s["shared_down_k"].dims == (320, 320, 1)
    # A stage credits A + B of two sub-tiles + scales: 16 KB + 2 x 16 KB (per sub-tile one box or two
    # halves) + 512 B (gemm_fp8.cuh load_stage): the 48 KB ring slot, the scales in a side ring.
    assert s["xrq_k"].box_bytes + 4 * s["gate_k"].box_bytes + s["xrq_s"].box_bytes == 49152 + 512
    assert s["aq_k"].box_bytes + 2 * s["down_k"].box_bytes + s["aq_s"].box_bytes == 49152 + 512
    n = M8.map_specs(_bufs(shared=False), small_dims(Is=0))
    assert all(n[k] is None for k in ("xq_k", "saq_k", "xq_s", "saq_s", "shared_gate_k", "shared_up_k", "shared_down_k"))


def test_staged_map_specs_and_choice(monkeypatch):
    d = small_dims()
    st = M8.staged_map_specs(_bufs(), d)
    assert tuple(st) == F.FP8_STAGED_MAP_NAMES
    # gu [R, 2 I] bf16 in 64 x 128 boxes (128 B rows: one swizzle atom wide).
    assert st["gu_st"].dims == (2 * 192, 1280) and st["gu_st"].strides == (4 * 192,) and st["gu_st"].box == (64, 128)
    assert st["gu_st"].dtype == "bf16" and st["gu_st"].swizzle == Swizzle.B128
    assert st["sgu_st"].dims == (2 * 320, 300)
    assert M8.staged_map_specs(_bufs(shared=False), small_dims(Is=0))["sgu_st"] is None
    # The choice reads STAGED_MIN_K_BLOCKS at each call: H = 320 is 3 K blocks.
    assert not M8.staged(d)
    monkeypatch.setattr(M8, "STAGED_MIN_K_BLOCKS", 3)
    assert M8.staged(d)


def test_launch_params():
    d = small_dims()
    b = _bufs()
    plan = M8.forward_plan(d)
    sched = L.ScheduleBuffers(**{n: 4096 * (i + 1) for i, n in enumerate(L.ScheduleBuffers.__dataclass_fields__)})
    q = M8._params(b, sched, plan, d, L.KernelKnobs(), err_ptr=64, trace_ptr=0, context_only=False)
    assert all(getattr(q.p.w, n) == 0 for n, _ in P.MoEWeights._fields_)
    assert q.p.ctx.x_routed == q.p.ctx.act == q.p.ctx.sact == 0
    assert q.p.ctx.gu == b.gu and q.p.ctx.y_slot == b.y_slot and q.p.ctx.sgu == b.sgu
    assert q.wq.gate == b.gate and q.wq.shared_down_s == b.shared_down_s and q.qctx.aq_s == b.aq_s
    ptrs = plan.counter_pointers(b.counters)
    assert q.token_xq_ready == ptrs["token_xq_ready"] and q.p.cnt.block_ready == ptrs["block_ready"]
    assert q.plan8.quant_x.count == d.token_blocks and q.plan8.token_ld == 384
    assert q.p.plan.h_tiles == 2 and q.p.peers.num_ranks == 1 and q.p.err == 64
    with pytest.raises(mok.ArgumentError):
        M8.launch_forward_fp8(L.ForwardBuffers(), sched, d, stream=0, err_ptr=64)


# ---- the weight quantiser -------------------------------------------------------------------------------
def test_quantizer_jobs():
    jobs, total = Q8.plan_jobs([(8, 192, 320), (8, 192, 320), (8, 320, 192), (1, 128, 320)])
    assert jobs == [(8, 192, 320, 0), (8, 192, 320, 48), (8, 320, 192, 96), (1, 128, 320, 144)]
    assert total == 147
    assert Q8.scale_shape((8, 192, 320)) == (8, 2, 3) and Q8.scale_shape((320, 64)) == (3, 1)
    assert Q8.as_shape3((320, 64)) == (1, 320, 64)
    with pytest.raises(mok.ArgumentError):
        Q8.plan_jobs([(1, 64, 64)] * 7)
    with pytest.raises(mok.ArgumentError):
        Q8.plan_jobs([(1, 66, 64)])


# ---- validation ------------------------------------------------------------------------------------------
def _cfg(**kw):
    return mok.MoEConfig(hidden=256, intermediate=128, num_experts=8, top_k=2, precision="fp8_block", **kw)


def test_backend_precision_rules():
    check_backend_precision("cuda", "fp8_block")
    check_backend_precision("cuda", "bf16", 4)
    check_backend_precision("reference", "mxfp8")
    check_backend_precision("cuda", "fp8_block", 2)   # the forward with EP (the backward refuses: below)
    for args in (("cuda", "mxfp8"), ("cuda", "mxfp8", 2)):
        with pytest.raises(mok.ArgumentError) as ei:
            check_backend_precision(*args)
        assert ei.value.argument == "precision"


def test_quantized_weights_must_come_from_the_backend_that_runs_them():
    import numpy as np
    from mok_rt.reference.quantize import quantize_experts
    cfg = _cfg()
    shapes = (((8, 128, 256), (8, 128, 256), (8, 256, 128)), None)
    ref_q = quantize_experts(np.zeros((8, 128, 256)), np.zeros((8, 128, 256)), np.zeros((8, 256, 128)), "fp8_block")
    dev_q = Q8.DeviceQuantized(*([None] * 6), device_id=1)
    cuda_rank = SimpleNamespace(config=cfg, experts_per_rank=8, backend="cuda", device_id=0)
    ref_rank = SimpleNamespace(config=cfg, experts_per_rank=8, backend="reference", device_id=0)
    for rank, qw, words in ((cuda_rank, QuantizedWeights("fp8_block", shapes, ref_q), "made by another backend"),
                            (cuda_rank, QuantizedWeights("fp8_block", shapes, dev_q), "quantised on device 1"),
                            (ref_rank, QuantizedWeights("fp8_block", shapes, dev_q), "made by the CUDA backend")):
        with pytest.raises(mok.ArgumentError) as ei:
            check_quantized(rank, qw, None)
        assert ei.value.argument == "experts" and words in str(ei.value)
    check_quantized(ref_rank, QuantizedWeights("fp8_block", shapes, ref_q), None)
    check_quantized(cuda_rank, QuantizedWeights("fp8_block", shapes, Q8.DeviceQuantized(*([None] * 6), device_id=0)),
                    None)
