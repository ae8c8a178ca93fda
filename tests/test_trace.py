"""Per-task timelines (mok_rt/kernels/trace.py) without a GPU: the plan phase tables, record decoding,
statistics and Chrome events, the parameter-struct field, and the reference backend."""
from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest

import mok_rt as mok
from mok_rt.kernels import moe_launch as L
from mok_rt.kernels import moe_params as P
from mok_rt.kernels.trace import LaunchTrace, TaskSpan, write_chrome_trace


def _dims(T=1000, H=1024, I=512, Is=0, k=4, El=16, R=None):
    R = R if R is not None else -(-T * k // 128) * 128 + El * 128
    return L.LayerDims(tokens=T, hidden=H, intermediate=I, top_k=k, local_experts=El, capacity_rows=R,
                       shared_intermediate=Is, swiglu_limit=None)


def _cdiv(a, b):
    return -(-a // b)


def test_phase_tables_come_from_the_plans():
    d = _dims(T=1000, Is=384)
    for plan in (L.forward_plan(d), L.backward_plan(d, push_tasks=8)):
        table = plan.phase_table()
        assert sum(n for _, n in table) == plan.total
        assert [n for n, _ in table] == [ph.name for ph in plan.phases]


def test_trace_pointer_follows_the_error_word_in_both_structs():
    for s in (P.MoEForwardParams, P.MoEBackwardParams):
        assert s.trace.offset == s.err.offset + 8 and s.dims.offset == s.trace.offset + 8
    # One record per task of the plan that travels in the same struct.
    assert P.MoEForwardParams.plan.offset == P.MoEForwardParams.dims.offset + ctypes.sizeof(P.MoEDims)
    assert P.MoEBackwardParams.plan.offset == P.MoEBackwardParams.dims.offset + ctypes.sizeof(P.MoEDims)


_PHASES = (("dispatch", 2), ("routed_gate_up", 3), ("empty", 0), ("combine", 1))


def _records(rows):
    """rows: (grab, ready, end, task, sm) in ns / indices -> uint64 [n, 4]."""
    return np.array([(g, r, e, (t << 32) | sm) for g, r, e, t, sm in rows], dtype=np.uint64)


def test_decode_spans_statistics_and_chrome_events(tmp_path):
    base = 1_700_000_000_000_000_000
    rec = _records([(base + 0, base + 0, base + 2_000, 0, 3),
                    (base + 100, base + 100, base + 1_500, 1, 7),
                    (base + 2_000, base + 2_500, base + 9_000, 2, 3),     # waited 0.5 us
                    (base + 1_500, base + 1_500, base + 8_000, 3, 7),
                    (base + 8_000, base + 8_000, base + 10_000, 4, 7),
                    (base + 9_000, base + 9_500, 0, 5, 3)])               # never finished
    t = LaunchTrace.decode(rec, kind="forward", phases=_PHASES, rank=1, device_id=0)
    assert t.unfinished == 1 and len(t.spans) == 5
    assert [s.task for s in t.spans] == [0, 1, 3, 2, 4]
    assert {s.task: s.phase for s in t.spans} == {0: "dispatch", 1: "dispatch", 2: "routed_gate_up",
                                                   3: "routed_gate_up", 4: "routed_gate_up"}
    assert t.span_us == pytest.approx(10.0)
    stats = {p.phase: p for p in t.phase_stats()}
    assert stats["routed_gate_up"].tasks == 3
    assert stats["routed_gate_up"].wait_us == pytest.approx(0.5)
    assert stats["routed_gate_up"].busy_us == pytest.approx(6.5 + 6.5 + 2.0)
    assert stats["dispatch"].first_us == 0.0 and stats["dispatch"].last_us == pytest.approx(2.0)
    busy = t.sm_busy_fraction()
    assert busy[3] == pytest.approx((2.0 + 6.5) / 10.0) and busy[7] == pytest.approx((1.4 + 6.5 + 2.0) / 10.0)
    assert t.tail_idle_us() == pytest.approx(10.0 - 9.0)   # SM 3 ended at 9 us, SM 7 at 10 us
    text = t.summary()
    assert "routed_gate_up" in text and "1 unfinished" in text and "rank 1" in text
    gaps = t.idle_gaps(window_us=1.0)   # SM 7 starts 0.1 us late; SM 3 idles 2.0-2.5 us
    assert list(gaps["by_phase"]) == ["dispatch", "routed_gate_up"]   # plan order
    assert gaps["by_phase"]["dispatch"] == (pytest.approx(0.1), 1)
    assert gaps["by_phase"]["routed_gate_up"] == (pytest.approx(0.5), 1)
    assert len(gaps["by_window"]) == 10 and gaps["by_window"][0] == pytest.approx(0.1)
    assert gaps["by_window"][2] == pytest.approx(0.5) and sum(gaps["by_window"]) == pytest.approx(0.6)
    assert "routed_gate_up" in t.gaps_summary(window_us=2.5)
    # Gaps across window edges, with windows no float represents exactly: split, none lost, no stall.
    for w in (0.1, 0.3, 0.7, 3.0):
        g = t.idle_gaps(window_us=w)
        assert sum(g["by_window"]) == pytest.approx(0.6) and len(g["by_window"]) == -(-10.0 // w)
    g = t.idle_gaps(window_us=0.3)   # SM 3's gap 2.0-2.5 spans windows 6 (1.8-2.1), 7 and 8 (2.4-2.7)
    assert g["by_window"][6:9] == pytest.approx([0.1, 0.3, 0.1])
    ev = [e for e in t.chrome_events() if e["ph"] == "X"]
    assert sum(e["cat"] == "wait" for e in ev) == 1 and sum(e["cat"] == "forward" for e in ev) == 5
    assert {e["tid"] for e in ev if e["cat"] == "wait"} == {LaunchTrace.WAIT_ROW + 3}
    for sm in (3, 7):   # the work of one SM never overlaps
        row = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e["tid"] == sm)
        assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in zip(row, row[1:]))
    path = tmp_path / "t.json"
    write_chrome_trace(path, [t, t])
    doc = json.loads(path.read_text())
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1}


