"""The "fp8_block" calls of the CUDA backend on the CPU, against the null driver of
bench/null_driver.py (nothing runs; every launch is recorded): which kernels are enqueued, and
what their parameter structs hold -- the quantiser's jobs, the FP8 forward's weights, context,
counters and plan -- for quantize_weights, forward (on QuantizedWeights and on bf16 weights) and
recompute_context (the backward: tests/test_fp8_backward_null_driver.py)."""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from null_driver import null_driver  # noqa: E402

import mok_rt as mok  # noqa: E402
from mok_rt.kernels import fp8_quantize as Q8  # noqa: E402
from mok_rt.kernels import moe_params_fp8 as F  # noqa: E402

from _fp8_null import E, H, I, Is, K, T, launches  # noqa: E402,F401  (launches: a fixture)
from _fp8_null import Inputs as _Inputs  # noqa: E402


def _ws(tokens=T):
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K, shared_intermediate=Is,
                        precision="fp8_block")
    return mok.Workspace(cfg, max_tokens=tokens)


def _fwd_params(raw: bytes) -> F.MoEFp8ForwardTmaParams:
    assert len(raw) == ctypes.sizeof(F.MoEFp8ForwardTmaParams)
    return F.MoEFp8ForwardTmaParams.from_buffer_copy(raw)


