"""The task order of clusters of two (engine "tma2": ws::PairOrder over ws::AheadOrder in
cuda_src/moe/ws_pipeline.cuh, TmaForward::make_pairs in tma_forward.cuh), mirrored here line by
line and checked without a GPU: every plan task exactly once, the two tasks of a pair from one
phase and independent, row-block GEMM pairs on the same tile of row blocks 2q and 2q + 1, and
every task after the tasks it waits on (so the task-graph argument holds for pairs)."""
from __future__ import annotations

import pytest

from mok_rt import _moe_launch as L


def _cdiv(a, b):
    return -(-a // b)


class _Range:
    def __init__(self, begin, count):
        self.begin, self.count = begin, count


class _Ahead:  # ws::AheadOrder
    def __init__(self, lead, dispatch, gemm, trail, per_block, grid):
        self.lead, self.dispatch, self.gemm, self.trail, self.per_block = lead, dispatch, gemm, trail, per_block
        self.begin = min(lead.begin, dispatch.begin, trail.begin if trail.count > 0 else dispatch.begin)
        self.end = self.begin + lead.count + dispatch.count + gemm.count + trail.count
        self.ahead = min(dispatch.count, _cdiv(2 * grid, per_block + 1))

    def map(self, t):
        if t < self.begin or t >= self.end:
            return t
        u = t - self.begin
        if u < self.lead.count:
            return self.lead.begin + u
        u -= self.lead.count
        blocks, g, d = self.dispatch.count, self.per_block, self.ahead
        if u < d:
            return self.dispatch.begin + u
        u -= d
        mid = (blocks - d) * (g + 1)
        if u < mid:
            b, r = divmod(u, g + 1)
            return self.dispatch.begin + b + d if r == 0 else self.gemm.begin + b * g + (r - 1)
        u -= mid
        if u < d * g:
            return self.gemm.begin + (blocks - d) * g + u
        return self.trail.begin + (u - d * g)


class _Pairs:  # ws::PairOrder
    def __init__(self):
        self.begin, self.tasks, self.tiles, self.pair0 = [], [], [], [0]

    def add(self, begin, count, tiles=0):
        self.begin.append(begin)
        self.tasks.append(count)
        self.tiles.append(tiles)
        pairs = _cdiv(count // tiles, 2) * tiles if tiles else _cdiv(count, 2)
        self.pair0.append(self.pair0[-1] + pairs)
        return len(self.begin) - 1

    def pairs_of(self, i):
        return _Range(self.pair0[i], self.pair0[i + 1] - self.pair0[i])

    def task(self, pair, rank):
        u = self.order.map(pair)
        i = 0
        while i + 1 < len(self.begin) and u >= self.pair0[i + 1]:
            i += 1
        j = u - self.pair0[i]
        if self.tiles[i]:
            t = self.tiles[i]
            blk = 2 * (j // t) + rank
            return self.begin[i] + blk * t + j % t if blk < self.tasks[i] // t else -1
        q = 2 * j + rank
        return self.begin[i] + q if q < self.tasks[i] else -1


def _forward_pairs(dims, push, grid, context_only=False):
    """TmaForward::make_pairs on the plan of forward_phases (engine "tma2")."""
    phases = L.forward_phases(dims, context_only=context_only, push_tasks=push, engine="tma2")
    rng, at = {}, 0
    for name, n in phases:
        rng[name] = (at, n)
        at += n
    gu_tiles = _cdiv(dims.intermediate, 128)
    h_tiles = _cdiv(dims.hidden, 256)
    o = _Pairs()
    ep = push > 0
    o.add(*rng.get("push", (rng["dispatch"][0], 0)))
    o.add(*rng.get("push_notify", (rng["dispatch"][0], 0)))
    first = o.add(*rng["shared_gate_up" if ep else "dispatch"])
    second = o.add(*rng["dispatch" if ep else "shared_gate_up"])
    sgu, disp = (first, second) if ep else (second, first)
    gu = o.add(*rng["routed_gate_up"], tiles=gu_tiles)
    o.add(*rng["shared_down"])
    o.add(*rng["routed_down"], tiles=h_tiles)
    o.add(*rng.get("down_notify", (rng["combine"][0], 0)))
    o.add(*rng["combine"])
    d = o.pairs_of(disp)
    o.order = _Ahead(o.pairs_of(sgu), d, o.pairs_of(gu), _Range(d.begin, 0), gu_tiles, grid // 2)  # clusters
    return o, rng, gu_tiles, h_tiles


def _phase_of(rng, t):
    for name, (b, n) in rng.items():
        if b <= t < b + n:
            return name
    raise AssertionError(t)


@pytest.mark.parametrize("push", [0, 8, 7])
@pytest.mark.parametrize("T,H,I,Is,E", [(1000, 1024, 512, 0, 16), (517, 2048, 768, 256, 12), (1, 512, 256, 128, 4),
                                        (4096, 2048, 768, 0, 128)])
@pytest.mark.parametrize("grid", [132, 6])
@pytest.mark.parametrize("context_only", [False, True])
def test_pairs_cover_the_plan_and_respect_its_dependencies(push, T, H, I, Is, E, grid, context_only):
    k = 4
    R = _cdiv(T * k, 128) * 128 + E * 128
    dims = L.LayerDims(tokens=T, hidden=H, intermediate=I, top_k=k, local_experts=E, capacity_rows=R,
                       shared_intermediate=Is, swiglu_limit=None)
    o, rng, gu_tiles, h_tiles = _forward_pairs(dims, push, grid, context_only)
    total = sum(n for _, n in L.forward_phases(dims, context_only=context_only, push_tasks=push, engine="tma2"))
    num_pairs = o.pair0[-1]
    position = {}
    empty_pairs = 0
    for p in range(num_pairs):
        t0, t1 = o.task(p, 0), o.task(p, 1)
        empty_pairs += t0 < 0 and t1 < 0
        names = {_phase_of(rng, t) for t in (t0, t1) if t >= 0}
        assert len(names) <= 1, (p, t0, t1, names)      # a pair never spans two phases
        for t in (t0, t1):
            if t >= 0:
                assert t not in position, t
                position[t] = p
        if names & {"routed_gate_up", "routed_down"} and t0 >= 0 and t1 >= 0:
            name = names.pop()
            b, _ = rng[name]
            tiles = gu_tiles if name == "routed_gate_up" else h_tiles
            (b0, n0), (b1, n1) = divmod(t0 - b, tiles), divmod(t1 - b, tiles)
            assert n0 == n1 and b0 % 2 == 0 and b1 == b0 + 1
    assert sorted(position) == list(range(total))
    assert empty_pairs == 0   # a pair always holds at least one task (phases are cut, not padded)
    mb = dims.max_blocks

    def pos(name, i):
        return position[rng[name][0] + i]
    # F2 (block b, tile n) after F0 (block b); F4 after every F2 of its block; the notifies and
    # combines after what they count; the tasks of one pair never wait on each other.
    for blk in range(mb):
        for n in range(gu_tiles):
            assert pos("dispatch", blk) < pos("routed_gate_up", blk * gu_tiles + n)
        for h in range(h_tiles):
            assert max(pos("routed_gate_up", blk * gu_tiles + n) for n in range(gu_tiles)) < \
                pos("routed_down", blk * h_tiles + h)
    if push:
        assert max(pos("push", i) for i in range(push)) < pos("push_notify", 0)
        assert pos("push_notify", 0) < min(pos("dispatch", b) for b in range(mb))
        assert max(pos("routed_down", i) for i in range(rng["routed_down"][1])) < pos("down_notify", 0)
    for tb in range(rng["combine"][1]):
        assert max(pos("routed_down", i) for i in range(rng["routed_down"][1])) < pos("combine", tb)
