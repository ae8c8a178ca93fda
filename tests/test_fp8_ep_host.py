"""Host side of "fp8_block" with expert parallelism (cuda_src/moe/tasks/ep_fp8.cuh), without a GPU:
the FP8 EP plans (push tasks one per token block; quant_x / token_prep folded into them), the
buffers the push needs (dims.expert_parallel), the launch parameters with peers (the backward's
doubled local deadline), the FP8 layout inside the symmetric routed region, and what is still
refused (mxfp8 on CUDA)."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from _plan_checks import check_plan_well_formed

import mok_rt as mok
from mok_rt.api.validate import check_backend_precision
from mok_rt.dist import ep as _ep
from mok_rt.kernels import moe_fp8 as M8
from mok_rt.kernels import moe_fp8_bwd as MB
from mok_rt.kernels import moe_launch as L
from mok_rt.kernels import moe_params_fp8_bwd as B
from mok_rt.kernels import moe_plan as _moe_plan
from mok_rt.kernels.moe_params_fp8 import KBLOCK

REPO = Path(__file__).resolve().parents[1]


def _dims(T=300, H=320, I=192, Is=320, E=5, k=3, R=1280, rank=1, ep=True):
    return L.LayerDims(tokens=T, hidden=H, intermediate=I, top_k=k, local_experts=E, capacity_rows=R,
                       shared_intermediate=Is, rank=rank, expert_parallel=ep)


DIMS = [_dims(), _dims(Is=0), _dims(T=0), _dims(T=0, Is=0), _dims(T=1, H=256, I=128, Is=128),
        _dims(T=4096, H=2048, I=768, Is=0, E=64, k=8, R=4096 * 8 + 64 * 128)]


def _peers(d, push_tasks=None):
    return L.PeerSpec(peer_bases=(1 << 40, 2 << 40), peer_array=4096, routed_offset=1 << 20, slot_offset=1 << 30,
                      flags_offset=4096, end_pad_offset=8192, rank=d.rank, epoch=7,
                      push_tasks=push_tasks or M8.push_tasks(d), slot_rows=max(1, d.tokens * d.top_k), chunk_tokens=64, chunks=64)


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
    check_plan_well_formed(plan)
    xq = next(w for w in plan.waits if w.counter == "token_xq_ready")
    assert xq.producer == ("push" if d.shared_intermediate else "quant_x")
    # Every push task signals token_xq_ready[its block] (T = 0: one task, one element).
    assert next(c for c in plan.counters if c.name == "token_xq_ready").length == n
    s, x = plan.struct(), plan.fp8_struct()
    assert (s.push.begin, s.push.count) == (0, n) and x.quant_x.count == 0
    assert s.wait_push_done == n and x.wait_token_xq_ready == (1 if d.shared_intermediate else 0)


@pytest.mark.parametrize("d", DIMS)
def test_fp8_ep_backward_plan(d):
    n = M8.push_tasks(d)
    plan = MB.backward_plan(d, push_tasks=n)
    one = MB.backward_plan(d)
    names = [ph.name for ph in plan.phases]
    assert names[:6] == ["push", "push_notify", "token_prep", "d_weights", "shared_da", "dispatch"]
    assert plan.phase("push").count == n and plan.phase("token_prep").count == 0   # folded into push
    assert plan.phase("dx_notify").count == 1
    assert plan.total == one.total + n + 2 - one.phase("token_prep").count
    check_plan_well_formed(plan, targets=d.tokens > 0)   # (T = 0: one push task, no token block to widen)
    shared = bool(d.shared_intermediate)
    assert {w.counter: w.producer for w in plan.waits}["prep_done"] == ("push" if shared else "token_prep")
    assert next(c for c in plan.counters if c.name == "token_dq_ready").length == n
    assert plan.tiles["token_rows"] == d.token_blocks * 128          # dq's token-order rows exist with EP
    s, x = plan.struct(), plan.fp8_struct()
    assert (s.push.count, s.wait_push_done, x.token_prep.count) == (n, n, 0)
    assert x.wait_prep_done == (d.token_blocks if shared else 0)


def test_fp8_plans_refuse_other_push_counts():
    d = _dims()
    for bad in (1, M8.push_tasks(d) + 1):
        with pytest.raises(AssertionError):
            _moe_plan.forward_plan(d, push_tasks=bad, precision="fp8_block")
        with pytest.raises(AssertionError):
            _moe_plan.backward_plan(d, push_tasks=bad, precision="fp8_block")


def test_buffers_with_ep_hold_the_token_order_copies():
    for d in DIMS:
        one = _dims(T=d.tokens, H=d.hidden, I=d.intermediate, Is=d.shared_intermediate, E=d.local_experts,
                    k=d.top_k, R=d.capacity_rows, ep=False)
        f1, fe = M8.forward_buffer_bytes(one), M8.forward_buffer_bytes(d)
        assert fe["xq"] == d.tokens * d.hidden and fe["xq_s"] == 4 * -(-d.hidden // KBLOCK) * d.token_blocks * 128
        assert {n: v for n, v in fe.items() if n not in ("xq", "xq_s", "counters")} == \
               {n: v for n, v in f1.items() if n not in ("xq", "xq_s", "counters")}
        assert fe["counters"] == 4 * M8.forward_plan(d, push_tasks=M8.push_tasks(d)).counter_words
        b1, be = MB.backward_buffer_bytes(one), MB.backward_buffer_bytes(d)
        rows = d.token_blocks * 128 + d.capacity_rows
        assert be["dq"] == rows * d.hidden and be["dq_bf"] == be["xq_bf"] == 2 * rows * d.hidden
        assert be["ts"] == 4 * (-(-d.hidden // KBLOCK) + 2 * -(-d.shared_intermediate // KBLOCK)) * d.token_blocks * 128
        assert be["counters"] == 4 * MB.backward_plan(d, push_tasks=M8.push_tasks(d)).counter_words
        if d.shared_intermediate:   # a shared expert has them anyway
            assert all(f1[n] == fe[n] for n in ("xq", "xq_s")) and all(b1[n] == be[n] for n in ("dq", "ts", "dq_bf"))
        assert B.token_rows(d) == d.token_blocks * 128 and B.token_rows(one) == (d.token_blocks * 128
                                                                                if d.shared_intermediate else 0)


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


def _bwd_bufs():
    v = iter(range(1 << 20, 1 << 34, 1 << 20))
    return MB.Fp8BackwardBuffers(**{n: next(v) for n in MB.Fp8BackwardBuffers.__dataclass_fields__})


def test_backward_params_with_peers():
    d = _dims()
    b, peers = _bwd_bufs(), _peers(d)
    plan = MB.backward_plan(d, push_tasks=peers.push_tasks)
    knobs = L.KernelKnobs()
    q = MB._params(b, _sched(), plan, d, knobs, 64, 0, False, False, peers)
    assert (q.p.peers.num_ranks, q.p.peers.push_tasks, q.p.peers.epoch) == (2, M8.push_tasks(d), 7)
    assert q.p.plan.push.count == M8.push_tasks(d) and q.p.plan.dx_notify.count == 1
    assert q.plan8.token_prep.count == 0 and q.plan8.token_rows == d.token_blocks * 128
    # the kernel's local waits use dims.timeout_ns, its peer waits divide by the factor (ep.cuh's 2)
    assert q.p.dims.timeout_ns == 2 * knobs.timeout_ns and MB.LOCAL_TIMEOUT_FACTOR == 2
    one = MB._params(b, _sched(), MB.backward_plan(d), d, knobs, 64, 0, False, False)
    assert one.p.dims.timeout_ns == knobs.timeout_ns and one.p.peers.num_ranks == 1
    assert q.q.dyq == b.dq + d.token_blocks * 128 * d.hidden and q.p.dx_slot == b.dx_slot


def test_local_timeout_factor_matches_the_header():
    src = (REPO / "cuda_src/moe/tasks/ep.cuh").read_text()
    assert re.search(r"constexpr long long kLocalTimeoutFactor = (\d+);", src).group(1) == str(MB.LOCAL_TIMEOUT_FACTOR)


def test_backward_launch_checks_peers_before_touching_the_device():
    d = _dims()
    b, sched = _bwd_bufs(), _sched()
    with pytest.raises(mok.ArgumentError) as e:
        MB.prepare_backward_fp8(b, sched, d, stream=0, err_ptr=64, peers=_peers(d, push_tasks=32))
    assert e.value.argument == "peers"
    with pytest.raises(mok.ArgumentError) as e:
        MB.prepare_backward_fp8(b, sched, d, stream=0, err_ptr=64, peers=_peers(d), plan=MB.backward_plan(d))
    assert e.value.argument == "plan"
    no_ep = L.LayerDims(**{**d.__dict__, "expert_parallel": False})
    with pytest.raises(mok.ArgumentError) as e:
        MB.prepare_backward_fp8(b, sched, no_ep, stream=0, err_ptr=64, peers=_peers(d))
    assert e.value.argument == "dims"


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
    no_ep = L.LayerDims(**{**d.__dict__, "expert_parallel": False})
    with pytest.raises(mok.ArgumentError) as e:
        M8.launch_forward_fp8(b, sched, no_ep, stream=0, err_ptr=64, peers=_peers(d))
    assert e.value.argument == "dims"


def test_fp8_peers_replaces_only_the_push_count():
    d = _dims()
    p = _peers(d, push_tasks=32)
    q = M8.fp8_peers(p, d)
    assert q.push_tasks == M8.push_tasks(d) and q.epoch == p.epoch and q.peer_bases == p.peer_bases


@pytest.mark.parametrize("H", [64, 320, 2048, 7168])
def test_fp8_rows_and_scales_fit_the_routed_region(H):
    # ep_fp8.cuh: e4m3 [max_rows, H], fp32 [ceil(H/128), max_rows], then (backward) fp32 [max_rows],
    # inside [max_rows, H] bf16.
    R = 6528
    lay = _ep.HeapLayout.make(max_tokens=1000, top_k=3, hidden=H, capacity_rows=R, push_tasks=32)
    assert lay.slot - lay.routed >= R * H + 4 * -(-H // KBLOCK) * R + 4 * R
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


def test_prepare_loads_every_fp8_kernel(monkeypatch):
    """With expert parallelism the backend loads every kernel an FP8 step can launch when the
    workspace is made (a kernel loaded lazily at its first launch can wait behind a megakernel
    that spins for a peer the host has not launched yet)."""
    from mok_rt.kernels import fp8_quantize
    from mok_rt.runtime import cubins, launch
    loaded = []
    monkeypatch.setattr(L, "get_kernel", lambda stem, name, dev: loaded.append((stem, name)) or (stem, name))
    monkeypatch.setattr(cubins, "get_kernel", lambda stem, name, dev: loaded.append((stem, name)) or (stem, name))
    monkeypatch.setattr(L, "_ctas_that_fit", lambda kernel, dev, eng: 1)
    monkeypatch.setattr(launch, "_ensure_shared_memory", lambda kernel, dev, nbytes: None)
    assert M8.prepare(0) == 1 and MB.prepare(0) == 1
    fp8_quantize.prepare(0)
    assert sorted(loaded) == [("moe_backward_fp8", "moe_backward_fp8"), ("moe_forward_fp8", "moe_forward_fp8"),
                              ("moe_forward_fp8_staged", "moe_forward_fp8_staged"),
                              ("quantize_weights", "fp8_quantize_weights")]
