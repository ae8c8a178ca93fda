"""The megakernels' task plan (mok_rt/kernels/moe_plan.py, read by the kernels as MoEForwardPlan /
MoEBackwardPlan in cuda_src/moe/params.cuh), checked as a plan without a GPU: phases contiguous and
covering [0, total), every dependency's producer phase before its consumers (the kernels' tasks
wait only on lower-indexed tasks), signal targets equal to what the producers signal, the counter
layout inside its allocation, and the variants (expert parallelism, shared expert, context only,
T = 0)."""
from __future__ import annotations

import ctypes
import itertools

import pytest

from mok_rt.kernels import moe_launch as L
from mok_rt.kernels import moe_params as P
from mok_rt.kernels import moe_plan as _moe_plan


def _dims(T, H, I, Is, E, k=4):
    R = -(-T * k // 128) * 128 + E * 128
    return L.LayerDims(tokens=T, hidden=H, intermediate=I, top_k=k, local_experts=E, capacity_rows=R,
                       shared_intermediate=Is)


CASES = [(1000, 1024, 512, 0, 16), (517, 2048, 768, 256, 12), (1, 512, 256, 128, 4), (4096, 2048, 768, 0, 128),
         (8192, 7168, 2048, 0, 256), (0, 320, 192, 320, 5), (20000, 64, 64, 64, 1)]


def _plans():
    for (T, H, I, Is, E), push in itertools.product(CASES, (0, 7)):
        d = _dims(T, H, I, Is, E)
        for ctx in (False, True):
            yield d, push, L.forward_plan(d, context_only=ctx, push_tasks=push)
        yield d, push, L.backward_plan(d, push_tasks=push)


PLANS = list(_plans())


@pytest.mark.parametrize("d,push,plan", PLANS)
def test_phases_are_contiguous_and_cover_the_index_space(d, push, plan):
    at = 0
    for ph in plan.phases:
        assert ph.begin == at and ph.count >= 0, ph
        at = ph.end
    assert at == plan.total
    assert len({ph.name for ph in plan.phases}) == len(plan.phases)
    for t in {0, plan.total // 2, plan.total - 1} if plan.total else ():
        ph = plan.phase(plan.phase_of(t))
        assert ph.begin <= t < ph.end


@pytest.mark.parametrize("d,push,plan", PLANS)
def test_producers_precede_consumers_and_targets_match_what_they_signal(d, push, plan):
    for w in plan.waits:
        prod = plan.phase(w.producer)
        for c in w.consumers:
            cons = plan.phase(c)
            if prod.count and cons.count:
                assert prod.end <= cons.begin, (w.counter, w.producer, c)
        # Each producer task signals its counter element once: the elements together expect
        # exactly the producer's tasks (a waiter would hang on fewer, run early on more).
        if prod.count:
            assert w.target * w.units == prod.count, (w.counter, w.target, w.units, prod.count)
        assert w.counter in {c.name for c in plan.counters}


@pytest.mark.parametrize("d,push,plan", PLANS)
def test_counter_layout_is_disjoint_inside_the_allocation(d, push, plan):
    at = 0
    for c in plan.counters:
        assert c.offset == at and c.length >= 1 or c.length == 0, c
        at = c.offset + c.length
    assert at == plan.counter_words
    ptrs = plan.counter_pointers(1 << 20)
    cls = P.MoEForwardCounters if plan.kind == "forward" else P.MoEBackwardCounters
    assert list(ptrs) == [n for n, _ in cls._fields_]


@pytest.mark.parametrize("d,push,plan", PLANS)
def test_struct_carries_every_field(d, push, plan):
    s = plan.struct()
    assert s.total == plan.total
    for ph in plan.phases:
        assert (getattr(s, ph.name).begin, getattr(s, ph.name).count) == (ph.begin, ph.count)
    for w in plan.waits:
        assert getattr(s, w.field) == w.target
    raw = bytes(s)
    assert len(raw) == ctypes.sizeof(type(s))


def test_variants():
    d = _dims(1000, 1024, 512, 256, 16)
    one = L.forward_plan(d)
    assert [ph.name for ph in one.phases if ph.count] == [
        "dispatch", "shared_gu", "routed_gu", "shared_down", "routed_down", "combine"]
    # With EP the shared expert's gate|up runs while the rows travel, before the dispatch, and a
    # context-only launch still collects its routes' outputs (combine).
    ep = L.forward_plan(d, push_tasks=4)
    assert [ph.name for ph in ep.phases][:4] == ["push", "push_notify", "shared_gu", "dispatch"]
    assert ep.total == one.total + 4 + 2
    assert L.forward_plan(d, context_only=True).phase("combine").count == 0
    assert L.forward_plan(d, context_only=True).phase("shared_down").count == 0
    assert L.forward_plan(d, context_only=True, push_tasks=4).phase("combine").count > 0
    bwd = L.backward_plan(d, push_tasks=4)
    assert [ph.name for ph in bwd.phases][:5] == ["push", "push_notify", "d_weights", "shared_da", "dispatch"]
    assert L.backward_plan(d).phases[-1].name == "combine"
    # No shared expert: no shared phases, and nothing waits on the shared counters.
    ns = L.backward_plan(_dims(1000, 1024, 512, 0, 16))
    assert all(ns.phase(n).count == 0 for n in ("shared_da", "shared_dx", "shared_wgrad"))
    # T = 0: nothing to run in a forward; a backward still writes the weight gradients.
    z = _dims(0, 320, 192, 320, 5)
    assert L.forward_plan(z).phase("routed_gu").count > 0   # capacity-sized, skipped on the device
    assert all(L.forward_plan(z).phase(n).count == 0 for n in ("shared_gu", "shared_down", "combine"))
    assert L.backward_plan(z).phase("wgrad_down").count > 0


def test_tile_counts():
    d = L.LayerDims(tokens=16384, hidden=2048, intermediate=768, top_k=8, local_experts=128,
                    capacity_rows=16384 * 8 + 128 * 128)
    f, b = L.forward_plan(d).tiles, L.backward_plan(d).tiles
    assert (f["gu_tiles"], f["h_tiles"], f["combine_parts"]) == (6, 8, 2)   # 768 / 128, 2048 / 256, 128 blocks
    assert (b["i_tiles"], b["h_tiles"], b["h_rows"], b["i_rows"]) == (3, 8, 16, 6)
    assert [_moe_plan.combine_parts(n) for n in (1, 8, 9, 16, 63, 64, 127, 128, 255, 256, 1000)] == \
        [32, 32, 32, 16, 8, 4, 4, 2, 2, 1, 1]
    for n in range(1, 300):   # at least 256 combine tasks where 32 parts allow; a power of two (divides 128)
        parts = _moe_plan.combine_parts(n)
        assert 128 % parts == 0 and (n * parts >= 256 or parts == 32) and (parts == 1 or n * parts // 2 < 256)


# ---- the grab order with expert parallelism (cuda_src/moe/pipeline/task_order.cuh) --------------

def _ahead_map(plan, names, *, per_block, tiled_per_block, grid, num_blocks, order=None, waves=2,
               dispatch_wave=False, walk=None, trail=None, walk_extra=0):
    """Python twin of pipe::AheadOrderOf<Blocks, waves, dispatch_wave>::map: grab position -> plan
    task.  ``names``: the lead, dispatch, GEMM and tiled phases; ``trail``: the trail phase's name
    (None: empty).  ``order``: the schedule's block order (ScheduledBlocks; the expert walk is then
    off); None: plan block order, with the expert walk over ``walk`` = (block_expert,
    expert_offset, expert_count) when given.  ``walk_extra``: added to the walk's block cap (a
    mutation: the tests show that a longer walk breaks the order)."""
    lead, dispatch, gemm, tiled = (plan.phase(n) for n in names)
    tr = plan.phase(trail) if trail else None
    trail_count = tr.count if tr else 0
    begin = min(lead.begin, dispatch.begin, tr.begin if trail_count else dispatch.begin)
    end = begin + lead.count + dispatch.count + gemm.count + trail_count
    in_waves = -(-waves * grid // (per_block + 1))
    ahead = min(dispatch.count, grid if dispatch_wave and grid > in_waves else in_waves)
    order_blocks = min(num_blocks, dispatch.count)
    walk_max = min(ahead, -(-2 * grid // (per_block + 1))) + 1 + walk_extra   # pipe::kWalkWaves = 2

    def block_at(i):
        if order is None:
            return i
        return order[i] if i < order_blocks and 0 <= order[i] < order_blocks else i

    def walked(q, per):   # pipe::ExpertWalk::map
        b = q // per
        if walk is None or b >= order_blocks:
            return q
        block_expert, offset, count = walk
        e = block_expert[b]
        s, m = offset[e] // 128, -(-count[e] // 128)
        if m <= 1 or m > walk_max or b < s or b >= s + m:
            return q
        j = q - s * per
        n = j // m
        return (s + (j - n * m)) * per + n

    def permuted(q, per):
        return block_at(q // per) * per + q % per

    def gemm_tile(q, per):
        return permuted(q, per) if order is not None else walked(q, per)

    def groups(j, blocks, per, group=8):
        span = group * per
        gi, w = divmod(j, span)
        first = gi * group
        size = min(group, blocks - first)
        tile = w // size
        return (first + (w - tile * size)) * per + tile

    def f(t):
        if tiled.begin <= t < tiled.begin + tiled.count:
            return tiled.begin + permuted(groups(t - tiled.begin, tiled.count // tiled_per_block, tiled_per_block),
                                          tiled_per_block)
        if t < begin or t >= end:
            return t
        u = t - begin
        if u < lead.count:
            return lead.begin + u
        u -= lead.count
        blocks, g, d = dispatch.count, per_block, ahead
        if u < d:
            return dispatch.begin + block_at(u)
        u -= d
        mid = (blocks - d) * (g + 1)
        if u < mid:
            b, r = divmod(u, g + 1)
            return dispatch.begin + block_at(b + d) if r == 0 else gemm.begin + gemm_tile(b * g + r - 1, g)
        u -= mid
        if u < d * g:
            return gemm.begin + gemm_tile((blocks - d) * g + u, g)
        return tr.begin + (u - d * g)
    f.ahead, f.walk_max = ahead, walk_max
    return f


def _check_waits(plan, f, *, nb, gu, hd, names=("dispatch", "routed_gu", "routed_down")):
    """f is a permutation of the plan in which every block's first GEMM tiles (gate|up, dA) come
    after its dispatch and its second (down, dX) after all of its first; returns grab position by
    task."""
    where = {}
    for t in range(plan.total):
        task = f(t)
        assert task not in where and 0 <= task < plan.total
        where[task] = t
    disp, rgu, rdown = (plan.phase(n) for n in names)
    for b in range(nb):
        at_dispatch = where[disp.begin + b]
        gu_at = [where[rgu.begin + b * gu + n] for n in range(gu)]
        assert min(gu_at) > at_dispatch, b
        assert min(where[rdown.begin + b * hd + h] for h in range(hd)) > max(gu_at), b
    return where


def _schedule(rng, T, E, k, mb, *, sizes=None):
    """A routing's schedule arrays as the kernels read them: (block_expert [mb], expert_offset
    (rows, multiples of 128), expert_count), and the blocks in use.  Skewed top-k routing (each
    token picks k distinct experts, Gumbel top-k over Dirichlet weights), or ``sizes``: given
    per-expert row counts."""
    import numpy as np
    if sizes is None:
        logp = np.log(rng.dirichlet(np.full(E, 0.3)) + 1e-12)
        ids = np.argsort(-(logp + rng.gumbel(size=(T, E))), axis=1)[:, :k]
        count = np.bincount(ids.ravel(), minlength=E)
    else:
        count = np.asarray(sizes)
    blocks = -(-count // 128)
    offset = np.concatenate([[0], np.cumsum(blocks)[:-1]]) * 128
    nb = int(blocks.sum())
    assert nb <= mb
    block_expert = np.full(mb, -1)
    for e in range(E):
        block_expert[offset[e] // 128: offset[e] // 128 + blocks[e]] = e
    return (block_expert, offset, count), nb


_FP8_FWD = ("shared_gu", "dispatch", "routed_gu", "routed_down")


@pytest.mark.parametrize("grid", [132, 66, 8])
@pytest.mark.parametrize("T,H,I,E,k", [(8192, 7168, 2048, 32, 8), (4096, 2048, 768, 16, 4), (300, 512, 256, 5, 2)])
def test_fp8_order_keeps_every_task_after_what_it_waits_on(grid, T, H, I, E, k):
    """The FP8 kernels' orders (pipe::AheadOrder: D = max(grid, four waves), the expert walk over
    the schedule): permutations of the FP8 forward and backward plans with every wait satisfied by
    earlier grabs, for empty experts, experts of one block, of a few and of more than the walk
    takes."""
    import numpy as np
    d = _dims(T, H, I, 0, E, k)
    walk, nb = _schedule(np.random.default_rng(T + grid), T, E, k, d.max_blocks)
    plan = _moe_plan.forward_plan(d, precision="fp8_block")
    st = plan.struct()
    f = _ahead_map(plan, _FP8_FWD, per_block=st.gu_tiles, tiled_per_block=st.h_tiles, grid=grid, num_blocks=nb,
                   waves=4, dispatch_wave=True, walk=walk)
    where = _check_waits(plan, f, nb=nb, gu=st.gu_tiles, hd=st.h_tiles)
    disp = plan.phase("dispatch")
    four_waves = -(-4 * grid // (st.gu_tiles + 1))
    assert f.ahead == min(disp.count, max(grid, four_waves))
    # the first `ahead` grabs after quant_x are dispatches (every CTA starts by copying rows)
    assert sorted(where[disp.begin + b] for b in range(f.ahead)) == list(range(disp.begin, disp.begin + f.ahead))
    # The backward (TmaBackwardFp8::make_order, one GPU): lead shared dA, dispatch, dA tiles, trail
    # the d_weights tasks, tiled dX.
    bplan = _moe_plan.backward_plan(d, precision="fp8_block")
    bs = bplan.struct()
    fb = _ahead_map(bplan, ("shared_da", "dispatch", "routed_da", "routed_dx"), per_block=bs.i_tiles,
                    tiled_per_block=bs.h_tiles, grid=grid, num_blocks=nb, waves=4, dispatch_wave=True, walk=walk,
                    trail="d_weights")
    _check_waits(bplan, fb, nb=nb, gu=bs.i_tiles, hd=bs.h_tiles, names=("dispatch", "routed_da", "routed_dx"))


@pytest.mark.parametrize("grid", [132, 8])
def test_fp8_expert_walk_stops_at_its_bound(grid):
    """Experts of exactly the walk's longest length are walked tile-major and keep the order; a
    walk over an expert twice the look-ahead long (a mutated cap) puts a tile before its block's
    dispatch.  (m <= ahead + 1 is what the kernel's argument needs; with per_block tiles the walk
    first breaks the order near m = ahead * per_block / (per_block - 1).)"""
    import numpy as np
    T, E, k = 65536, 8, 8   # an expert of 2 x 132 + 4 blocks needs that many tokens
    d = _dims(T, 7168, 2048, 0, E, k)
    plan = _moe_plan.forward_plan(d, precision="fp8_block")
    st = plan.struct()
    kw = dict(per_block=st.gu_tiles, tiled_per_block=st.h_tiles, grid=grid, waves=4, dispatch_wave=True)
    cap = _ahead_map(plan, _FP8_FWD, num_blocks=0, **kw).walk_max   # the longest expert walked tile-major
    ahead = _ahead_map(plan, _FP8_FWD, num_blocks=0, **kw).ahead
    # expert 0: small; expert 1: the cap exactly; expert 2: 2 ahead + 4 blocks
    long = 2 * ahead + 4
    sizes = [300, 128 * cap, 128 * long] + [128] * (E - 3)
    walk, nb = _schedule(np.random.default_rng(0), T, E, k, d.max_blocks, sizes=sizes)
    good = _ahead_map(plan, _FP8_FWD, num_blocks=nb, walk=walk, **kw)
    where = _check_waits(plan, good, nb=nb, gu=st.gu_tiles, hd=st.h_tiles)
    s1 = walk[1][1] // 128   # expert 1 walked tile-major: tile 1 of its first block right after tile 0 of its last
    rgu = plan.phase("routed_gu")
    assert where[rgu.begin + s1 * st.gu_tiles + 1] == where[rgu.begin + (s1 + cap - 1) * st.gu_tiles] + 1
    bad = _ahead_map(plan, _FP8_FWD, num_blocks=nb, walk=walk, walk_extra=long - cap, **kw)
    with pytest.raises(AssertionError):
        _check_waits(plan, bad, nb=nb, gu=st.gu_tiles, hd=st.h_tiles)


@pytest.mark.parametrize("grid,used", [(132, 1.0), (66, 0.6), (8, 0.3)])
def test_block_order_keeps_every_task_after_what_it_waits_on(grid, used):
    """With the schedule's block order (EP), the grab order is still a permutation of the plan in
    which a block's gate|up tiles come after its dispatch and its down tiles after all of its
    gate|up tiles (the kernels' tasks wait only on tasks grabbed earlier)."""
    import numpy as np
    d = _dims(4096, 2048, 768, 0, 16)
    plan = _moe_plan.forward_plan(d, push_tasks=7)
    st = plan.struct()
    gu, hd = st.gu_tiles, st.h_tiles
    mb = d.max_blocks
    nb = int(mb * used)
    order = np.concatenate([np.random.default_rng(grid).permutation(nb), np.arange(nb, mb)])
    f = _ahead_map(plan, ("shared_gu", "dispatch", "routed_gu", "routed_down"), per_block=gu, tiled_per_block=hd,
                   grid=grid, num_blocks=nb, order=order)
    where = _check_waits(plan, f, nb=nb, gu=gu, hd=hd)
    disp = plan.phase("dispatch")
    # the dispatches come in the schedule's order
    assert sorted(range(nb), key=lambda b: where[disp.begin + b]) == list(order[:nb])
