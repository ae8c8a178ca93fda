"""Expert parallelism on the CPU: the dispatch / combine bookkeeping simulated with the schedule's
NumPy twin for P = 8 and P = 6, capacity seen by every rank, configuration agreement across ranks
(a fake group, and real processes over a test all-gather), API validation, the heap layout and the
parameter mirrors.  The device path itself is tested by test_ep_gpu.py / test_ep_multigpu.py."""
from __future__ import annotations

import dataclasses

import json

import numpy as np
import pytest

import mok_rt as mok
from mok_rt.dist import ep as _ep
from mok_rt.kernels.moe_launch import LayerDims, PeerSpec, backward_task_count, forward_task_count
from mok_rt.kernels import moe_params as P
from mok_rt.kernels.moe_params import combine_parts
from mok_rt.kernels.moe_plan import readiness_chunks
from mok_rt.errors import ArgumentError
from mok_rt.dist.group import ProcessGroup
from mok_rt.reference.schedule import schedule_reference, schedule_reference_all_ranks
from test_group import RankFailure, run_ranks


# ---------------------------------------------------------------------------------------------
# The device protocol, simulated with the schedule twin
# ---------------------------------------------------------------------------------------------

def _routing(rng, num_ranks, tokens, num_experts, k):
    return [np.stack([rng.permutation(num_experts)[:k] for _ in range(t)]) if t else np.zeros((0, k), np.int64)
            for t in tokens]


