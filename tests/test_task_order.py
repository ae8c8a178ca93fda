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
               dispatch_wave=False, walk=None):
    """Python twin of pipe::AheadOrderOf<Blocks, waves, dispatch_wave>::map: grab position -> plan
    task.  ``order``: the schedule's block order (ScheduledBlocks; the expert walk is then off);
    None: plan block order, with the expert walk over ``walk`` = (block_expert, expert_offset,
    expert_count) when given."""
    lead, dispatch, gemm, tiled = (plan.phase(n) for n in names)
    trail_count = 0
    begin = min(lead.begin, dispatch.begin)
    end = begin + lead.count + dispatch.count + gemm.count + trail_count
    in_waves = -(-waves * grid // (per_block + 1))
    ahead = min(dispatch.count, grid if dispatch_wave and grid > in_waves else in_waves)
    order_blocks = min(num_blocks, dispatch.count)
    walk_max = min(ahead, -(-2 * grid // (per_block + 1))) + 1   # pipe::kWalkWaves = 2

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
        return gemm.begin + gemm_tile((blocks - d) * g + u, g)
    return f


def _check_waits(plan, f, *, nb, gu, hd):
    """f is a permutation of the plan in which every block's gate|up tiles come after its dispatch
    and its down tiles after all of its gate|up tiles; returns grab position by task."""
    where = {}
    for t in range(plan.total):
        task = f(t)
        assert task not in where and 0 <= task < plan.total
        where[task] = t
    disp, rgu, rdown = plan.phase("dispatch"), plan.phase("routed_gu"), plan.phase("routed_down")
    for b in range(nb):
        at_dispatch = where[disp.begin + b]
        gu_at = [where[rgu.begin + b * gu + n] for n in range(gu)]
        assert min(gu_at) > at_dispatch, b
        assert min(where[rdown.begin + b * hd + h] for h in range(hd)) > max(gu_at), b
    return where


@pytest.mark.parametrize("grid", [132, 66, 8])
@pytest.mark.parametrize("T,H,I,E,k", [(8192, 7168, 2048, 32, 8), (4096, 2048, 768, 16, 4), (300, 512, 256, 5, 2)])
def test_fp8_order_keeps_every_task_after_what_it_waits_on(grid, T, H, I, E, k):
    """The FP8 kernels' order (pipe::AheadOrder: four waves ahead, a dispatch per CTA first, the
    expert walk over the schedule): a permutation of the FP8 plan with every wait satisfied by
    earlier grabs, for experts of one block, of a few and of more than the walk takes."""
    import numpy as np
    d = _dims(T, H, I, 0, E, k)
    plan = _moe_plan.forward_plan(d, precision="fp8_block")
    st = plan.struct()
    gu, hd, mb = st.gu_tiles, st.h_tiles, d.max_blocks
    rng = np.random.default_rng(T + grid)
    count = rng.multinomial(T * k, rng.dirichlet(np.full(E, 0.3)))   # skewed: empty and large experts
    blocks = -(-count // 128)
    offset = np.concatenate([[0], np.cumsum(blocks)[:-1]]) * 128
    nb = int(blocks.sum())
    assert nb <= mb
    block_expert = np.full(mb, -1)
    for e in range(E):
        block_expert[offset[e] // 128: offset[e] // 128 + blocks[e]] = e
    f = _ahead_map(plan, ("shared_gu", "dispatch", "routed_gu", "routed_down"), per_block=gu, tiled_per_block=hd,
                   grid=grid, num_blocks=nb, waves=4, dispatch_wave=True, walk=(block_expert, offset, count))
    where = _check_waits(plan, f, nb=nb, gu=gu, hd=hd)
    disp = plan.phase("dispatch")
    first = min(disp.count, max(grid, -(-4 * grid // (gu + 1))))
    # the first `first` grabs after the lead are dispatches (every CTA starts by copying rows)
    assert sorted(where[disp.begin + b] for b in range(first)) == list(range(first))


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
