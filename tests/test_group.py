"""Process groups (CPU): validation, the one-process group, CallableGroup over a real multi-process
all-gather, MPIGroup over a stand-in communicator.

Also home of ``run_ranks``: N spawned processes joined by an all-gather hub in the parent (a test
harness standing in for the trainer's engine), reused by the other symmetric-memory tests.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import traceback
from dataclasses import dataclass

import pytest

from mok_rt.errors import ArgumentError
from mok_rt.dist.group import CallableGroup, MPIGroup, ProcessGroup, SingleProcessGroup, collective_step

# ---------------------------------------------------------------------------------------------
# Multi-process harness
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankFailure:
    """What a rank raised (exceptions do not always pickle; their text does)."""

    type_name: str
    message: str
    traceback: str


class RankContext:
    """Handed to the function each spawned rank runs."""

    def __init__(self, rank: int, size: int, conn):
        self.rank, self.size, self._conn = rank, size, conn

    def all_gather(self, obj):
        self._conn.send(obj)
        return self._conn.recv()

    def group(self, device_id: int = 0, **kw) -> CallableGroup:
        return CallableGroup(rank=self.rank, size=self.size, device_id=device_id, all_gather=self.all_gather, **kw)


def _rank_main(fn, rank, size, conn, results, args, env):
    os.environ.update(env)
    try:
        value = fn(RankContext(rank, size, conn), *args)
        results.put((rank, True, value))
    except BaseException as e:  # report, never hang the parent
        results.put((rank, False, RankFailure(type(e).__name__, str(e), traceback.format_exc())))
    finally:
        conn.close()


def _hub(conns) -> None:
    """The all-gather: one item from every rank, in rank order, then the list to everyone."""
    while True:
        try:
            items = [c.recv() for c in conns]
            for c in conns:
                c.send(items)
        except (EOFError, OSError):
            return


def run_ranks(fn, size: int, *args, timeout: float = 120.0, env: dict | None = None) -> list:
    """Run ``fn(ctx, *args)`` in ``size`` spawned processes; their return values (or RankFailure)
    in rank order.  ``fn`` must be a module-level function of a test module."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(size)]
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, size, pipes[r][1], results, args, env or {}), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    for _, child in pipes:
        child.close()
    hub = threading.Thread(target=_hub, args=([parent for parent, _ in pipes],), daemon=True)
    hub.start()
    out: dict[int, object] = {}
    try:
        for _ in range(size):
            rank, ok, value = results.get(timeout=timeout)
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        for parent, _ in pipes:
            parent.close()
    return [out[r] for r in range(size)]


def assert_ok(results: list) -> list:
    for r, v in enumerate(results):
        if isinstance(v, RankFailure):
            pytest.fail(f"rank {r} raised {v.type_name}: {v.message}\n{v.traceback}")
    return results


# ---------------------------------------------------------------------------------------------
# SingleProcessGroup
# ---------------------------------------------------------------------------------------------


def test_single_process_group_ranks_and_devices():
    g = SingleProcessGroup(devices=[0, 0, 1])
    assert isinstance(g, ProcessGroup)
    assert g.size == 3 and g.devices == (0, 0, 1)
    assert g.local_ranks == (0, 1, 2)
    assert (g.process_index, g.num_processes) == (0, 1)
    assert [g.device_id(r) for r in range(3)] == [0, 0, 1]
    assert g.all_gather_bytes(b"abc") == [b"abc"]
    g.barrier()
    assert g.is_local(2) and g.check_local(2) == 2
    assert not hasattr(g, "rank")  # one process, many ranks: no single rank
    assert "devices=[0, 0, 1]" in repr(g)


@pytest.mark.parametrize("devices, argument", [([], "devices"), ("01", "devices"), (7, "devices"),
                                               ([0, -1], "devices[1]"), ([0, 1.0], "devices[1]"),
                                               ([True], "devices[0]")])
def test_single_process_group_rejects(devices, argument):
    with pytest.raises(ArgumentError) as e:
        SingleProcessGroup(devices=devices)
    assert e.value.argument == argument


def test_rank_lookups_name_the_argument():
    g = SingleProcessGroup(devices=[0, 1])
    for bad in (2, -1, "0", True):
        with pytest.raises(ArgumentError, match="rank"):
            g.device_id(bad)


# ---------------------------------------------------------------------------------------------
# CallableGroup in one process (size 1, or hand-made gathers)
# ---------------------------------------------------------------------------------------------


def test_callable_group_of_one():
    seen = []

    def gather(obj):
        seen.append(obj)
        return [obj]

    g = CallableGroup(rank=0, size=1, device_id=3, all_gather=gather)
    assert (g.rank, g.size, g.devices, g.device, g.local_ranks) == (0, 1, (3,), 3, (0,))
    assert isinstance(seen[0], bytes)  # the caller's gather only ever sees bytes
    assert g.all_gather_bytes(bytearray(b"x")) == [b"x"]
    g.barrier()  # falls back to an all-gather
    assert len(seen) == 3


