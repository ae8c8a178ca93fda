"""Launching the fused MoE forward/backward kernels on one GPU, or as one rank of an
expert-parallel group (``peers=PeerSpec(...)``).

The kernels (cuda_src/moe/moe_layer.cu): 384 threads, a TMA producer warp + 2 wgmma worker
warpgroups, epilogues from registers; a tensor map per operand view (moe_maps.py).

The caller (the Workspace) owns every buffer; this module only checks the plain facts it can
see (sizes, alignment, null pointers), fills the parameter structs, zeroes the dependency
counters with one ``cuMemsetD32Async`` on the stream and launches the persistent grid.  Nothing
here synchronises or reads a routing-dependent count: the kernels read those on the device.

Typical use::

    dims = LayerDims(tokens=T, hidden=H, intermediate=I, top_k=k, local_experts=E_l,
                     capacity_rows=cap, shared_intermediate=I_s, swiglu_limit=None)
    sizes = forward_buffer_bytes(dims)          # allocate each entry (bytes)
    launch_forward(ForwardBuffers(...), sched, dims, stream=s, err_ptr=err, device_id=0)
    launch_backward(BackwardBuffers(...), sched, dims, stream=s, err_ptr=err, device_id=0)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, make_dataclass

from mok_rt.kernels import moe_maps as _moe_maps
from mok_rt.kernels import moe_params as P
from mok_rt.kernels import moe_plan as _moe_plan
from mok_rt.runtime.driver import call, driver
from mok_rt.runtime.cubins import Kernel, get_kernel
from mok_rt.errors import ArgumentError, MokError
from mok_rt.runtime.launch import PreparedLaunch, multiprocessor_count, stream_handle

__all__ = [
    "LayerDims", "ScheduleBuffers", "ForwardBuffers", "BackwardBuffers", "KernelKnobs", "PeerSpec",
    "forward_buffer_bytes", "backward_buffer_bytes", "forward_plan", "backward_plan", "forward_task_count",
    "backward_task_count",
    "launch_forward", "launch_backward", "prepare_forward", "prepare_backward", "PreparedMegakernel",
]

_I32 = 4


@dataclass(frozen=True)
class _Kernels:
    cubin: str
    forward: str
    backward: str
    threads: int
    smem_bytes: int


_KERNELS = _Kernels("moe_layer", "moe_forward", "moe_backward", P.THREADS, P.SMEM_BYTES)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _int(name: str, v, *, minimum: int = 0, multiple: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum or v % multiple:
        need = f"an int >= {minimum}" + (f" and a multiple of {multiple}" if multiple > 1 else "")
        raise ArgumentError(name, f"expected {need}, got {v!r}")
    return v


@dataclass(frozen=True)
class LayerDims:
    """Host-known sizes of one launch: T, H, I, k, E_l, capacity, I_s."""

    tokens: int                 # T (0 allowed)
    hidden: int                 # H, multiple of 64
    intermediate: int           # I, multiple of 64
    top_k: int                  # k
    local_experts: int          # E_l
    capacity_rows: int          # max_rows: padded row capacity, multiple of BLOCK_M
    shared_intermediate: int = 0  # I_s: 0 = no shared expert, else multiple of 64
    swiglu_limit: float | None = None
    rank: int = 0               # reported in error words
    # A rank of an expert-parallel group.  Only the FP8 buffer tables read it: their push tasks
    # quantise the rank's token rows in token order (kernels/moe_params_fp8.py token_order_rows).
    expert_parallel: bool = False

    def __post_init__(self):
        _int("tokens", self.tokens)
        _int("hidden", self.hidden, minimum=64, multiple=64)
        _int("intermediate", self.intermediate, minimum=64, multiple=64)
        _int("top_k", self.top_k, minimum=1)
        _int("local_experts", self.local_experts, minimum=1)
        _int("capacity_rows", self.capacity_rows, multiple=P.BLOCK_M)
        _int("shared_intermediate", self.shared_intermediate, multiple=64)
        _int("rank", self.rank)
        lim = self.swiglu_limit
        if lim is not None and (isinstance(lim, bool) or not isinstance(lim, (int, float))
                                or not math.isfinite(lim) or lim <= 0):
            raise ArgumentError("swiglu_limit", f"expected None or a positive finite float, got {lim!r}")
        # Route slots (t*k + j) and row indices are int32 on the device.
        if self.tokens * self.top_k >= 2 ** 31 or self.capacity_rows >= 2 ** 31:
            raise ArgumentError("tokens", "problem too large for the kernels' 32-bit route indices")

    @property
    def max_blocks(self) -> int:
        return self.capacity_rows // P.BLOCK_M

    @property
    def token_blocks(self) -> int:
        return _ceil_div(self.tokens, P.BLOCK_M)

    def _struct(self, timeout_ns: int) -> P.MoEDims:
        return P.MoEDims(
            timeout_ns=int(timeout_ns), tokens=self.tokens, hidden=self.hidden, inter=self.intermediate,
            shared_inter=self.shared_intermediate, top_k=self.top_k, local_experts=self.local_experts,
            max_rows=self.capacity_rows, max_blocks=self.max_blocks, rank=self.rank,
            has_limit=int(self.swiglu_limit is not None),
            swiglu_limit=float(self.swiglu_limit) if self.swiglu_limit is not None else 0.0, pad_=0)


def _buffers_class(name: str, table, doc: str):
    """A frozen dataclass with one int field (a device pointer, default 0) per buffer of ``table``:
    an unknown name is a TypeError, a missing one a null pointer (refused by the launch checks)."""
    cls = make_dataclass(name, [(b.name, int, field(default=0)) for b in table], frozen=True, kw_only=True)
    cls.__doc__ = doc
    cls.__module__ = __name__
    return cls


_SCHEDULE_TABLE = tuple(b for b in P.FORWARD_BUFFERS if b.role == "schedule")
_FORWARD_TABLE = tuple(b for b in P.FORWARD_BUFFERS if b.role != "schedule")
_BACKWARD_TABLE = tuple(b for b in P.BACKWARD_BUFFERS if b.role != "schedule")

ScheduleBuffers = _buffers_class("ScheduleBuffers", _SCHEDULE_TABLE, """Device pointers of the routing schedule
    (int32 arrays, _moe_params.FORWARD_BUFFERS role "schedule"); the schedule's block_m must be BLOCK_M.""")
