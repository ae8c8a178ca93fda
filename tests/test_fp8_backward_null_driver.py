"""The "fp8_block" backward of the CUDA backend on the CPU, against the null driver of
bench/null_driver.py (nothing runs; every launch and memset is recorded): one moe_backward_fp8
launch per backward, what its parameter struct holds (the transposed weight copies, the forward's
context, the scratch and its views, the counters, the plan), the shapes of its 17 tensor maps, the
transposed copies quantised inside the call when the weights lack them, the prepared-call cache,
and the arguments still refused (ArgumentError naming the argument) before anything is enqueued.
What the kernel computes is tests/test_fp8_backward_gpu.py's."""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from null_driver import null_driver  # noqa: E402

import mok_rt as mok  # noqa: E402
from mok_rt.kernels import fp8_quantize as Q8  # noqa: E402
from mok_rt.kernels import moe_fp8_bwd as MB  # noqa: E402
from mok_rt.kernels import moe_launch as L  # noqa: E402
from mok_rt.kernels import moe_params_fp8 as F  # noqa: E402
from mok_rt.kernels import moe_params as P  # noqa: E402
from mok_rt.kernels import moe_params_fp8_bwd as B  # noqa: E402

from _fp8_null import BF, E, H, I, Is, K, T, launches  # noqa: E402,F401  (launches: a fixture)
from _fp8_null import Inputs as _Inputs  # noqa: E402


@pytest.fixture
def maps(monkeypatch):
    """Each "encoded" map holds its spec: address, dtype, dims and box (the null driver's are zeros)."""
    from mok_rt.kernels import moe_maps

    def encode(spec):
        dims = b"".join(int(v).to_bytes(8, "little") for v in (*spec.dims, 0, 0, 0, 0)[:5])
        box = b"".join(int(v).to_bytes(4, "little") for v in (*spec.box, 0, 0, 0, 0)[:5])
        return spec.address.to_bytes(8, "little") + spec.dtype.encode().ljust(8, b"\0") + dims + box + bytes(52)
    monkeypatch.setattr(moe_maps, "encode", encode)
    monkeypatch.setattr(moe_maps, "_cache", type(moe_maps._cache)())
    monkeypatch.setattr(MB, "_maps_cache", MB._maps.StructCache())


def map_of(tp, name):
    """(address, dtype, dims, box) of map ``name``; None for a zero (unused) map."""
    raw = bytes(getattr(tp.maps, name))
    if not any(raw):
        return None
    dims = tuple(v for v in (int.from_bytes(raw[16 + 8 * i:24 + 8 * i], "little") for i in range(5)) if v)
    box = tuple(v for v in (int.from_bytes(raw[56 + 4 * i:60 + 4 * i], "little") for i in range(5)) if v)
    return int.from_bytes(raw[:8], "little"), raw[8:16].rstrip(b"\0").decode(), dims, box


def _ws(tokens=T, shared=True, **kw):
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K, shared_intermediate=Is if shared else 0,
                        precision="fp8_block")
    return mok.Workspace(cfg, max_tokens=tokens, **kw)


def _bwd(raw: bytes) -> B.MoEFp8BackwardTmaParams:
    assert len(raw) == ctypes.sizeof(B.MoEFp8BackwardTmaParams) == 3712
    return B.MoEFp8BackwardTmaParams.from_buffer_copy(raw)


def _fwd(raw: bytes) -> F.MoEFp8ForwardTmaParams:
    return F.MoEFp8ForwardTmaParams.from_buffer_copy(raw)


def _names(seen, n0=0):
    return [n for n, _ in seen[n0:]]