def test_quantize_weights_one_launch_of_six_jobs(launches):
    with null_driver(), _ws() as ws:
        a = _Inputs()
        qw = mok.quantize_weights(ws, a.experts, a.shared)
        assert [n for n, _ in launches] == ["fp8_quantize_weights"]
        p = Q8.Params.from_buffer_copy(launches[0][1])
        assert p.num_jobs == 6
        srcs = [*a.experts, *a.shared]
        dsts = [(g, getattr(qw.experts if i < 3 else qw.shared, part), getattr(qw.experts if i < 3 else qw.shared,
                                                                                part + "_scale"))
                for i, (g, part) in enumerate(zip(srcs, ("gate", "up", "down") * 2))]
        first = 0
        for j, (src, q, s) in enumerate(dsts):
            job = p.jobs[j]
            g = qw.experts if j < 3 else qw.shared
            part = ("gate", "up", "down")[j % 3]
            qt, st = getattr(g, part + "_t"), getattr(g, part + "_t_scale")   # for_backward (the default)
            shape = src.shape if len(src.shape) == 3 else (1, *src.shape)
            assert (job.w, job.q, job.s, job.qt, job.st) == (src.ptr, q.ptr, s.ptr, qt.ptr, st.ptr)
            assert (job.groups, job.r, job.c, job.first_block) == (*shape, first)
            assert tuple(q.shape) == tuple(src.shape) and q.dtype.name == "float8_e4m3fn"
            assert tuple(s.shape) == Q8.scale_shape(src.shape) and q.ptr % 256 == 0 and s.ptr % 256 == 0
            assert tuple(qt.shape) == Q8.transposed_shape(src.shape) and qt.dtype.name == "float8_e4m3fn"
            assert tuple(st.shape) == Q8.scale_shape(qt.shape) and qt.ptr % 256 == 0 and st.ptr % 256 == 0
            first += shape[0] * -(-shape[1] // 128) * -(-shape[2] // 128)
        assert qw.precision == "fp8_block" and qw.shapes[1] == ((Is, H), (Is, H), (H, Is))
        assert qw.experts.for_backward and qw.shared.for_backward


def test_quantize_weights_for_the_forward_only(launches):
    with null_driver(), _ws() as ws:
        a = _Inputs()
        qw = mok.quantize_weights(ws, a.experts, a.shared, for_backward=False)
        p = Q8.Params.from_buffer_copy(launches[-1][1])
        assert p.num_jobs == 6 and all(p.jobs[j].qt == p.jobs[j].st == 0 for j in range(6))
        assert not qw.experts.for_backward and qw.experts.down_t is None and qw.shared.gate_t_scale is None
        assert all(p.jobs[j].q != 0 for j in range(6))


def test_forward_and_recompute(launches, monkeypatch):
    # Each "encoded" map holds its spec's address and dtype (the null driver's maps are zeros).
    from mok_rt.kernels import moe_fp8, moe_maps
    monkeypatch.setattr(moe_maps, "encode", lambda spec: spec.address.to_bytes(8, "little") +
                        spec.dtype.encode().ljust(8, b"\0") + bytes(112))
    monkeypatch.setattr(moe_maps, "_cache", type(moe_maps._cache)())
    monkeypatch.setattr(moe_fp8, "_maps_cache", moe_fp8._maps.StructCache())
    with null_driver(), _ws() as ws:
        a = _Inputs()
        qw = mok.quantize_weights(ws, a.experts, a.shared)
        sched = mok.schedule(ws, a.ids)
        n0 = len(launches)
        out, ctx = mok.forward(ws, sched, a.x, a.tw, qw)
        assert [n for n, _ in launches[n0:]] == ["moe_forward_fp8"]
        tp = _fwd_params(launches[-1][1])
        q, p = tp.p, tp.p.p
        assert (p.x, p.topk_weights, p.out) == (a.x.ptr, a.tw.ptr, out.ptr) and out.shape == (T, H)
        assert all(getattr(p.w, n) == 0 for n, _ in p.w._fields_)          # bf16 weights unused
        assert p.ctx.x_routed == p.ctx.act == p.ctx.sact == 0
        assert (q.wq.gate, q.wq.down_s, q.wq.shared_up) == (qw.experts.gate.ptr, qw.experts.down_scale.ptr,
                                                           qw.shared.up.ptr)
        ctx_ptrs = [getattr(q.qctx, n) for n, _ in q.qctx._fields_] + [p.ctx.gu, p.ctx.y_slot, p.ctx.sgu]
        assert all(ctx_ptrs) and len(set(ctx_ptrs)) == len(ctx_ptrs) and all(v % 256 == 0 for v in ctx_ptrs)
        assert q.plan8.quant_x.count == -(-T // 128) and q.plan8.token_ld == 256 and p.plan.h_tiles == 2
        assert q.token_xq_ready and q.token_xq_ready not in (p.cnt.block_ready, p.cnt.task_next)
        assert p.context_only == 0 and p.peers.num_ranks == 1
        def map_of(name):
            raw = bytes(getattr(tp.maps, name))
            return int.from_bytes(raw[:8], "little"), raw[8:16].rstrip(b"\0").decode()
        assert map_of("xq_k") == (q.qctx.xq, "u8") and map_of("xrq_s") == (q.qctx.xrq_s, "f32")
        assert map_of("aq_k") == (q.qctx.aq, "u8") and map_of("saq_s") == (q.qctx.saq_s, "f32")
        assert map_of("gate_k") == (q.wq.gate, "u8") and map_of("shared_down_k") == (q.wq.shared_down, "u8")
        # bf16 master weights: quantised inside the call (one more launch), then the same forward.
        n0 = len(launches)
        mok.forward(ws, sched, a.x, a.tw, a.experts, shared=a.shared)
        assert [n for n, _ in launches[n0:]] == ["fp8_quantize_weights", "moe_forward_fp8"]
        qp = Q8.Params.from_buffer_copy(launches[n0][1])   # the forward's own: no transposed copies
        assert qp.num_jobs == 6 and all(qp.jobs[j].qt == 0 for j in range(6))
        # recompute_context: context only, no out.
        n0 = len(launches)
        mok.recompute_context(ws, sched, a.x, a.tw, qw)
        r = _fwd_params(launches[-1][1]).p.p
        assert [n for n, _ in launches[n0:]] == ["moe_forward_fp8"] and r.context_only == 1 and r.out == 0


def test_bf16_quantized_weights_mismatch_is_refused():
    with null_driver(), _ws() as ws:
        a = _Inputs()
        qw = mok.quantize_weights(ws, a.experts, a.shared)
        sched = mok.schedule(ws, a.ids)
        with pytest.raises(mok.ArgumentError) as ei:
            mok.forward(ws, sched, a.x, a.tw, qw, shared=a.shared)
        assert ei.value.argument == "shared"
        cfg16 = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K, shared_intermediate=Is)
        with mok.Workspace(cfg16, max_tokens=T) as ws16:
            with pytest.raises(mok.ArgumentError) as ei:
                mok.forward(ws16, mok.schedule(ws16, a.ids), a.x, a.tw, qw)
            assert ei.value.argument == "experts"
            with pytest.raises(mok.ArgumentError) as ei:
                mok.quantize_weights(ws16, a.experts, a.shared)
            assert ei.value.argument == "precision"
