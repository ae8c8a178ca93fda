"""Expert parallelism: the symmetric memory a workspace's ranks share, and its bookkeeping.

One :class:`~mok_rt.dist.symmetric.SymmetricHeap` per workspace holds, in every rank's block, what
peers write there (docs/ARCHITECTURE.md: dispatch and combine)::

    [0, CONTROL)     int32 flags [NUM_PEER_FLAGS][MAX_EP_RANKS] (epochs, see params.cuh), right
                     after them int32 chunk flags [chunks][CHUNK_KINDS][MAX_EP_RANKS] (the push's
                     readiness chunks, ep.cuh), the routing exchange's barrier pad, the
                     end-of-launch barrier's pad
    routing[0], [1]  two routing areas (int32 token count, int32 ids [max_tokens, k]); consecutive
                     schedules alternate, so a peer still reading the previous one is never overwritten
    routed           [capacity_rows, H] bf16: rows pushed to this rank (x forward, weighted d_out backward)
    slot             [max_tokens * k, H] bf16: rows returned to this rank (y forward, dx backward)

The control region is zeroed once, when the workspace is created (collectively: no peer can
signal before every rank has zeroed its own); nothing peers signal is ever reset afterwards.
Every launch that talks to peers gets an epoch, counted on the host: every rank makes the same
sequence of calls, so the ranks agree on it without talking.  Buffers are reused across launches
safely because every expert-parallel launch ends with a group barrier (ep.cuh).

After an error (:class:`EPHealth`): an expert-id or capacity error is found by every rank in the
schedule, from the same all-gathered routing, so every rank skips the same launches and the
epochs stay in step: the workspace stays usable.  After a timeout or an internal error some
rank skipped a call or a barrier that its peers made (or a late peer may still write into this
rank's memory), so the shared state is undefined: the workspace refuses further calls, and the
ranks must close it and create a new one.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mok_rt.runtime import driver as _driver
from mok_rt.runtime.errorword import ERR_CAPACITY, ERR_EXPERT_ID
from mok_rt.kernels.moe_launch import PeerSpec
from mok_rt.kernels.moe_params import CHUNK_FLAGS_OFFSET, CHUNK_KINDS, MAX_EP_RANKS, NUM_PEER_FLAGS
from mok_rt.kernels.moe_plan import readiness_chunks
from mok_rt.errors import ArgumentError, MokError
from mok_rt.dist.group import ProcessGroup, collective_step
from mok_rt.kernels.schedule import RoutingExchange, routing_area_bytes

__all__ = ["HeapLayout", "EPHealth", "EPShared", "EPRank", "check_same_config"]

_ALIGN = 256
_PAD_BYTES = 4 * (1 + MAX_EP_RANKS)   # pad_words(size) in barrier.cuh, for the largest group


def _up(x: int, m: int = _ALIGN) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class HeapLayout:
    """Byte offsets inside every rank's block (the same on every rank)."""

    flags: int
    chunk_flags: int
    chunk_tokens: int
    chunks: int
    exchange_pad: int
    end_pad: int
    control_bytes: int
    routing: tuple
    routed: int
    slot: int
    slot_rows: int
    nbytes: int

    @classmethod
    def make(cls, *, max_tokens: int, top_k: int, hidden: int, capacity_rows: int,
             push_tasks: int) -> "HeapLayout":
        flags = 0
        chunk_flags = flags + CHUNK_FLAGS_OFFSET  # where the kernels find them (kChunkFlagsOffset)
        assert CHUNK_FLAGS_OFFSET == 4 * NUM_PEER_FLAGS * MAX_EP_RANKS
        chunk_tokens, chunks = readiness_chunks(max(1, max_tokens), push_tasks)
        exchange_pad = _up(chunk_flags + 4 * chunks * CHUNK_KINDS * MAX_EP_RANKS)
        end_pad = _up(exchange_pad + _PAD_BYTES)
        control = _up(end_pad + _PAD_BYTES)
        area = _up(routing_area_bytes(max_tokens, top_k))
        routing = (control, control + area)
        routed = control + 2 * area
        slot = _up(routed + capacity_rows * hidden * 2)
        slot_rows = max_tokens * top_k
        nbytes = _up(slot + slot_rows * hidden * 2)
        return cls(flags=flags, chunk_flags=chunk_flags, chunk_tokens=chunk_tokens, chunks=chunks,
                   exchange_pad=exchange_pad, end_pad=end_pad, control_bytes=control,
                   routing=routing, routed=routed, slot=slot, slot_rows=slot_rows, nbytes=nbytes)