def test_one_launch_its_pointers_counters_plan_and_maps(launches, maps):
    with null_driver() as drv, _ws() as ws:
        drv.record_launches = True
        a = _Inputs()
        qw = mok.quantize_weights(ws, a.experts, a.shared)
        sched = mok.schedule(ws, a.ids)
        out, ctx = mok.forward(ws, sched, a.x, a.tw, qw)
        fq = _fwd(launches[-1][1]).p
        n0, m0, z0 = len(launches), len(drv.memsets), len(drv.memsets8)
        g = mok.backward(ws, ctx, a.d_out)
        assert _names(launches, n0) == ["moe_backward_fp8"]   # the transposed copies exist: no quantiser
        tp = _bwd(launches[-1][1])
        q, p = tp.p, tp.p.p
        dims = ctx.saved.dims
        rows = B.token_rows(dims)
        assert rows == 256 and dims.capacity_rows % 128 == 0
        # The transposed weights: quantize_weights(for_backward=True)'s copies and scales.
        for prefix, grp in (("", qw.experts), ("shared_", qw.shared)):
            for part in ("gate", "up", "down"):
                assert getattr(q.wt, f"{prefix}{part}_t") == getattr(grp, f"{part}_t").ptr
                assert getattr(q.wt, f"{prefix}{part}_t_s") == getattr(grp, f"{part}_t_scale").ptr
        # The forward's context, read as it wrote it; the bf16 weights and x null.
        assert [getattr(q.qctx, n) for n, _ in q.qctx._fields_] == [getattr(fq.qctx, n) for n, _ in fq.qctx._fields_]
        assert (p.ctx.gu, p.ctx.y_slot, p.ctx.sgu) == (fq.p.ctx.gu, fq.p.ctx.y_slot, fq.p.ctx.sgu)
        assert all(getattr(p.w, n) == 0 for n, _ in p.w._fields_) and p.x == 0
        # Inputs and results.
        assert (p.d_out, p.topk_weights, p.dx, p.d_topk_weights) == (a.d_out.ptr, a.tw.ptr, g.dx.ptr,
                                                                     g.d_topk_weights.ptr)
        assert (p.grads.dw_gate, p.grads.dw_up, p.grads.dw_down) == tuple(t.ptr for t in g.dw)
        assert (p.grads.d_shared_gate, p.grads.d_shared_up, p.grads.d_shared_down) == tuple(t.ptr for t in g.dw_shared)
        assert g.dx.shape == (T, H) and g.dw.gate.dtype.name == "float32" and p.grad_bf16 == 0 and p.accumulate == 0
        # Scratch: distinct, aligned, not the context's; the views token_rows rows into their arrays.
        scratch = [getattr(q.q, n) for n in ("dq", "dguq", "dsguq", "rs", "ts", "dq_bf", "xq_bf")] + \
                  [p.ctx.act, p.ctx.sact, p.dgu, p.dsgu, p.dx_slot, p.dx_shared]
        assert all(scratch) and len(set(scratch)) == len(scratch) and all(v % 256 == 0 for v in scratch)
        assert not set(scratch) & {fq.p.ctx.gu, fq.p.ctx.y_slot, fq.p.ctx.sgu, *(getattr(q.qctx, n) for n, _ in
                                                                                 q.qctx._fields_)}
        assert q.q.dyq == q.q.dq + rows * H
        assert p.dy_routed == q.q.dq_bf + 2 * rows * H and p.ctx.x_routed == q.q.xq_bf + 2 * rows * H
        # Counters: the plan's layout in one allocation, zeroed by one memset before the launch.
        plan = MB.backward_plan(dims)
        (base, value, words), = drv.memsets[m0:]
        assert value == 0 and words == plan.counter_words
        cnt = {n: getattr(p.cnt, n) for n, _ in p.cnt._fields_}
        cnt.update(token_dq_ready=q.token_dq_ready, expert_widen_ready=q.expert_widen_ready, prep_done=q.prep_done)
        assert cnt == plan.counter_pointers(base)
        # The plan: the bf16-shaped part and the FP8 extras.
        assert p.plan.total == plan.total and p.plan.i_tiles == plan.tiles["i_tiles"]
        x = plan.fp8_struct()
        assert bytes(q.plan8) == bytes(x) and q.plan8.token_rows == rows and q.plan8.ip_blocks == 2
        assert q.plan8.token_prep.count == 2 and q.plan8.widen.count == dims.max_blocks
        assert p.dims.tokens == T and p.peers.num_ranks == 1 and p.err == ws._single()._impl.error.device_ptr
        # The pad rows [T, token_rows) of dq_bf and xq_bf zeroed (the shared wgrads' K runs through them).
        pads = sorted(m for m in drv.memsets8[z0:] if m[0] in (q.q.dq_bf + 2 * T * H, q.q.xq_bf + 2 * T * H))
        assert pads == sorted((ptr + 2 * T * H, 0, 2 * (rows - T) * H) for ptr in (q.q.dq_bf, q.q.xq_bf))
        # The 17 maps: operand, dtype, extents (innermost first) and boxes.
        R, ld = dims.capacity_rows, F.token_ld(dims)
        want = {
            "dq_k": (q.q.dq, "u8", (H, rows + R), (128, 128)),
            "dguq_k": (q.q.dguq, "u8", (2 * 256, R), (128, 128)),
            "dsguq_k": (q.q.dsguq, "u8", (2 * 128, T), (128, 128)),
            "rs_s": (q.q.rs, "f32", (R, 3 + 4), (128, 1)),
            "ts_s": (q.q.ts, "f32", (T, 3 + 2), (128, 1)),
            "down_t_k": (q.wt.down_t, "u8", (H, I, E), (128, 128, 1)),
            "gate_t_k": (q.wt.gate_t, "u8", (I, H, E), (128, 128, 1)),
            "up_t_k": (q.wt.up_t, "u8", (I, H, E), (128, 128, 1)),
            "shared_down_t_k": (q.wt.shared_down_t, "u8", (H, Is, 1), (128, 128, 1)),
            "shared_gate_t_k": (q.wt.shared_gate_t, "u8", (Is, H, 1), (128, 128, 1)),
            "shared_up_t_k": (q.wt.shared_up_t, "u8", (Is, H, 1), (128, 128, 1)),
            "dy_mn": (q.q.dq_bf, "bf16", (H, rows + R, 1), (64, 64, 1)),
            "x_mn": (q.q.xq_bf, "bf16", (H, rows + R, 1), (64, 64, 1)),
            "act_mn": (p.ctx.act, "bf16", (I, R, 1), (64, 64, 1)),
            "sact_mn": (p.ctx.sact, "bf16", (Is, T, 1), (64, 64, 1)),
            "dgu_mn": (p.dgu, "bf16", (2 * I, R, 1), (64, 64, 1)),
            "dsgu_mn": (p.dsgu, "bf16", (2 * Is, T, 1), (64, 64, 1)),
        }
        assert list(want) == list(B.FP8_BACKWARD_MAP_NAMES)
        for name, w in want.items():
            assert map_of(tp, name) == w, name
        assert ld == 256


