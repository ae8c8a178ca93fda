"""The "fp8_block" launches with expert parallelism on the CPU, against the null driver of
bench/null_driver.py (nothing runs; every launch is recorded): moe_forward_fp8 and
moe_backward_fp8 enqueued with peers, and what their parameter structs hold -- the push tasks
(one per token block), the peers, the EP plan's phases and counters, the token-order buffers the
push quantises into, the slot rows dx returns to and the backward's doubled local deadline."""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from null_driver import null_driver  # noqa: E402

from mok_rt.kernels import moe_fp8 as M8  # noqa: E402
from mok_rt.kernels import moe_fp8_bwd as MB  # noqa: E402
from mok_rt.kernels import moe_launch as L  # noqa: E402
from mok_rt.kernels import moe_params_fp8 as F  # noqa: E402
from mok_rt.kernels import moe_params_fp8_bwd as B  # noqa: E402

from _fp8_null import launches  # noqa: E402,F401  (a fixture)

SLOT = 1 << 36   # the symmetric block's slot rows (peer_bases[rank] + slot_offset)


def _dims(T, Is):
    return L.LayerDims(tokens=T, hidden=320, intermediate=192, top_k=3, local_experts=3, capacity_rows=1280,
                       shared_intermediate=Is, rank=1, expert_parallel=True)


def _peers(d):
    return M8.fp8_peers(L.PeerSpec(peer_bases=(1 << 34, 1 << 35), peer_array=4096, routed_offset=1 << 20,
                                   slot_offset=SLOT - (1 << 35), flags_offset=4096, end_pad_offset=8192, rank=1,
                                   epoch=5, push_tasks=32, slot_rows=1000 * 3, chunk_tokens=64, chunks=64), d)


def _pointers(cls, d):
    """Every buffer at its own 4 KB-aligned fake address (0 where the table says 0 bytes)."""
    at = iter(range(1 << 40, 1 << 48, 1 << 28))
    table = {b.name: b for b in (M8._TABLE if cls is M8.Fp8ForwardBuffers else MB.FP8_BACKWARD_TABLE)}
    return cls(**{n: (next(at) if table[n].role == "counters" or table[n].nbytes(d) else 0)
                  for n in cls.__dataclass_fields__})


def _sched():
    return L.ScheduleBuffers(**{n: 4096 * (i + 1) for i, n in enumerate(L.ScheduleBuffers.__dataclass_fields__)})


@pytest.mark.parametrize("T,Is", [(300, 0), (300, 128), (0, 128)])
def test_forward_with_peers(launches, T, Is):
    d = _dims(T, Is)
    peers = _peers(d)
    bufs = _pointers(M8.Fp8ForwardBuffers, d)
    assert (bufs.xq and bufs.xq_s) or T == 0   # the push quantises into them, with or without a shared expert
    with null_driver():
        M8.launch_forward_fp8(bufs, _sched(), d, stream=0, err_ptr=64, peers=peers)
    (name, raw), = launches
    assert name == "moe_forward_fp8" and len(raw) == ctypes.sizeof(F.MoEFp8ForwardTmaParams)
    q = F.MoEFp8ForwardTmaParams.from_buffer_copy(raw).p
    p = q.p
    n = max(1, d.token_blocks)
    assert (p.peers.num_ranks, p.peers.rank, p.peers.epoch, p.peers.push_tasks) == (2, 1, 5, n)
    assert p.peers.base[1] == 1 << 35 and p.peers.routed_offset == 1 << 20
    assert (p.plan.push.begin, p.plan.push.count, p.plan.push_notify.count, p.plan.down_notify.count) == (0, n, 1, 1)
    assert p.plan.wait_push_done == n and q.plan8.quant_x.count == 0
    assert p.plan.combine.count > 0 or T == 0
    assert q.qctx.xq == bufs.xq and q.qctx.xq_s == bufs.xq_s and p.dims.rank == 1
    plan = M8.forward_plan(d, push_tasks=n)
    assert q.token_xq_ready == plan.counter_pointers(bufs.counters)["token_xq_ready"]
    assert p.cnt.push_done == plan.counter_pointers(bufs.counters)["push_done"]


@pytest.mark.parametrize("T,Is", [(300, 0), (300, 128), (0, 128)])
def test_backward_with_peers(launches, T, Is):
    d = _dims(T, Is)
    peers = _peers(d)
    bufs = _pointers(MB.Fp8BackwardBuffers, d)
    bufs = MB.Fp8BackwardBuffers(**{**bufs.__dict__, "dx_slot": SLOT})   # the slot rows, as the backend passes
    knobs = L.KernelKnobs()
    with null_driver():
        MB.prepare_backward_fp8(bufs, _sched(), d, stream=0, err_ptr=64, knobs=knobs, peers=peers)()
    (name, raw), = launches
    assert name == "moe_backward_fp8" and len(raw) == ctypes.sizeof(B.MoEFp8BackwardTmaParams)
    q = B.MoEFp8BackwardTmaParams.from_buffer_copy(raw).p
    p = q.p
    n = max(1, d.token_blocks)
    assert (p.peers.num_ranks, p.peers.push_tasks, p.plan.push.count, p.plan.dx_notify.count) == (2, n, n, 1)
    assert q.plan8.token_prep.count == 0 and q.plan8.token_rows == d.token_blocks * 128
    assert p.dx_slot == SLOT and q.q.dq == bufs.dq and q.q.ts == bufs.ts and q.q.dq_bf == bufs.dq_bf
    assert q.q.dyq == bufs.dq + d.token_blocks * 128 * d.hidden
    assert p.dims.timeout_ns == MB.LOCAL_TIMEOUT_FACTOR * knobs.timeout_ns   # local; peer waits divide
    assert q.plan8.wait_prep_done == (d.token_blocks if Is else 0)
