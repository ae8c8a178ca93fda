"""The NumPy twin of the routing schedule: hand-worked cases, a brute-force oracle, invariants, errors."""
from __future__ import annotations

import numpy as np
import pytest

from mok_rt.errors import ArgumentError
from mok_rt.reference.schedule import Schedule, schedule_reference, schedule_reference_all_ranks


def _eq(actual, expected):
    assert actual.dtype == np.int32
    np.testing.assert_array_equal(actual, np.asarray(expected))


def test_hand_worked_two_ranks():
    ids = [np.array([[0, 2], [3, 0], [2, 2]]), np.array([[1, 0]])]
    s0, s1 = schedule_reference_all_ranks(ids, num_experts=4, num_ranks=2, block_m=4)
    # rank 0 owns experts 0, 1: expert 0 gets (r0,t0,j0), (r0,t1,j1), (r1,t0,j1); expert 1 gets (r1,t0,j0)
    _eq(s0.expert_count, [3, 1])
    _eq(s0.expert_offset, [0, 4, 8])
    assert (s0.num_rows, s0.num_blocks) == (8, 2)
    _eq(s0.block_expert, [0, 1])
    _eq(s0.row_src_rank, [0, 0, 1, -1, 1, -1, -1, -1])
    _eq(s0.row_slot, [0, 3, 1, -1, 0, -1, -1, -1])
    _eq(s0.route_row, [0, 0, 4, 1, 1, 2])      # rows on ranks 0, 1, 1, 0, 1, 1
    # rank 1 owns experts 2, 3
    _eq(s1.expert_count, [3, 1])
    _eq(s1.expert_offset, [0, 4, 8])
    _eq(s1.block_expert, [0, 1])
    _eq(s1.row_src_rank, [0, 0, 0, -1, 0, -1, -1, -1])
    _eq(s1.row_slot, [1, 4, 5, -1, 2, -1, -1, -1])
    _eq(s1.route_row, [4, 2])                  # both on rank 0
    assert schedule_reference(ids, num_experts=4, num_ranks=2, block_m=4, rank=1).row_slot.tolist() \
        == s1.row_slot.tolist()


def test_hand_worked_empty_expert_block_m_1():
    s = schedule_reference([np.array([[2], [0], [2]])], num_experts=3, num_ranks=1, block_m=1, rank=0)
    _eq(s.expert_count, [1, 0, 2])
    _eq(s.expert_offset, [0, 1, 1, 3])
    _eq(s.block_expert, [0, 2, 2])
    _eq(s.row_src_rank, [0, 0, 0])
    _eq(s.row_slot, [1, 0, 2])
    _eq(s.route_row, [1, 0, 2])


def test_hand_worked_padding_and_empty_expert():
    # k = 3, one token: experts 1, 1, 3 with block_m = 2 -> expert 0 and 2 empty (no rows)
    s = schedule_reference([np.array([[1, 3, 1]], dtype=np.int32)], num_experts=4, num_ranks=1,
                           block_m=2, rank=0)
    _eq(s.expert_count, [0, 2, 0, 1])
    _eq(s.expert_offset, [0, 0, 2, 2, 4])
    _eq(s.block_expert, [1, 3])
    _eq(s.row_src_rank, [0, 0, 0, -1])
    _eq(s.row_slot, [0, 2, 1, -1])
    _eq(s.route_row, [0, 2, 1])