def test_no_shared_expert_leaves_its_maps_and_pointers_null(launches, maps):
    with null_driver() as drv, _ws(shared=False) as ws:
        drv.record_launches = True
        a = _Inputs(shared=False)
        qw = mok.quantize_weights(ws, a.experts)
        _, ctx = mok.forward(ws, mok.schedule(ws, a.ids), a.x, a.tw, qw)
        z0 = len(drv.memsets8)
        g = mok.backward(ws, ctx, a.d_out)
        tp = _bwd(launches[-1][1])
        q, p = tp.p, tp.p.p
        assert g.dw_shared is None and q.plan8.token_rows == 0 and q.plan8.token_prep.count == 0
        assert q.q.dsguq == q.q.ts == 0 and p.dsgu == p.ctx.sact == p.dx_shared == 0
        assert all(getattr(q.wt, f"shared_{n}") == 0 for n in ("gate_t", "up_t", "down_t", "gate_t_s"))
        assert q.q.dyq == q.q.dq and p.dy_routed == q.q.dq_bf and p.ctx.x_routed == q.q.xq_bf
        for name in ("dsguq_k", "ts_s", "shared_down_t_k", "shared_gate_t_k", "shared_up_t_k", "sact_mn", "dsgu_mn"):
            assert map_of(tp, name) is None, name
        assert map_of(tp, "dq_k")[2] == (H, ctx.saved.dims.capacity_rows)
        assert not [m for m in drv.memsets8[z0:] if m[0] in (q.q.dq_bf, q.q.xq_bf)]   # no pad rows


