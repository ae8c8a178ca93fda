"""Launching the fused MoE forward/backward kernels on one GPU, or as one rank of an
expert-parallel group (``peers=PeerSpec(...)``).

The kernels (cuda_src/moe/moe_layer.cu): 384 threads, a TMA producer warp + 2 wgmma worker
warpgroups, epilogues from registers; a tensor map per operand view (_moe_maps.py).

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
from dataclasses import dataclass, fields

from . import _moe_maps
from . import _moe_params as P
from ._driver import call, driver
from ._kernels import Kernel, get_kernel
from .errors import ArgumentError, MokError
from .launch import launch, multiprocessor_count, stream_handle

__all__ = [
    "LayerDims", "ScheduleBuffers", "ForwardBuffers", "BackwardBuffers", "KernelKnobs", "PeerSpec",
    "forward_buffer_bytes", "backward_buffer_bytes", "forward_phases", "backward_phases", "forward_task_count",
    "backward_task_count",
    "launch_forward", "launch_backward",
]

_BF16, _F32, _I32 = 2, 4, 4


@dataclass(frozen=True)
class _Engine:
    cubin: str
    forward: str
    backward: str
    threads: int
    smem_bytes: int
    tile_n: int          # dA / dX / down / wgrad tile width
    gate_up_cols: int    # intermediate columns per fused gate|up tile


_ENGINE = _Engine("moe_layer", "moe_forward", "moe_backward", P.THREADS, P.SMEM_BYTES, P.TILE_N,
                  P.GATE_UP_COLS)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _int(name: str, v, *, minimum: int = 0, multiple: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum or v % multiple:
        need = f"an int >= {minimum}" + (f" and a multiple of {multiple}" if multiple > 1 else "")
        raise ArgumentError(name, f"expected {need}, got {v!r}")
    return v


@dataclass(frozen=True)
class LayerDims:
    """Host-known sizes of one launch (DESIGN.md §2 names): T, H, I, k, E_l, capacity, I_s."""

    tokens: int                 # T (0 allowed)
    hidden: int                 # H, multiple of 64
    intermediate: int           # I, multiple of 64
    top_k: int                  # k
    local_experts: int          # E_l
    capacity_rows: int          # max_rows: padded row capacity, multiple of BLOCK_M
    shared_intermediate: int = 0  # I_s: 0 = no shared expert, else multiple of 64
    swiglu_limit: float | None = None
    rank: int = 0               # reported in error words

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


@dataclass(frozen=True)
class ScheduleBuffers:
    """Device pointers of the routing schedule (int32 arrays; see params.cuh MoESchedule); the
    schedule's block_m must be BLOCK_M (128)."""

    expert_count: int    # [E_l]
    expert_offset: int   # [E_l + 1]
    num_blocks: int      # [1]
    block_expert: int    # [max_blocks]
    row_src_rank: int    # [max_rows]
    row_slot: int        # [max_rows]
    route_row: int       # [T * k]
    route_rank: int = 0  # [T * k] (read only with expert parallelism)


@dataclass(frozen=True)
class ForwardBuffers:
    """Device pointers for moe_forward.  Shared-expert fields stay 0 when I_s = 0."""

    x: int               # [T, H] bf16
    topk_weights: int    # [T, k] f32
    w_gate: int          # [E_l, I, H] bf16
    w_up: int            # [E_l, I, H] bf16
    w_down: int          # [E_l, H, I] bf16
    x_routed: int        # context [max_rows, H] bf16
    gu: int              # context [max_rows, 2I] bf16
    act: int             # context [max_rows, I] bf16
    y_slot: int          # context [T*k, H] bf16
    out: int             # [T, H] bf16 (unused when context_only)
    counters: int        # scratch, forward_buffer_bytes(dims)["counters"] bytes
    ws_gate: int = 0     # [I_s, H] bf16
    ws_up: int = 0       # [I_s, H] bf16
    ws_down: int = 0     # [H, I_s] bf16
    sgu: int = 0         # context [T, 2I_s] bf16
    sact: int = 0        # context [T, I_s] bf16
    shared_y: int = 0    # scratch [T, H] f32


