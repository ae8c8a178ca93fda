"""Collective setup with a failure on ONE process (CPU, real processes): every process must raise.

Creating a group, a symmetric heap or an expert-parallel workspace is collective.  A step that
fails on one process only (a bad argument, a stream, a GPU its node lacks, a driver call) must
be followed by a status all-gather: that process raises its own error, every other one a
MokError naming the failed rank and its error.  Without it the others wait forever in the next
all-gather (which has no timeout: it is the caller's engine's), so every test here runs the
ranks concurrently under a hard time limit, and a regression fails instead of hanging.

The heap runs on tests/fake_driver.py (POSIX handles are real memfds, exchanged over the real
socket path); the workspace's streams and kernels on bench/null_driver.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import types
from pathlib import Path

import pytest
from test_group import assert_ok, run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from mok_rt.dist.group import MPIGroup, collective_step  # noqa: E402

# Each group of cases runs in one set of processes (spawning is the slow part), case after case:
# every case fails on every process, so they stay in step.  A process that hangs makes run_ranks
# give up after RANKS_S (and kill the processes); pytest-timeout is the backstop.
RANKS_S = 60
pytestmark = pytest.mark.timeout(120)


def _outcome(fn) -> tuple:
    """("ok", what fn returned) or (exception type name, message): what one case did here."""
    try:
        return "ok", fn()
    except BaseException as e:  # noqa: BLE001 -- every failure is the case's result
        return type(e).__name__, str(e)


def _ranks_outcomes(worker, size: int, cases: list) -> dict:
    """``{case: [outcome of rank 0, rank 1, ...]}`` of running every case on ``size`` processes."""
    res = assert_ok(run_ranks(worker, size, cases, timeout=RANKS_S))
    return {case: [res[r][i] for r in range(size)] for i, case in enumerate(cases)}


def _assert_fails_everywhere(outcomes, bad: int, own_type: str, *fragments: str, prefix: str = "") -> None:
    """Rank ``bad`` raised its own ``own_type``; every other rank a MokError naming rank ``bad``
    and quoting its error (each of ``fragments``), starting with ``prefix``."""
    for r, (kind, message) in enumerate(outcomes):
        assert kind != "ok", f"rank {r} returned {message!r} instead of raising"
        if r == bad:
            assert kind == own_type, (r, kind, message)
        else:
            assert kind == "MokError", (r, kind, message)
            assert f"rank {bad}" in message and own_type in message and message.startswith(prefix), message
        for f in fragments:
            assert f in message, (r, f, message)


# ---------------------------------------------------------------------------------------------
# Expert-parallel Workspace: heap on the fake driver, streams and kernels on the null driver
# ---------------------------------------------------------------------------------------------

def _cfg():
    import mok_rt as mok
    return mok.MoEConfig(hidden=128, intermediate=128, num_experts=8, top_k=2)


def _workspace_case(ctx, bad: int, fault: str):
    import mok_rt as mok
    from fake_driver import FakeDriver
    from null_driver import null_driver
    from mok_rt.backends import cuda
    from mok_rt.dist import symmetric
    from mok_rt.runtime import device as D

    # This process's heap on the fake driver (EPShared makes it with the default driver).
    fake = symmetric._driver = FakeDriver(gpus=("gpu0",), tag=f"p{ctx.rank}")
    real = {name: getattr(D, name) for name in ("_device", "default_stream", "wrap_stream")}
    real_backend = cuda.CudaBackend.__init__
    kwargs, device_id = {}, 0
    with null_driver():   # puts back what it patched in D, and what this case patched there
        if ctx.rank == bad:
            if fault == "stream":
                D.wrap_stream = real["wrap_stream"]   # the library's own check of the stream
                kwargs["stream"] = "not-a-stream"
            elif fault == "flag":
                kwargs["poison_outputs"] = "yes"
            elif fault == "missing_gpu":
                # The real device lookup: the null driver shows one GPU, this rank names a second
                # (MPIGroup(device_id=...) naming a GPU its node lacks).
                for name, fn in real.items():
                    setattr(D, name, fn)
                device_id = 1
            elif fault == "backend":
                def no_backend(*a, **k):
                    raise RuntimeError("no cubin for this GPU")
                cuda.CudaBackend.__init__ = no_backend
        try:
            ws = mok.Workspace(_cfg(), ctx.group(device_id=device_id), max_tokens=256, **kwargs)
        except BaseException:
            # A failed workspace released its share of the heap (or never made one).
            assert fake.leaks() == {}, fake.leaks()
            raise
        finally:
            cuda.CudaBackend.__init__ = real_backend
        out = {"ranks": ws.num_ranks, "heap": ws._ep.heap.handle_type}
        ws.close()
        out["leaks"] = fake.leaks()
        return out


def _workspace_worker(ctx, cases):
    return [_outcome(lambda: _workspace_case(ctx, bad, fault)) for bad, fault, *_ in cases]


_WS_FAULTS = [
    ("stream", "ArgumentError", "stream: expected None, a cuda.core Stream"),   # before the heap
    ("flag", "ArgumentError", "poison_outputs"),                                 # before the heap
    ("missing_gpu", "ArgumentError", "CUDA device 1 does not exist"),            # before the heap
    ("backend", "RuntimeError", "no cubin for this GPU"),                        # after the heap
]
_WS_CASES = [(bad, *f) for f in _WS_FAULTS for bad in (0, 1)] + [(-1, "", "", "")]


@pytest.fixture(scope="module")
def workspace_outcomes():
    return _ranks_outcomes(_workspace_worker, 2, _WS_CASES)


@pytest.mark.parametrize("case", _WS_CASES[:-1], ids=lambda c: f"{c[1]}-on-rank-{c[0]}")
def test_workspace_failure_on_one_rank_fails_every_rank(workspace_outcomes, case):
    bad, _, own_type, fragment = case
    _assert_fails_everywhere(workspace_outcomes[case], bad, own_type, fragment, prefix="Workspace: ")


def test_workspace_builds_on_every_rank_with_the_extra_exchanges(workspace_outcomes):
    # Every process makes the same sequence of collectives on the successful path too (and the
    # cases before, which failed everywhere, left every process in step).
    assert workspace_outcomes[_WS_CASES[-1]] == [("ok", {"ranks": 2, "heap": "posix_fd", "leaks": {}})] * 2


# ---------------------------------------------------------------------------------------------
# SymmetricHeap: arguments are checked inside its first collective step
# ---------------------------------------------------------------------------------------------

def _heap_case(ctx, bad: int, kwargs: dict, fail: dict):
    from fake_driver import FakeDriver
    from mok_rt.dist.symmetric import SymmetricHeap
    fake = FakeDriver(gpus=("gpu0",), tag=f"p{ctx.rank}", fail=fail if ctx.rank == bad else {})
    args = dict(nbytes=4096, timeout_s=20)
    if ctx.rank == bad:
        args.update(kwargs)
    try:
        SymmetricHeap(ctx.group(device_id=0), args.pop("nbytes"), _api=fake, **args).close()
    finally:
        assert fake.leaks() == {}, fake.leaks()
    return "built"


def _heap_worker(ctx, cases):
    return [_outcome(lambda: _heap_case(ctx, 1, json.loads(kw), json.loads(fail))) for kw, fail, *_ in cases]


_HEAP_CASES = [
    ('{"nbytes": 0}', "{}", "ArgumentError", "nbytes: expected an int > 0, got 0"),
    ('{"nbytes": 4096.0}', "{}", "ArgumentError", "nbytes: expected an int > 0, got 4096.0"),
    ('{"handle_type": "ipc"}', "{}", "ArgumentError", "handle_type: expected one of"),
    ('{"multicast": 1}', "{}", "ArgumentError", "multicast: expected a bool, got 1"),
    ('{"timeout_s": -1}', "{}", "ArgumentError", "timeout_s: expected a positive number of seconds"),
    # the driver's first calls (cuInit, the contexts) used to run before the first collective too
    ("{}", '{"cuDevicePrimaryCtxRetain": 1}', "CudaDriverError", "cuDevicePrimaryCtxRetain"),
    ("{}", "{}", "", ""),
]


@pytest.fixture(scope="module")
def heap_outcomes():
    return _ranks_outcomes(_heap_worker, 2, _HEAP_CASES)


@pytest.mark.parametrize("case", _HEAP_CASES[:-1], ids=lambda c: c[3].split(":")[0])
def test_heap_failure_on_one_rank_fails_every_rank(heap_outcomes, case):
    _assert_fails_everywhere(heap_outcomes[case], 1, case[2], case[3],
                             prefix="SymmetricHeap: describe ranks: process 1 failed: ")


def test_heap_values_that_agree_still_build(heap_outcomes):
    assert heap_outcomes[_HEAP_CASES[-1]] == [("ok", "built")] * 2


# ---------------------------------------------------------------------------------------------
# Groups: a bad argument on one process must not strand the others in the first all-gather
# ---------------------------------------------------------------------------------------------

class _StandInComm:
    """An mpi4py communicator over the harness's all-gather (mpi4py itself is not needed)."""

    def __init__(self, ctx):
        self.ctx, self.splits = ctx, 0

    def Get_rank(self):  # noqa: N802 -- mpi4py's names
        return self.ctx.rank

    def Get_size(self):  # noqa: N802
        return self.ctx.size

    def allgather(self, obj):
        return self.ctx.all_gather(obj)

    def Barrier(self):  # noqa: N802
        self.ctx.all_gather(b"")

    def Split_type(self, kind):  # noqa: N802 -- collective in MPI: every process must make it
        self.splits += 1
        self.ctx.all_gather(b"split")
        return types.SimpleNamespace(Get_rank=lambda: self.ctx.rank, Free=lambda: None)


