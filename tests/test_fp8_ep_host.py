"""Host side of the "fp8_block" forward with expert parallelism (cuda_src/moe/tasks/ep_fp8.cuh),
without a GPU: the FP8 EP plan (push tasks one per token block, quant_x folded into them), the
buffers the push needs, the launch parameters with peers, the FP8 layout inside the symmetric
routed region, and what is still refused (the FP8 backward with EP, mxfp8 on CUDA)."""
from __future__ import annotations

import itertools
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import mok_rt as mok
from mok_rt.api.validate import check_backend_precision
from mok_rt.dist import ep as _ep
from mok_rt.kernels import moe_fp8 as M8
from mok_rt.kernels import moe_launch as L
from mok_rt.kernels import moe_plan as _moe_plan
from mok_rt.kernels.moe_params_fp8 import KBLOCK

REPO = Path(__file__).resolve().parents[1]


def _dims(T=300, H=320, I=192, Is=320, E=5, k=3, R=1280, rank=1):
    return L.LayerDims(tokens=T, hidden=H, intermediate=I, top_k=k, local_experts=E, capacity_rows=R,
                       shared_intermediate=Is, rank=rank)


DIMS = [_dims(), _dims(Is=0), _dims(T=0), _dims(T=0, Is=0), _dims(T=1, H=256, I=128, Is=128),
        _dims(T=4096, H=2048, I=768, Is=0, E=64, k=8, R=4096 * 8 + 64 * 128)]


def _peers(d, push_tasks=None):
    return L.PeerSpec(peer_bases=(1 << 40, 2 << 40), peer_array=4096, routed_offset=1 << 20, slot_offset=1 << 30,
                      flags_offset=4096, end_pad_offset=8192, rank=d.rank, epoch=7,
                      push_tasks=push_tasks or M8.push_tasks(d), slot_rows=max(1, d.tokens * d.top_k))


@pytest.mark.parametrize("d,ctx", list(itertools.product(DIMS, (False, True))))
def test_fp8_ep_plan(d, ctx):
    n = M8.push_tasks(d)
    assert n == max(1, d.token_blocks)
    plan = M8.forward_plan(d, context_only=ctx, push_tasks=n)
    one = M8.forward_plan(d, context_only=ctx)
    names = [ph.name for ph in plan.phases]
    assert names[:5] == ["push", "push_notify", "quant_x", "shared_gu", "dispatch"]
    assert plan.phase("push").count == n and plan.phase("push_notify").count == 1
    assert plan.phase("down_notify").count == 1 and plan.phase("quant_x").count == 0   # folded into push
    # With EP a context-only launch still collects its routes' outputs (y_slot is context).
    assert plan.phase("combine").count == d.token_blocks * _moe_plan.combine_parts(d.token_blocks)
    extra = n + 2 - one.phase("quant_x").count + (plan.phase("combine").count - one.phase("combine").count)
    assert plan.total == one.total + extra
    at = 0
    for ph in plan.phases:
        assert ph.begin == at
        at = ph.end
    for w in plan.waits:   # producers before consumers; targets = what the producers signal
        prod = plan.phase(w.producer)
        for c in w.consumers:
            if prod.count and plan.phase(c).count:
                assert prod.end <= plan.phase(c).begin, (w.counter, c)
        if prod.count:
            assert w.target * w.units == prod.count, w
    xq = next(w for w in plan.waits if w.counter == "token_xq_ready")
    assert xq.producer == ("push" if d.shared_intermediate else "quant_x")
    # Every push task signals token_xq_ready[its block] (T = 0: one task, one element).
    assert next(c for c in plan.counters if c.name == "token_xq_ready").length == n
    s, x = plan.struct(), plan.fp8_struct()
    assert (s.push.begin, s.push.count) == (0, n) and x.quant_x.count == 0
    assert s.wait_push_done == n and x.wait_token_xq_ready == (1 if d.shared_intermediate else 0)


def test_fp8_plan_refuses_other_push_counts_and_the_backward():
    d = _dims()
    for bad in (1, M8.push_tasks(d) + 1):
        with pytest.raises(AssertionError):
            _moe_plan.forward_plan(d, push_tasks=bad, precision="fp8_block")
    with pytest.raises(AssertionError):   # the FP8 backward has no EP yet
        _moe_plan.backward_plan(d, push_tasks=4, precision="fp8_block")


