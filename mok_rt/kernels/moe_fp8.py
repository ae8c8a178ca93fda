"""Launching the "fp8_block" forward megakernel (cuda_src/moe/moe_forward_fp8.cu), on one GPU or as
one rank of an expert-parallel group (``peers``).

The same contract as :func:`mok_rt.kernels.moe_launch.launch_forward` (the caller owns every
buffer; nothing here synchronises or reads a routing-dependent count), with the FP8 buffer table
(kernels/moe_params_fp8.py), the FP8 plan (``forward_plan(..., precision="fp8_block")``) and the
FP8 tensor maps (:func:`map_specs`: e4m3 operands with 128-byte K boxes, fp32 scale rows).
With expert parallelism (cuda_src/moe/tasks/ep_fp8.cuh) the push tasks are one per token block
(:func:`push_tasks`) and quantise x in token order into ``xq`` / ``xq_s`` before pushing the E4M3
rows, so those two are allocated with or without a shared expert (``LayerDims.expert_parallel``).
"""
from __future__ import annotations

import dataclasses

from mok_rt.errors import ArgumentError
from mok_rt.kernels import moe_launch as L
from mok_rt.kernels import moe_maps as _maps
from mok_rt.kernels import moe_params as P
from mok_rt.kernels import moe_params_fp8 as F
from mok_rt.kernels import moe_plan as _moe_plan
from mok_rt.runtime.cubins import get_kernel
from mok_rt.runtime.driver import call, driver
from mok_rt.runtime.launch import launch, stream_handle
from mok_rt.runtime.tensormap import Swizzle, TensorMapSpec

__all__ = ["Fp8ForwardBuffers", "forward_plan", "forward_buffer_bytes", "map_specs", "staged_map_specs",
           "launch_forward_fp8", "push_tasks", "fp8_peers", "check_push_tasks", "staged", "prepare"]

_KERNELS = L._Kernels("moe_forward_fp8", "moe_forward_fp8", "", P.THREADS, P.SMEM_BYTES)
# The same forward with the gate|up tiles' g, u stored through shared memory by TMA (cuda_src/moe/
# pipeline/staged_tile.cuh): faster where the gate|up K (H) is long, slower where it is short (the
# borrowed ring slot delays the next tile's last stage; bench/NOTES-FP8-2.md round 16, NOTES-FP8-3.md).
# Same bits.
_KERNELS_STAGED = L._Kernels("moe_forward_fp8_staged", "moe_forward_fp8_staged", "", P.THREADS, P.SMEM_BYTES)
STAGED_MIN_K_BLOCKS = 32   # H >= 31 * 128 + 1: deepseek-v3 (H = 7168, 56 K blocks) staged, qwen3 (2048, 16) not