def _plain(v):
    return v if v is None or isinstance(v, (bool, int, float, str)) else repr(v)


def check_same_config(group: ProcessGroup, config, max_tokens, backend: str = "cuda") -> None:
    """Collective, and the first thing a multi-rank workspace does: every process compares every
    rank's MoEConfig, max_tokens and backend; a mismatch raises the same :class:`ArgumentError`
    (naming the field and the ranks) on every process.  Run before any other validation, so that
    a bad argument then fails the same way on every rank instead of on one rank only (which would
    leave the others waiting in the next collective)."""
    def describe() -> dict:   # inside the step: even this could fail on one process only
        fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else {"config": repr(config)}
        return {"config": {k: _plain(v) for k, v in fields.items()}, "max_tokens": _plain(max_tokens),
                "backend": _plain(backend), "ranks": list(group.local_ranks)}

    _, entries = collective_step(group, "Workspace: compare configurations", describe, share=lambda m: m)
    first = entries[0]
    for e in entries[1:]:
        who, ref = e["ranks"][0] if e["ranks"] else "?", first["ranks"][0] if first["ranks"] else "?"
        for name in sorted(set(first["config"]) | set(e["config"])):
            a, b = first["config"].get(name), e["config"].get(name)
            if a != b:
                raise ArgumentError(name, f"rank {who} has {name}={b!r} but rank {ref} has {name}={a!r}: every "
                                          f"rank of the group must use the same MoEConfig")
        for name in ("max_tokens", "backend"):
            if e[name] != first[name]:
                raise ArgumentError(name, f"rank {who} has {name}={e[name]!r} but rank {ref} has "
                                          f"{first[name]!r}: every rank must pass the same {name}")


# Device errors that every rank of the group detects alike (in the schedule, from the same global
# routing): every rank skips the same launches, so the workspace remains usable.
GROUP_CONSISTENT_ERRORS = (ERR_CAPACITY, ERR_EXPERT_ID)


class EPHealth:
    """Whether the state a workspace's ranks share is still defined (one per process's workspace).

    :meth:`record` is told every device error a local rank reports; an error that not every rank
    sees alike (a timeout, an internal error) breaks the workspace, and :meth:`check` then refuses
    every further call with the reason."""

    RECREATE = ("close this workspace and create a new one on every rank (collectively): after a "
                "timeout a rank may have skipped a call or a barrier that its peers made, or may "
                "still be writing into this rank's memory")

    def __init__(self):
        self.broken: str | None = None

    def record(self, code: int, message: str) -> str:
        """Note a device error; returns what to append to its message ("" when it is harmless)."""
        if code in GROUP_CONSISTENT_ERRORS:
            return ""
        if self.broken is None:
            self.broken = message
        return f"; the expert-parallel state is now undefined: {self.RECREATE}"

    def check(self, rank: int) -> None:
        if self.broken is not None:
            raise MokError(f"mok_rt (rank {rank}): this workspace cannot run expert-parallel calls any more "
                           f"(earlier: {self.broken}); {self.RECREATE}")


