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


class _ExpertWalk:  # ws::ExpertWalk; sched = (block_expert, expert_offset, expert_count) or None
    def __init__(self, sched, experts, num_blocks, max_blocks):
        self.sched, self.experts, self.num_blocks, self.max_blocks = sched, experts, num_blocks, max_blocks

    def map(self, q, per_block):
        b = q // per_block
        if b >= self.num_blocks or self.sched is None:
            return q
        block_expert, expert_offset, expert_count = self.sched
        e = block_expert[b]
        if e < 0 or e >= self.experts:
            return q
        s, m = expert_offset[e] // 128, _cdiv(expert_count[e], 128)
        if m <= 1 or m > self.max_blocks or b < s or b >= s + m:
            return q
        j = q - s * per_block
        n = j // m
        return (s + (j - n * m)) * per_block + n


class _Ahead:  # ws::AheadOrder
    def __init__(self, lead, dispatch, gemm, trail, per_block, tiled, tiled_per_block, grid, sched=None,
                 experts=0, num_blocks=0):
        self.lead, self.dispatch, self.gemm, self.trail, self.tiled = lead, dispatch, gemm, trail, tiled
        self.per_block = per_block
        self.begin = min(lead.begin, dispatch.begin, trail.begin if trail.count > 0 else dispatch.begin)
        self.end = self.begin + lead.count + dispatch.count + gemm.count + trail.count
        self.ahead = min(dispatch.count, _cdiv(2 * grid, per_block + 1))
        self.tiled_walk = _Groups(tiled.count // tiled_per_block if tiled_per_block else 0, tiled_per_block,
                                  BLOCK_GROUP)
        self.gemm_walk = _ExpertWalk(sched, experts, min(num_blocks, dispatch.count), self.ahead + 1)

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
            return self.dispatch.begin + b + d if r == 0 else self.gemm.begin + self.gemm_walk.map(b * g + (r - 1), g)
        u -= mid
        if u < d * g:
            return self.gemm.begin + self.gemm_walk.map((blocks - d) * g + u, g)
        return self.trail.begin + (u - d * g)


def _ranges(phases):
    rng, at = {}, 0
    for name, n in phases:
        rng[name] = _Range(at, n)
        at += n
    return rng, at


def _order(kind, dims, push, grid, sched=None, num_blocks=0):
    """TmaForward::make_order / TmaBackward::make_order on the plan of forward/backward_phases."""
    if kind == "forward":
        rng, total = _ranges(L.forward_phases(dims, push_tasks=push))
        lead, dispatch, gemm, tiled = rng["shared_gate_up"], rng["dispatch"], rng["routed_gate_up"], rng["routed_down"]
        trail = _Range(dispatch.begin, 0)
    else:
        rng, total = _ranges(L.backward_phases(dims, push_tasks=push))
        dispatch, gemm, tiled = rng["dispatch"], rng["routed_da"], rng["routed_dx"]
        if push:
            lead = _Range(rng["d_weights"].begin, rng["d_weights"].count + rng["shared_da"].count)
            trail = _Range(dispatch.begin, 0)
        else:
            lead, trail = rng["shared_da"], rng["d_weights"]
    blocks = dispatch.count
    per_block, tiled_per_block = gemm.count // blocks, tiled.count // blocks
    o = _Ahead(lead, dispatch, gemm, trail, per_block, tiled, tiled_per_block, grid, sched, dims.local_experts,
               num_blocks)
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
    # without a schedule (ExpertWalk off) the GEMM phase after dispatch is block-major
    gemm_tasks = [t - o.gemm.begin for t in (o.map(u) for u in range(total)) if o.gemm.has(t)]
    assert gemm_tasks == list(range(o.gemm.count))


def test_groups_cover_a_partial_last_group():
    w = _Groups(blocks=11, per_block=3, group=4)
    got = [w.map(j) for j in range(33)]
    assert sorted(got) == list(range(33))
    assert [q // 3 for q in got[24:]] == [8, 9, 10] * 3   # last group: 3 blocks, tile-major


def _schedule(rng, dims, counts):
    """A schedule of the schedule kernel's shape: expert e's rows padded to blocks, in expert order."""
    E = dims.local_experts
    expert_count = list(counts)
    expert_offset, at = [], 0
    for c in expert_count:
        expert_offset.append(at)
        at += _cdiv(c, 128) * 128
    expert_offset.append(at)
    num_blocks = at // 128
    max_blocks = dims.capacity_rows // 128
    block_expert = [-1] * max_blocks
    for e in range(E):
        for b in range(expert_offset[e] // 128, expert_offset[e + 1] // 128):
            block_expert[b] = e
    # stale ids past num_blocks (a previous launch's) must not change the walk
    for b in range(num_blocks, max_blocks):
        block_expert[b] = int(rng.integers(0, E))
    return (block_expert, expert_offset, expert_count), num_blocks


@pytest.mark.parametrize("kind", ["forward", "backward"])
@pytest.mark.parametrize("push", [0, 7])
@pytest.mark.parametrize("grid", [132, 6])
@pytest.mark.parametrize("seed", range(4))
def test_expert_walk_is_a_permutation_that_respects_dependencies(kind, push, grid, seed):
    """The gate|up / dA phase with a device schedule: skewed, empty and one-block experts, and
    experts longer than the walk allows (block-major); tile n of an expert's blocks in consecutive grabs."""
    import numpy as np
    rng = np.random.default_rng(seed)
    E, k, T = 24, 4, 3000
    dims = _dims(T, 1024, 512, 0, E, k=k)
    counts = rng.multinomial(T * k, rng.dirichlet(np.full(E, 0.3)))
    counts[int(rng.integers(0, E))] = 0
    sched, num_blocks = _schedule(rng, dims, counts)
    o, rng_, total, blocks, g, tg = _order(kind, dims, push, grid, sched, num_blocks)
    order = [o.map(t) for t in range(total)]
    assert sorted(order) == list(range(total))
    pos = {task: at for at, task in enumerate(order)}
    for b in range(blocks):
        first = min(pos[o.gemm.begin + b * g + n] for n in range(g))
        assert first > pos[o.dispatch.begin + b], (b, "GEMM tile before its dispatch")
        last = max(pos[o.gemm.begin + b * g + n] for n in range(g))
        assert min(pos[o.tiled.begin + b * tg + n] for n in range(tg)) > last
    walked = 0
    _, expert_offset, expert_count = sched
    for e in range(E):
        s, m = expert_offset[e] // 128, _cdiv(expert_count[e], 128)
        tiles = sorted(((pos[o.gemm.begin + b * g + n], b, n) for b in range(s, s + m) for n in range(g)))
        if 2 <= m <= o.ahead + 1:
            walked += 1
            assert [(b, n) for _, b, n in tiles] == [(s + i % m, i // m) for i in range(m * g)], e
        else:
            assert [(b, n) for _, b, n in tiles] == [(s + i // g, i % g) for i in range(m * g)], e
    assert walked > 0