def test_buffers_with_ep_hold_the_token_order_copy():
    for d in DIMS:
        one, ep = M8.forward_buffer_bytes(d), M8.forward_buffer_bytes(d, expert_parallel=True)
        assert ep["xq"] == d.tokens * d.hidden and ep["xq_s"] == 4 * -(-d.hidden // KBLOCK) * d.token_blocks * 128
        assert {n: v for n, v in ep.items() if n not in ("xq", "xq_s", "counters")} == \
               {n: v for n, v in one.items() if n not in ("xq", "xq_s", "counters")}
        plan = M8.forward_plan(d, push_tasks=M8.push_tasks(d))
        assert ep["counters"] == 4 * plan.counter_words
        if d.shared_intermediate:
            assert (one["xq"], one["xq_s"]) == (ep["xq"], ep["xq_s"])


def _bufs(d):
    v = iter(range(1 << 20, 1 << 34, 1 << 20))
    return M8.Fp8ForwardBuffers(**{n: next(v) for n in M8.Fp8ForwardBuffers.__dataclass_fields__})


def _sched():
    return L.ScheduleBuffers(**{n: 4096 * (i + 1) for i, n in enumerate(L.ScheduleBuffers.__dataclass_fields__)})


def test_launch_params_with_peers():
    d = _dims()
    b, peers = _bufs(d), _peers(d)
    plan = M8.forward_plan(d, push_tasks=peers.push_tasks)
    q = M8._params(b, _sched(), plan, d, L.KernelKnobs(), err_ptr=64, trace_ptr=0, context_only=False, peers=peers)
    pe = q.p.peers
    assert (pe.num_ranks, pe.rank, pe.epoch, pe.push_tasks) == (2, 1, 7, M8.push_tasks(d))
    assert (pe.base[0], pe.base[1], pe.base_array) == (1 << 40, 2 << 40, 4096)
    assert (pe.routed_offset, pe.slot_offset, pe.flags_offset, pe.end_pad_offset) == (1 << 20, 1 << 30, 4096, 8192)
    assert q.p.plan.push.count == M8.push_tasks(d) and q.p.plan.down_notify.count == 1
    assert q.p.plan.wait_push_done == M8.push_tasks(d) and q.plan8.quant_x.count == 0
    assert q.token_xq_ready == plan.counter_pointers(b.counters)["token_xq_ready"]
    assert q.qctx.xq == b.xq and q.qctx.xq_s == b.xq_s and q.p.dims.rank == 1


def test_launch_checks_peers_before_touching_the_device():
    d = _dims(Is=0)
    b, sched = _bufs(d), _sched()
    with pytest.raises(mok.ArgumentError) as e:   # the bf16 push count
        M8.launch_forward_fp8(b, sched, d, stream=0, err_ptr=64, peers=_peers(d, push_tasks=32))
    assert e.value.argument == "peers" and "one token block per task" in str(e.value)
    nx = M8.Fp8ForwardBuffers(**{**b.__dict__, "xq": 0})
    with pytest.raises(mok.ArgumentError) as e:   # no shared expert, but the push quantises into xq
        M8.launch_forward_fp8(nx, sched, d, stream=0, err_ptr=64, peers=_peers(d))
    assert e.value.argument == "xq"
    with pytest.raises(mok.ArgumentError) as e:   # a one-rank plan with peers
        M8.launch_forward_fp8(b, sched, d, stream=0, err_ptr=64, peers=_peers(d), plan=M8.forward_plan(d))
    assert e.value.argument == "plan"
    wrong_rank = L.LayerDims(**{**d.__dict__, "rank": 0})
    with pytest.raises(mok.ArgumentError) as e:
        M8.launch_forward_fp8(b, sched, wrong_rank, stream=0, err_ptr=64, peers=_peers(d))
    assert e.value.argument == "peers"


def test_fp8_peers_replaces_only_the_push_count():
    d = _dims()
    p = _peers(d, push_tasks=32)
    q = M8.fp8_peers(p, d)
    assert q.push_tasks == M8.push_tasks(d) and q.epoch == p.epoch and q.peer_bases == p.peer_bases


@pytest.mark.parametrize("H", [64, 320, 2048, 7168])
def test_fp8_rows_and_scales_fit_the_routed_region(H):
    # ep_fp8.cuh: e4m3 [max_rows, H], then fp32 [ceil(H/128), max_rows], inside [max_rows, H] bf16.
    R = 6528
    lay = _ep.HeapLayout.make(max_tokens=1000, top_k=3, hidden=H, capacity_rows=R)
    assert lay.slot - lay.routed >= R * H + 4 * -(-H // KBLOCK) * R
    assert (R * H) % 16 == 0 and lay.routed % 16 == 0


def test_device_layout_comment_names_the_same_offsets():
    src = (REPO / "cuda_src/moe/tasks/ep_fp8.cuh").read_text()
    assert re.search(r"routed_q\(pe, r\) \+ \(size_t\)d\.max_rows \* d\.hidden", src)
    assert "byte max_rows H:    fp32 scales [ceil(H/128), max_rows]" in src


def test_precision_rules_with_ep():
    check_backend_precision("cuda", "fp8_block", 2)
    check_backend_precision("cuda", "fp8_block", 8)
    with pytest.raises(mok.ArgumentError) as ei:
        check_backend_precision("cuda", "mxfp8", 2)
    assert ei.value.argument == "precision" and "Blackwell" in str(ei.value)


def test_fp8_backward_with_ep_is_refused_clearly():
    from mok_rt.backends.cuda import CudaBackend
    with pytest.raises(mok.ArgumentError) as ei:
        CudaBackend._run_backward_fp8(SimpleNamespace(ep=object()), None, None, None, None, out={}, grad_dtype=None,
                                      accumulate=False, stream=None)
    assert ei.value.argument == "precision"
    assert "one rank only" in str(ei.value) and "forward and recompute_context are built" in str(ei.value)
