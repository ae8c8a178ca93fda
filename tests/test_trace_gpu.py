"""Per-task timelines on the GPU (Workspace(trace=True)): every task of every launch is recorded
once, in order (grab <= ready <= end), with its plan phase and SM; tracing changes no result bit;
and an EP pair of ranks sharing one GPU."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from _gpu import cp  # noqa: E402  (CuPy is imported when a test first uses it)

import mok_rt as mok  # noqa: E402
from mok_rt.kernels import moe_launch as L  # noqa: E402
from mok_rt.runtime.launch import multiprocessor_count  # noqa: E402
from test_layer_gpu import _experts, _shared, _to_dev, make_problem  # noqa: E402


def _step(ws, d):
    sched = mok.schedule(ws, d["ids"])
    out, ctx = mok.forward(ws, sched, d["x"], d["tw"], _experts(d), shared=_shared(d))
    g = mok.backward(ws, ctx, d["d_out"])
    return out, g


def _host(t):
    return t.to_numpy().view(np.uint16)


def test_every_task_recorded_once_and_results_unchanged():
    h = make_problem(31, T=1000, H=1024, I=512, E=16, k=4, Is=256)
    d = _to_dev(h)
    cfg = mok.MoEConfig(hidden=1024, intermediate=512, num_experts=16, top_k=4, shared_intermediate=256)
    results = {}
    for trace in (False, True):
        with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=1000, trace=trace) as ws:
            out, g = _step(ws, d)
            ws.synchronize()
            results[trace] = (_host(out), _host(g.dx), g.dw.down.to_numpy())
            traces = ws.take_traces()
            if not trace:
                assert traces == []
                continue
            assert [t.kind for t in traces] == ["forward", "backward"] and ws.take_traces() == []
            sms = multiprocessor_count(0)   # (%smid need not be below it: only the count of SMs is)
            for t in traces:
                total = sum(c for _, c in t.phases)
                assert t.unfinished == 0 and len(t.spans) == total, t.summary()
                assert sorted(s.task for s in t.spans) == list(range(total))
                assert all(s.grab_us <= s.ready_us <= s.end_us for s in t.spans)
                assert len({s.sm for s in t.spans}) <= sms
                assert t.span_us > 0 and {p.phase for p in t.phase_stats()} <= {n for n, _ in t.phases}
                print(t.summary())
    for a, b in zip(results[False], results[True]):
        assert np.array_equal(a, b)


def test_ep_ranks_sharing_one_gpu_each_record_their_launches():
    T, H, I, E, k = 600, 512, 256, 8, 2
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k)
    probs = [_to_dev(make_problem(40 + r, T=T, H=H, I=I, E=E, k=k)) for r in range(2)]
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0, 0]), max_tokens=T, trace=True) as ws:
        ranks = [ws.rank(r) for r in range(2)]
        scheds = [mok.schedule(ranks[r], probs[r]["ids"]) for r in range(2)]
        fwd = [mok.forward(ranks[r], scheds[r], probs[r]["x"], probs[r]["tw"],
                           mok.ExpertWeights(*(probs[r][n][4 * r:4 * r + 4] for n in ("w_gate", "w_up", "w_down"))))
               for r in range(2)]
        ws.synchronize()
        traces = ws.take_traces()
        assert sorted((t.rank, t.kind) for t in traces) == [(0, "forward"), (1, "forward")]
        for t in traces:
            assert t.unfinished == 0 and len(t.spans) == sum(c for _, c in t.phases)
            assert "push" in {n for n, _ in t.phases}
        del fwd


def _ep_pair_step(comm_sms, probs, *, T, H, I, E, k, trace):
    """Forward + backward of two EP ranks sharing GPU 0; returns host copies and the traces."""
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k, comm_sms=comm_sms)
    el = E // 2
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0, 0]), max_tokens=T, trace=trace,
                       poison_outputs=True) as ws:
        ranks = [ws.rank(r) for r in range(2)]
        scheds = [mok.schedule(ranks[r], probs[r]["ids"]) for r in range(2)]
        fwd = [mok.forward(ranks[r], scheds[r], probs[r]["x"], probs[r]["tw"],
                           mok.ExpertWeights(*(probs[r][n][el * r:el * (r + 1)] for n in ("w_gate", "w_up", "w_down"))))
               for r in range(2)]
        grads = [mok.backward(ranks[r], fwd[r][1], probs[r]["d_out"]) for r in range(2)]
        ws.synchronize()
        host = [(_host(fwd[r][0]), _host(grads[r].dx), grads[r].dw.down.to_numpy(), grads[r].dw.gate.to_numpy())
                for r in range(2)]
        return host, ws.take_traces()


def test_ep_gemms_start_under_the_push():
    """Readiness chunks (ep.cuh): a row block's GEMM tiles wait only for the chunks holding its
    rows, so with few push tasks (a long push) the first routed GEMM tile of each rank starts
    before that rank's last push task ends, forward and backward.  The push's chunking changes
    no result bit (comm_sms 2 against 32), and every output is written (NaN-poisoned)."""
    T, H, I, E, k = 8192, 2048, 768, 16, 4
    probs = [_to_dev(make_problem(60 + r, T=T, H=H, I=I, E=E, k=k)) for r in range(2)]
    slow, traces = _ep_pair_step(2, probs, T=T, H=H, I=I, E=E, k=k, trace=True)
    fast, _ = _ep_pair_step(32, probs, T=T, H=H, I=I, E=E, k=k, trace=False)
    for r in range(2):
        for a, b in zip(slow[r], fast[r]):
            assert np.array_equal(a, b), f"rank {r}: the push's chunking changed a result"
        for bits in slow[r][:2]:   # bf16 out, dx: no NaN / inf exponent (poisoned outputs are NaN)
            assert ((bits & 0x7F80) != 0x7F80).all(), f"rank {r}: an output element was not written"
        assert np.isfinite(slow[r][2]).all() and np.isfinite(slow[r][3]).all()
    assert sorted((t.kind, t.rank) for t in traces) == [("backward", 0), ("backward", 1), ("forward", 0),
                                                        ("forward", 1)]
    for t in traces:
        print(t.overlap_summary())
        o = t.push_overlap()
        assert t.unfinished == 0
        assert o["first_routed_gemm_us"] is not None and o["last_push_end_us"] is not None
        assert o["first_routed_gemm_us"] < o["last_push_end_us"], t.overlap_summary()
        assert o["routed_gemm_under_push_us"] > 0, t.overlap_summary()
