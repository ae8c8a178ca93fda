"""Per-task timelines (mok_rt/_trace.py) without a GPU: the plan phase tables, record decoding,
statistics and Chrome events, the parameter-struct field, and the reference backend."""
from __future__ import annotations

import json

import numpy as np
import pytest

import mok_rt as mok
from mok_rt import _moe_launch as L
from mok_rt import _moe_params as P
from mok_rt._trace import LaunchTrace, write_chrome_trace


def _dims(T=1000, H=1024, I=512, Is=0, k=4, El=16, R=None):
    R = R if R is not None else -(-T * k // 128) * 128 + El * 128
    return L.LayerDims(tokens=T, hidden=H, intermediate=I, top_k=k, local_experts=El, capacity_rows=R,
                       shared_intermediate=Is, swiglu_limit=None)


def _cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("Is", [0, 384])
@pytest.mark.parametrize("push", [0, 8])
@pytest.mark.parametrize("T", [0, 1, 1000])
def test_phase_tables_add_up_to_the_plans(Is, push, T):
    # The closed forms the kernels' plans compute (forward_tasks.cuh / backward_tasks.cuh).
    d = _dims(T=T, Is=Is)
    tile_n, gu_cols = P.TILE_N, P.GATE_UP_COLS
    tb, mb, h_t = d.token_blocks, d.max_blocks, _cdiv(d.hidden, tile_n)
    cp = P.combine_parts(tb)  # combine tasks per token block
    gu, sgu = _cdiv(d.intermediate, gu_cols), _cdiv(Is, gu_cols)
    for ctx_only in (False, True):
        want = ((push + 2 if push else 0) + mb + tb * sgu + mb * gu + (tb * h_t if Is and not ctx_only else 0)
                + mb * h_t + (0 if ctx_only and not push else tb * cp))
        phases = L.forward_phases(d, context_only=ctx_only, push_tasks=push)
        assert sum(n for _, n in phases) == want == L.forward_task_count(
            d, context_only=ctx_only, push_tasks=push)
        assert len({n for n, _ in phases}) == len(phases)
    i_t, si_t = _cdiv(d.intermediate, tile_n), _cdiv(Is, tile_n)
    h_r, i_r, si_r = _cdiv(d.hidden, 128), _cdiv(d.intermediate, 128), _cdiv(Is, 128)
    want = ((push + 2 if push else 0) + mb + tb + (tb * si_t if Is else 0) + mb * i_t + (tb * h_t if Is else 0)
            + mb * h_t + d.local_experts * h_r * i_t + d.local_experts * 2 * i_r * h_t
            + (h_r * si_t + 2 * si_r * h_t if Is else 0) + tb * cp)
    assert sum(n for _, n in L.backward_phases(d, push_tasks=push)) == want


def test_phase_order_follows_the_plans():
    d = _dims(Is=256)
    assert [n for n, _ in L.forward_phases(d)] == [
        "dispatch", "shared_gate_up", "routed_gate_up", "shared_down", "routed_down", "down_notify", "combine"]
    # With EP the shared expert's gate|up runs while the rows travel, before the dispatch.
    assert [n for n, _ in L.forward_phases(d, push_tasks=4)][:4] == ["push", "push_notify", "shared_gate_up",
                                                                     "dispatch"]
    assert [n for n, _ in L.backward_phases(d, push_tasks=4)][:5] == ["push", "push_notify", "d_weights",
                                                                      "shared_da", "dispatch"]
    assert [n for n, _ in L.backward_phases(d)][-1] == "combine"


def test_trace_pointer_follows_the_error_word_in_both_structs():
    for s in (P.MoEForwardParams, P.MoEBackwardParams):
        assert s.trace.offset == s.err.offset + 8 and s.dims.offset == s.trace.offset + 8
    # The record count travels too: the kernels trace only when it equals their plan's task count.
    assert P.MoEForwardParams.trace_tasks.offset == P.MoEForwardParams.context_only.offset + 4
    assert P.MoEBackwardParams.trace_tasks.offset == P.MoEBackwardParams.accumulate.offset + 4


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
        mok.forward(ws, sched, x, tw, *w)
        assert ws.take_traces() == []