@dataclass(frozen=True)
class BackwardBuffers:
    """Device pointers for moe_backward.  Shared-expert fields stay 0 when I_s = 0."""

    d_out: int           # [T, H] bf16
    x: int               # [T, H] bf16 (read only with a shared expert)
    topk_weights: int    # [T, k] f32
    w_gate: int
    w_up: int
    w_down: int
    x_routed: int        # forward context
    gu: int
    act: int
    y_slot: int
    dx: int              # [T, H] bf16
    d_topk_weights: int  # [T, k] f32
    dw_gate: int         # [E_l, I, H] f32
    dw_up: int           # [E_l, I, H] f32
    dw_down: int         # [E_l, H, I] f32
    dy_routed: int       # scratch [max_rows, H] bf16
    dgu: int             # scratch [max_rows, 2I] bf16
    dx_slot: int         # scratch [T*k, H] bf16
    counters: int        # scratch, backward_buffer_bytes(dims)["counters"] bytes
    ws_gate: int = 0
    ws_up: int = 0
    ws_down: int = 0
    sgu: int = 0         # forward context
    sact: int = 0
    dws_gate: int = 0    # [I_s, H] f32
    dws_up: int = 0      # [I_s, H] f32
    dws_down: int = 0    # [H, I_s] f32
    dsgu: int = 0        # scratch [T, 2I_s] bf16
    dx_shared: int = 0   # scratch [T, H] f32


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
    [capacity_rows, H] bf16, ``slot_offset`` [slot_rows, H] bf16 (slot_rows = max_tokens * k),
    ``flags_offset`` int32 [NUM_PEER_FLAGS][MAX_EP_RANKS] (zeroed once, never reset),
    ``end_pad_offset`` the end-of-launch barrier's signal pad.  ``epoch``: this launch's number,
    the same on every rank and larger than any earlier launch's.  ``push_tasks``: how many tasks
    push this rank's rows (at most that many CTAs move rows while the others start GEMM tiles).
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

    def __post_init__(self):
        n = len(self.peer_bases)
        if not 2 <= n <= P.MAX_EP_RANKS:
            raise ArgumentError("peer_bases", f"expected 2 to {P.MAX_EP_RANKS} ranks, got {n}")
        if not 0 <= self.rank < n:
            raise ArgumentError("rank", f"expected a rank in [0, {n}), got {self.rank}")
        _int("push_tasks", self.push_tasks, minimum=1)
        _int("slot_rows", self.slot_rows)
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
        return s


def _no_peers() -> P.MoEPeers:
    s = P.MoEPeers()
    s.num_ranks, s.rank = 1, 0
    return s


# ---- sizes ------------------------------------------------------------------------------------

def _forward_counter_words(d: LayerDims) -> int:
    return 4 + 2 * d.max_blocks + 2 * d.token_blocks


def _backward_counter_words(d: LayerDims) -> int:
    return 5 + 2 * d.max_blocks + 2 * d.local_experts + 2 * d.token_blocks


def forward_buffer_bytes(dims: LayerDims) -> dict[str, int]:
    """Bytes of every buffer moe_forward writes (context, output, scratch); 0 = not needed."""
    d = dims
    T, H, I, Is, R = d.tokens, d.hidden, d.intermediate, d.shared_intermediate, d.capacity_rows
    return {
        "x_routed": R * H * _BF16,
        "gu": R * 2 * I * _BF16,
        "act": R * I * _BF16,
        "y_slot": T * d.top_k * H * _BF16,
        "sgu": T * 2 * Is * _BF16,
        "sact": T * Is * _BF16,
        "out": T * H * _BF16,
        "shared_y": T * H * _F32 if Is else 0,
        "counters": _forward_counter_words(d) * _I32,
    }