def staged(dims: L.LayerDims) -> bool:
    """Whether the forward of ``dims`` runs the staged gate|up kernel (``moe_forward_fp8_staged``):
    where the gate|up K has at least STAGED_MIN_K_BLOCKS blocks of 128 (read at each launch)."""
    return -(-dims.hidden // _BOX) >= STAGED_MIN_K_BLOCKS


def prepare(device_id: int) -> int:
    """Load the FP8 forward's two kernels on ``device_id`` and set their launch attributes now
    (before any expert-parallel launch: see ``moe_launch.prepare``); returns how many of their
    CTAs fit on one SM."""
    return min(L.prepare(device_id, _KERNELS), L.prepare(device_id, _KERNELS_STAGED))


_TABLE = tuple(b for b in F.FP8_FORWARD_BUFFERS if b.role != "schedule")
Fp8ForwardBuffers = L._buffers_class("Fp8ForwardBuffers", _TABLE, """Device pointers for moe_forward_fp8, one per
    buffer of moe_params_fp8.FP8_FORWARD_BUFFERS (shapes and roles there); 0 where the buffer has 0 bytes.""")


def forward_plan(dims: L.LayerDims, *, context_only: bool = False, push_tasks: int = 0) -> _moe_plan.Plan:
    """The FP8 forward's plan; ``push_tasks`` > 0 (then :func:`push_tasks`) with expert parallelism."""
    return _moe_plan.forward_plan(dims, context_only=context_only, push_tasks=push_tasks, precision="fp8_block")


push_tasks = _moe_plan.fp8_push_tasks


def fp8_peers(peers: L.PeerSpec, dims: L.LayerDims) -> L.PeerSpec:
    """``peers`` with the FP8 forward's push tasks (one per token block, :func:`push_tasks`)."""
    return dataclasses.replace(peers, push_tasks=push_tasks(dims))


def check_push_tasks(peers: L.PeerSpec, dims: L.LayerDims) -> None:
    """The FP8 launches push one token block per task (each quantises its block once): ``peers``
    must say so (:func:`fp8_peers`)."""
    if peers.push_tasks != push_tasks(dims):
        raise ArgumentError("peers", f"the FP8 launches push one token block per task: push_tasks must be "
                                     f"{push_tasks(dims)}, got {peers.push_tasks} (see moe_fp8.fp8_peers)")


def forward_buffer_bytes(dims: L.LayerDims) -> dict[str, int]:
    """Bytes of every buffer moe_forward_fp8 writes (context, output, scratch, counters).  With
    ``dims.expert_parallel`` the token-order ``xq`` / ``xq_s`` exist without a shared expert too
    (the push tasks quantise into them), and the counters are those of the EP plan."""
    plan = forward_plan(dims, push_tasks=push_tasks(dims) if dims.expert_parallel else 0)
    return L._written_bytes(_TABLE, dims, plan.counter_words)


# ---- tensor maps ---------------------------------------------------------------------------------
_BOX = F.KBLOCK   # 128: one K block of e4m3 (one 128-byte swizzled line); also the A tile's rows


def _a(address: int, rows: int, k: int) -> TensorMapSpec | None:
    """e4m3 A [rows, K]: dims {K, rows}, box {128, 128}."""
    if not address or rows <= 0:
        return None
    return TensorMapSpec(address=address, dims=(k, rows), strides=(k,), box=(_BOX, _BOX), swizzle=Swizzle.B128,
                         dtype="u8")


def _scales(address: int, rows: int, k: int, ld: int) -> TensorMapSpec | None:
    """fp32 A scales [K/128, ld]: dims {rows, K/128}, box {128, 1} (the tile's rows of one K block)."""
    if not address or rows <= 0:
        return None
    return TensorMapSpec(address=address, dims=(rows, -(-k // _BOX)), strides=(ld * 4,), box=(_BOX, 1),
                         swizzle=Swizzle.NONE, dtype="f32")


def _b(address: int, n: int, k: int, box_rows: int, groups: int = 1) -> TensorMapSpec | None:
    """e4m3 B [groups, N, K]: dims {K, N, groups}, box {128, box_rows, 1}."""
    if not address or n <= 0:
        return None
    return TensorMapSpec(address=address, dims=(k, n, groups), strides=(k, n * k), box=(_BOX, box_rows, 1),
                         swizzle=Swizzle.B128, dtype="u8")


def _staged_gu(address: int, rows: int, inter: int) -> TensorMapSpec | None:
    """bf16 gu [rows, 2 I] (gate | up): dims {2 I, rows}, box {64, 128}, 128B-swizzled: the staged
    gate|up tiles' TMA stores (cuda_src/moe/pipeline/staged_tile.cuh)."""
    if not address or rows <= 0 or inter <= 0:
        return None
    return TensorMapSpec(address=address, dims=(2 * inter, rows), strides=(4 * inter,), box=(64, _BOX),
                         swizzle=Swizzle.B128, dtype="bf16")


def map_specs(bufs, dims: L.LayerDims) -> dict[str, TensorMapSpec | None]:
    """The spec of every map of moe_forward_fp8 in the struct's field order (None: unused, zeros)."""
    d, b = dims, bufs
    T, H, I, Is, R, E = (d.tokens, d.hidden, d.intermediate, d.shared_intermediate, d.capacity_rows,
                         d.local_experts)
    ld = F.token_ld(d)
    specs = {
        "xq_k": _a(b.xq, T, H),
        "xrq_k": _a(b.xrq, R, H),
        "saq_k": _a(b.saq, T, Is) if Is else None,
        "aq_k": _a(b.aq, R, I),
        "xq_s": _scales(b.xq_s, T, H, ld),
        "xrq_s": _scales(b.xrq_s, R, H, R),
        "saq_s": _scales(b.saq_s, T, Is, ld) if Is else None,
        "aq_s": _scales(b.aq_s, R, I, R),
        "gate_k": _b(b.gate, I, H, _BOX // 2, E),       # gate|up sub-tiles: 64 gate rows + 64 up rows
        "up_k": _b(b.up, I, H, _BOX // 2, E),
        "down_k": _b(b.down, H, I, _BOX, E),
        "shared_gate_k": _b(b.shared_gate, Is, H, _BOX // 2) if Is else None,
        "shared_up_k": _b(b.shared_up, Is, H, _BOX // 2) if Is else None,
        "shared_down_k": _b(b.shared_down, H, Is, _BOX) if Is else None,
    }
    assert tuple(specs) == F.FP8_FORWARD_MAP_NAMES
    return specs


def staged_map_specs(bufs, dims: L.LayerDims) -> dict[str, TensorMapSpec | None]:
    """The maps only moe_forward_fp8_staged reads (:func:`staged`): its TMA stores of gu and sgu."""
    d, b = dims, bufs
    specs = {"gu_st": _staged_gu(b.gu, d.capacity_rows, d.intermediate),
             "sgu_st": _staged_gu(b.sgu, d.tokens, d.shared_intermediate) if d.shared_intermediate else None}
    assert tuple(specs) == F.FP8_STAGED_MAP_NAMES
    return specs


# ---- launching -----------------------------------------------------------------------------------
def _params(bufs, sched, plan, dims: L.LayerDims, knobs: L.KernelKnobs, err_ptr: int, trace_ptr: int,
            context_only: bool, peers: L.PeerSpec | None = None) -> F.MoEFp8ForwardParams:
    q = F.MoEFp8ForwardParams()
    p = q.p
    L._fill(p.sched, L._struct_values(sched, L._SCHEDULE_TABLE, "sched"))
    L._fill(p.w, dict.fromkeys(F.UNUSED_BF16_FIELDS["w"], 0))
    L._fill(p.ctx, {**L._struct_values(bufs, _TABLE, "ctx"), **dict.fromkeys(F.UNUSED_BF16_FIELDS["ctx"], 0)})
    counters = plan.counter_pointers(bufs.counters)
    q.token_xq_ready = counters.pop("token_xq_ready")
    L._fill(p.cnt, counters)
    for name, v in L._struct_values(bufs, _TABLE, "").items():
        setattr(p, name, int(v))
    p.err, p.trace = err_ptr, trace_ptr
    p.dims = dims._struct(knobs.timeout_ns)
    p.plan = plan.struct()
    p.context_only = int(bool(context_only))
    p.peers = L._no_peers() if peers is None else peers._struct()
    L._fill(q.wq, L._struct_values(bufs, _TABLE, "wq"))
    L._fill(q.qctx, L._struct_values(bufs, _TABLE, "qctx"))
    q.plan8 = plan.fp8_struct()
    return q


_maps_cache = _maps.StructCache()   # (dims, buffers) -> the encoded maps struct


def launch_forward_fp8(bufs, sched: L.ScheduleBuffers, dims: L.LayerDims, *, stream, err_ptr: int,
                       device_id: int = 0, knobs: L.KernelKnobs = L.KernelKnobs(), context_only: bool = False,
                       trace_ptr: int = 0, plan: _moe_plan.Plan | None = None,
                       peers: L.PeerSpec | None = None) -> None:
    """Enqueue the FP8 forward on ``stream``: counters memset, then one persistent launch.

    Writes the context (gu, y_slot, sgu in bf16; xq, xrq, aq, saq in E4M3 with their scales) and,
    unless ``context_only``, ``out``.  ``bufs``: :data:`Fp8ForwardBuffers` (the E4M3 weights of
    ``mok.quantize_weights``).  With ``peers`` (expert parallelism; ``peers.push_tasks`` must be
    :func:`push_tasks`, see :func:`fp8_peers`) every rank of the group must launch its forward, and
    ``xq`` / ``xq_s`` must be given (``dims.expert_parallel``)."""
    if not isinstance(bufs, Fp8ForwardBuffers):
        raise ArgumentError("bufs", f"expected Fp8ForwardBuffers, got {type(bufs).__name__}")
    L._check_launch(bufs, _TABLE, sched, dims, peers, err_ptr,
                    unused=frozenset({"out", "topk_weights", "shared_y"}) if context_only else frozenset())
    if peers is not None:
        check_push_tasks(peers, dims)
        for name in ("xq", "xq_s"):
            if dims.tokens and not getattr(bufs, name):
                raise ArgumentError(name, "null device pointer (the EP push tasks quantise x into it)")
    if plan is None:
        plan = forward_plan(dims, context_only=bool(context_only), push_tasks=0 if peers is None else peers.push_tasks)
    if plan.precision != "fp8_block":
        raise ArgumentError("plan", "expected the FP8 forward plan")
    if plan.phase("push").count != (0 if peers is None else peers.push_tasks):
        raise ArgumentError("plan", "its push tasks do not match peers")
    q = _params(bufs, sched, plan, dims, knobs, err_ptr, trace_ptr, context_only, peers)
    params = F.MoEFp8ForwardTmaParams()
    params.p = q
    _maps_cache.fill((dims, bufs), params.maps, lambda: map_specs(bufs, dims))
    use_staged = staged(dims)
    if use_staged:
        _maps_cache.fill((dims, bufs, "staged"), params.staged, lambda: staged_map_specs(bufs, dims))
    # The dependency counters start every launch at zero (one memset on the stream).
    call("cuMemsetD32Async", driver.CUdeviceptr(bufs.counters), 0, plan.counter_words,
         driver.CUstream(stream_handle(stream)))
    if plan.total == 0:
        return
    eng = _KERNELS_STAGED if use_staged else _KERNELS
    kernel = get_kernel(eng.cubin, eng.forward, device_id)
    launch(kernel, grid=L._grid(kernel, device_id, knobs, plan.total, eng), block=eng.threads, params=params,
           stream=stream, device_id=device_id, shared_mem=eng.smem_bytes)
