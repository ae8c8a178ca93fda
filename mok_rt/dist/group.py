"""Process groups: how the ranks of an expert-parallel group find each other.

A group has ``size`` ranks; rank ``r`` runs on CUDA device ``devices[r]`` (an ordinal as seen by
the process that drives rank ``r``).  Ranks are driven by one or more *processes*:

* :class:`SingleProcessGroup` -- one process drives every rank (``devices=[0, 1]``: two GPUs;
  ``devices=[0, 0]``: two ranks sharing one GPU, a supported test mode).  It has no single rank;
  ask for :attr:`ProcessGroup.local_ranks` and :meth:`ProcessGroup.device_id`.
* :class:`MPIGroup` -- one process per rank over an mpi4py communicator.
* :class:`CallableGroup` -- one process per rank over the caller's own all-gather (for example a
  wrapper around ``torch.distributed.all_gather_object`` or a JAX multi-host all-gather).

The collectives work between *processes*: :meth:`ProcessGroup.all_gather_bytes` returns one entry
per process, in process order (for one-rank-per-process groups: one per rank, in rank order).
mok_rt has no bootstrap of its own: it only ever uses what the caller's engine provides.

A failure that mok_rt sees on one process during a collective setup is reported to every process
(:func:`collective_step`).  A process that dies or never makes the call is not: the others wait
as long as the engine's all-gather does.  mok_rt adds no host-side timeout (``MoEConfig.timeout_s``
and :class:`~mok_rt.errors.PeerTimeoutError` bound the kernels' waits on the device, and
SymmetricHeap's ``timeout_s`` only its descriptor exchange); bound it in the engine (e.g. the
``timeout`` of ``torch.distributed.init_process_group``; MPI has none).
"""
from __future__ import annotations

import abc
import json
from typing import Any, Callable, Sequence

from mok_rt.errors import ArgumentError, MokError

__all__ = ["ProcessGroup", "SingleProcessGroup", "MPIGroup", "CallableGroup"]