def backward_buffer_bytes(dims: LayerDims) -> dict[str, int]:
    """Bytes of every buffer moe_backward writes (gradients and scratch); 0 = not needed."""
    d = dims
    T, H, I, Is, R, E = d.tokens, d.hidden, d.intermediate, d.shared_intermediate, d.capacity_rows, d.local_experts
    return {
        "dx": T * H * _BF16,
        "d_topk_weights": T * d.top_k * _F32,
        "dw_gate": E * I * H * _F32,
        "dw_up": E * I * H * _F32,
        "dw_down": E * H * I * _F32,
        "dws_gate": Is * H * _F32,
        "dws_up": Is * H * _F32,
        "dws_down": H * Is * _F32,
        "dy_routed": R * H * _BF16,
        "dgu": R * 2 * I * _BF16,
        "dx_slot": T * d.top_k * H * _BF16,
        "dsgu": T * 2 * Is * _BF16,
        "dx_shared": T * H * _F32 if Is else 0,
        "counters": _backward_counter_words(d) * _I32,
    }


def forward_phases(dims: LayerDims, *, context_only: bool = False, push_tasks: int = 0) -> tuple[tuple[str, int], ...]:
    """The forward's task index space as (phase, task count) in plan order: the mirror of
    ForwardPlan::make (forward_tasks.cuh) with the engine's tile widths; ``push_tasks`` > 0 with
    expert parallelism.  Task t belongs to the phase whose range holds t (trace labels)."""
    d, eng = dims, _ENGINE
    tb, mb, h_tiles = d.token_blocks, d.max_blocks, _ceil_div(d.hidden, eng.tile_n)
    gu, sgu = _ceil_div(d.intermediate, eng.gate_up_cols), _ceil_div(d.shared_intermediate, eng.gate_up_cols)
    shared = d.shared_intermediate > 0
    ep = push_tasks > 0
    lead = [("push", push_tasks), ("push_notify", 1), ("shared_gate_up", tb * sgu if shared else 0),
            ("dispatch", mb)] if ep else [("dispatch", mb), ("shared_gate_up", tb * sgu if shared else 0)]
    return tuple(lead + [("routed_gate_up", mb * gu),
                         ("shared_down", tb * h_tiles if shared and not context_only else 0),
                         ("routed_down", mb * h_tiles), ("down_notify", 1 if ep else 0),
                         ("combine", 0 if context_only and not ep else tb * P.combine_parts(tb))])


def backward_phases(dims: LayerDims, *, push_tasks: int = 0) -> tuple[tuple[str, int], ...]:
    """The backward's task index space as (phase, task count): mirror of BackwardPlan::make."""
    d, eng = dims, _ENGINE
    tb, mb = d.token_blocks, d.max_blocks
    i_t, si_t, h_t = (_ceil_div(v, eng.tile_n) for v in (d.intermediate, d.shared_intermediate, d.hidden))
    i_r, si_r, h_r = (_ceil_div(v, P.BLOCK_M) for v in (d.intermediate, d.shared_intermediate, d.hidden))
    shared = d.shared_intermediate > 0
    ep = push_tasks > 0
    local = [("d_weights", tb), ("shared_da", tb * si_t if shared else 0)]
    lead = ([("push", push_tasks), ("push_notify", 1), *local, ("dispatch", mb)] if ep
            else [("dispatch", mb), *local])
    return tuple(lead + [("routed_da", mb * i_t), ("shared_dx", tb * h_t if shared else 0),
                         ("routed_dx", mb * h_t), ("dx_notify", 1 if ep else 0),
                         ("wgrad_down", d.local_experts * h_r * i_t),
                         ("wgrad_gate_up", d.local_experts * 2 * i_r * h_t),
                         ("shared_wgrad", h_r * si_t + 2 * si_r * h_t if shared else 0),
                         ("combine", tb * P.combine_parts(tb))])