def _mpi_group(ctx, gpus_by_rank):
    from mok_rt.runtime import driver
    sys.modules.setdefault("mpi4py", types.SimpleNamespace(MPI=types.SimpleNamespace(COMM_TYPE_SHARED=1)))
    driver.device_count = lambda: gpus_by_rank[ctx.rank]
    comm = _StandInComm(ctx)
    try:
        return MPIGroup(comm).devices
    finally:
        assert comm.splits == 1   # made before the GPU count is known, by every process


def _group_worker(ctx, cases):
    out = []
    for kind, value, *_ in cases:
        if kind == "callable":   # rank 2 passes ``value`` as its device
            out.append(_outcome(lambda: ctx.group(device_id=value if ctx.rank == 2 else 0).devices))
        else:                    # every rank's count of visible GPUs
            out.append(_outcome(lambda: _mpi_group(ctx, value)))
    return out


_GROUP_CASES = [("callable", -1), ("callable", None), ("callable", "0"), ("mpi", (1, 1, 0)), ("mpi", (1, 2, 2))]


@pytest.fixture(scope="module")
def group_outcomes():
    return _ranks_outcomes(_group_worker, 3, _GROUP_CASES)


@pytest.mark.parametrize("case", _GROUP_CASES[:3], ids=repr)
def test_callable_group_bad_device_on_one_rank(group_outcomes, case):
    _assert_fails_everywhere(group_outcomes[case], 2, "ArgumentError", "device_id: expected an int >= 0",
                             prefix="CallableGroup construction: rank 2 failed: ArgumentError")


