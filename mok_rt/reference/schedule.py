"""NumPy twin of the device routing schedule (docs/ARCHITECTURE.md, the schedule).

The GPU schedule kernel must produce exactly these arrays.  Definitions (``P`` ranks, ``E``
experts, ``E_l = E / P`` per rank, rank ``d`` owns experts ``d*E_l .. d*E_l + E_l - 1``):

* Routes are ordered globally by (source rank, token, slot ``j``); a route's *slot* on its source
  is ``t * k + j``.
* ``count[e]`` is the number of routes to global expert ``e``; a route's *rank within its expert*
  is the number of earlier routes (global order) to the same expert.
* Destination rank ``d`` pads each local expert's rows to a multiple of ``block_m`` so that a row
  block belongs to exactly one expert: ``off_d[le] = sum_{l < le} ceil(count[d*E_l + l] / block_m) * block_m``.
* The row of a route in its destination's padded row space is ``off_d[le] + rank within expert``,
  so within an expert the rows are ordered by (source rank, token, j).
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Optional, Sequence

import numpy as np

from mok_rt.errors import ArgumentError

__all__ = ["Schedule", "CapacityOverflow", "schedule_reference", "schedule_reference_all_ranks"]

_INT32_MAX = np.iinfo(np.int32).max


class CapacityOverflow(ArgumentError):
    """More padded rows for a rank than ``capacity_rows``: an :class:`ArgumentError` naming
    ``capacity_rows`` that also carries what the device's error word reports (``rank``, ``rows``,
    ``capacity``), so that the reference backend can raise the device's ``CapacityError``."""

    def __init__(self, rank: int, rows: int, capacity: int):
        self.rank, self.rows, self.capacity = rank, rows, capacity
        super().__init__("capacity_rows", f"rank {rank} receives {rows} padded rows, more than "
                                          f"capacity_rows = {capacity}")


@dataclass(frozen=True, eq=False)
class Schedule:
    """The schedule seen by one rank: its expert rows (destination view) and its own routes (source view).

    Arrays are read-only int32.
    """
    rank: int
    num_ranks: int
    num_experts: int
    block_m: int
    top_k: int
    expert_count: np.ndarray    # [E_l]    routes received by each local expert
    expert_offset: np.ndarray   # [E_l+1]  padded first row of each local expert; [E_l] = num_rows
    num_rows: int               # padded rows received by this rank
    num_blocks: int             # num_rows // block_m
    block_expert: np.ndarray    # [num_blocks] local expert of each row block
    row_src_rank: np.ndarray    # [num_rows] source rank of the route in each row, -1 for padding
    row_slot: np.ndarray        # [num_rows] t*k+j on that source, -1 for padding
    route_row: np.ndarray       # [T_r*k] row of each of this rank's routes on its destination rank
    route_rank: np.ndarray      # [T_r*k] destination rank of each of this rank's routes

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ArgumentError(name, f"expected an integer >= {minimum}, got {value!r}")
    return int(value)


def _readonly_i32(a: np.ndarray) -> np.ndarray:
    out = np.ascontiguousarray(a, dtype=np.int32)
    out.flags.writeable = False
    return out


