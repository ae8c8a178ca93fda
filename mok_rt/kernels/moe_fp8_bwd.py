"""Launching the "fp8_block" backward megakernel (cuda_src/moe/moe_backward_fp8.cu), on one GPU or as
one rank of an expert-parallel group (``peers``).

The contract of :func:`mok_rt.kernels.moe_launch.prepare_backward` (the caller owns every buffer;
nothing here synchronises or reads a routing-dependent count), with the FP8 backward's buffer table
(:data:`FP8_BACKWARD_TABLE`, from kernels/moe_params_fp8_bwd.py), its plan (``backward_plan(...,
precision="fp8_block")``) and its 17 tensor maps (:func:`map_specs`, docs/FP8_BACKWARD.md,
"Parameters").

What the launch reads: the FP8 forward's context (bf16 ``gu``, ``y_slot``, ``sgu``; the E4M3
``xq``, ``xrq``, ``aq``, ``saq`` and their scales), the transposed E4M3 weights (``*_t``, from
``mok.quantize_weights(for_backward=True)`` or quantised by the backend for the call), d_out and the
routing weights.  What it writes: dx, d_topk_weights, the weight gradients, and its scratch: the
quantised gradients (``dq``, ``dguq``, ``dsguq``, their scales ``rs`` / ``ts``), the bf16 wgrad
operands (``dq_bf``, ``xq_bf``, ``act``, ``sact``, ``dgu``, ``dsgu``), ``dx_slot`` / ``dx_shared``
and the counters.  Three pointers are views, not buffers of their own: ``q.dyq`` (dq's routed rows),
``p.dy_routed`` (dq_bf's) and ``p.ctx.x_routed`` (xq_bf's), each ``token_rows`` rows into its
array, so that one tensor map covers the token-order and the routed rows (the 4 KB parameter
budget).  The bf16 weights and ``x`` are null: the GEMMs read the E4M3 copies and the widened ones.

With expert parallelism (cuda_src/moe/tasks/ep_fp8.cuh): one push task per token block
(``moe_fp8.push_tasks``) quantises d_out into the token-order rows of dq / dq_bf (which
``dims.expert_parallel`` sizes with or without a shared expert) and sends E4M3 rows, scales and
routing weights; ``dx_slot`` must be the rank's slot rows of the symmetric block (the destinations
return dx there, as in the bf16 EP backward); and ``dims.timeout_ns`` goes to the kernel times
``LOCAL_TIMEOUT_FACTOR`` (its local waits use it as it is, its peer waits divide: see
TmaBackwardFp8::wait_ctx), so the deadlines are the bf16 EP backward's.
"""
from __future__ import annotations

import dataclasses

from mok_rt.errors import ArgumentError
from mok_rt.kernels import moe_launch as L
from mok_rt.kernels import moe_maps as _maps
from mok_rt.kernels import moe_params as P
from mok_rt.kernels import moe_params_fp8 as F
from mok_rt.kernels import moe_params_fp8_bwd as B
from mok_rt.kernels import moe_plan as _moe_plan
from mok_rt.kernels.moe_fp8 import _a, _b, _scales, check_push_tasks
from mok_rt.runtime.cubins import get_kernel
from mok_rt.runtime.driver import call, driver
from mok_rt.runtime.launch import PreparedLaunch, stream_handle
from mok_rt.runtime.tensormap import Major, TensorMapSpec, gemm_operand

__all__ = ["FP8_BACKWARD_TABLE", "Fp8BackwardBuffers", "backward_plan", "backward_buffer_bytes", "views",
           "map_specs", "pad_rows", "prepare_backward_fp8", "launch_backward_fp8", "PreparedFp8Backward", "prepare"]

_KERNELS = L._Kernels("moe_backward_fp8", "", "moe_backward_fp8", P.THREADS, P.SMEM_BYTES)


def prepare(device_id: int) -> int:
    """Load the FP8 backward on ``device_id`` and set its launch attributes now (before any expert-
    parallel launch: see ``moe_launch.prepare``); returns how many of its CTAs fit on one SM."""
    return L.prepare(device_id, _KERNELS)


_BF = {b.name: b for b in P.BACKWARD_BUFFERS}
_FWD8 = {b.name: b for b in F.FP8_FORWARD_BUFFERS}
_BWD8 = {b.name: b for b in B.FP8_BACKWARD_BUFFERS}

