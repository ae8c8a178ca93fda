"""The schedule kernel against its NumPy twin (exact equality), on the GPU."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from _gpu import cp  # noqa: E402  (CuPy is imported when a test first uses it)

from mok_rt.kernels import schedule as routing  # noqa: E402
from mok_rt.errors import CapacityError, ExpertIdError  # noqa: E402
from mok_rt.reference.schedule import schedule_reference  # noqa: E402

DEV = 0


@pytest.fixture(scope="module")
def err():
    from mok_rt.runtime.errorword import ErrorWord
    from mok_rt.runtime.device import activate
    activate(DEV)
    w = ErrorWord(DEV)
    yield w


@pytest.fixture
def stream():
    from mok_rt.runtime.device import activate
    return activate(DEV).create_stream()


def _run(err, stream, ids_list, *, num_experts, rank, block_m=128, capacity=None, int64=False):
    err.clear()
    k = ids_list[0].shape[1]
    dtype = np.int64 if int64 else np.int32
    dev_ids = [cp.asarray(np.ascontiguousarray(a, dtype=dtype)) for a in ids_list]
    tokens = [a.shape[0] for a in ids_list]
    P = len(ids_list)
    el = num_experts // P
    worst = sum(tokens) * k + el * (block_m - 1)
    max_rows = capacity if capacity is not None else -(-max(worst, 1) // block_m) * block_m
    cp.cuda.runtime.deviceSynchronize()
    s = routing.build_schedule([a.data.ptr for a in dev_ids], tokens, ids_int64=int64, num_experts=num_experts,
                               top_k=k, rank=rank, block_m=block_m, max_rows=max_rows,
                               max_total_routes=sum(tokens) * k, device_id=DEV, stream=stream,
                               err_ptr=err.device_ptr, poison=True)
    stream.sync()
    err.raise_if_set("schedule")
    return s.to_numpy(), max_rows


def _compare(got, ref):
    np.testing.assert_array_equal(got["expert_count"], ref.expert_count)
    np.testing.assert_array_equal(got["expert_offset"], ref.expert_offset)
    assert got["num_rows"] == ref.num_rows and got["num_blocks"] == ref.num_blocks
    np.testing.assert_array_equal(got["block_expert"], ref.block_expert)
    np.testing.assert_array_equal(got["row_src_rank"], ref.row_src_rank)
    np.testing.assert_array_equal(got["row_slot"], ref.row_slot)
    np.testing.assert_array_equal(got["route_row"], ref.route_row)


def _check(err, stream, ids_list, *, num_experts, block_m=128, int64=False):
    P = len(ids_list)
    for r in range(P):
        got, _ = _run(err, stream, ids_list, num_experts=num_experts, rank=r, block_m=block_m, int64=int64)
        ref = schedule_reference(ids_list, num_experts=num_experts, num_ranks=P, block_m=block_m, rank=r)
        _compare(got, ref)


@pytest.mark.parametrize("k", range(1, 9))
def test_uniform_every_k(err, stream, k):
    rng = np.random.default_rng(k)
    ids = rng.integers(0, 16, size=(1000, k))
    _check(err, stream, [ids], num_experts=16)


def test_skewed_empty_and_one_expert(err, stream):
    rng = np.random.default_rng(7)
    skew = rng.choice(32, size=(777, 4), p=np.r_[np.full(4, 0.2), np.full(28, 0.2 / 28)])
    _check(err, stream, [skew], num_experts=32)
    only3 = rng.choice([3, 17], size=(300, 2))           # 30 of 32 experts empty
    _check(err, stream, [only3], num_experts=32)
    zero = np.zeros((513, 1), dtype=np.int64)            # every token on expert 0
    _check(err, stream, [zero], num_experts=8)


def test_duplicate_ids_in_a_token(err, stream):
    ids = np.array([[1, 1], [0, 1], [1, 1]])
    _check(err, stream, [ids], num_experts=4, block_m=64)


def test_zero_tokens(err, stream):
    _check(err, stream, [np.zeros((0, 4), dtype=np.int32)], num_experts=8)


def test_int64_ids_and_large_problem(err, stream):
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 128, size=(16384, 8))        # 32 chunks of routes
    _check(err, stream, [ids], num_experts=128, int64=True)


@pytest.mark.parametrize("tokens,E,k", [((1000, 37), 6, 3), ((100, 0, 37), 6, 3), ((50,) * 8, 64, 8),
                                        ((5, 0, 300, 1, 0, 64), 12, 5)])
def test_many_ranks_given_together(err, stream, tokens, E, k):
    rng = np.random.default_rng(sum(tokens))
    ids = [rng.integers(0, E, size=(t, k)) for t in tokens]
    _check(err, stream, ids, num_experts=E)


@pytest.mark.parametrize("bad", [16, -1, 2**40])
def test_ids_out_of_range_raise(err, stream, bad):
    ids = np.zeros((40, 2), dtype=np.int64)
    ids[17, 1] = bad
    with pytest.raises(ExpertIdError) as info:
        _run(err, stream, [ids], num_experts=16, rank=0, int64=True)
    assert "17" in str(info.value)
    err.clear()
    # The workspace is usable again after the error is reported.
    _check(err, stream, [np.ones((40, 2), dtype=np.int32)], num_experts=16)


def test_capacity_exceeded_raises(err, stream):
    ids = np.zeros((300, 2), dtype=np.int32)
    with pytest.raises(CapacityError):
        _run(err, stream, [ids], num_experts=4, rank=0, capacity=256)
    err.clear()


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_more_experts_than_scan_threads_and_a_hot_expert(err, stream, ranks):
    # E = 1536 > the scan's 1024 threads (two experts per thread), most experts empty, one expert
    # with many row blocks, an empty expert right before and after it.
    rng = np.random.default_rng(ranks)
    E = 1536
    probs = np.zeros(E)
    probs[700] = 0.5
    probs[rng.choice(np.r_[0:699, 702:E], size=40, replace=False)] = 0.5 / 40
    ids = [rng.choice(E, size=(t, 4), p=probs) for t in (3000, 17, 900)[:ranks]]
    _check(err, stream, ids, num_experts=E)


def test_capacity_names_the_first_overflowing_rank(err, stream):
    # three sources given together, every route on rank 2's experts: rank 0's schedule names rank 2
    ids = [np.full((200, 2), 5, dtype=np.int32) for _ in range(3)]
    with pytest.raises(CapacityError) as info:
        _run(err, stream, ids, num_experts=6, rank=0, capacity=256)
    assert info.value.info == (2, 1280, 256)
    err.clear()