def test_mpi_group_node_without_gpu_fails_every_rank(group_outcomes):
    _assert_fails_everywhere(group_outcomes[_GROUP_CASES[3]], 2, "ArgumentError",
                             "no CUDA device is visible to this process",
                             prefix="MPIGroup construction: rank 2 failed: ArgumentError")
    # and with a GPU on every node: rank % visible GPUs, the same table everywhere
    assert group_outcomes[_GROUP_CASES[4]] == [("ok", (0, 1, 0))] * 3


# ---------------------------------------------------------------------------------------------
# The status exchange itself, and the steps before the heap's
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _LockedConfig:
    lock: object = dataclasses.field(default_factory=threading.Lock)   # asdict cannot copy it


def _status_case(ctx, case: str):
    from mok_rt.dist.ep import check_same_config
    from mok_rt.dist.fdpass import exchange_fds
    group = ctx.group()
    if case == "unencodable":   # a payload JSON cannot take used to raise before the all-gather
        return collective_step(group, "step", lambda: {1} if ctx.rank == 1 else [1], share=lambda v: v)[1]
    if case == "two_failures":
        def fn():
            if ctx.rank:
                raise RuntimeError(f"broken on {ctx.rank}")
        return collective_step(group, "step", fn)
    if case == "config":
        return check_same_config(group, _LockedConfig() if ctx.rank == 1 else _cfg(), 64)
    fd = os.memfd_create(f"r{ctx.rank}")
    try:
        # Rank 1 offers more descriptors than one message may carry (never looked at: it fails first).
        return exchange_fds(group, {r: fd for r in range(300)} if ctx.rank == 1 else {ctx.rank: fd}, timeout_s=20)
    finally:
        os.close(fd)


def _status_worker(ctx, cases):
    return [_outcome(lambda: _status_case(ctx, case)) for case in cases]


_STATUS_CASES = ["unencodable", "two_failures", "config", "fds"]


@pytest.fixture(scope="module")
def status_outcomes():
    return _ranks_outcomes(_status_worker, 3, _STATUS_CASES)


def test_collective_step_unencodable_payload_fails_every_rank(status_outcomes):
    _assert_fails_everywhere(status_outcomes["unencodable"], 1, "TypeError", "JSON serializable",
                             prefix="step: process 1 failed: TypeError")
    assert "(rank 1)" in status_outcomes["unencodable"][0][1]


def test_collective_step_names_every_failed_rank(status_outcomes):
    res = status_outcomes["two_failures"]
    assert res[0] == ("MokError", "step: process 1 failed: RuntimeError: broken on 1 (rank 1); "
                                  "process 2 failed: RuntimeError: broken on 2 (rank 2)")
    assert res[1:] == [("RuntimeError", "broken on 1"), ("RuntimeError", "broken on 2")]


def test_config_comparison_that_fails_on_one_rank_fails_every_rank(status_outcomes):
    _assert_fails_everywhere(status_outcomes["config"], 1, "TypeError", "lock",
                             prefix="Workspace: compare configurations: process 1 failed")


def test_fd_exchange_check_on_one_rank_fails_every_rank(status_outcomes):
    _assert_fails_everywhere(status_outcomes["fds"], 1, "FdExchangeError", "descriptors exceed the 253",
                             prefix="fd exchange: rendezvous: process 1 failed")


def test_status_entries_are_json():
    # What the peers parse: one entry per process, the failed one naming its ranks.
    class One:
        local_ranks, size, devices = (4, 5), 6, (0,) * 6

        def all_gather_bytes(self, data):
            self.sent = json.loads(data)
            return [data]

    g = One()
    with pytest.raises(ZeroDivisionError):
        collective_step(g, "x", lambda: 1 / 0)
    assert g.sent == {"ok": False, "ranks": [4, 5], "error": "ZeroDivisionError: division by zero"}