@pytest.mark.parametrize("num_ranks,tokens", [(8, (50, 0, 300, 1, 77, 128, 129, 3)), (6, (1000, 37, 0, 5, 256, 64))])
def test_push_compute_return_combine(num_ranks, tokens):
    """Every route's row travels source -> (route_rank, route_row) -> expert -> (row_src_rank,
    row_slot) -> its slot on the source, exactly once; the combine then equals the direct sum."""
    rng = np.random.default_rng(num_ranks)
    k, el, H, bm = 4, 3, 16, 8
    E = el * num_ranks
    ids = _routing(rng, num_ranks, tokens, E, k)
    xs = [rng.standard_normal((t, H)) for t in tokens]
    ws = [rng.random((t, k)) for t in tokens]
    scheds = schedule_reference_all_ranks(ids, num_experts=E, num_ranks=num_ranks, block_m=bm)

    # push: each source writes its rows into its destinations' routed rows
    routed = [np.zeros((s.num_rows, H)) for s in scheds]
    writes = [np.zeros(s.num_rows, int) for s in scheds]
    for s in range(num_ranks):
        mine = scheds[s]
        np.testing.assert_array_equal(mine.route_rank, (ids[s].reshape(-1) // el))
        for q in range(tokens[s] * k):
            d, row = mine.route_rank[q], mine.route_row[q]
            routed[d][row] = xs[s][q // k]
            writes[d][row] += 1
    # every real row written exactly once, padding rows never
    for d, sc in enumerate(scheds):
        np.testing.assert_array_equal(writes[d], (sc.row_slot >= 0).astype(int))
        assert not routed[d][sc.row_slot < 0].any()

    # experts (a stand-in: expert e scales by e + 1), then the return to every row's source slot
    slots = [np.full((t * k, H), np.nan) for t in tokens]
    for d, sc in enumerate(scheds):
        expert = d * el + sc.block_expert[np.arange(sc.num_rows) // bm]
        y = routed[d] * (expert[:, None] + 1)
        for row in np.nonzero(sc.row_slot >= 0)[0]:
            src, slot = sc.row_src_rank[row], sc.row_slot[row]
            assert np.isnan(slots[src][slot]).all(), "a slot written twice"
            slots[src][slot] = y[row]

    # combine on every source, j in order
    for s in range(num_ranks):
        y = slots[s].reshape(tokens[s], k, H)
        assert np.isfinite(y).all(), f"rank {s}: a route's row never came back"
        want = np.einsum("tk,tkh->th", ws[s], (ids[s][:, :, None] + 1) * xs[s][:, None, :])
        np.testing.assert_allclose(np.einsum("tk,tkh->th", ws[s], y), want, rtol=1e-12, atol=1e-12)


def _block_chunk_waits(row_src_rank, row_slot, b, bm, chunk_tokens, k):
    """Twin of ep::wait_block_rows_thread: the (source, chunk) flags row block b waits on, found
    the device's way (per source: its first row, its last row by binary search), and the rows
    it read to find them."""
    src, slot = row_src_rank[b * bm:(b + 1) * bm], row_slot[b * bm:(b + 1) * bm]
    waits, reads, r = [], 0, 0
    while r < bm:
        s = src[r]
        reads += 1
        if s < 0:
            break
        end = bm - 1
        reads += 1
        if src[end] != s:
            hi, end = end, r
            while hi - end > 1:
                mid = (end + hi) // 2
                reads += 1
                if src[mid] == s:
                    end = mid
                else:
                    hi = mid
        first, last = slot[r] // (chunk_tokens * k), slot[end] // (chunk_tokens * k)
        assert first <= last
        waits += [(int(s), c) for c in range(last, first - 1, -1)]
        r = end + 1
    return waits, reads


@pytest.mark.parametrize("num_ranks,tokens,push_tasks", [(8, (50, 0, 300, 1, 77, 128, 129, 3), 3),
                                                         (6, (1000, 37, 0, 5, 256, 64), 32), (2, (777, 1000), 1)])
def test_readiness_chunks_cover_every_row(num_ranks, tokens, push_tasks):
    """The push's chunks (push task i: chunks i, i + P, ...) store every route exactly once, each
    chunk's flag after all of its rows; a row block's dispatch waits on the chunk of every row it
    holds (and only on chunks some source releases), finding them with a few reads per source."""
    rng = np.random.default_rng(num_ranks + push_tasks)
    k, el, bm = 4, 3, 8
    E = el * num_ranks
    max_tokens = max(tokens)
    chunk_tokens, chunks = readiness_chunks(max_tokens, push_tasks)
    assert chunks <= 4 * push_tasks and chunk_tokens * chunks >= max_tokens
    ids = _routing(rng, num_ranks, tokens, E, k)
    scheds = schedule_reference_all_ranks(ids, num_experts=E, num_ranks=num_ranks, block_m=bm)
    # the push: which chunk carries each route, and which chunks each source releases
    released = set()
    for s, t in enumerate(tokens):
        seen = np.zeros(t, int)
        for task in range(max(1, min(push_tasks, t))):
            for c in range(task, -(-t // chunk_tokens), max(1, min(push_tasks, t))):
                seen[c * chunk_tokens:min(t, (c + 1) * chunk_tokens)] += 1
                released.add((s, c))
        np.testing.assert_array_equal(seen, 1)
        assert all(c < chunks for (_, c) in released)
    for d, sc in enumerate(scheds):
        for b in range(sc.num_rows // bm):
            waits, reads = _block_chunk_waits(sc.row_src_rank, sc.row_slot, b, bm, chunk_tokens, k)
            assert set(waits) <= released, "a wait no source ever releases (a hang)"
            rows = range(b * bm, (b + 1) * bm)
            need = {(int(sc.row_src_rank[r]), int(sc.row_slot[r]) // (chunk_tokens * k)) for r in rows
                    if sc.row_slot[r] >= 0}
            assert need <= set(waits), f"rank {d} block {b}: a row's chunk is not awaited"
            sources = len({s for s, _ in need})
            assert reads <= 1 + sources * (2 + (bm - 1).bit_length())


def test_block_order_is_a_stable_sort_by_arrival_wave():
    """The EP block order's twin (schedule_block_order): a permutation of the blocks in use, by
    the wave of readiness chunks bringing each block's last row, equal waves in block order (an
    expert's blocks stay adjacent), unused positions in place."""
    from mok_rt.reference.schedule import block_order_reference
    rng = np.random.default_rng(5)
    P_, k, el, bm, T = 2, 4, 4, 8, 400
    ids = _routing(rng, P_, (T, T), el * P_, k)
    sc = schedule_reference_all_ranks(ids, num_experts=el * P_, num_ranks=P_, block_m=bm)[1]
    chunk_tokens, _ = readiness_chunks(T, 5)
    wave = chunk_tokens * 5 * k
    nb = sc.num_rows // bm
    order = block_order_reference(sc.row_slot, num_blocks=nb, max_blocks=nb + 3, block_m=bm, wave_routes=wave)
    assert sorted(order[:nb]) == list(range(nb)) and list(order[nb:]) == [nb, nb + 1, nb + 2]
    keys = [max(int(sc.row_slot[b * bm:(b + 1) * bm].max()), 0) // wave for b in order[:nb]]
    assert keys == sorted(keys) and len(set(keys)) > 1
    for a, b in zip(order[:nb - 1], order[1:nb]):
        ka, kb = (max(int(sc.row_slot[x * bm:(x + 1) * bm].max()), 0) // wave for x in (a, b))
        assert ka < kb or a < b


@pytest.mark.parametrize("num_ranks", [8, 6])
def test_every_rank_sees_any_rank_overflow(num_ranks):
    rng = np.random.default_rng(1)
    el, k, bm = 2, 2, 4
    E = el * num_ranks
    ids = _routing(rng, num_ranks, [20] * num_ranks, E, k)
    ids[3][:, 0] = 2 * el          # a hot expert on rank 2 ...
    ids[5][:, 0] = 2 * el + 1      # ... and its neighbour
    rows = schedule_reference_all_ranks(ids, num_experts=E, num_ranks=num_ranks, block_m=bm)
    need = max(s.num_rows for s in rows)
    assert int(np.argmax([s.num_rows for s in rows])) == 2
    for r in range(num_ranks):   # each rank's view names the same, overflowing rank
        with pytest.raises(ArgumentError, match="rank 2 receives"):
            schedule_reference(ids, num_experts=E, num_ranks=num_ranks, block_m=bm, rank=r, capacity_rows=need - bm)
        schedule_reference(ids, num_experts=E, num_ranks=num_ranks, block_m=bm, rank=r, capacity_rows=need)


def test_default_capacity_holds_the_worst_case():
    for P in (1, 2, 6, 8):
        cfg = mok.MoEConfig(hidden=64, intermediate=64, num_experts=24, top_k=3)
        cap = cfg.capacity_rows(max_tokens=100, num_ranks=P)
        el = cfg.experts_per_rank(P)
        # every route of every rank on one rank, every expert of it one row short of a block
        assert cap >= P * 100 * 3 + el * (cfg.block_m - 1)


# ---------------------------------------------------------------------------------------------
# Configurations must agree across ranks
# ---------------------------------------------------------------------------------------------

class _FakeTwoProcessGroup(ProcessGroup):
    """Rank 0 of a two-process group whose other process answers with a tampered copy."""

    def __init__(self, tamper):
        self.size, self.devices, self.local_ranks = 2, (0, 0), (0,)
        self.process_index, self.num_processes = 0, 2
        self.tamper = tamper

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        other = json.loads(data)
        if other.get("payload"):
            other["payload"]["ranks"] = [1]
            self.tamper(other["payload"])
        return [data, json.dumps(other).encode()]


def _cfg(**kw):
    base = dict(hidden=64, intermediate=64, num_experts=4, top_k=2)
    base.update(kw)
    return mok.MoEConfig(**base)


@pytest.mark.parametrize("field,value", [("num_experts", 8), ("top_k", 1), ("hidden", 128), ("swiglu_limit", 5.0),
                                         ("capacity_factor", 1.5), ("max_tokens", 63)])
def test_config_mismatch_is_named(field, value):
    def tamper(p):
        if field == "max_tokens":
            p["max_tokens"] = value
        else:
            p["config"][field] = value
    with pytest.raises(ArgumentError) as info:
        mok.Workspace(_cfg(), _FakeTwoProcessGroup(tamper), max_tokens=64, backend="reference")
    assert info.value.argument == field and "rank 1" in str(info.value), str(info.value)


def test_matching_configs_pass_the_check():
    _ep.check_same_config(_FakeTwoProcessGroup(lambda p: None), _cfg(), 64)


def _mismatch_worker(ctx, experts):
    group = ctx.group(device_id=0)
    mok.Workspace(_cfg(num_experts=experts[ctx.rank]), group, max_tokens=64, backend="reference")


def test_mismatch_raises_on_every_process():
    res = run_ranks(_mismatch_worker, 3, (4, 4, 8), timeout=120)
    for r, v in enumerate(res):
        assert isinstance(v, RankFailure) and v.type_name == "ArgumentError", (r, v)
        assert "num_experts" in v.message and "rank 2" in v.message, v.message
    # agreeing ranks get past the check (and then learn that the reference backend runs one rank)
    res = run_ranks(_mismatch_worker, 2, (4, 4), timeout=120)
    for v in res:
        assert isinstance(v, RankFailure) and v.type_name == "ArgumentError" and "backend" in v.message, v


# ---------------------------------------------------------------------------------------------
# API validation
# ---------------------------------------------------------------------------------------------

def test_workspace_validation():
    with pytest.raises(ArgumentError) as e:
        mok.Workspace(_cfg(), mok.SingleProcessGroup([0, 0]), max_tokens=8, backend="reference")
    assert e.value.argument == "backend"
    with pytest.raises(ArgumentError) as e:
        mok.Workspace(_cfg(num_experts=6), mok.SingleProcessGroup([0, 0, 0, 0]), max_tokens=8)
    assert e.value.argument == "num_experts"
    with pytest.raises(ArgumentError) as e:
        mok.Workspace(_cfg(), None, max_tokens=8, backend="reference", stream=[1, 2])
    assert e.value.argument == "stream"


def test_single_rank_workspace_stands_for_its_rank():
    with mok.Workspace(_cfg(), max_tokens=8, backend="reference") as ws:
        assert ws.local_ranks == (0,) and ws.rank_id == 0 and ws.rank(0).rank_id == 0
        ids = np.array([[0, 1], [2, 3]], np.int32)
        s = mok.schedule(ws, ids)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2, 64))
        w = [rng.standard_normal(s_) * 0.1 for s_ in ((4, 64, 64), (4, 64, 64), (4, 64, 64))]
        out, _ = mok.forward(ws.rank(0), s, x, rng.random((2, 2)), mok.ExpertWeights(*w))   # ws and ws.rank(0): one rank
        assert out.shape == (2, 64)
        with pytest.raises(ArgumentError) as e:
            ws.rank(1)
        assert e.value.argument == "rank"
        with pytest.raises(ArgumentError) as e:
            mok.schedule("not a workspace", ids)
        assert e.value.argument == "ws"


def test_peer_spec_validation():
    good = dict(peer_bases=(1 << 20, 2 << 20), peer_array=4096, routed_offset=4096, slot_offset=8192,
                flags_offset=0, end_pad_offset=512, rank=1, epoch=1, push_tasks=8, slot_rows=64, chunk_tokens=16,
                chunks=4)
    s = PeerSpec(**good)._struct()   # what the kernels get (MoEPeers mirror)
    assert (s.chunk_tokens, s.push_tasks, s.num_ranks) == (16, 8, 2) and P.MoEPeers.chunk_tokens.offset == 572
    for field, value in [("peer_bases", (1,)), ("rank", 2), ("epoch", 0), ("push_tasks", 0),
                         ("routed_offset", 4100), ("chunk_tokens", 0), ("chunks", 0)]:
        with pytest.raises(ArgumentError) as e:
            PeerSpec(**{**good, field: value})
        assert e.value.argument == field


def test_launch_checks_peers_against_dims():
    """A launch with peers needs dims.expert_parallel (the schedule's block order follows
    block_expert) and no more tokens than the chunk-flag region covers (the push writes a flag per
    chunk into every rank's block)."""
    from mok_rt.kernels import moe_launch as L
    spec = PeerSpec(peer_bases=(1 << 20, 2 << 20), peer_array=4096, routed_offset=4096, slot_offset=8192,
                    flags_offset=0, end_pad_offset=512, rank=1, epoch=1, push_tasks=8, slot_rows=4096 * 3,
                    chunk_tokens=16, chunks=4)

    def dims(tokens, ep=True):
        return L.LayerDims(tokens=tokens, hidden=256, intermediate=128, top_k=3, local_experts=2,
                           capacity_rows=4096, shared_intermediate=0, rank=1, expert_parallel=ep)

    sched = L.ScheduleBuffers(**{f.name: 4096 for f in dataclasses.fields(L.ScheduleBuffers)})
    L._check_peers(spec, sched, dims(64))   # 4 chunks of 16: fits
    for d, arg in ((dims(65), "peers"), (dims(64, ep=False), "dims")):
        with pytest.raises(ArgumentError) as e:
            L._check_peers(spec, sched, d)
        assert e.value.argument == arg
    block_expert = next(b for b in L._SCHEDULE_TABLE if b.name == "block_expert")
    assert block_expert.shape(dims(64)) == (2 * dims(64).max_blocks,)
    assert block_expert.shape(dims(64, ep=False)) == (dims(64).max_blocks,)


def test_heap_layout_is_aligned_and_disjoint():
    lay = _ep.HeapLayout.make(max_tokens=1000, top_k=3, hidden=1024, capacity_rows=6528, push_tasks=8)
    spans = [(lay.flags, lay.chunk_flags), (lay.chunk_flags, lay.exchange_pad), (lay.exchange_pad, lay.end_pad),
             (lay.end_pad, lay.control_bytes),
             (lay.routing[0], lay.routing[1]), (lay.routing[1], lay.routed), (lay.routed, lay.slot),
             (lay.slot, lay.nbytes)]
    for a, b in spans:
        assert a % 256 == 0 and a < b
    # the kernels find the chunk flags right after the per-rank flags (kChunkFlagsOffset), and the
    # region holds [chunks][kinds][MAX_EP_RANKS] int32 for every chunk of max_tokens
    assert lay.chunk_flags - lay.flags == 4 * P.NUM_PEER_FLAGS * P.MAX_EP_RANKS == P.CHUNK_FLAGS_OFFSET
    assert (lay.chunk_tokens, lay.chunks) == (32, 32)  # ceil(1000 / (4 * 8)), ceil(1000 / 32)
    assert lay.exchange_pad - lay.chunk_flags >= 4 * lay.chunks * P.CHUNK_KINDS * P.MAX_EP_RANKS
    assert lay.routing[1] - lay.routing[0] >= 16 + 4 * 1000 * 3
    assert lay.slot - lay.routed >= 6528 * 1024 * 2
    assert lay.nbytes - lay.slot >= 1000 * 3 * 1024 * 2 and lay.slot_rows == 3000


def test_task_counts_with_peers():
    d = LayerDims(tokens=300, hidden=256, intermediate=128, top_k=2, local_experts=2, capacity_rows=1024,
                  shared_intermediate=128)
    # push tasks + "rows sent" + "outputs returned"; a context-only EP launch still collects y
    assert forward_task_count(d, push_tasks=5) == forward_task_count(d) + 5 + 2
    assert forward_task_count(d, context_only=True, push_tasks=5) == \
        forward_task_count(d, context_only=True) + 5 + 2 + d.token_blocks * combine_parts(d.token_blocks)
    assert backward_task_count(d, push_tasks=5) == backward_task_count(d) + 5 + 2


def test_schedule_prepare_loads_every_schedule_kernel():
    """With lazy loading a kernel's first launch can wait for the running kernels (a peer wait
    among them), so prepare() must load every kernel the schedule cubin has before any launch."""
    import re
    from pathlib import Path
    from mok_rt.kernels import schedule
    root = Path(__file__).resolve().parent.parent
    defined = set(re.findall(r'__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(',
                             (root / "cuda_src/moe/schedule.cu").read_text()))
    launched = set(re.findall(r'get_kernel\(_CUBIN,\s*"(\w+)"', Path(schedule.__file__).read_text()))
    assert defined and launched <= defined
    assert sorted(defined - set(schedule.KERNELS)) == []