def forward_task_count(dims: LayerDims, *, context_only: bool = False, push_tasks: int = 0) -> int:
    """Size of the forward task index space (see forward_phases)."""
    return sum(n for _, n in forward_phases(dims, context_only=context_only, push_tasks=push_tasks))


def backward_task_count(dims: LayerDims, *, push_tasks: int = 0) -> int:
    """Size of the backward task index space (see backward_phases)."""
    return sum(n for _, n in backward_phases(dims, push_tasks=push_tasks))


# ---- launching --------------------------------------------------------------------------------

_SHARED_ONLY = frozenset({"ws_gate", "ws_up", "ws_down", "sgu", "sact", "shared_y", "dws_gate", "dws_up",
                          "dws_down", "dsgu", "dx_shared"})
# Token-sized buffers may be empty (T = 0): the kernels never touch them then.
_TOKEN_SIZED = frozenset({"x", "topk_weights", "out", "y_slot", "d_out", "dx", "d_topk_weights", "dx_slot",
                          "route_row", "sgu", "sact", "shared_y", "dsgu", "dx_shared"})


def _check_pointers(obj, dims: LayerDims, *, align: int, unused: frozenset = frozenset()) -> None:
    """Every pointer an int, aligned (16 bytes for data: the kernels move 16-byte vectors), and
    non-null unless the buffer is unused (no shared expert, or T = 0)."""
    no_shared = dims.shared_intermediate == 0
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ArgumentError(f.name, f"expected a device pointer (int), got {v!r}")
        if v % align:
            raise ArgumentError(f.name, f"device pointer {v:#x} is not {align}-byte aligned")
        if v == 0 and f.name not in unused and not (no_shared and f.name in _SHARED_ONLY) \
                and not (dims.tokens == 0 and f.name in _TOKEN_SIZED):
            raise ArgumentError(f.name, "null device pointer")


def _dims_struct(dims: LayerDims, knobs: KernelKnobs) -> P.MoEDims:
    return dims._struct(knobs.timeout_ns)


def _fill(struct, values: dict[str, int]) -> None:
    for name, _ in struct._fields_:
        if name in values:
            setattr(struct, name, int(values[name]))


def _schedule_struct(sched: ScheduleBuffers) -> P.MoESchedule:
    s = P.MoESchedule()
    _fill(s, {f.name: getattr(sched, f.name) for f in fields(sched)})
    return s


def _carve(base: int, sizes: list[tuple[str, int]]) -> dict[str, int]:
    """Consecutive int32 sub-arrays of one counter allocation."""
    out, at = {}, base
    for name, words in sizes:
        out[name] = at
        at += words * _I32
    return out


_fit_cache: dict[tuple[int, int], int] = {}


def _ctas_that_fit(kernel: Kernel, device_id: int, eng: _Engine) -> int:
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


def _grid(kernel: Kernel, device_id: int, knobs: KernelKnobs, num_tasks: int, eng: _Engine) -> int:
    per_sm = knobs.ctas_per_sm or _ctas_that_fit(kernel, device_id, eng)
    grid = multiprocessor_count(device_id) * per_sm
    if knobs.max_ctas is not None:
        grid = min(grid, knobs.max_ctas)
    return max(1, min(grid, num_tasks))


def _zero_counters(ptr: int, words: int, stream) -> None:
    call("cuMemsetD32Async", driver.CUdeviceptr(ptr), 0, words, driver.CUstream(stream_handle(stream)))


def _check_launch(bufs, sched: ScheduleBuffers, dims: LayerDims, peers: PeerSpec | None, err_ptr: int, *,
                  unused: frozenset = frozenset()) -> None:
    """What both launches check before touching the device."""
    _check_pointers(bufs, dims, align=16, unused=unused)
    _check_pointers(sched, dims, align=4, unused=frozenset({"route_rank"}))
    _check_peers(peers, sched, dims)
    if not err_ptr:
        raise ArgumentError("err_ptr", "null error word")