ForwardBuffers = _buffers_class("ForwardBuffers", _FORWARD_TABLE, """Device pointers for moe_forward, one per
    buffer of _moe_params.FORWARD_BUFFERS (shapes and roles there); 0 where the buffer has 0 bytes.""")
BackwardBuffers = _buffers_class("BackwardBuffers", _BACKWARD_TABLE, """Device pointers for moe_backward, one per
    buffer of _moe_params.BACKWARD_BUFFERS (shapes and roles there); 0 where the buffer has 0 bytes.""")


@dataclass(frozen=True)
class KernelKnobs:
    """ctas_per_sm: persistent CTAs per SM (None: as many as fit); max_ctas caps the grid;
    timeout_ns: how long a dependency wait may last before the kernel reports kErrTimeout."""

    ctas_per_sm: int | None = None
    max_ctas: int | None = None
    timeout_ns: int = 10_000_000_000

    def __post_init__(self):
        if self.ctas_per_sm is not None:
            _int("ctas_per_sm", self.ctas_per_sm, minimum=1)
        if self.max_ctas is not None:
            _int("max_ctas", self.max_ctas, minimum=1)
        _int("timeout_ns", self.timeout_ns, minimum=1)


@dataclass(frozen=True)
class PeerSpec:
    """One rank of an expert-parallel group (mirror of MoEPeers in params.cuh).

    ``peer_bases[r]``: rank r's symmetric block, valid on this rank's device (``peer_array``: the
    same as a device uint64 array).  Offsets are bytes into every block: ``routed_offset``
    [capacity_rows, H] bf16 (the FP8 forward's E4M3 rows + scales inside it: ep_fp8.cuh), ``slot_offset`` [slot_rows, H] bf16 (slot_rows = max_tokens * k),
    ``flags_offset`` int32 [NUM_PEER_FLAGS][MAX_EP_RANKS] (zeroed once, never reset),
    ``end_pad_offset`` the end-of-launch barrier's signal pad.  ``epoch``: this launch's number,
    the same on every rank and larger than any earlier launch's.  ``push_tasks``: how many tasks
    push this rank's rows (at most that many CTAs move rows while the others start GEMM tiles).
    ``chunk_tokens``: source tokens per readiness chunk, the same on every rank
    (:func:`~mok_rt.kernels.moe_plan.readiness_chunks`); the chunk flags, int32
    [ceil(max_tokens / chunk_tokens)][CHUNK_KINDS][MAX_EP_RANKS], follow the flags at
    ``flags_offset + CHUNK_FLAGS_OFFSET`` (zeroed once too); ``chunks``: how many chunk flags that
    region holds per (kind, source) (HeapLayout.chunks): a launch's tokens must fit in them.
    """

    peer_bases: tuple
    peer_array: int
    routed_offset: int
    slot_offset: int
    flags_offset: int
    end_pad_offset: int
    rank: int
    epoch: int
    push_tasks: int
    slot_rows: int
    chunk_tokens: int
    chunks: int

    def __post_init__(self):
        n = len(self.peer_bases)
        if not 2 <= n <= P.MAX_EP_RANKS:
            raise ArgumentError("peer_bases", f"expected 2 to {P.MAX_EP_RANKS} ranks, got {n}")
        if not 0 <= self.rank < n:
            raise ArgumentError("rank", f"expected a rank in [0, {n}), got {self.rank}")
        _int("push_tasks", self.push_tasks, minimum=1)
        _int("slot_rows", self.slot_rows)
        _int("chunk_tokens", self.chunk_tokens, minimum=1)
        _int("chunks", self.chunks, minimum=1)
        if not 0 < self.epoch < 2 ** 31:
            raise ArgumentError("epoch", f"expected an epoch in [1, 2**31), got {self.epoch}")
        for name in ("routed_offset", "slot_offset"):
            if getattr(self, name) % 16:
                raise ArgumentError(name, "must be 16-byte aligned")

    @property
    def num_ranks(self) -> int:
        return len(self.peer_bases)

    def _struct(self) -> P.MoEPeers:
        s = P.MoEPeers()
        for r, b in enumerate(self.peer_bases):
            s.base[r] = int(b)
        s.base_array, s.routed_offset, s.slot_offset = self.peer_array, self.routed_offset, self.slot_offset
        s.flags_offset, s.end_pad_offset = self.flags_offset, self.end_pad_offset
        s.num_ranks, s.rank, s.epoch, s.push_tasks, s.slot_rows = (self.num_ranks, self.rank, self.epoch,
                                                                   self.push_tasks, self.slot_rows)
        s.chunk_tokens = self.chunk_tokens
        return s