def _as_index(value, argument: str, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ArgumentError(argument, f"expected an int >= {low}, got {value!r}")
    return int(value)


def _as_bytes(value, argument: str) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise ArgumentError(argument, f"expected bytes, got {type(value).__name__}")


class ProcessGroup(abc.ABC):
    """What mok_rt needs from a group of ranks (see the module docstring)."""

    #: Number of ranks.
    size: int
    #: Device ordinal of every rank, indexed by rank.
    devices: tuple[int, ...]
    #: The ranks this process drives, ascending.
    local_ranks: tuple[int, ...]
    #: This process's index among the group's processes, and how many there are.
    process_index: int
    num_processes: int

    @abc.abstractmethod
    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every process's ``data``, indexed by process (a collective: all processes call it)."""

    def barrier(self) -> None:
        """Return once every process has called it."""
        self.all_gather_bytes(b"")

    def device_id(self, rank: int) -> int:
        """The device ordinal rank ``rank`` runs on (in the process that drives it)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ArgumentError("rank", f"expected a rank in [0, {self.size}), got {rank!r}")
        return self.devices[rank]

    def is_local(self, rank: int) -> bool:
        """Whether this process drives ``rank``."""
        return rank in self.local_ranks

    def check_local(self, rank: int) -> int:
        """``rank`` if this process drives it, else an ArgumentError naming the local ranks."""
        self.device_id(rank)
        if rank not in self.local_ranks:
            raise ArgumentError("rank", f"rank {rank} is not driven by this process "
                                        f"(its ranks: {list(self.local_ranks)})")
        return rank

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(size={self.size}, devices={list(self.devices)}, "
                f"local_ranks={list(self.local_ranks)})")


class SingleProcessGroup(ProcessGroup):
    """One process driving every rank; rank ``i`` runs on ``devices[i]`` (repeats allowed)."""

    def __init__(self, devices: Sequence[int] = (0,)):
        if isinstance(devices, (str, bytes)) or not hasattr(devices, "__len__") or len(devices) == 0:
            raise ArgumentError("devices", f"expected a non-empty sequence of device ordinals, got {devices!r}")
        self.devices = tuple(_as_index(d, f"devices[{i}]") for i, d in enumerate(devices))
        self.size = len(self.devices)
        self.local_ranks = tuple(range(self.size))
        self.process_index = 0
        self.num_processes = 1

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [_as_bytes(data, "data")]

    def barrier(self) -> None:
        return None


class _OneRankPerProcess(ProcessGroup):
    """Shared part of the groups whose every process drives exactly one rank."""

    rank: int
    #: What the engine's all-gather is called in errors about what it returned.
    _GATHER: str

    def _gather(self, data: bytes) -> list:
        """The engine's all-gather of ``data`` (bytes), unchecked: every process's item."""
        raise NotImplementedError

    def _setup(self, rank, size, device_id, *, source: str, failure: BaseException | None = None) -> None:
        """Check this process's arguments and run the group's first collective.  ``failure``: what
        went wrong on this process before (MPIGroup's device detection)."""
        # A bad argument on one process must not leave the others waiting forever in the
        # all-gather below: it is noted, this process still takes part, and then every process
        # raises (this one its own error, the others a MokError naming it).
        try:
            self.size = _as_index(size, "size", low=1)
            self.rank = _as_index(rank, "rank")
            if self.rank >= self.size:
                raise ArgumentError("rank", f"rank {self.rank} is outside a group of size {self.size}")
            device_id = _as_index(device_id, "device_id")
        except ArgumentError as e:
            failure = e if failure is None else failure   # the earlier one explains this one
        # One collective up front checks that every process agrees on the group's shape (and that
        # the gather returns its items in rank order) and learns every rank's device.
        if failure is None:
            mine = {"rank": self.rank, "size": self.size, "device": device_id}
        else:
            mine = {"error": f"{type(failure).__name__}: {failure}"}
        gathered = self._gather(json.dumps(mine).encode())
        if failure is not None:
            raise failure
        items = self._check_gathered(gathered, self._GATHER)
        entries = [json.loads(e) for e in items]
        failed = [f"rank {i} failed: {e['error']}" for i, e in enumerate(entries) if e.get("error")]
        if failed:
            raise MokError(f"{type(self).__name__} construction: " + "; ".join(failed))
        for i, e in enumerate(entries):
            if e["size"] != self.size:
                raise ArgumentError("size", f"rank {i} says the group has {e['size']} ranks, rank {self.rank} "
                                            f"says {self.size}")
            if e["rank"] != i:
                raise ArgumentError(source, f"item {i} of the all-gather came from rank {e['rank']}: it must "
                                            f"return one item per rank, in rank order")
        self.devices = tuple(int(e["device"]) for e in entries)
        self.local_ranks = (self.rank,)
        self.process_index = self.rank
        self.num_processes = self.size

    @property
    def device(self) -> int:
        """This process's device ordinal."""
        return self.devices[self.rank]

    def _check_gathered(self, items, argument: str) -> list[bytes]:
        items = list(items)
        if len(items) != self.size:
            raise ArgumentError(argument, f"the all-gather returned {len(items)} items for a group of "
                                          f"{self.size} ranks")
        return [_as_bytes(b, f"{argument}()[{i}]") for i, b in enumerate(items)]


class MPIGroup(_OneRankPerProcess):
    """One process per rank over an mpi4py communicator (launched by mpirun / mpiexec).

    ``device_id`` defaults to the process's rank among the ranks of its node, modulo the number
    of visible GPUs (so two ranks on a one-GPU machine share GPU 0).  Construction is collective.
    """

    _GATHER = "comm.allgather"

    def __init__(self, comm, *, device_id: int | None = None):
        for name in ("Get_rank", "Get_size", "allgather", "Barrier"):
            if not hasattr(comm, name):
                raise ArgumentError("comm", f"expected an mpi4py communicator, got {type(comm).__name__}")
        self.comm = comm
        failure = None
        if device_id is None:
            try:
                device_id = self._node_local_device(comm)
            except Exception as e:  # reported through _setup's all-gather, which every process joins
                failure = e
        self._setup(comm.Get_rank(), comm.Get_size(), device_id, source="comm", failure=failure)

    @staticmethod
    def _node_local_device(comm) -> int:
        from mpi4py import MPI

        from mok_rt.runtime.driver import device_count
        # The split is collective: every process makes it before anything that can fail on one
        # process only (a node without a visible GPU), so that none is left waiting in it.
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            local = node.Get_rank()
        finally:
            node.Free()
        n = device_count()
        if n == 0:
            raise ArgumentError("device_id", "no CUDA device is visible to this process; pass device_id=")
        return local % n

    def _gather(self, data: bytes) -> list:
        return self.comm.allgather(data)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return self._check_gathered(self._gather(_as_bytes(data, "data")), self._GATHER)

    def barrier(self) -> None:
        self.comm.Barrier()


class CallableGroup(_OneRankPerProcess):
    """One process per rank over the caller's collectives.

    ``all_gather(obj) -> list`` returns every rank's ``obj`` in rank order (``obj`` is ``bytes``).
    For PyTorch::

        def gather(obj):
            out = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(out, obj)
            return out

        group = CallableGroup(rank=r, size=n, device_id=local_gpu, all_gather=gather,
                              barrier=torch.distributed.barrier)

    ``barrier`` defaults to an all-gather of nothing.  Construction is collective.
    """

    _GATHER = "all_gather"

    def __init__(self, *, rank: int, size: int, device_id: int, all_gather: Callable[[Any], list],
                 barrier: Callable[[], Any] | None = None):
        if not callable(all_gather):
            raise ArgumentError("all_gather", f"expected a callable, got {type(all_gather).__name__}")
        if barrier is not None and not callable(barrier):
            raise ArgumentError("barrier", f"expected a callable or None, got {type(barrier).__name__}")
        self._all_gather = all_gather
        self._barrier = barrier
        self._setup(rank, size, device_id, source="all_gather")

    def _gather(self, data: bytes) -> list:
        out = self._all_gather(data)
        if out is None or isinstance(out, (bytes, str)) or not hasattr(out, "__len__"):
            raise ArgumentError("all_gather", f"expected it to return a list, got {type(out).__name__}")
        return out

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return self._check_gathered(self._gather(_as_bytes(data, "data")), self._GATHER)

    def barrier(self) -> None:
        if self._barrier is None:
            super().barrier()
        else:
            self._barrier()


def collective_step(group: ProcessGroup, what: str, fn: Callable[[], Any], *,
                    share: Callable[[Any], Any] | None = None) -> tuple[Any, list[Any]]:
    """Run ``fn()`` on this process, then all-gather ``share(result)`` (JSON-able; nothing by
    default) from every process.  Returns ``(result, shared)``, ``shared`` indexed by process.

    A step that fails on one process must fail on all of them, or the others wait forever in the
    next collective.  So each process reports success or its error, and if any failed, every
    process raises: its own exception where it failed, elsewhere a :class:`MokError` naming every
    failed process, the ranks it drives and its error.
    """
    failure = result = None
    ranks = list(group.local_ranks)
    try:
        result = fn()
        # Encoded here: a payload JSON cannot take is this process's failure too.
        mine = json.dumps({"ok": True, "ranks": ranks, "payload": share(result) if share is not None else None})
    except BaseException as e:
        failure = e
        mine = json.dumps({"ok": False, "ranks": ranks, "error": f"{type(e).__name__}: {e}"})
    entries = [json.loads(e) for e in group.all_gather_bytes(mine.encode())]
    if failure is not None:
        raise failure
    failed = [f"process {p} failed: {e['error']} ({_ranks_text(e.get('ranks'))})"
              for p, e in enumerate(entries) if not e["ok"]]
    if failed:
        raise MokError(f"{what}: " + "; ".join(failed))
    return result, [e["payload"] for e in entries]


def _ranks_text(ranks) -> str:
    """Which ranks a failed process drives, for the error every other process raises."""
    if not ranks:
        return "no rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)