@pytest.mark.parametrize("how", ["master_weights", "for_backward_false"])
def test_missing_transposed_copies_are_quantised_first(launches, how):
    with null_driver(), _ws() as ws:
        a = _Inputs()
        sched = mok.schedule(ws, a.ids)
        if how == "master_weights":
            _, ctx = mok.forward(ws, sched, a.x, a.tw, a.experts, shared=a.shared)
        else:
            qw = mok.quantize_weights(ws, a.experts, a.shared, for_backward=False)
            _, ctx = mok.forward(ws, sched, a.x, a.tw, qw)
        n0 = len(launches)
        mok.backward(ws, ctx, a.d_out)
        assert _names(launches, n0) == ["fp8_quantize_weights", "moe_backward_fp8"]
        jobs = Q8.Params.from_buffer_copy(launches[n0][1])
        q = _bwd(launches[-1][1]).p
        srcs = [*a.experts, *a.shared]
        assert jobs.num_jobs == 6
        for j, (src, name) in enumerate(zip(srcs, ("gate", "up", "down", "shared_gate", "shared_up", "shared_down"))):
            job = jobs.jobs[j]
            shape = src.shape if len(src.shape) == 3 else (1, *src.shape)
            # The transposed copy alone (q = s = 0), from the master weight, into what the backward reads.
            assert (job.w, job.q, job.s) == (src.ptr, 0, 0) and (job.groups, job.r, job.c) == shape
            assert (job.qt, job.st) == (getattr(q.wt, f"{name}_t"), getattr(q.wt, f"{name}_t_s"))
            assert job.qt % 256 == 0 and job.st % 256 == 0 and job.qt and job.st
        # Repeated: the copies' block comes back (same stream, same size), so the prepared launch hits.
        calls = ws._single()._impl._calls
        hits = calls.hits
        mok.backward(ws, ctx, a.d_out)
        assert calls.hits == hits + 1 and launches[-1] == launches[n0 + 1]


def test_recompute_context_then_backward_reads_the_recomputed_context(launches):
    with null_driver(), _ws() as ws:
        a = _Inputs()
        qw = mok.quantize_weights(ws, a.experts, a.shared)
        sched = mok.schedule(ws, a.ids)
        _, ctx = mok.forward(ws, sched, a.x, a.tw, qw)
        rctx = mok.recompute_context(ws, sched, a.x, a.tw, qw)
        r = _fwd(launches[-1][1]).p
        n0 = len(launches)
        mok.backward(ws, rctx, a.d_out)
        assert _names(launches, n0) == ["moe_backward_fp8"]
        q = _bwd(launches[-1][1]).p
        assert [getattr(q.qctx, n) for n, _ in q.qctx._fields_] == [getattr(r.qctx, n) for n, _ in r.qctx._fields_]
        assert (q.p.ctx.gu, q.p.ctx.y_slot, q.p.ctx.sgu) == (r.p.ctx.gu, r.p.ctx.y_slot, r.p.ctx.sgu)
        mok.backward(ws, ctx, a.d_out)   # the first context is still good
        assert _bwd(launches[-1][1]).p.p.ctx.gu != q.p.ctx.gu