def _no_peers() -> P.MoEPeers:
    s = P.MoEPeers()
    s.num_ranks, s.rank = 1, 0
    return s


# ---- sizes and plans -------------------------------------------------------------------------

def forward_plan(dims: LayerDims, *, context_only: bool = False, push_tasks: int = 0) -> _moe_plan.Plan:
    """The forward's task plan (mok_rt/kernels/moe_plan.py); ``push_tasks`` > 0 with expert parallelism."""
    return _moe_plan.forward_plan(dims, context_only=context_only, push_tasks=push_tasks)


def backward_plan(dims: LayerDims, *, push_tasks: int = 0) -> _moe_plan.Plan:
    """The backward's task plan (mok_rt/kernels/moe_plan.py)."""
    return _moe_plan.backward_plan(dims, push_tasks=push_tasks)


def _written_bytes(table, dims: LayerDims, counter_words: int) -> dict[str, int]:
    return {b.name: (counter_words * _I32 if b.role == "counters" else b.nbytes(dims))
            for b in table if b.role in ("context", "output", "scratch", "heap", "counters")}


def forward_buffer_bytes(dims: LayerDims) -> dict[str, int]:
    """Bytes of every buffer moe_forward writes (context, output, scratch, counters); 0 = not needed."""
    return _written_bytes(_FORWARD_TABLE, dims, forward_plan(dims).counter_words)


def backward_buffer_bytes(dims: LayerDims) -> dict[str, int]:
    """Bytes of every buffer moe_backward writes (gradients, scratch, counters); 0 = not needed."""
    return _written_bytes(_BACKWARD_TABLE, dims, backward_plan(dims).counter_words)


