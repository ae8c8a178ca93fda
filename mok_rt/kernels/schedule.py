"""The routing schedule, computed on the device (docs/ARCHITECTURE.md, the schedule).

Given the top-k expert ids of every rank, lay out the rows that land on one rank: by local
expert, each expert's rows padded to the GEMM tile height ``block_m`` (so a row block belongs to
one expert), inside an expert by (source rank, token, slot j).  Three small launches (count,
scan, place); nothing is read back by the host.  ``mok_rt.reference.schedule`` is the NumPy twin.

With expert parallelism (:func:`build_schedule_ep`) a fourth launch comes first: each rank
publishes its token count and ids into its own symmetric block and meets every peer at a group
barrier; every rank then lays out the same global routing reading its peers' blocks, so an
expert-id or capacity error anywhere is reported by every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from mok_rt.interop import dtypes
from mok_rt.runtime.cubins import get_kernel
from mok_rt.kernels.schedule_params import (MAX_RANKS, ROUTING_IDS_OFFSET, SCHEDULE_CHUNK, SCHEDULE_THREADS, ExchangeParams,
                                            BlockOrderParams,
                               ScheduleParams)
from mok_rt.errors import ArgumentError
from mok_rt.runtime.driver import call, driver
from mok_rt.runtime.launch import PreparedLaunch, launch, stream_handle
from mok_rt.interop.tensor import Tensor

__all__ = ["Schedule", "RoutingExchange", "build_schedule", "build_schedule_ep", "routing_area_bytes", "output_shapes",
           "scratch_words"]

_CUBIN = "schedule"


@dataclass
class Schedule:
    """Device arrays describing one rank's routed rows (int32 :class:`Tensor` s).

    expert_count [E_l], expert_offset [E_l+1], totals [2] (row blocks, padded rows),
    block_expert [max_rows/block_m] (with expert parallelism [2 * max_rows/block_m]: then the
    second half, ``block_order``, is the order in which the layer launches take the row blocks,
    by the latest readiness chunk each needs: :func:`build_schedule_ep`), row_src_rank/row_slot
    [max_rows] (-1 on padding rows),
    route_row [T*k] (each of this rank's routes: its row in its destination rank), route_rank
    [T*k] (each of this rank's routes: its destination rank).
    """

    num_ranks: int
    rank: int
    num_experts: int
    top_k: int
    block_m: int
    max_rows: int
    tokens: int
    device_id: int
    expert_count: Tensor
    expert_offset: Tensor
    totals: Tensor
    block_expert: Tensor
    row_src_rank: Tensor
    row_slot: Tensor
    route_row: Tensor
    route_rank: Tensor
    _scratch: tuple = field(default=(), repr=False)
    _passes: tuple = field(default=(), repr=False)   # the prepared count / scan / place launches

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def max_blocks(self) -> int:
        return self.max_rows // self.block_m

    def to_numpy(self) -> dict:
        """Host copies of the valid parts (synchronising; for tests and debugging)."""
        totals = self.totals.to_numpy()
        rows = int(totals[1])
        return {
            "expert_count": self.expert_count.to_numpy(),
            "expert_offset": self.expert_offset.to_numpy(),
            "num_blocks": int(totals[0]),
            "num_rows": rows,
            "block_expert": self.block_expert.to_numpy()[: int(totals[0])],
            **({"block_order": self.block_expert.to_numpy()[self.max_blocks:]} if self.num_ranks > 1 else {}),
            "row_src_rank": self.row_src_rank.to_numpy()[:rows],
            "row_slot": self.row_slot.to_numpy()[:rows],
            "route_row": self.route_row.to_numpy(),
            "route_rank": self.route_rank.to_numpy(),
        }


@dataclass(frozen=True)
class RoutingExchange:
    """Where the ranks of an expert-parallel group publish their routing (symmetric memory).

    ``peer_bases[r]`` / ``peer_array``: rank r's block base (a tuple, and the same as a device
    ``uint64`` array), valid on this rank's device; ``area_offset``: this call's routing area
    (:func:`routing_area_bytes` bytes; alternate two areas between consecutive calls so a peer
    still reading the previous call's is never overwritten); ``pad_offset``: the barrier's
    signal pad (zeroed once, used by nothing else).
    """

    peer_bases: tuple
    peer_array: int
    area_offset: int
    pad_offset: int
    timeout_ns: int


def routing_area_bytes(max_tokens: int, top_k: int) -> int:
    """Bytes of one routing area: int32 token count, then int32 ids [max_tokens, top_k]."""
    return ROUTING_IDS_OFFSET + 4 * max_tokens * top_k


def build_schedule(ids_ptrs: Sequence[int], tokens: Sequence[int], *, ids_int64: bool, num_experts: int,
                   top_k: int, rank: int, block_m: int, max_rows: int, max_total_routes: int,
                   device_id: int, stream, err_ptr: int, poison: bool = False, outputs=None,
                   scratch=None) -> Schedule:
    """Enqueue the schedule of rank ``rank`` on ``stream``.

    ``ids_ptrs[s]`` is the device address of source rank s's ``topk_ids`` [tokens[s], top_k]
    (validated by the caller); ``max_total_routes`` bounds sum(tokens) * top_k and sizes the
    grids (the device reads the real counts).  ``poison`` fills every output with 0x7f7f7f7f first
    (tests use it so that an element the kernels fail to write cannot pass).  ``outputs`` /
    ``scratch``: where the arrays come from (see ``_enqueue``; default: new tensors).
    """
    num_ranks = len(ids_ptrs)
    _check_layout(num_ranks, num_experts, max_rows, block_m)
    p = ScheduleParams()
    p.ids_int64 = int(bool(ids_int64))
    for s in range(num_ranks):
        p.src_ids[s] = int(ids_ptrs[s])
        p.src_tokens[s] = int(tokens[s])
    return _enqueue(p, num_ranks=num_ranks, tokens=int(tokens[rank]), num_experts=num_experts, top_k=top_k,
                    rank=rank, block_m=block_m, max_rows=max_rows, max_total_routes=max_total_routes,
                    device_id=device_id, stream=stream, err_ptr=err_ptr, poison=poison, outputs=outputs,
                    scratch=scratch)


def build_schedule_ep(ids_ptr: int, tokens: int, *, ids_int64: bool, exchange, num_ranks: int, num_experts: int,
                      top_k: int, rank: int, block_m: int, max_rows: int, max_tokens: int, wave_tokens: int,
                      device_id: int, stream, err_ptr: int, poison: bool = False, outputs=None,
                      scratch=None) -> Schedule:
    """Enqueue rank ``rank``'s part of an expert-parallel schedule: publish this rank's
    ``topk_ids`` [tokens, top_k] at ``exchange``, wait for every peer (a peer that never comes
    is reported as a timeout naming it), then lay out the rows this rank receives from everyone,
    and the order in which the layer launches take the row blocks (the second half of
    block_expert): by the wave of readiness chunks (``wave_tokens`` source tokens: one chunk per
    push task) that brings a block's last row, stably (cuda_src/moe/schedule_params.cuh).
    Every rank of the group must call it, in the same order as its other collective calls.

    ``exchange()`` gives the routing area to publish into (a :class:`RoutingExchange`; taking one
    advances the rank's count of schedules, dist/ep.py).  It is called once every check and
    allocation of this call has passed, right before the exchange kernel is enqueued: a call that
    raises before has taken no area, so the ranks keep counting the same schedules."""
    _check_layout(num_ranks, num_experts, max_rows, block_m)
    if isinstance(wave_tokens, bool) or not isinstance(wave_tokens, int) or wave_tokens < 1:
        raise ArgumentError("wave_tokens", f"expected an int >= 1, got {wave_tokens!r}")   # (before the collective)
    if not 0 <= tokens <= max_tokens:
        raise ArgumentError("topk_ids", f"{tokens} tokens exceed max_tokens={max_tokens}")
    p = ScheduleParams()
    p.ids_int64 = 0                       # the routing areas hold int32 ids
    p.tokens_on_device = 1

    def publish():   # after the allocations (_enqueue): the routing area is taken only now
        ex = exchange()
        if len(ex.peer_bases) != num_ranks:
            raise ArgumentError("exchange", f"{len(ex.peer_bases)} peers for {num_ranks} ranks")
        x = ExchangeParams()
        x.peer_bases, x.ids, x.err = ex.peer_array, ids_ptr, err_ptr
        x.area_offset, x.pad_offset, x.timeout_ns = ex.area_offset, ex.pad_offset, ex.timeout_ns
        x.tokens, x.top_k, x.ids_int64, x.rank, x.num_ranks = tokens, top_k, int(bool(ids_int64)), rank, num_ranks
        launch(get_kernel(_CUBIN, "schedule_exchange", device_id), grid=1, block=SCHEDULE_THREADS, params=x,
               stream=stream, device_id=device_id)
        for s, base in enumerate(ex.peer_bases):
            area = int(base) + ex.area_offset
            p.src_ids[s] = area + ROUTING_IDS_OFFSET
            p.src_tokens_at[s] = area

    out = _enqueue(p, num_ranks=num_ranks, tokens=tokens, num_experts=num_experts, top_k=top_k, rank=rank,
                   block_m=block_m, max_rows=max_rows, max_total_routes=num_ranks * max_tokens * top_k,
                   device_id=device_id, stream=stream, err_ptr=err_ptr, poison=poison, outputs=outputs,
                   scratch=scratch, before_passes=publish)
    mb = max_rows // block_m
    o = BlockOrderParams()
    o.row_slot, o.totals, o.block_order = out.row_slot.ptr, out.totals.ptr, out.block_expert.ptr + 4 * mb
    o.max_blocks, o.block_m, o.wave_routes = mb, block_m, wave_tokens * top_k
    o.keyed = int(4 * mb <= ORDER_SHARED_BYTES)   # else the identity order (no room for the keys)
    launch(get_kernel(_CUBIN, "schedule_block_order", device_id), grid=1, block=SCHEDULE_THREADS, params=o,
           shared_mem=4 * mb if o.keyed else 0, stream=stream, device_id=device_id)
    return out


# schedule_block_order's keys in dynamic shared memory, kept under the 48 KB a launch gets without
# an opt-in together with the kernel's static ~1 KB (47 KB were 16 bytes over): 11 264 row blocks,
# 1.4 M rows per rank; more, and the blocks keep their plain order.
ORDER_SHARED_BYTES = 44 * 1024


# Every kernel of the schedule cubin: prepare() loads them all before any launch can wait on a peer.
KERNELS = ("schedule_exchange", "schedule_count", "schedule_scan", "schedule_place", "schedule_block_order")


def prepare(device_id: int, num_experts: int) -> None:
    """Load the schedule kernels on ``device_id`` and set their shared-memory limits now (see
    ``_moe_launch.prepare``: with expert parallelism nothing may load once a peer wait runs)."""
    from mok_rt.runtime.launch import _ensure_shared_memory
    for name in KERNELS:
        get_kernel(_CUBIN, name, device_id)
    _ensure_shared_memory(get_kernel(_CUBIN, "schedule_place", device_id), device_id,
                          (33 * num_experts + MAX_RANKS + 1) * 4)
    _ensure_shared_memory(get_kernel(_CUBIN, "schedule_count", device_id), device_id,
                          (num_experts + MAX_RANKS + 1) * 4)
    _ensure_shared_memory(get_kernel(_CUBIN, "schedule_scan", device_id), device_id, scan_shared_bytes(num_experts))


def scan_shared_bytes(num_experts: int) -> int:
    """Dynamic shared memory of schedule_scan: int64 prefix [E + 1], int32 counts [E], route bases."""
    return 8 * (num_experts + 1) + 4 * num_experts + 4 * (MAX_RANKS + 1)


def _check_layout(num_ranks: int, num_experts: int, max_rows: int, block_m: int) -> None:
    if not 1 <= num_ranks <= MAX_RANKS:
        raise ArgumentError("topk_ids", f"between 1 and {MAX_RANKS} ranks are supported, got {num_ranks}")
    if num_experts % num_ranks:
        raise ArgumentError("num_experts", f"{num_experts} experts cannot be split over {num_ranks} ranks")
    if max_rows % block_m:
        raise ArgumentError("max_rows", f"must be a multiple of block_m={block_m}, got {max_rows}")


def output_shapes(*, num_ranks: int, num_experts: int, top_k: int, block_m: int, max_rows: int,
                  tokens: int) -> dict:
    """The schedule's int32 arrays by name and shape (see :class:`Schedule`)."""
    el = num_experts // num_ranks
    # With EP the kernels find the block order right after block_expert (block_expert + max_blocks).
    blocks = (max_rows // block_m,) if num_ranks == 1 else (2 * (max_rows // block_m),)
    return {"expert_count": (el,), "expert_offset": (el + 1,), "totals": (2,), "block_expert": blocks,
            "row_src_rank": (max_rows,), "row_slot": (max_rows,), "route_row": (tokens * top_k,),
            "route_rank": (tokens * top_k,)}


def scratch_words(*, num_experts: int, max_total_routes: int) -> dict:
    """The passes' int32 scratch arrays by name and length in words."""
    max_chunks = max(1, -(-max_total_routes // SCHEDULE_CHUNK))
    return {"chunk_count": max_chunks * num_experts, "expert_total": num_experts, "expert_row_base": num_experts}


def poison_schedule(s: Schedule, stream) -> None:
    """Fill every array of ``s`` with 0x7f7f7f7f on ``stream`` (tests: an element the passes fail
    to write cannot pass)."""
    for t in (s.expert_count, s.expert_offset, s.totals, s.block_expert, s.row_src_rank, s.row_slot, s.route_row,
              s.route_rank):
        if t.nbytes:
            call("cuMemsetD32Async", driver.CUdeviceptr(t.ptr), 0x7F7F7F7F, t.nbytes // 4,
                 driver.CUstream(stream_handle(stream)))


def _enqueue(p: ScheduleParams, *, num_ranks: int, tokens: int, num_experts: int, top_k: int, rank: int,
             block_m: int, max_rows: int, max_total_routes: int, device_id: int, stream, err_ptr: int,
             poison: bool, outputs=None, scratch=None, before_passes=None) -> Schedule:
    """Allocate the outputs and enqueue the count / scan / place passes (``p``'s sources set, or
    set by ``before_passes()``, which runs once everything is allocated, before any pass).

    ``outputs(shapes)``: int32 tensors for ``{name: shape}`` (the schedule's arrays);
    ``scratch(words)``: device pointers to ``{name: int32 words}`` that live until the passes ran.
    The defaults allocate new tensors (the backends pass their own: one block per call, reused
    scratch)."""
    el = num_experts // num_ranks
    max_chunks = max(1, -(-max_total_routes // SCHEDULE_CHUNK))
    keep = []
    if outputs is None:
        def outputs(shapes):
            return {n: Tensor.empty(shape, dtypes.int32, device_id=device_id, stream=stream)
                    for n, shape in shapes.items()}
    if scratch is None:
        def scratch(words):
            keep.extend(Tensor.empty((w,), dtypes.int32, device_id=device_id, stream=stream) for w in words.values())
            return {n: t.ptr for n, t in zip(words, keep)}

    arrays = outputs(output_shapes(num_ranks=num_ranks, num_experts=num_experts, top_k=top_k, block_m=block_m,
                                   max_rows=max_rows, tokens=tokens))
    out = Schedule(num_ranks=num_ranks, rank=rank, num_experts=num_experts, top_k=top_k, block_m=block_m,
                   max_rows=max_rows, tokens=tokens, device_id=device_id, **arrays)
    work = scratch(scratch_words(num_experts=num_experts, max_total_routes=max_total_routes))
    out._scratch = tuple(keep)
    if poison:
        poison_schedule(out, stream)
    if before_passes is not None:
        before_passes()

    p.err = err_ptr
    p.chunk_count, p.expert_total, p.expert_row_base = work["chunk_count"], work["expert_total"], \
        work["expert_row_base"]
    p.expert_count, p.expert_offset, p.totals = out.expert_count.ptr, out.expert_offset.ptr, out.totals.ptr
    p.block_expert, p.row_src_rank, p.row_slot = out.block_expert.ptr, out.row_src_rank.ptr, out.row_slot.ptr
    p.route_row, p.route_rank = out.route_row.ptr, out.route_rank.ptr
    p.num_ranks, p.rank, p.num_experts, p.experts_per_rank = num_ranks, rank, num_experts, el
    p.top_k, p.block_m, p.max_rows, p.max_chunks = top_k, block_m, max_rows, max_chunks

    ints = 4
    smem_count = (num_experts + MAX_RANKS + 1) * ints
    smem_scan = scan_shared_bytes(num_experts)
    smem_place = (33 * num_experts + MAX_RANKS + 1) * ints
    common = dict(block=SCHEDULE_THREADS, params=p, stream=stream, device_id=device_id)
    # Prepared, so that a backend may enqueue the same passes again for a call with the same
    # pointers, sizes and stream (the three share the one params struct).
    out._passes = (
        PreparedLaunch(get_kernel(_CUBIN, "schedule_count", device_id), grid=max_chunks, shared_mem=smem_count,
                       **common),
        PreparedLaunch(get_kernel(_CUBIN, "schedule_scan", device_id), grid=1, shared_mem=smem_scan, **common),
        PreparedLaunch(get_kernel(_CUBIN, "schedule_place", device_id), grid=max_chunks, shared_mem=smem_place,
                       **common))
    for run in out._passes:
        run()
    return out