class _Global:
    """What every rank's schedule is cut from: per-route destination rows, counts and offsets."""

    def __init__(self, topk_ids: Sequence, num_experts: int, num_ranks: int, block_m: int):
        self.num_experts = _positive_int("num_experts", num_experts)
        self.num_ranks = _positive_int("num_ranks", num_ranks)
        self.block_m = _positive_int("block_m", block_m)
        if self.num_experts % self.num_ranks:
            raise ArgumentError("num_experts", f"{self.num_experts} experts do not divide evenly "
                                               f"over {self.num_ranks} ranks")
        e_local = self.num_experts // self.num_ranks
        if isinstance(topk_ids, np.ndarray) or not isinstance(topk_ids, (list, tuple)):
            raise ArgumentError("topk_ids", "expected a list with one [T_r, k] array per source rank")
        if len(topk_ids) != self.num_ranks:
            raise ArgumentError("topk_ids", f"expected {self.num_ranks} arrays (one per rank), "
                                            f"got {len(topk_ids)}")
        ids = [self._check_ids(s, a) for s, a in enumerate(topk_ids)]
        self.top_k = ids[0].shape[1]
        for s, a in enumerate(ids):
            if a.shape[1] != self.top_k:
                raise ArgumentError("topk_ids", f"rank {s} has k = {a.shape[1]}, rank 0 has k = {self.top_k}")
        self.route_counts = [a.size for a in ids]          # T_r * k per source
        flat = np.concatenate([a.reshape(-1) for a in ids]) if ids else np.zeros(0, np.int64)
        if flat.size > _INT32_MAX:
            raise ArgumentError("topk_ids", f"{flat.size} routes do not fit int32 slots")
        self.src_rank = np.repeat(np.arange(self.num_ranks, dtype=np.int64), self.route_counts)
        self.src_slot = np.concatenate([np.arange(n, dtype=np.int64) for n in self.route_counts])

        count = np.bincount(flat, minlength=self.num_experts).astype(np.int64)
        # Rank within expert: position in a stable sort by expert minus the expert's first position.
        order = np.argsort(flat, kind="stable")
        first = np.concatenate([[0], np.cumsum(count)[:-1]])
        within = np.empty(flat.size, dtype=np.int64)
        within[order] = np.arange(flat.size, dtype=np.int64) - first[flat[order]]

        padded = -(-count // self.block_m) * self.block_m
        self.count = count.reshape(self.num_ranks, e_local)
        self.offset = np.zeros((self.num_ranks, e_local + 1), dtype=np.int64)
        np.cumsum(padded.reshape(self.num_ranks, e_local), axis=1, out=self.offset[:, 1:])
        if self.offset[:, -1].max(initial=0) > _INT32_MAX:
            raise ArgumentError("topk_ids", "padded row count does not fit int32")
        self.dest = flat // e_local
        self.local = flat - self.dest * e_local
        self.row = self.offset[self.dest, self.local] + within

    def _check_ids(self, s: int, a) -> np.ndarray:
        arr = a if isinstance(a, np.ndarray) else np.asarray(a)
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise ArgumentError("topk_ids", f"rank {s}: expected an integer dtype, got {arr.dtype}")
        if arr.ndim != 2 or arr.shape[1] < 1:
            raise ArgumentError("topk_ids", f"rank {s}: expected shape [T_r, k >= 1], got {arr.shape}")
        bad = np.argwhere((arr < 0) | (arr >= self.num_experts))
        if bad.size:
            t, j = (int(v) for v in bad[0])
            raise ArgumentError("topk_ids", f"rank {s} token {t} slot {j} has expert id {int(arr[t, j])} "
                                            f"outside [0, {self.num_experts})")
        return arr.astype(np.int64)

    def for_rank(self, rank: int, capacity_rows: Optional[int]) -> Schedule:
        e_local = self.num_experts // self.num_ranks
        off = self.offset[rank]
        num_rows = int(off[-1])
        if capacity_rows is not None:
            # Every rank checks every destination (as the device does), so that with expert
            # parallelism all ranks report an overflow anywhere, not only its victim.
            over = np.nonzero(self.offset[:, -1] > capacity_rows)[0]
            if over.size:
                d = int(over[0])
                raise CapacityOverflow(d, int(self.offset[d, -1]), capacity_rows)
        row_src_rank = np.full(num_rows, -1, dtype=np.int64)
        row_slot = np.full(num_rows, -1, dtype=np.int64)
        mine = self.dest == rank
        row_src_rank[self.row[mine]] = self.src_rank[mine]
        row_slot[self.row[mine]] = self.src_slot[mine]
        start = sum(self.route_counts[:rank])
        route_row = self.row[start:start + self.route_counts[rank]]
        route_rank = self.dest[start:start + self.route_counts[rank]]
        block_expert = np.repeat(np.arange(e_local), (off[1:] - off[:-1]) // self.block_m)
        return Schedule(
            rank=rank, num_ranks=self.num_ranks, num_experts=self.num_experts,
            block_m=self.block_m, top_k=self.top_k,
            expert_count=_readonly_i32(self.count[rank]), expert_offset=_readonly_i32(off),
            num_rows=num_rows, num_blocks=num_rows // self.block_m,
            block_expert=_readonly_i32(block_expert), row_src_rank=_readonly_i32(row_src_rank),
            row_slot=_readonly_i32(row_slot), route_row=_readonly_i32(route_row),
            route_rank=_readonly_i32(route_rank))


def _check_capacity(capacity_rows) -> Optional[int]:
    if capacity_rows is None:
        return None
    return _positive_int("capacity_rows", capacity_rows, minimum=0)


def schedule_reference(topk_ids: Sequence, *, num_experts: int, num_ranks: int, block_m: int,
                       rank: int, capacity_rows: Optional[int] = None) -> Schedule:
    """Schedule of ``rank`` given every source rank's ``[T_r, k]`` global expert ids.

    Raises :class:`ArgumentError` for an id outside ``[0, num_experts)`` (naming rank, token and
    id), ``num_experts`` not divisible by ``num_ranks``, or (:class:`CapacityOverflow`) more padded
    rows for any rank than ``capacity_rows``.
    """
    g = _Global(topk_ids, num_experts, num_ranks, block_m)
    if isinstance(rank, bool) or not isinstance(rank, Integral) or not 0 <= rank < g.num_ranks:
        raise ArgumentError("rank", f"expected an integer in [0, {g.num_ranks}), got {rank!r}")
    return g.for_rank(int(rank), _check_capacity(capacity_rows))


def schedule_reference_all_ranks(topk_ids: Sequence, *, num_experts: int, num_ranks: int,
                                 block_m: int, capacity_rows: Optional[int] = None) -> list[Schedule]:
    """:func:`schedule_reference` for every rank (one pass over the routing)."""
    g = _Global(topk_ids, num_experts, num_ranks, block_m)
    cap = _check_capacity(capacity_rows)
    return [g.for_rank(r, cap) for r in range(g.num_ranks)]


def block_order_reference(row_slot: np.ndarray, *, num_blocks: int, max_blocks: int, block_m: int,
                          wave_routes: int, order_keys: int = 256) -> np.ndarray:
    """Twin of schedule_block_order (cuda_src/moe/schedule.cu): position -> row block, the blocks
    in use sorted stably by the wave of readiness chunks that brings their last row (max over a
    block's rows of row_slot // wave_routes, clamped below ``order_keys``), then the unused
    positions in place."""
    slots = np.asarray(row_slot, np.int64)[:num_blocks * block_m].reshape(num_blocks, block_m)
    last = np.maximum(slots.max(axis=1, initial=-1), 0) if num_blocks else np.zeros(0, np.int64)
    keys = np.minimum(last // max(wave_routes, 1), order_keys - 1)
    order = np.argsort(keys, kind="stable")
    return np.concatenate([order, np.arange(num_blocks, max_blocks)]).astype(np.int32)