# Every buffer one launch takes, but the schedule's (ScheduleBuffers) and the views (:func:`views`).
# Roles: "context" = the FP8 forward's (read only here), "input" (d_out, topk_weights, the
# transposed weights), "output" (dx, d_topk_weights, the weight gradients; fp32 sizes as in the bf16
# table), "scratch" and "counters" (the backend's per-rank scratch).  dx_slot is "heap" in the bf16
# table (the rows that travel with expert parallelism); on one GPU it is plain scratch.
FP8_BACKWARD_TABLE: tuple[P.Buffer, ...] = (
    *(_FWD8[n] for n in ("gu", "y_slot", "sgu")),
    *(b for b in F.FP8_FORWARD_BUFFERS if b.struct == "qctx"),
    *(b for b in B.FP8_BACKWARD_BUFFERS if b.struct == "wt"),
    *(b for b in P.BACKWARD_BUFFERS if b.struct == "grads"),
    *(_BF[n] for n in ("topk_weights", "d_out", "dx", "d_topk_weights")),
    dataclasses.replace(_BF["dx_slot"], role="scratch"), _BF["dx_shared"],
    *(b for b in B.FP8_BACKWARD_BUFFERS if b.struct in ("q", "ctx", "") and b.role != "view"),
    _BF["counters"],
)
_names = [b.name for b in FP8_BACKWARD_TABLE]
assert len(_names) == len(set(_names)), "a buffer listed twice"
del _names

Fp8BackwardBuffers = L._buffers_class("Fp8BackwardBuffers", FP8_BACKWARD_TABLE, """Device pointers for
    moe_backward_fp8, one per buffer of moe_fp8_bwd.FP8_BACKWARD_TABLE (shapes and roles there); 0 where
    the buffer has 0 bytes.""")
Fp8BackwardBuffers.__module__ = __name__

# The bf16 struct's fields an FP8 launch leaves null: its weights (the GEMMs read the E4M3 copies)
# and x (the shared wgrads read xq_bf).  d_weights reads d_out itself (unquantised, as the oracle).
_NULL_W = tuple(n for n, _ in P.MoEWeights._fields_)
_FP8_COUNTERS = ("token_dq_ready", "expert_widen_ready", "prep_done")


LOCAL_TIMEOUT_FACTOR = 2   # ep::kLocalTimeoutFactor (cuda_src/moe/tasks/ep.cuh)


def backward_plan(dims: L.LayerDims, *, push_tasks: int = 0) -> _moe_plan.Plan:
    """The FP8 backward's plan; ``push_tasks`` > 0 (then ``moe_fp8.push_tasks``) with expert parallelism."""
    return _moe_plan.backward_plan(dims, push_tasks=push_tasks, precision="fp8_block")


def backward_buffer_bytes(dims: L.LayerDims) -> dict[str, int]:
    """Bytes of every buffer moe_backward_fp8 writes (outputs, scratch, counters); 0 = not needed.
    With ``dims.expert_parallel`` the counters are the EP plan's, and dx_slot is the symmetric
    block's slot rows (listed here all the same: the caller does not allocate it then)."""
    words = backward_plan(dims, push_tasks=_moe_plan.fp8_push_tasks(dims) if dims.expert_parallel else 0).counter_words
    return {b.name: (words * 4 if b.role == "counters" else b.nbytes(dims))
            for b in FP8_BACKWARD_TABLE if b.role in ("output", "scratch", "counters")}


def views(bufs, dims: L.LayerDims) -> dict[str, int]:
    """The pointers that are views into other buffers: the routed rows of dq (``dyq``, e4m3), of
    dq_bf (``dy_routed``) and of xq_bf (``x_routed``), ``token_rows`` rows in (0 where the array is
    0 bytes)."""
    skip = B.token_rows(dims) * dims.hidden

    def at(base: int, itemsize: int) -> int:
        return base + skip * itemsize if base and dims.capacity_rows else 0
    return {"dyq": at(bufs.dq, 1), "dy_routed": at(bufs.dq_bf, 2), "x_routed": at(bufs.xq_bf, 2)}


def pad_rows(bufs, dims: L.LayerDims) -> tuple[tuple[int, int], ...]:
    """(pointer, bytes) of the token-order rows [T, token_rows) of dq_bf and xq_bf.  The shared
    wgrads read their K (tokens) through the maps dy_mn / x_mn, which run on into the routed rows:
    K rows past T of the shared token block are inside the map, not zero-filled by TMA, and their
    partner operand's zeros (dsgu_mn, sact_mn end at T) would not cancel NaN there.  The launch
    zeroes them (the kernel's token_prep writes rows < T only)."""
    T, H, rows = dims.tokens, dims.hidden, B.token_rows(dims)
    if rows <= T:
        return ()
    return tuple((ptr + 2 * T * H, 2 * (rows - T) * H) for ptr in (bufs.dq_bf, bufs.xq_bf) if ptr)


# ---- tensor maps ---------------------------------------------------------------------------------
_A_ROWS, _B_ROWS = P.BLOCK_M, P.TILE_N   # the bf16 wgrad bodies' boxes (moe_maps.py)
_BOX = F.KBLOCK                          # FP8 K box and sub-tile rows (moe_fp8.py)