def test_caller_buffers_accumulate_bf16_and_zero_tokens(launches):
    with null_driver(), _ws(tokens=T) as ws:
        a = _Inputs()
        qw = mok.quantize_weights(ws, a.experts, a.shared)
        sched = mok.schedule(ws, a.ids)
        _, ctx = mok.forward(ws, sched, a.x, a.tw, qw)
        dw = mok.ExpertWeights(*(a.new(s, BF) for s in ((E, I, H), (E, I, H), (E, H, I))))
        dws = mok.ExpertWeights(*(a.new(s, BF) for s in ((Is, H), (Is, H), (H, Is))))
        g = mok.backward(ws, ctx, a.d_out, dw=dw, dw_shared=dws, accumulate=True)
        p = _bwd(launches[-1][1]).p.p
        assert (p.accumulate, p.grad_bf16) == (1, 1) and g.dw is dw and p.grads.dw_up == dw.up.ptr
        assert p.grads.d_shared_down == dws.down.ptr
        # T = 0: still one launch (the weight gradients are written: zeros), no token-order rows.
        z = _Inputs(tokens=0, base=1 << 45)
        _, ctx0 = mok.forward(ws, mok.schedule(ws, z.ids), z.x, z.tw, qw)
        n0 = len(launches)
        g0 = mok.backward(ws, ctx0, z.d_out)
        assert _names(launches, n0) == ["moe_backward_fp8"] and g0.dx.shape == (0, H)
        q0 = _bwd(launches[-1][1]).p
        assert q0.plan8.token_rows == 0 and q0.p.dims.tokens == 0 and q0.q.ts == q0.q.dsguq == 0


def test_repeats_hit_the_prepared_call_and_captures_take_the_arena(launches):
    with null_driver() as drv, _ws() as ws:
        a = _Inputs()
        qw = mok.quantize_weights(ws, a.experts, a.shared)
        _, ctx = mok.forward(ws, mok.schedule(ws, a.ids), a.x, a.tw, qw)
        impl = ws._single()._impl
        g = mok.backward(ws, ctx, a.d_out)
        first, dx = launches[-1], g.dx.ptr
        del g                                   # its block comes back to the next backward
        hits, misses = impl._calls.hits, impl._calls.misses
        g = mok.backward(ws, ctx, a.d_out)
        assert (impl._calls.hits, impl._calls.misses) == (hits + 1, misses) and g.dx.ptr == dx
        assert launches[-1] == first            # the same launch, bit for bit
        # Captured: the results and the scratch from the graph arena, nothing cached.
        drv.capturing = True
        n, arena = len(impl._calls), ws.memory_bytes()["graph_arena"]
        gc = mok.backward(ws, ctx, a.d_out)
        drv.capturing = False
        q = _bwd(launches[-1][1]).p
        assert len(impl._calls) == n and ws.memory_bytes()["graph_arena"] > arena
        assert gc.dx.ptr != dx and q.q.dq != _bwd(first[1]).p.q.dq and gc.dx._producer_stream is None


def test_bad_input_still_raises_and_launches_nothing(launches):
    with null_driver(), _ws() as ws:
        a = _Inputs()
        qw = mok.quantize_weights(ws, a.experts, a.shared)
        _, ctx = mok.forward(ws, mok.schedule(ws, a.ids), a.x, a.tw, qw)
        mok.backward(ws, ctx, a.d_out)
        mok.backward(ws, ctx, a.d_out)   # a prepared-call hit first: checks still run after it
        n = len(launches)
        shapes = ((E, I, H), (E, I, H), (E, H, I))
        cases = [
            ("d_out", lambda: mok.backward(ws, ctx, a.new((T, H), BF, offset=8))),          # misaligned
            ("d_out", lambda: mok.backward(ws, ctx, a.new((T + 1, H), BF))),                # shape
            ("d_out", lambda: mok.backward(ws, ctx, a.new((T, H), np.float32))),            # dtype
            ("ctx", lambda: mok.backward(ws, object(), a.d_out)),
            ("dw", lambda: mok.backward(ws, ctx, a.d_out, accumulate=True)),                # nothing to add into
            ("dw.gate", lambda: mok.backward(ws, ctx, a.d_out, dw=mok.ExpertWeights(
                *(a.new(s, np.float32) for s in ((E, I, H + 64), shapes[1], shapes[2]))))),
            ("dw.up", lambda: mok.backward(ws, ctx, a.d_out, dw=mok.ExpertWeights(
                a.new(shapes[0], np.float32), a.new(shapes[1], BF), a.new(shapes[2], np.float32)))),
        ]
        for arg, call in cases:
            with pytest.raises(mok.ArgumentError) as ei:
                call()
            assert ei.value.argument == arg, (arg, ei.value)
        assert len(launches) == n