def _oracle(ids, num_experts, num_ranks, block_m):
    """Brute force straight from the definitions, one route at a time."""
    e_local = num_experts // num_ranks
    routes = [(s, t * a.shape[1] + j, int(a[t, j])) for s, a in enumerate(ids)
              for t in range(a.shape[0]) for j in range(a.shape[1])]
    count = [sum(1 for r in routes if r[2] == e) for e in range(num_experts)]
    offs = []
    for d in range(num_ranks):
        off = [0]
        for le in range(e_local):
            c = count[d * e_local + le]
            off.append(off[-1] + (c + block_m - 1) // block_m * block_m)
        offs.append(off)
    seen = [0] * num_experts
    rows = {}
    for s, slot, e in routes:
        d, le = divmod(e, e_local)
        rows[(s, slot)] = (d, offs[d][le] + seen[e])
        seen[e] += 1
    out = []
    for d in range(num_ranks):
        n = offs[d][-1]
        src, sl = [-1] * n, [-1] * n
        for (s, slot), (dd, row) in rows.items():
            if dd == d:
                src[row], sl[row] = s, slot
        blocks = [le for le in range(e_local) for _ in range((offs[d][le + 1] - offs[d][le]) // block_m)]
        route_row = [rows[(d, slot)][1] for slot in range(ids[d].size)]
        out.append(dict(expert_count=count[d * e_local:(d + 1) * e_local], expert_offset=offs[d],
                        block_expert=blocks, row_src_rank=src, row_slot=sl, route_row=route_row))
    return out


def _check_invariants(ids, scheds, num_experts, num_ranks, block_m):
    e_local = num_experts // num_ranks
    k = ids[0].shape[1]
    total = sum(a.size for a in ids)
    assert sum(int(s.expert_count.sum()) for s in scheds) == total
    placed = 0
    for d, s in enumerate(scheds):
        assert isinstance(s, Schedule) and s.rank == d and s.top_k == k
        off = s.expert_offset.astype(np.int64)
        assert off[0] == 0 and off[-1] == s.num_rows and s.num_rows == s.num_blocks * block_m
        assert not (off % block_m).any()
        np.testing.assert_array_equal(np.diff(off), -(-s.expert_count.astype(np.int64) // block_m) * block_m)
        assert s.row_src_rank.shape == s.row_slot.shape == (s.num_rows,)
        assert s.block_expert.shape == (s.num_blocks,)
        pad = s.row_src_rank == -1
        np.testing.assert_array_equal(pad, s.row_slot == -1)
        for le in range(e_local):
            lo, c, hi = off[le], int(s.expert_count[le]), off[le + 1]
            assert not pad[lo:lo + c].any() and pad[lo + c:hi].all()
            assert (s.block_expert[lo // block_m:hi // block_m] == le).all()
            # order within an expert is (source rank, token, j) = (source rank, slot)
            key = s.row_src_rank[lo:lo + c].astype(np.int64) * (1 << 32) + s.row_slot[lo:lo + c]
            assert (np.diff(key) > 0).all()
            for row in range(lo, lo + c):   # the row's route really targets this expert
                src, slot = s.row_src_rank[row], s.row_slot[row]
                assert ids[src][slot // k, slot % k] == d * e_local + le
        placed += int((~pad).sum())
        for a in (s.expert_count, s.expert_offset, s.block_expert, s.row_src_rank, s.row_slot, s.route_row):
            assert a.dtype == np.int32 and not a.flags.writeable
    assert placed == total
    # route_row and (row_src_rank, row_slot) are inverse: every route appears exactly once
    for src, s in enumerate(scheds):
        flat = ids[src].reshape(-1)
        assert s.route_row.shape == (flat.size,)
        dest = flat // e_local
        for slot in range(flat.size):
            row = s.route_row[slot]
            assert scheds[dest[slot]].row_src_rank[row] == src
            assert scheds[dest[slot]].row_slot[row] == slot


def _random_ids(rng, num_ranks, num_experts, k, max_tokens, mode):
    counts = rng.integers(0, max_tokens + 1, size=num_ranks)
    ids = []
    for t in counts:
        if mode == "uniform":
            a = rng.integers(0, num_experts, size=(t, k))
        elif mode == "skewed":   # a few hot experts, many cold or empty ones
            p = 1.0 / np.arange(1, num_experts + 1) ** 2
            a = rng.choice(num_experts, size=(t, k), p=p / p.sum())
        else:                    # every route to one expert
            a = np.full((t, k), num_experts // 2)
        ids.append(a.astype(rng.choice([np.int32, np.int64])))
    return ids


@pytest.mark.parametrize("num_ranks", [1, 2, 6, 8])
@pytest.mark.parametrize("mode", ["uniform", "skewed", "one_expert"])
def test_random_against_oracle_and_invariants(num_ranks, mode):
    rng = np.random.default_rng(num_ranks * 7 + len(mode))
    for k in range(1, 9):
        e_local = int(rng.integers(1, 4))
        num_experts = e_local * num_ranks
        block_m = int(rng.choice([1, 3, 4, 8, 64]))
        ids = _random_ids(rng, num_ranks, num_experts, k, 13, mode)
        scheds = schedule_reference_all_ranks(ids, num_experts=num_experts, num_ranks=num_ranks,
                                              block_m=block_m)
        _check_invariants(ids, scheds, num_experts, num_ranks, block_m)
        for s, want in zip(scheds, _oracle(ids, num_experts, num_ranks, block_m)):
            for field, value in want.items():
                np.testing.assert_array_equal(getattr(s, field), np.asarray(value, dtype=np.int64),
                                              err_msg=field)
        r = int(rng.integers(0, num_ranks))
        one = schedule_reference(ids, num_experts=num_experts, num_ranks=num_ranks, block_m=block_m, rank=r)
        np.testing.assert_array_equal(one.row_slot, scheds[r].row_slot)
        np.testing.assert_array_equal(one.route_row, scheds[r].route_row)


def test_all_tokens_empty():
    ids = [np.zeros((0, 4), np.int32)] * 3
    for s in schedule_reference_all_ranks(ids, num_experts=6, num_ranks=3, block_m=128):
        assert s.num_rows == 0 and s.num_blocks == 0
        _eq(s.expert_count, [0, 0])
        _eq(s.expert_offset, [0, 0, 0])
        assert s.block_expert.size == s.row_slot.size == s.route_row.size == 0


def test_capacity():
    ids = [np.array([[0, 1], [1, 1], [1, 0]])]   # counts 2, 4 -> padded 4 + 4 rows
    s = schedule_reference(ids, num_experts=2, num_ranks=1, block_m=4, capacity_rows=8, rank=0)
    assert s.num_rows == 8
    with pytest.raises(ArgumentError) as info:
        schedule_reference(ids, num_experts=2, num_ranks=1, block_m=4, capacity_rows=7, rank=0)
    assert info.value.argument == "capacity_rows" and "8" in str(info.value)


def _raises(argument, **kwargs):
    args = dict(topk_ids=[np.array([[0, 1]]), np.array([[2, 3]])], num_experts=4, num_ranks=2,
                block_m=4, rank=0)
    args.update(kwargs)
    with pytest.raises(ArgumentError) as info:
        schedule_reference(args.pop("topk_ids"), **args)
    assert info.value.argument == argument, str(info.value)
    return str(info.value)


def test_errors():
    msg = _raises("topk_ids", topk_ids=[np.array([[0, 1]]), np.array([[2, 3], [4, 0]])])
    assert "rank 1" in msg and "token 1" in msg and "4" in msg
    assert "-1" in _raises("topk_ids", topk_ids=[np.array([[0, -1]]), np.array([[2, 3]])])
    _raises("topk_ids", topk_ids=[np.array([[0, 1]])])                       # one array for two ranks
    _raises("topk_ids", topk_ids=[np.array([[0, 1]]), np.array([[2]])])      # k differs
    _raises("topk_ids", topk_ids=[np.array([[0.0, 1.0]]), np.array([[2, 3]])])
    _raises("topk_ids", topk_ids=[np.array([0, 1]), np.array([[2, 3]])])
    _raises("topk_ids", topk_ids=[np.zeros((2, 0), np.int32), np.zeros((1, 0), np.int32)])
    _raises("topk_ids", topk_ids=np.array([[0, 1], [2, 3]]))
    _raises("num_experts", num_experts=5)
    _raises("num_experts", num_experts=0)
    _raises("num_ranks", num_ranks=0)
    _raises("block_m", block_m=0)
    _raises("block_m", block_m=2.0)
    _raises("rank", rank=2)
    _raises("rank", rank=-1)
    _raises("capacity_rows", capacity_rows=-1)