def test_idle_stretches_and_the_worst_window():
    # Two SMs, 100-us tasks back to back over 6 ms; SM 1 idles 3000-3150 us (a routed_dx task
    # then a wgrad_down task it grabbed at 3000 that waited 150 us), and SM 0 40 us at 4000: the
    # worst interior window of 250 us is [3000, 3250).
    spans, task = [], 0
    for sm in (0, 1):
        t = 0.0
        while t < 6000.0:
            gap = 150.0 if (sm, t) == (1, 3000.0) else 40.0 if (sm, t) == (0, 4000.0) else 0.0
            phase = "routed_dx" if t < 3000.0 else "wgrad_down"
            spans.append(TaskSpan(task=task, phase=phase, sm=sm, grab_us=t, ready_us=t + gap, end_us=t + gap + 100.0))
            task, t = task + 1, t + gap + 100.0
    tr = LaunchTrace(kind="backward", rank=0, device_id=0, phases=(("routed_dx", 60), ("wgrad_down", 62)),
                     spans=spans)
    got = tr.idle_stretches(min_us=20.0)
    assert [(g.sm, g.from_us, g.to_us, g.after, g.next) for g in got] == [
        (1, 3000.0, 3150.0, "routed_dx", "wgrad_down"), (0, 4000.0, 4040.0, "wgrad_down", "wgrad_down")]
    assert got[0].next_grab_us == 3000.0 and tr.spans[got[0].next_task].ready_us == 3150.0
    assert tr.idle_stretches(min_us=50.0) == got[:1]
    text = tr.worst_window_summary(window_us=250.0, min_us=20.0, edge_us=1000.0)
    assert "[3000, 3250)" in text and "SM   1 idle" in text and "0.6 SMs idle" in text and "SM   0" not in text
    assert "no window" in tr.worst_window_summary(edge_us=5000.0)


def test_decode_rejects_records_that_do_not_fit_the_plan():
    with pytest.raises(ValueError, match="records for a plan of 6"):
        LaunchTrace.decode(np.zeros((5, 4), np.uint64), kind="forward", phases=_PHASES)
    bad = np.zeros((6, 4), np.uint64)
    bad[0] = (1, 1, 2, (6 << 32) | 0)
    with pytest.raises(ValueError, match="task 6"):
        LaunchTrace.decode(bad, kind="forward", phases=_PHASES)
    empty = LaunchTrace.decode(np.zeros((6, 4), np.uint64), kind="backward", phases=_PHASES)
    assert empty.spans == [] and empty.span_us == 0.0 and "0 tasks" in empty.summary()


def test_reference_backend_has_no_timelines():
    cfg = mok.MoEConfig(hidden=64, intermediate=64, num_experts=4, top_k=2)
    rng = np.random.default_rng(0)
    with mok.Workspace(cfg, max_tokens=8, backend="reference", trace=True) as ws:
        assert ws.trace
        ids = np.stack([rng.permutation(4)[:2] for _ in range(8)]).astype(np.int32)
        x = rng.standard_normal((8, 64)).astype(np.float32)
        tw = rng.random((8, 2)).astype(np.float32)
        w = [rng.standard_normal(s).astype(np.float32) for s in ((4, 64, 64), (4, 64, 64), (4, 64, 64))]
        sched = mok.schedule(ws, ids)
        mok.forward(ws, sched, x, tw, mok.ExpertWeights(*w))
        assert ws.take_traces() == []