def test_launch_checks_name_the_buffer():
    d = L.LayerDims(tokens=T, hidden=H, intermediate=I, top_k=K, local_experts=E, capacity_rows=1024,
                    shared_intermediate=Is)
    ptrs, at = {}, 1 << 40
    for b in MB.FP8_BACKWARD_TABLE:
        ptrs[b.name] = at
        at += 1 << 30
    sched = L.ScheduleBuffers(**{n: 1 << 32 for n in L.ScheduleBuffers.__dataclass_fields__})
    kw = dict(stream=0, err_ptr=1 << 33)
    good = MB.Fp8BackwardBuffers(**ptrs)
    for name, value in (("dq", 0), ("gate_t", 0), ("aq_s", 0), ("dx_slot", ptrs["dx_slot"] + 8)):
        with pytest.raises(mok.ArgumentError) as ei:
            MB.prepare_backward_fp8(MB.Fp8BackwardBuffers(**{**ptrs, name: value}), sched, d, **kw)
        assert ei.value.argument == name
    with pytest.raises(mok.ArgumentError) as ei:
        MB.prepare_backward_fp8(L.BackwardBuffers(), sched, d, **kw)
    assert ei.value.argument == "bufs"
    with pytest.raises(mok.ArgumentError) as ei:
        MB.prepare_backward_fp8(good, sched, d, stream=0, err_ptr=0)
    assert ei.value.argument == "err_ptr"
    with pytest.raises(mok.ArgumentError) as ei:
        MB.prepare_backward_fp8(good, sched, d, plan=L.backward_plan(d), **kw)
    assert ei.value.argument == "plan"
    # Sizes: what the backend allocates is the table's, the counters the plan's.
    sizes = MB.backward_buffer_bytes(d)
    assert sizes["counters"] == 4 * MB.backward_plan(d).counter_words
    assert sizes["dguq"] == 1024 * 2 * 256 and sizes["dq"] == (256 + 1024) * H and "gu" not in sizes
    assert "dyq" not in sizes and "gate_t" not in sizes


def test_every_pointer_of_the_struct_has_a_source():
    """Each pointer field of MoEFp8BackwardParams comes from the launch's table, is a view, a
    counter of the plan, the error word / trace, or is null by design (the bf16 weights, x)."""
    table = {b.name for b in MB.FP8_BACKWARD_TABLE}
    views, nulls = {"dyq", "dy_routed", "x_routed"}, {"x"} | {n for n, _ in P.MoEWeights._fields_}
    counters = {c.name for c in MB.backward_plan(L.LayerDims(
        tokens=T, hidden=H, intermediate=I, top_k=K, local_experts=E, capacity_rows=1024,
        shared_intermediate=Is)).counters}
    sched = {n for n, _ in P.MoESchedule._fields_}
    fields = set()
    for struct in (P.MoEContext, P.MoEWeightGrads, B.MoEFp8WeightsT, F.MoEFp8Context, B.MoEFp8BackwardScratch):
        fields |= {n for n, _ in struct._fields_}
    fields |= {n for n, t in P.MoEBackwardParams._fields_ if t is ctypes.c_uint64} - {"err", "trace"}
    fields |= {n for n, t in B.MoEFp8BackwardParams._fields_ if t is ctypes.c_uint64}
    assert fields - table - views - nulls - counters - sched == set()
    assert table - fields == {"counters"}       # and nothing in the table is left unused
    assert counters >= {n for n, _ in P.MoEBackwardCounters._fields_} | {"token_dq_ready", "expert_widen_ready",
                                                                          "prep_done"}