def forward_task_count(dims: LayerDims, *, context_only: bool = False, push_tasks: int = 0) -> int:
    """Size of the forward task index space."""
    return forward_plan(dims, context_only=context_only, push_tasks=push_tasks).total


def backward_task_count(dims: LayerDims, *, push_tasks: int = 0) -> int:
    """Size of the backward task index space."""
    return backward_plan(dims, push_tasks=push_tasks).total


# ---- launching --------------------------------------------------------------------------------

def _check_pointers(obj, table, dims: LayerDims, *, align: int, unused: frozenset = frozenset()) -> None:
    """Every pointer an int, aligned (16 bytes for data: the kernels move 16-byte vectors), and
    non-null unless the buffer has 0 bytes (no shared expert, T = 0) or is unused."""
    for b in table:
        v = getattr(obj, b.name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ArgumentError(b.name, f"expected a device pointer (int), got {v!r}")
        if v % align:
            raise ArgumentError(b.name, f"device pointer {v:#x} is not {align}-byte aligned")
        empty = b.role != "counters" and b.nbytes(dims) == 0
        if v == 0 and not empty and b.name not in unused:
            raise ArgumentError(b.name, "null device pointer")


def _fill(struct, values: dict[str, int]) -> None:
    """Sets every pointer field of ``struct`` from ``values``; a name that is not a field, or a
    field without a value, is a bug and raises."""
    names = {n for n, _ in struct._fields_ if not n.endswith("_")}
    if set(values) != names:
        raise KeyError(f"{type(struct).__name__}: unknown {sorted(set(values) - names)}, "
                       f"missing {sorted(names - set(values))}")
    for name, v in values.items():
        setattr(struct, name, int(v))


def _struct_values(bufs, table, struct: str) -> dict[str, int]:
    return {b.name: getattr(bufs, b.name) for b in table if b.struct == struct}


def _params(cls, bufs, table, sched: ScheduleBuffers, plan: _moe_plan.Plan, dims: LayerDims, knobs: KernelKnobs,
            peers: PeerSpec | None, err_ptr: int, trace_ptr: int):
    """The parameter struct: every pointer from the buffer table, the counters from the plan's
    layout, the plan, dims and peers."""
    p = cls()
    _fill(p.sched, _struct_values(sched, _SCHEDULE_TABLE, "sched"))
    _fill(p.w, _struct_values(bufs, table, "w"))
    _fill(p.ctx, _struct_values(bufs, table, "ctx"))
    _fill(p.cnt, plan.counter_pointers(bufs.counters))
    if hasattr(p, "grads"):
        _fill(p.grads, _struct_values(bufs, table, "grads"))
    for name, v in _struct_values(bufs, table, "").items():
        setattr(p, name, int(v))
    p.err, p.trace = err_ptr, trace_ptr
    p.dims = dims._struct(knobs.timeout_ns)
    p.plan = plan.struct()
    p.peers = _no_peers() if peers is None else peers._struct()
    return p


_fit_cache: dict[tuple[int, int], int] = {}
_maps_cache = _moe_maps.StructCache()   # (backward, dims, buffers) -> the encoded maps struct


def _ctas_that_fit(kernel: Kernel, device_id: int, eng: _Kernels) -> int:
    key = (kernel.address, device_id)
    if key not in _fit_cache:
        try:
            dev = call("cuDeviceGet", device_id)
            call("cuKernelSetAttribute", driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                 eng.smem_bytes, kernel.handle, dev)
            n = call("cuOccupancyMaxActiveBlocksPerMultiprocessor", driver.CUfunction(kernel.address), eng.threads,
                     eng.smem_bytes)
            _fit_cache[key] = max(1, int(n))
        except MokError:  # occupancy is advice only: one CTA per SM always works
            _fit_cache[key] = 1
    return _fit_cache[key]


def _grid(kernel: Kernel, device_id: int, knobs: KernelKnobs, num_tasks: int, eng: _Kernels) -> int:
    per_sm = knobs.ctas_per_sm or _ctas_that_fit(kernel, device_id, eng)
    grid = multiprocessor_count(device_id) * per_sm
    if knobs.max_ctas is not None:
        grid = min(grid, knobs.max_ctas)
    return max(1, min(grid, num_tasks))


def _check_launch(bufs, table, sched: ScheduleBuffers, dims: LayerDims, peers: PeerSpec | None, err_ptr: int, *,
                  unused: frozenset = frozenset()) -> None:
    """What both launches check before touching the device."""
    _check_pointers(bufs, table, dims, align=16, unused=unused)
    _check_pointers(sched, _SCHEDULE_TABLE, dims, align=4, unused=frozenset({"route_rank"}))
    _check_peers(peers, sched, dims)
    if not err_ptr:
        raise ArgumentError("err_ptr", "null error word")


class PreparedMegakernel:
    """A megakernel launch with its parameters filled: calling it enqueues the memset of the
    dependency counters (they start every launch at zero) and the launch, unless there is no task
    (a forward with T = 0; a backward always has weight-gradient tasks).  Everything in it is fixed
    by the pointers, sizes, stream and flags it was prepared for, so it may be enqueued again for a
    call that repeats them (mok_rt/backends/cuda.py caches them)."""

    __slots__ = ("launch", "plan", "_counters", "_words", "_stream")

    def __init__(self, launch_: PreparedLaunch | None, plan: _moe_plan.Plan, counters: int, stream):
        self.launch, self.plan = launch_, plan
        self._counters = driver.CUdeviceptr(counters)
        self._words = plan.counter_words
        self._stream = driver.CUstream(stream_handle(stream))

    def __call__(self) -> None:
        call("cuMemsetD32Async", self._counters, 0, self._words, self._stream)
        if self.launch is not None:
            self.launch()


def _prepare_megakernel(p, bufs, dims: LayerDims, plan: _moe_plan.Plan, *, backward: bool, stream, device_id: int,
                        knobs: KernelKnobs) -> PreparedMegakernel:
    """The common tail of both launches: the tensor maps, then the prepared memset and launch."""
    eng = _KERNELS
    params = P.MoEBackwardTmaParams() if backward else P.MoEForwardTmaParams()
    params.p = p
    _maps_cache.fill((backward, dims, bufs), params.maps,
                     lambda: _moe_maps.map_specs(bufs, dims, backward=backward))
    run = None
    if plan.total:
        kernel = get_kernel(eng.cubin, eng.backward if backward else eng.forward, device_id)
        run = PreparedLaunch(kernel, grid=_grid(kernel, device_id, knobs, plan.total, eng), block=eng.threads,
                             params=params, stream=stream, device_id=device_id, shared_mem=eng.smem_bytes)
    return PreparedMegakernel(run, plan, bufs.counters, stream)


def _check_peers(peers: PeerSpec | None, sched: ScheduleBuffers, dims: LayerDims) -> None:
    if peers is None:
        return
    if not isinstance(peers, PeerSpec):
        raise ArgumentError("peers", f"expected a PeerSpec or None, got {type(peers).__name__}")
    if dims.rank != peers.rank:
        raise ArgumentError("peers", f"rank {peers.rank} differs from dims.rank={dims.rank}")
    if not dims.expert_parallel:
        raise ArgumentError("dims", "expert_parallel must be True with peers (it sizes the EP buffers: the block "
                                    "order after block_expert, FP8's token-order xq / dq)")
    if -(-dims.tokens // peers.chunk_tokens) > peers.chunks:   # the push writes one flag per chunk
        raise ArgumentError("peers", f"{dims.tokens} tokens in chunks of {peers.chunk_tokens} need "
                                     f"{-(-dims.tokens // peers.chunk_tokens)} chunk flags; the region has {peers.chunks}")
    if dims.tokens * dims.top_k > peers.slot_rows:
        raise ArgumentError("tokens", f"{dims.tokens} tokens x {dims.top_k} routes exceed the {peers.slot_rows} "
                                      f"slot rows")
    if dims.tokens and not sched.route_rank:
        raise ArgumentError("route_rank", "null device pointer (needed with expert parallelism)")


def launch_forward(bufs: ForwardBuffers, sched: ScheduleBuffers, dims: LayerDims, **kw) -> None:
    """:func:`prepare_forward` (same arguments), enqueued once."""
    prepare_forward(bufs, sched, dims, **kw)()


def launch_backward(bufs: BackwardBuffers, sched: ScheduleBuffers, dims: LayerDims, **kw) -> None:
    """:func:`prepare_backward` (same arguments), enqueued once."""
    prepare_backward(bufs, sched, dims, **kw)()


def prepare_forward(bufs: ForwardBuffers, sched: ScheduleBuffers, dims: LayerDims, *, stream, err_ptr: int,
                    device_id: int = 0, knobs: KernelKnobs = KernelKnobs(), context_only: bool = False,
                    peers: PeerSpec | None = None, trace_ptr: int = 0,
                    plan: _moe_plan.Plan | None = None) -> PreparedMegakernel:
    """Check the arguments and prepare the fused forward on ``stream`` (call the result to enqueue
    it: counters memset, then one persistent launch).

    Writes the context (x_routed, gu, act, y_slot, sgu, sact) and, unless ``context_only``,
    ``out``.  ``err_ptr``: the device error word (int32[4]); the caller checks it after syncing.
    With ``peers`` (expert parallelism) every rank of the group must launch its forward.
    ``trace_ptr``: 0, or device memory for one 32-byte record per task of the plan
    (forward_plan(...).total), zeroed by the caller (mok_rt/kernels/trace.py).
    """
    # A context-only launch (recompute) writes no output and never reads the routing weights.
    _check_launch(bufs, _FORWARD_TABLE, sched, dims, peers, err_ptr,
                  unused=frozenset({"out", "topk_weights", "shared_y"}) if context_only else frozenset())
    if plan is None:   # (the caller may pass the plan it already built for these arguments)
        plan = forward_plan(dims, context_only=bool(context_only), push_tasks=0 if peers is None else peers.push_tasks)
    p = _params(P.MoEForwardParams, bufs, _FORWARD_TABLE, sched, plan, dims, knobs, peers, err_ptr, trace_ptr)
    p.context_only = int(bool(context_only))
    return _prepare_megakernel(p, bufs, dims, plan, backward=False, stream=stream, device_id=device_id, knobs=knobs)


def prepare_backward(bufs: BackwardBuffers, sched: ScheduleBuffers, dims: LayerDims, *, stream, err_ptr: int,
                     device_id: int = 0, knobs: KernelKnobs = KernelKnobs(), accumulate: bool = False,
                     grad_bf16: bool = False, peers: PeerSpec | None = None, trace_ptr: int = 0,
                     plan: _moe_plan.Plan | None = None) -> PreparedMegakernel:
    """Check the arguments and prepare the fused backward on ``stream`` (call the result to
    enqueue it: counters memset, then one persistent launch).

    Writes dx, d_topk_weights and the weight gradients, fp32 or (``grad_bf16``) bf16, added to
    their contents when ``accumulate``.  Needs the forward context of the same schedule and inputs.  With ``peers``
    the dy_routed / dx_slot pointers must be this rank's routed / slot rows in its block.
    ``trace_ptr``: as for launch_forward (backward_plan(...).total records).
    """
    _check_launch(bufs, _BACKWARD_TABLE, sched, dims, peers, err_ptr)
    if plan is None:
        plan = backward_plan(dims, push_tasks=0 if peers is None else peers.push_tasks)
    p = _params(P.MoEBackwardParams, bufs, _BACKWARD_TABLE, sched, plan, dims, knobs, peers, err_ptr, trace_ptr)
    p.accumulate = int(bool(accumulate))
    p.grad_bf16 = int(bool(grad_bf16))
    return _prepare_megakernel(p, bufs, dims, plan, backward=True, stream=stream, device_id=device_id, knobs=knobs)


def prepare(device_id: int, eng: "_Kernels" = _KERNELS) -> int:
    """Load the megakernels of ``eng`` (default: the bf16 forward and backward) on ``device_id``
    and set their launch attributes now; returns how many of their CTAs fit on one SM.  Expert
    parallelism needs this before the first launch: loading a module or changing a kernel's
    attributes may wait for the device's running kernels, and a rank's kernel may already be
    spinning for a peer whose launch would then wait behind it."""
    from mok_rt.runtime.launch import _ensure_shared_memory
    fit = []
    for name in (n for n in (eng.forward, eng.backward) if n):
        kernel = get_kernel(eng.cubin, name, device_id)
        fit.append(_ctas_that_fit(kernel, device_id, eng))
        _ensure_shared_memory(kernel, device_id, eng.smem_bytes)
    return min(fit)