def _launch_megakernel(p, bufs, dims: LayerDims, eng: _Engine, *, backward: bool, num_tasks: int, trace_ptr: int,
                       counter_words: int, stream, device_id: int, knobs: KernelKnobs) -> None:
    """The common tail of both launches: trace size, the tensor maps, the memset of
    the dependency counters (they start every launch at zero), then the launch unless there is
    no task (a forward with T = 0; a backward always has weight-gradient tasks)."""
    p.trace_tasks = num_tasks if trace_ptr else 0
    params = P.MoEBackwardTmaParams() if backward else P.MoEForwardTmaParams()
    params.p = p
    _moe_maps.encode_maps(_moe_maps.map_specs(bufs, dims, backward=backward), params.maps)
    _zero_counters(bufs.counters, counter_words, stream)
    if num_tasks == 0:
        return
    kernel = get_kernel(eng.cubin, eng.backward if backward else eng.forward, device_id)
    launch(kernel, grid=_grid(kernel, device_id, knobs, num_tasks, eng), block=eng.threads, params=params,
           stream=stream, device_id=device_id, shared_mem=eng.smem_bytes)


def _check_peers(peers: PeerSpec | None, sched: ScheduleBuffers, dims: LayerDims) -> None:
    if peers is None:
        return
    if not isinstance(peers, PeerSpec):
        raise ArgumentError("peers", f"expected a PeerSpec or None, got {type(peers).__name__}")
    if dims.rank != peers.rank:
        raise ArgumentError("peers", f"rank {peers.rank} differs from dims.rank={dims.rank}")
    if dims.tokens * dims.top_k > peers.slot_rows:
        raise ArgumentError("tokens", f"{dims.tokens} tokens x {dims.top_k} routes exceed the {peers.slot_rows} "
                                      f"slot rows")
    if dims.tokens and not sched.route_rank:
        raise ArgumentError("route_rank", "null device pointer (needed with expert parallelism)")