def test_callable_group_uses_callers_barrier():
    calls = []
    g = CallableGroup(rank=0, size=1, device_id=0, all_gather=lambda o: [o], barrier=lambda: calls.append(1))
    g.barrier()
    assert calls == [1]


def _entry(rank, size, device=0):
    return json.dumps({"rank": rank, "size": size, "device": device}).encode()


@pytest.mark.parametrize("kwargs, argument", [
    (dict(rank=0, size=1, device_id=0, all_gather=None), "all_gather"),
    (dict(rank=0, size=1, device_id=0, all_gather=lambda o: [o], barrier=3), "barrier"),
    (dict(rank=1, size=1, device_id=0, all_gather=lambda o: [o]), "rank"),
    (dict(rank=-1, size=1, device_id=0, all_gather=lambda o: [o]), "rank"),
    (dict(rank=0, size=0, device_id=0, all_gather=lambda o: [o]), "size"),
    (dict(rank=0, size=1, device_id=-2, all_gather=lambda o: [o]), "device_id"),
    (dict(rank=0, size=1, device_id=0, all_gather=lambda o: o), "all_gather"),          # not a list
    (dict(rank=0, size=1, device_id=0, all_gather=lambda o: [o, o]), "all_gather"),     # wrong length
    (dict(rank=0, size=1, device_id=0, all_gather=lambda o: ["text"]), "all_gather()[0]"),
    # the gather returned rank 1's item first: not in rank order
    (dict(rank=0, size=2, device_id=0, all_gather=lambda o: [_entry(1, 2), o]), "all_gather"),
    # another rank believes in another group size
    (dict(rank=0, size=2, device_id=0, all_gather=lambda o: [o, _entry(1, 3)]), "size"),
])
def test_callable_group_rejects(kwargs, argument):
    with pytest.raises(ArgumentError) as e:
        CallableGroup(**kwargs)
    assert e.value.argument == argument


# ---------------------------------------------------------------------------------------------
# MPIGroup over a stand-in communicator (the real one runs in tests/mpi_symmetric_check.py)
# ---------------------------------------------------------------------------------------------


class _OneRankComm:
    def __init__(self):
        self.barriers = 0

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, obj):
        return [obj]

    def Barrier(self):
        self.barriers += 1


def test_mpi_group_with_explicit_device():
    comm = _OneRankComm()
    g = MPIGroup(comm, device_id=2)
    assert (g.rank, g.size, g.devices, g.local_ranks) == (0, 1, (2,), (0,))
    assert g.all_gather_bytes(b"q") == [b"q"]
    g.barrier()
    assert comm.barriers == 1


def test_mpi_group_rejects_non_communicator():
    with pytest.raises(ArgumentError) as e:
        MPIGroup(object(), device_id=0)
    assert e.value.argument == "comm"


# ---------------------------------------------------------------------------------------------
# CallableGroup across real processes
# ---------------------------------------------------------------------------------------------


def _group_worker(ctx):
    g = ctx.group(device_id=10 + ctx.rank)
    got = g.all_gather_bytes(f"from {ctx.rank}".encode())
    g.barrier()
    result, payloads = collective_step(g, "test", lambda: ctx.rank * 2, share=lambda x: {"rank": x // 2})
    assert result == 2 * ctx.rank
    return {"devices": g.devices, "got": got, "payloads": payloads, "local": g.local_ranks}


def test_callable_group_across_processes():
    res = assert_ok(run_ranks(_group_worker, 3))
    for r, v in enumerate(res):
        assert v["devices"] == (10, 11, 12)
        assert v["got"] == [b"from 0", b"from 1", b"from 2"]
        assert v["payloads"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        assert v["local"] == (r,)


def _failing_step_worker(ctx):
    def step():
        if ctx.rank == 1:
            raise RuntimeError("disk on fire")
        return "fine"
    return collective_step(ctx.group(), "step", step, share=lambda x: x)


def test_collective_step_fails_on_every_process():
    res = run_ranks(_failing_step_worker, 3)
    assert all(isinstance(v, RankFailure) for v in res)
    assert res[1].type_name == "RuntimeError" and "disk on fire" in res[1].message
    for r in (0, 2):
        assert res[r].type_name == "MokError"
        assert "step: process 1 failed: RuntimeError: disk on fire" in res[r].message


def test_collective_step_in_one_process():
    g = SingleProcessGroup([0, 0])
    assert collective_step(g, "x", lambda: 5) == (5, [None])
    assert collective_step(g, "x", lambda: 5, share=lambda v: [v]) == (5, [[5]])
    with pytest.raises(ZeroDivisionError):
        collective_step(g, "x", lambda: 1 / 0)
