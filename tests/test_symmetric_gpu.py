"""Symmetric memory on one GPU: several ranks in one process, two processes on one GPU (the full
export / exchange / import / map path), the device barrier and its timeout, DLPack export, and
100 create/destroy cycles.  The ``check_*`` functions take the ranks' devices so that
test_symmetric_multigpu.py runs the same checks across GPUs.

Multicast must never run on these machines: every test here runs with the driver's
cuMulticast* entry points replaced by functions that fail the test.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from cuda.bindings import driver as real_driver
from mpi_run import run_mpi_script
from mpi_symmetric_check import free_memory, pattern_round, preload, round_ok
from test_group import assert_ok, run_ranks

from mok_rt.runtime import driver as _driver
from mok_rt.runtime.device import activate
from mok_rt.errors import PeerTimeoutError
from mok_rt.dist.group import SingleProcessGroup
from mok_rt.dist.barrier import device_barrier
from mok_rt.dist.symmetric import SymmetricHeap

pytestmark = pytest.mark.gpu

_MULTICAST_CALLS = ("cuMulticastCreate", "cuMulticastAddDevice", "cuMulticastBindMem", "cuMulticastBindMem_v2",
                    "cuMulticastBindAddr", "cuMulticastBindAddr_v2")


def forbid_multicast() -> None:
    """Make every multicast entry point of the real driver fail loudly (this process)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a multicast object was requested on a shared test machine")
    for name in _MULTICAST_CALLS:
        if hasattr(real_driver, name):
            setattr(real_driver, name, refuse)


@pytest.fixture(autouse=True)
def _no_multicast(monkeypatch):
    for name in _MULTICAST_CALLS:
        if hasattr(real_driver, name):
            monkeypatch.setattr(real_driver, name, getattr(real_driver, name))  # restored afterwards
    forbid_multicast()


def _streams(devices) -> dict:
    return {r: activate(d).create_stream() for r, d in enumerate(devices)}


# ---------------------------------------------------------------------------------------------
# Checks shared with the multi-GPU tests
# ---------------------------------------------------------------------------------------------


def check_one_process(devices) -> None:
    group = SingleProcessGroup(devices)
    streams = _streams(devices)
    with SymmetricHeap(group, 1 << 20) as heap:
        assert heap.handle_type == "none" and heap.block_bytes >= (1 << 20)
        assert len(set(heap.peer_ptrs(0))) == len(devices)
        for seed in (0x1234, 0xBEEF):  # a second round: the barrier reuses its pads without a reset
            for r, res in pattern_round(heap, streams, seed=seed).items():
                assert round_ok(res), (r, res)


def check_barrier_reuse(devices, rounds: int = 50) -> None:
    group = SingleProcessGroup(devices)
    streams = _streams(devices)
    with SymmetricHeap(group, 4096) as heap:
        for d in set(devices):
            preload(d)
        t0 = time.monotonic()
        for _ in range(rounds):
            for r in range(len(devices)):
                activate(devices[r])
                device_barrier(heap, rank=r, stream=streams[r], timeout_s=20)
        for r, s in streams.items():
            s.sync()
            heap.error_word(r).raise_if_set("barrier")
        assert time.monotonic() - t0 < 20


def check_timeout_names_rank(devices) -> None:
    group = SingleProcessGroup(devices)
    streams = _streams(devices)
    missing = len(devices) - 1
    with SymmetricHeap(group, 1 << 20) as heap:
        for d in set(devices):
            preload(d)
        t0 = time.monotonic()
        for r in range(missing):  # everyone but the last rank arrives
            activate(devices[r])
            device_barrier(heap, rank=r, stream=streams[r], timeout_s=0.3)
        for r in range(missing):
            streams[r].sync()
            with pytest.raises(PeerTimeoutError, match=f"rank {r} timed out waiting for rank {missing}") as e:
                heap.error_word(r).raise_if_set("barrier")
            assert e.value.rank == missing and e.value.info == (r, missing, 1)
            heap.error_word(r).clear()
        assert time.monotonic() - t0 < 10  # a timeout, not a hang
        # wait=True raises directly
        activate(devices[0])
        with pytest.raises(PeerTimeoutError) as e:
            device_barrier(heap, rank=0, stream=streams[0], timeout_s=0.2, wait=True)
        assert e.value.rank == missing
        heap.error_word(0).clear()
        # after a reset the group works again
        heap.reset_signal_pad()
        for r, res in pattern_round(heap, streams, seed=99).items():
            assert round_ok(res), (r, res)