def launch_forward(bufs: ForwardBuffers, sched: ScheduleBuffers, dims: LayerDims, *, stream, err_ptr: int,
                   device_id: int = 0, knobs: KernelKnobs = KernelKnobs(), context_only: bool = False,
                   peers: PeerSpec | None = None, trace_ptr: int = 0) -> None:
    """Enqueue the fused forward on ``stream``: counters memset, then one persistent launch.

    Writes the context (x_routed, gu, act, y_slot, sgu, sact) and, unless ``context_only``,
    ``out``.  ``err_ptr``: the device error word (int32[4]); the caller checks it after syncing.
    With ``peers`` (expert parallelism) every rank of the group must launch its forward.
    ``trace_ptr``: 0, or device memory for one 32-byte record per task (forward_task_count),
    zeroed by the caller (mok_rt/_trace.py).
    """
    # A context-only launch (recompute) writes no output and never reads the routing weights.
    _check_launch(bufs, sched, dims, peers, err_ptr,
                  unused=frozenset({"out", "topk_weights", "shared_y"}) if context_only else frozenset())
    d = dims
    cnt = _carve(bufs.counters, [("task_next", 1), ("down_done", 1), ("block_ready", d.max_blocks),
                                 ("block_act_ready", d.max_blocks), ("token_sact_ready", d.token_blocks),
                                 ("token_shared_done", d.token_blocks), ("push_done", 1), ("ctas_done", 1)])
    eng = _ENGINE
    p = P.MoEForwardParams()
    p.sched = _schedule_struct(sched)
    _fill(p.w, {n: getattr(bufs, n) for n in ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")})
    _fill(p.ctx, {n: getattr(bufs, n) for n in ("x_routed", "gu", "act", "y_slot", "sgu", "sact")})
    _fill(p.cnt, cnt)
    _fill(p, {"x": bufs.x, "topk_weights": bufs.topk_weights, "out": bufs.out, "shared_y": bufs.shared_y,
              "err": err_ptr})
    p.trace = trace_ptr
    p.dims = _dims_struct(d, knobs)
    p.context_only = int(bool(context_only))
    p.peers = _no_peers() if peers is None else peers._struct()

    num_tasks = forward_task_count(d, context_only=bool(context_only),
                                   push_tasks=0 if peers is None else peers.push_tasks)
    _launch_megakernel(p, bufs, d, eng, backward=False, num_tasks=num_tasks, trace_ptr=trace_ptr,
                       counter_words=_forward_counter_words(d), stream=stream, device_id=device_id, knobs=knobs)


def launch_backward(bufs: BackwardBuffers, sched: ScheduleBuffers, dims: LayerDims, *, stream, err_ptr: int,
                    device_id: int = 0, knobs: KernelKnobs = KernelKnobs(), accumulate: bool = False,
                    peers: PeerSpec | None = None, trace_ptr: int = 0) -> None:
    """Enqueue the fused backward on ``stream``: counters memset, then one persistent launch.

    Writes dx, d_topk_weights and the fp32 weight gradients (added to their contents when
    ``accumulate``).  Needs the forward context of the same schedule and inputs.  With ``peers``
    the dy_routed / dx_slot pointers must be this rank's routed / slot rows in its block.
    ``trace_ptr``: as for launch_forward (backward_task_count records).
    """
    _check_launch(bufs, sched, dims, peers, err_ptr)
    d = dims
    cnt = _carve(bufs.counters, [("task_next", 1), ("dx_done", 1), ("dsgu_done", 1),
                                 ("block_dy_ready", d.max_blocks), ("block_dgu_ready", d.max_blocks),
                                 ("expert_dy_ready", d.local_experts), ("expert_dgu_ready", d.local_experts),
                                 ("token_dsgu_ready", d.token_blocks), ("token_dxs_ready", d.token_blocks),
                                 ("push_done", 1), ("ctas_done", 1)])
    eng = _ENGINE
    p = P.MoEBackwardParams()
    p.sched = _schedule_struct(sched)
    _fill(p.w, {n: getattr(bufs, n) for n in ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")})
    _fill(p.ctx, {"x_routed": bufs.x_routed, "gu": bufs.gu, "act": bufs.act, "y_slot": bufs.y_slot,
                  "sgu": bufs.sgu, "sact": bufs.sact})
    _fill(p.cnt, cnt)
    _fill(p.grads, {n: getattr(bufs, n) for n in ("dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")})
    _fill(p, {n: getattr(bufs, n) for n in ("x", "topk_weights", "d_out", "dx", "d_topk_weights", "dy_routed",
                                            "dgu", "dx_slot", "dsgu", "dx_shared")})
    p.err = err_ptr
    p.trace = trace_ptr
    p.dims = _dims_struct(d, knobs)
    p.accumulate = int(bool(accumulate))
    p.peers = _no_peers() if peers is None else peers._struct()

    num_tasks = backward_task_count(d, push_tasks=0 if peers is None else peers.push_tasks)
    _launch_megakernel(p, bufs, d, eng, backward=True, num_tasks=num_tasks, trace_ptr=trace_ptr,
                       counter_words=_backward_counter_words(d), stream=stream, device_id=device_id, knobs=knobs)


def prepare(device_id: int) -> None:
    """Load both megakernels on ``device_id`` and set their launch attributes now.
    Expert parallelism needs this before the first launch: loading a module or changing a
    kernel's attributes may wait for the device's running kernels, and a rank's kernel may
    already be spinning for a peer whose launch would then wait behind it."""
    from .launch import _ensure_shared_memory
    eng = _ENGINE
    for name in (eng.forward, eng.backward):
        kernel = get_kernel(eng.cubin, name, device_id)
        _ctas_that_fit(kernel, device_id, eng)
        _ensure_shared_memory(kernel, device_id, eng.smem_bytes)
