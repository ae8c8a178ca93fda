"""The task order of the TMA kernels (ws::AheadOrder and ws::BlockGroups in
cuda_src/moe/ws_pipeline.cuh, make_order in tma_forward.cuh / tma_backward.cuh), mirrored here line
by line and checked without a GPU: every plan task grabbed exactly once, every task after the
tasks it waits on (so the task-graph argument of task_graph.cuh holds), and the row-block GEMM
phase after it (forward down, backward dX) walked tile-major inside block groups (the tasks that share
a weight tile grabbed together)."""
from __future__ import annotations

import pytest

from mok_rt import _moe_launch as L

BLOCK_GROUP = 8  # ws::kBlockGroup


def _cdiv(a, b):
    return -(-a // b)


class _Range:
    def __init__(self, begin, count):
        self.begin, self.count = begin, count

    def has(self, t):
        return self.begin <= t < self.begin + self.count


class _Groups:  # ws::BlockGroups
    def __init__(self, blocks, per_block, group):
        self.blocks, self.per_block, self.group = blocks, per_block, group

    def map(self, j):
        span = self.group * self.per_block
        gi, w = divmod(j, span)
        first = gi * self.group
        size = min(self.group, self.blocks - first)
        tile = w // size
        return (first + (w - tile * size)) * self.per_block + tile


class _Ahead:  # ws::AheadOrder
    def __init__(self, lead, dispatch, gemm, trail, per_block, tiled, tiled_per_block, grid):
        self.lead, self.dispatch, self.gemm, self.trail, self.tiled = lead, dispatch, gemm, trail, tiled
        self.per_block = per_block
        self.begin = min(lead.begin, dispatch.begin, trail.begin if trail.count > 0 else dispatch.begin)
        self.end = self.begin + lead.count + dispatch.count + gemm.count + trail.count
        self.ahead = min(dispatch.count, _cdiv(2 * grid, per_block + 1))
        self.tiled_walk = _Groups(tiled.count // tiled_per_block if tiled_per_block else 0, tiled_per_block,
                                  BLOCK_GROUP)

    def map(self, t):
        if self.tiled.has(t):
            return self.tiled.begin + self.tiled_walk.map(t - self.tiled.begin)
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


def _ranges(phases):
    rng, at = {}, 0
    for name, n in phases:
        rng[name] = _Range(at, n)
        at += n
    return rng, at


def _order(kind, dims, push, grid):
    """TmaForward::make_order / TmaBackward::make_order on the plan of forward/backward_phases."""
    if kind == "forward":
        rng, total = _ranges(L.forward_phases(dims, push_tasks=push, engine="tma"))
        lead, dispatch, gemm, tiled = rng["shared_gate_up"], rng["dispatch"], rng["routed_gate_up"], rng["routed_down"]
        trail = _Range(dispatch.begin, 0)
    else:
        rng, total = _ranges(L.backward_phases(dims, push_tasks=push, engine="tma"))
        dispatch, gemm, tiled = rng["dispatch"], rng["routed_da"], rng["routed_dx"]
        if push:
            lead = _Range(rng["d_weights"].begin, rng["d_weights"].count + rng["shared_da"].count)
            trail = _Range(dispatch.begin, 0)
        else:
            lead, trail = rng["shared_da"], rng["d_weights"]
    blocks = dispatch.count
    per_block, tiled_per_block = gemm.count // blocks, tiled.count // blocks
    o = _Ahead(lead, dispatch, gemm, trail, per_block, tiled, tiled_per_block, grid)
    return o, rng, total, blocks, per_block, tiled_per_block


def _dims(T, H, I, Is, E, k=4):
    R = _cdiv(T * k, 128) * 128 + E * 128
    return L.LayerDims(tokens=T, hidden=H, intermediate=I, top_k=k, local_experts=E, capacity_rows=R,
                       shared_intermediate=Is)


CASES = [(1000, 1024, 512, 0, 16), (517, 2048, 768, 256, 12), (1, 512, 256, 128, 4), (4096, 2048, 768, 0, 128),
         (8192, 7168, 2048, 0, 256)]


@pytest.mark.parametrize("kind", ["forward", "backward"])
@pytest.mark.parametrize("push", [0, 7])
@pytest.mark.parametrize("T,H,I,Is,E", CASES)
@pytest.mark.parametrize("grid", [132, 6, 1])
def test_order_is_a_permutation_that_respects_dependencies(kind, push, T, H, I, Is, E, grid):
    o, rng, total, blocks, g, tg = _order(kind, _dims(T, H, I, Is, E), push, grid)
    order = [o.map(t) for t in range(total)]
    assert sorted(order) == list(range(total))
    pos = {task: at for at, task in enumerate(order)}
    gemm, dispatch, tiled = o.gemm, o.dispatch, o.tiled
    for b in range(blocks):
        d = pos[dispatch.begin + b]
        last_gemm = max(pos[gemm.begin + b * g + n] for n in range(g))
        assert min(pos[gemm.begin + b * g + n] for n in range(g)) > d, (b, "GEMM tile before its dispatch")
        # the tiled phase (down / dX) of block b after every GEMM tile of b it waits on
        assert min(pos[tiled.begin + b * tg + n] for n in range(tg)) > last_gemm
    # phases outside the reordered range keep their plan positions as a set (later phases wait on
    # earlier ones as wholes: combine after every down / dX tile, and so on)
    for name, r in rng.items():
        if r.count and not (o.begin <= r.begin < o.end):
            assert sorted(pos[t] for t in range(r.begin, r.begin + r.count)) == list(range(r.begin, r.begin + r.count)), name


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_block_groups_walk_tile_major(kind):
    """deepseek-v3 sizes: the blocks of a group take one weight tile in consecutive grabs."""
    o, rng, total, blocks, g, tg = _order(kind, _dims(8192, 7168, 2048, 0, 256, k=8), 0, 132)
    assert o.tiled_walk.group == BLOCK_GROUP
    tiled = o.tiled
    walk = [o.map(tiled.begin + j) - tiled.begin for j in range(2 * BLOCK_GROUP * tg)]
    for j, q in enumerate(walk):
        group, w = divmod(j, BLOCK_GROUP * tg)
        assert q % tg == w // BLOCK_GROUP            # the tile
        assert q // tg == group * BLOCK_GROUP + w % BLOCK_GROUP  # the block
    # the GEMM phase after dispatch stays block-major: all tiles of block b, then block b + 1
    gemm_tasks = [t - o.gemm.begin for t in (o.map(u) for u in range(total)) if o.gemm.has(t)]
    assert gemm_tasks == list(range(o.gemm.count))


def test_groups_cover_a_partial_last_group():
    w = _Groups(blocks=11, per_block=3, group=4)
    got = [w.map(j) for j in range(33)]
    assert sorted(got) == list(range(33))
    assert [q // 3 for q in got[24:]] == [8, 9, 10] * 3   # last group: 3 blocks, tile-major