def _mn(address: int, rows: int, k: int, box_rows: int) -> TensorMapSpec | None:
    """A bf16 wgrad operand, MN-major as the bf16 backward's *_mn maps: [k, rows], rows contiguous."""
    if not address or rows <= 0 or k <= 0:
        return None
    return gemm_operand(address, major=Major.MN, rows=rows, k=k, box_rows=box_rows)


def map_specs(bufs, dims: L.LayerDims) -> dict[str, TensorMapSpec | None]:
    """The spec of every map of moe_backward_fp8 in the struct's field order (None: unused, zeros).
    Token-order and routed rows share dq_k, dy_mn and x_mn (rows [0, token_rows) then the routed)."""
    d, b = dims, bufs
    T, H, I, Is, R, E = (d.tokens, d.hidden, d.intermediate, d.shared_intermediate, d.capacity_rows,
                         d.local_experts)
    rows = B.token_rows(d) + R
    ip, ips = B.padded_inter(I), B.padded_inter(Is)
    kh = -(-H // _BOX) * _BOX   # the K extent of dA in whole blocks: rs / ts rows [0, H/128) are dA's
    specs = {
        "dq_k": _a(b.dq, rows, H),
        "dguq_k": _a(b.dguq, R, 2 * ip),
        "dsguq_k": _a(b.dsguq, T, 2 * ips) if Is else None,
        "rs_s": _scales(b.rs, R, kh + 2 * ip, R),
        "ts_s": _scales(b.ts, T, kh + 2 * ips, F.token_ld(d)) if Is else None,
        "down_t_k": _b(b.down_t, I, H, _BOX, E),         # [E, I, H]: n = i, k = h
        "gate_t_k": _b(b.gate_t, H, I, _BOX, E),         # [E, H, I]: n = h, k = i
        "up_t_k": _b(b.up_t, H, I, _BOX, E),
        "shared_down_t_k": _b(b.shared_down_t, Is, H, _BOX) if Is else None,
        "shared_gate_t_k": _b(b.shared_gate_t, H, Is, _BOX) if Is else None,
        "shared_up_t_k": _b(b.shared_up_t, H, Is, _BOX) if Is else None,
        # wgrads (bf16, K = rows): as the bf16 backward's dy_routed_mn / d_out_mn, x_routed_mn / x_mn, ...
        "dy_mn": _mn(b.dq_bf, H, rows, _A_ROWS),
        "x_mn": _mn(b.xq_bf, H, rows, _B_ROWS),
        "act_mn": _mn(b.act, I, R, _B_ROWS),
        "sact_mn": _mn(b.sact, Is, T, _B_ROWS),
        "dgu_mn": _mn(b.dgu, 2 * I, R, _A_ROWS),
        "dsgu_mn": _mn(b.dsgu, 2 * Is, T, _A_ROWS),
    }
    assert tuple(specs) == B.FP8_BACKWARD_MAP_NAMES
    return specs


# ---- parameters ----------------------------------------------------------------------------------
def _values(bufs, struct: str) -> dict[str, int]:
    return {b.name: getattr(bufs, b.name) for b in FP8_BACKWARD_TABLE if b.struct == struct}


def _params(bufs, sched, plan, dims: L.LayerDims, knobs: L.KernelKnobs, err_ptr: int, trace_ptr: int,
            accumulate: bool, grad_bf16: bool, peers: L.PeerSpec | None = None) -> B.MoEFp8BackwardParams:
    q = B.MoEFp8BackwardParams()
    p = q.p
    v = views(bufs, dims)
    L._fill(p.sched, L._struct_values(sched, L._SCHEDULE_TABLE, "sched"))
    L._fill(p.w, dict.fromkeys(_NULL_W, 0))
    L._fill(p.ctx, {**_values(bufs, "ctx"), "x_routed": v["x_routed"]})
    counters = plan.counter_pointers(bufs.counters)
    for name in _FP8_COUNTERS:
        setattr(q, name, counters.pop(name))
    L._fill(p.cnt, counters)
    L._fill(p.grads, _values(bufs, "grads"))
    for name, value in {**_values(bufs, ""), "x": 0, "dy_routed": v["dy_routed"]}.items():
        setattr(p, name, int(value))
    p.err, p.trace = err_ptr, trace_ptr
    # With EP the local deadline goes in (the kernel divides for its peer waits; module doc).
    p.dims = dims._struct(knobs.timeout_ns * (1 if peers is None else LOCAL_TIMEOUT_FACTOR))
    p.plan = plan.struct()
    p.accumulate, p.grad_bf16 = int(bool(accumulate)), int(bool(grad_bf16))
    p.peers = L._no_peers() if peers is None else peers._struct()
    L._fill(q.wt, _values(bufs, "wt"))
    L._fill(q.qctx, _values(bufs, "qctx"))
    L._fill(q.q, {**_values(bufs, "q"), "dyq": v["dyq"]})
    q.plan8 = plan.fp8_struct()
    return q


class PreparedFp8Backward:
    """The FP8 backward with its parameters filled (the bf16 path's PreparedMegakernel plus the
    zeroing of :func:`pad_rows`): calling it enqueues the memsets (counters, pad rows) and the
    launch.  Fixed by the pointers, sizes, stream and flags it was prepared for, so it may be
    enqueued again for a call that repeats them (mok_rt/backends/cuda.py caches it)."""

    __slots__ = ("megakernel", "plan", "_zero", "_stream")

    def __init__(self, megakernel: L.PreparedMegakernel, zero: tuple[tuple[int, int], ...], stream):
        self.megakernel, self.plan = megakernel, megakernel.plan
        self._zero = tuple((driver.CUdeviceptr(ptr), n) for ptr, n in zero)
        self._stream = driver.CUstream(stream_handle(stream))

    @property
    def launch(self) -> PreparedLaunch | None:
        return self.megakernel.launch

    def __call__(self) -> None:
        for ptr, n in self._zero:
            call("cuMemsetD8Async", ptr, 0, n, self._stream)
        self.megakernel()


_maps_cache = _maps.StructCache()   # (dims, buffers) -> the encoded maps struct


def prepare_backward_fp8(bufs, sched: L.ScheduleBuffers, dims: L.LayerDims, *, stream, err_ptr: int,
                         device_id: int = 0, knobs: L.KernelKnobs = L.KernelKnobs(), accumulate: bool = False,
                         grad_bf16: bool = False, trace_ptr: int = 0, plan: _moe_plan.Plan | None = None,
                         peers: L.PeerSpec | None = None) -> PreparedFp8Backward:
    """Check the arguments and prepare the FP8 backward on ``stream`` (call the result to enqueue
    it: counters and pad rows zeroed, then one persistent launch).

    ``bufs``: :data:`Fp8BackwardBuffers`, with the FP8 forward's (or recompute's) context of the
    same schedule and the transposed E4M3 weights.  Writes dx, d_topk_weights and the weight
    gradients, fp32 or (``grad_bf16``) bf16, added to their contents when ``accumulate``.
    ``err_ptr``: the device error word; the caller checks it after syncing.  ``trace_ptr``: 0 or
    zeroed device memory for backward_plan(dims).total records (mok_rt/kernels/trace.py).  With
    ``peers`` (expert parallelism; ``peers.push_tasks`` = ``moe_fp8.push_tasks(dims)``, see
    ``moe_fp8.fp8_peers``; ``dims.expert_parallel``) every rank of the group must launch its
    backward, and ``bufs.dx_slot`` must be the rank's slot rows (module doc)."""
    if not isinstance(bufs, Fp8BackwardBuffers):
        raise ArgumentError("bufs", f"expected Fp8BackwardBuffers, got {type(bufs).__name__}")
    L._check_launch(bufs, FP8_BACKWARD_TABLE, sched, dims, peers, err_ptr)
    push = 0 if peers is None else peers.push_tasks
    if peers is not None:
        check_push_tasks(peers, dims)
    if plan is None:
        plan = backward_plan(dims, push_tasks=push)
    if plan.precision != "fp8_block" or plan.kind != "backward":
        raise ArgumentError("plan", "expected the FP8 backward plan (backward_plan(dims))")
    if plan.phase("push").count != push:
        raise ArgumentError("plan", "its push tasks do not match peers")
    q = _params(bufs, sched, plan, dims, knobs, err_ptr, trace_ptr, accumulate, grad_bf16, peers)
    params = B.MoEFp8BackwardTmaParams()
    params.p = q
    _maps_cache.fill((dims, bufs), params.maps, lambda: map_specs(bufs, dims))
    eng = _KERNELS
    run = None
    if plan.total:   # never 0: a backward always has weight-gradient tasks
        kernel = get_kernel(eng.cubin, eng.backward, device_id)
        run = PreparedLaunch(kernel, grid=L._grid(kernel, device_id, knobs, plan.total, eng), block=eng.threads,
                             params=params, stream=stream, device_id=device_id, shared_mem=eng.smem_bytes)
    return PreparedFp8Backward(L.PreparedMegakernel(run, plan, bufs.counters, stream), pad_rows(bufs, dims), stream)


def launch_backward_fp8(bufs, sched: L.ScheduleBuffers, dims: L.LayerDims, **kw) -> None:
    """:func:`prepare_backward_fp8` (same arguments), enqueued once."""
    prepare_backward_fp8(bufs, sched, dims, **kw)()