def check_cycles(devices, n: int = 100) -> None:
    group = SingleProcessGroup(devices)

    def cycle():
        with SymmetricHeap(group, 8 << 20) as heap:
            assert heap.peer_ptr_array(0) and heap.error_word(0)

    cycle()  # first use loads what stays loaded
    before = {d: free_memory(d) for d in set(devices)}
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(n):
        cycle()
    after = {d: free_memory(d) for d in set(devices)}
    assert after == before
    assert len(os.listdir("/proc/self/fd")) == fds


def _two_process_worker(ctx, devices):
    forbid_multicast()
    dev = devices[ctx.rank]
    group = ctx.group(device_id=dev)
    stream = activate(dev).create_stream()
    out = {}
    with SymmetricHeap(group, 1 << 20, handle_type="posix_fd") as heap:
        out["handle_type"] = heap.handle_type
        out["round"] = pattern_round(heap, {ctx.rank: stream}, seed=0xC0FFEE)[ctx.rank]
        # the last rank withholds from one barrier; the others must time out naming it
        missing = group.size - 1
        if ctx.rank != missing:
            t0 = time.monotonic()
            try:
                device_barrier(heap, rank=ctx.rank, stream=stream, timeout_s=0.5, wait=True)
                out["timeout"] = None
            except PeerTimeoutError as e:
                out["timeout"] = (e.rank, e.info, time.monotonic() - t0)
            heap.error_word(ctx.rank).clear()
        group.barrier()
        heap.reset_signal_pad()
        out["round2"] = pattern_round(heap, {ctx.rank: stream}, seed=0xABCD)[ctx.rank]
    # more cycles through the whole exchange (after the driver opened whatever it keeps open):
    # no descriptor may leak
    fds_before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        SymmetricHeap(group, 2 << 20).close()
    out["fd_delta"] = len(os.listdir("/proc/self/fd")) - fds_before
    return out


def check_two_processes(devices) -> None:
    res = assert_ok(run_ranks(_two_process_worker, len(devices), devices, timeout=300))
    missing = len(devices) - 1
    for r, v in enumerate(res):
        assert v["handle_type"] == "posix_fd"
        assert round_ok(v["round"]), (r, v["round"])
        assert round_ok(v["round2"]), (r, v["round2"])
        assert v["fd_delta"] == 0
        if r != missing:
            rank, info, took = v["timeout"]
            assert rank == missing and info[:2] == (r, missing) and took < 10


# ---------------------------------------------------------------------------------------------
# One GPU
# ---------------------------------------------------------------------------------------------


def test_multicast_is_refused_here():
    with pytest.raises(AssertionError, match="multicast"):
        _driver.call("cuMulticastCreate", real_driver.CUmulticastObjectProp())


def test_one_process_one_rank():
    check_one_process([0])


def test_one_process_two_ranks_on_one_gpu():
    check_one_process([0, 0])


def test_one_process_three_ranks_on_one_gpu():
    check_one_process([0, 0, 0])


def test_barrier_is_reusable():
    check_barrier_reuse([0, 0])


def test_barrier_timeout_names_the_missing_rank():
    check_timeout_names_rank([0, 0])


def test_two_processes_on_one_gpu_full_path():
    check_two_processes([0, 0])


def test_100_create_destroy_cycles_leak_nothing():
    check_cycles([0, 0], n=100)


def test_blocks_export_through_dlpack():
    group = SingleProcessGroup([0, 0])
    stream = activate(0).create_stream()
    with SymmetricHeap(group, 1 << 16) as heap:
        mine = heap.as_tensor(0, "float32", (64, 32))
        seen_by_1 = heap.as_tensor(1, "float32", (64, 32), peer=0)  # rank 0's block, as rank 1 maps it
        assert seen_by_1.ptr == heap.peer_ptrs(1)[0] and mine.ptr == heap.local_ptr(0)
        data = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
        mine.copy_from_numpy(data, stream=stream)
        stream.sync()
        np.testing.assert_array_equal(seen_by_1.to_numpy(stream=stream), data)
        from _gpu import need_cupy
        cupy = need_cupy()
        with cupy.cuda.Device(0):
            arr = cupy.from_dlpack(heap.as_tensor(1, "float32", (64, 32)))
            arr[...] = cupy.asarray(data) * 2
            cupy.cuda.runtime.deviceSynchronize()
        np.testing.assert_array_equal(heap.as_tensor(0, "float32", (64, 32), peer=1).to_numpy(stream=stream),
                                      data * 2)


def test_mpi_script_under_mpirun():
    run_mpi_script("mpi_symmetric_check.py", timeout=300, min_passes=2 * 5)