class EPShared:
    """The heap and layout of one workspace's expert-parallel group (collective to create)."""

    def __init__(self, group: ProcessGroup, *, config, max_tokens: int, capacity_rows: int):
        from mok_rt.dist.symmetric import SymmetricHeap
        # No status exchange before the heap's: these depend only on what every process agreed
        # on (the group's size, check_same_config's config and max_tokens), so they fail alike.
        if group.size > MAX_EP_RANKS:
            raise ArgumentError("group", f"at most {MAX_EP_RANKS} ranks are supported, got {group.size}")
        self.group = group
        self.layout = HeapLayout.make(max_tokens=max_tokens, top_k=config.top_k, hidden=config.hidden,
                                      capacity_rows=capacity_rows, push_tasks=config.comm_sms)
        self.health = EPHealth()
        self.heap = SymmetricHeap(group, self.layout.nbytes)
        try:
            collective_step(group, "Workspace: zero the peer flags", self._zero_control)
        except BaseException:
            self.heap.close()
            raise

    def _zero_control(self) -> None:
        from mok_rt.runtime.device import activate
        for r in self.group.local_ranks:
            activate(self.group.devices[r])
            _driver.call("cuMemsetD32", self.heap.local_ptr(r) + self.layout.flags, 0,
                         self.layout.control_bytes // 4)
            _driver.call("cuCtxSynchronize")

    def ranks_sharing_gpu(self, rank: int) -> int:
        """How many ranks of the group run on ``rank``'s GPU (by UUID, across processes)."""
        uuids = getattr(self.heap, "_uuids", None)
        if not uuids:
            return sum(1 for d in self.group.devices if d == self.group.devices[rank])
        return sum(1 for u in uuids if u == uuids[rank])

    def close(self) -> None:
        self.heap.close()


class EPRank:
    """One local rank's view: its peers' addresses, error word and epoch counters."""

    def __init__(self, shared: EPShared, rank: int, *, timeout_s: float, push_tasks: int):
        self.shared = shared
        self.rank = rank
        heap = shared.heap
        self.num_ranks = heap.size
        self.peer_bases = tuple(heap.peer_ptrs(rank))
        self.peer_array = heap.peer_ptr_array(rank)
        self.error = heap.error_word(rank)
        self.timeout_ns = int(timeout_s * 1e9)
        self.push_tasks_max = push_tasks
        self._epoch = 0
        self._schedules = 0

    def mark(self) -> tuple[int, int]:
        """This rank's counts of launches (epochs) and schedules (routing areas), for rewind()."""
        return self._epoch, self._schedules

    def rewind(self, mark: tuple[int, int]) -> None:
        """Give back the epochs / routing areas taken since ``mark`` by a call that raised before
        its kernels were enqueued: every rank must count the same launches and schedules (a rank
        ahead by one would wait for its peers under an epoch they never use)."""
        self._epoch, self._schedules = mark

    def exchange(self) -> RoutingExchange:
        """The next schedule's routing exchange (alternating routing areas)."""
        lay = self.shared.layout
        area = lay.routing[self._schedules % 2]
        self._schedules += 1
        return RoutingExchange(peer_bases=self.peer_bases, peer_array=self.peer_array, area_offset=area,
                               pad_offset=lay.exchange_pad, timeout_ns=self.timeout_ns)

    def peers(self, tokens: int) -> PeerSpec:
        """The next forward/backward launch's peers (a new epoch)."""
        self._epoch += 1
        lay = self.shared.layout
        return PeerSpec(peer_bases=self.peer_bases, peer_array=self.peer_array, routed_offset=lay.routed,
                        slot_offset=lay.slot, flags_offset=lay.flags, end_pad_offset=lay.end_pad, rank=self.rank,
                        epoch=self._epoch, push_tasks=max(1, min(self.push_tasks_max, tokens)),
                        slot_rows=lay.slot_rows, chunk_tokens=lay.chunk_tokens, chunks=lay.chunks)

    def routed_ptr(self) -> int:
        return self.peer_bases[self.rank] + self.shared.layout.routed

    def slot_ptr(self) -> int:
        return self.peer_bases[self.rank] + self.shared.layout.slot
