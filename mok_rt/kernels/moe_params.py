"""ctypes mirrors of the fused MoE kernels' parameter structs (cuda_src/moe/params.cuh) and the one
table of the buffers they take.

Field order and types match the C++ structs exactly (pointers as 64-bit ints first, then 32-bit
fields); sizes and field offsets are asserted here and ``static_assert``-ed in the headers with the
same numbers, so a change on one side that is not made on the other fails at import or at compile
time.  The pointer fields of the buffer structs are derived from :data:`FORWARD_BUFFERS` /
:data:`BACKWARD_BUFFERS` (name, struct, dtype, shape, role), as are the byte sizes, the launch
checks (mok_rt/kernels/moe_launch.py) and the allocations (mok_rt/backends/cuda.py).  Also the tiling
constants the host needs to size grids, shared memory and buffers.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Callable

from mok_rt.runtime.tensormap import TENSOR_MAP_BYTES, TensorMapBytes

__all__ = [
    "BLOCK_M", "combine_parts", "THREADS", "TILE_N", "GATE_UP_COLS", "SMEM_BYTES", "FORWARD_MAP_NAMES", "BACKWARD_MAP_NAMES",
    "Buffer", "FORWARD_BUFFERS", "BACKWARD_BUFFERS", "GRAD_NAMES", "ROLES",
    "MoEForwardMaps", "MoEBackwardMaps", "MoEForwardTmaParams", "MoEBackwardTmaParams",
    "MoESchedule", "MoEDims", "MoEWeights", "MoEContext", "MoEForwardCounters", "MoEForwardParams",
    "MoEBackwardCounters", "MoEWeightGrads", "MoEBackwardParams", "MoEPeers", "MAX_EP_RANKS", "NUM_PEER_FLAGS",
    "CHUNK_KINDS", "CHUNK_FLAGS_OFFSET",
    "PhaseRange", "MoEForwardPlan", "MoEBackwardPlan",
]

# ---- tiling (cuda_src/moe/params.cuh, pipeline) -------------------------------------------------
BLOCK_M = 128          # rows per row block / token block; the schedule's block_m must equal it
THREADS = 384          # producer warpgroup + 2 worker warpgroups
TILE_N = 256           # GEMM tile width (128 x 256 tiles)
GATE_UP_COLS = 128     # intermediate columns per fused gate|up tile (128 gate + 128 up)
_BK, _STAGES = 64, 4
# 4-slot ring of (128 x 64 A + 256 x 64 B) bf16 + 1024 bytes of alignment slack + ring and queue
# mbarriers + 2 Jobs of 36 bytes (the pipeline asserts it).
SMEM_BYTES = _STAGES * (BLOCK_M + TILE_N) * _BK * 2 + 1024 + 2 * _STAGES * 8 + 2 * 2 * 8 + 2 * 36


def combine_parts(token_blocks: int) -> int:
    """Combine tasks per token block.  The combines run last, nothing overlaps them, and a task's
    threads walk its tokens in dependent rounds of k row loads: the time of the tail is the rounds
    of one task, so the token blocks are split into at least 256 tasks (two per SM of a 132-SM GPU)
    of at least 4 tokens: 256+ blocks: 1, 128+: 2, 64+: 4, ... 8 or fewer: 32 (divides BLOCK_M)."""
    parts = 1
    while parts < 32 and token_blocks * parts < 256:
        parts *= 2
    return parts


# ---- the buffer table ---------------------------------------------------------------------------
# Roles: "schedule" (the routing schedule's int32 arrays), "input" (the caller's tensors),
# "context" (written by the forward, read by the backward), "output" (what a launch returns),
# "scratch" (per launch), "heap" (scratch on one GPU; with expert parallelism the rows that travel,
# in the symmetric heap), "counters" (the dependency counters: the plan's layout, zeroed per launch).
ROLES = ("schedule", "input", "context", "output", "scratch", "heap", "counters")
_ITEMSIZE = {"bf16": 2, "f32": 4, "i32": 4, "u8": 1}   # u8: E4M3 (kernels/moe_params_fp8.py)


@dataclass(frozen=True)
class Buffer:
    """One buffer of a launch: its field ``name`` in ``struct`` ("sched", "w", "ctx", "grads", "" =
    the parameter struct itself, "cnt" = carved into the counter struct by the plan), element
    type, shape as a function of the launch's LayerDims, and role.  A buffer of 0 bytes (no shared
    expert, T = 0) may be a null pointer."""
    name: str
    struct: str
    dtype: str
    shape: Callable
    role: str

    def nbytes(self, d) -> int:
        return math.prod(self.shape(d)) * _ITEMSIZE[self.dtype]


def _shared(d, n: int) -> int:
    return n if d.shared_intermediate else 0


_SCHEDULE = (
    Buffer("expert_count", "sched", "i32", lambda d: (d.local_experts,), "schedule"),
    Buffer("expert_offset", "sched", "i32", lambda d: (d.local_experts + 1,), "schedule"),
    Buffer("num_blocks", "sched", "i32", lambda d: (1,), "schedule"),
    # With expert parallelism the second half is the order the launches take the blocks in
    # (schedule_block_order, ep.cuh): 2 * max_blocks entries.
    Buffer("block_expert", "sched", "i32", lambda d: (d.max_blocks * (2 if d.expert_parallel else 1),), "schedule"),
    Buffer("row_src_rank", "sched", "i32", lambda d: (d.capacity_rows,), "schedule"),
    Buffer("row_slot", "sched", "i32", lambda d: (d.capacity_rows,), "schedule"),
    Buffer("route_row", "sched", "i32", lambda d: (d.tokens * d.top_k,), "schedule"),
    Buffer("route_rank", "sched", "i32", lambda d: (d.tokens * d.top_k,), "schedule"),
)
_WEIGHTS = (
    Buffer("w_gate", "w", "bf16", lambda d: (d.local_experts, d.intermediate, d.hidden), "input"),
    Buffer("w_up", "w", "bf16", lambda d: (d.local_experts, d.intermediate, d.hidden), "input"),
    Buffer("w_down", "w", "bf16", lambda d: (d.local_experts, d.hidden, d.intermediate), "input"),
    Buffer("shared_gate", "w", "bf16", lambda d: (d.shared_intermediate, d.hidden), "input"),
    Buffer("shared_up", "w", "bf16", lambda d: (d.shared_intermediate, d.hidden), "input"),
    Buffer("shared_down", "w", "bf16", lambda d: (d.hidden, d.shared_intermediate), "input"),
)
_CONTEXT = (
    Buffer("x_routed", "ctx", "bf16", lambda d: (d.capacity_rows, d.hidden), "context"),
    Buffer("gu", "ctx", "bf16", lambda d: (d.capacity_rows, 2 * d.intermediate), "context"),
    Buffer("act", "ctx", "bf16", lambda d: (d.capacity_rows, d.intermediate), "context"),
    Buffer("y_slot", "ctx", "bf16", lambda d: (d.tokens * d.top_k, d.hidden), "context"),
    Buffer("sgu", "ctx", "bf16", lambda d: (d.tokens, 2 * d.shared_intermediate), "context"),
    Buffer("sact", "ctx", "bf16", lambda d: (d.tokens, d.shared_intermediate), "context"),
)
_X = Buffer("x", "", "bf16", lambda d: (d.tokens, d.hidden), "input")
_TOPK = Buffer("topk_weights", "", "f32", lambda d: (d.tokens, d.top_k), "input")
_COUNTERS = Buffer("counters", "cnt", "i32", lambda d: (0,), "counters")   # sized by the plan

FORWARD_BUFFERS: tuple[Buffer, ...] = (
    *_SCHEDULE, *_WEIGHTS, *_CONTEXT, _X, _TOPK,
    Buffer("out", "", "bf16", lambda d: (d.tokens, d.hidden), "output"),
    Buffer("shared_y", "", "f32", lambda d: (_shared(d, d.tokens), d.hidden), "scratch"),
    _COUNTERS,
)
BACKWARD_BUFFERS: tuple[Buffer, ...] = (
    *_SCHEDULE, *_WEIGHTS, *_CONTEXT,
    # The weight gradients are fp32 or, with grad_bf16, bf16: their sizes here are fp32's (the most).
    Buffer("dw_gate", "grads", "f32", lambda d: (d.local_experts, d.intermediate, d.hidden), "output"),
    Buffer("dw_up", "grads", "f32", lambda d: (d.local_experts, d.intermediate, d.hidden), "output"),
    Buffer("dw_down", "grads", "f32", lambda d: (d.local_experts, d.hidden, d.intermediate), "output"),
    Buffer("d_shared_gate", "grads", "f32", lambda d: (d.shared_intermediate, d.hidden), "output"),
    Buffer("d_shared_up", "grads", "f32", lambda d: (d.shared_intermediate, d.hidden), "output"),
    Buffer("d_shared_down", "grads", "f32", lambda d: (d.hidden, d.shared_intermediate), "output"),
    _X, _TOPK,
    Buffer("d_out", "", "bf16", lambda d: (d.tokens, d.hidden), "input"),
    Buffer("dx", "", "bf16", lambda d: (d.tokens, d.hidden), "output"),
    Buffer("d_topk_weights", "", "f32", lambda d: (d.tokens, d.top_k), "output"),
    Buffer("dy_routed", "", "bf16", lambda d: (d.capacity_rows, d.hidden), "heap"),
    Buffer("dgu", "", "bf16", lambda d: (d.capacity_rows, 2 * d.intermediate), "scratch"),
    Buffer("dx_slot", "", "bf16", lambda d: (d.tokens * d.top_k, d.hidden), "heap"),
    Buffer("dsgu", "", "bf16", lambda d: (d.tokens, 2 * d.shared_intermediate), "scratch"),
    Buffer("dx_shared", "", "f32", lambda d: (_shared(d, d.tokens), d.hidden), "scratch"),
    _COUNTERS,
)
assert all(b.role in ROLES for b in FORWARD_BUFFERS + BACKWARD_BUFFERS)
GRAD_NAMES = tuple(b.name for b in BACKWARD_BUFFERS if b.struct == "grads")   # the weight gradients


def _names(table, struct: str) -> tuple[str, ...]:
    return tuple(b.name for b in table if b.struct == struct)


_ptr = ctypes.c_uint64


def _pointers(*names: str) -> list[tuple[str, type]]:
    return [(n, _ptr) for n in names]


class MoESchedule(ctypes.Structure):
    _fields_ = _pointers(*_names(FORWARD_BUFFERS, "sched"))


class MoEDims(ctypes.Structure):
    _fields_ = [
        ("timeout_ns", ctypes.c_int64),
        ("tokens", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("inter", ctypes.c_int32),
        ("shared_inter", ctypes.c_int32),
        ("top_k", ctypes.c_int32),
        ("local_experts", ctypes.c_int32),
        ("max_rows", ctypes.c_int32),
        ("max_blocks", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("has_limit", ctypes.c_int32),
        ("swiglu_limit", ctypes.c_float),
        ("pad_", ctypes.c_int32),
    ]


class MoEWeights(ctypes.Structure):
    _fields_ = _pointers(*_names(FORWARD_BUFFERS, "w"))


class MoEContext(ctypes.Structure):
    _fields_ = _pointers(*_names(FORWARD_BUFFERS, "ctx"))


assert _names(BACKWARD_BUFFERS, "sched") == _names(FORWARD_BUFFERS, "sched")
assert _names(BACKWARD_BUFFERS, "w") == _names(FORWARD_BUFFERS, "w")
assert _names(BACKWARD_BUFFERS, "ctx") == _names(FORWARD_BUFFERS, "ctx")


# ---- the task plan (built by mok_rt/kernels/moe_plan.py) ----------------------------------------------
class PhaseRange(ctypes.Structure):
    _fields_ = [("begin", ctypes.c_int32), ("count", ctypes.c_int32)]


def _ints(*names: str) -> list[tuple[str, type]]:
    return [(n, ctypes.c_int32) for n in names]


class MoEForwardPlan(ctypes.Structure):
    _fields_ = [
        *[(n, PhaseRange) for n in ("push", "push_notify", "dispatch", "shared_gu", "routed_gu", "shared_down",
                                    "routed_down", "down_notify", "combine")],
        *_ints("total", "token_blocks", "gu_tiles", "sgu_tiles", "h_tiles", "combine_parts",
               "wait_block_ready", "wait_block_act_ready", "wait_token_sact_ready", "wait_token_shared_done",
               "wait_down_done_per_block", "wait_push_done"),
    ]


class MoEBackwardPlan(ctypes.Structure):
    _fields_ = [
        *[(n, PhaseRange) for n in ("push", "push_notify", "dispatch", "d_weights", "shared_da", "routed_da",
                                    "shared_dx", "routed_dx", "dx_notify", "wgrad_down", "wgrad_gate_up",
                                    "shared_wgrad", "combine")],
        *_ints("total", "token_blocks", "i_tiles", "si_tiles", "h_tiles", "h_rows", "i_rows", "si_rows",
               "combine_parts", "wait_block_dy_ready", "wait_block_dgu_ready", "wait_expert_dy_ready_per_block",
               "wait_expert_dgu_ready_per_block", "wait_token_dsgu_ready", "wait_token_dxs_ready", "wait_dsgu_done",
               "wait_dx_done_per_block", "wait_push_done"),
    ]


class MoEForwardCounters(ctypes.Structure):
    _fields_ = _pointers("task_next", "down_done", "block_ready", "block_act_ready", "token_sact_ready",
                         "token_shared_done", "push_done", "ctas_done")


MAX_EP_RANKS = 64      # kMaxEpRanks
NUM_PEER_FLAGS = 4     # kNumPeerFlags: forward rows, forward return, backward rows, backward return
CHUNK_KINDS = 2        # kChunkKinds: readiness chunks of the forward rows and the backward rows
CHUNK_FLAGS_OFFSET = 4 * NUM_PEER_FLAGS * MAX_EP_RANKS  # kChunkFlagsOffset: bytes after flags_offset


class MoEPeers(ctypes.Structure):
    """Expert parallelism: every rank's symmetric block and the layout inside it (params.cuh).

    The routed region ([max_rows, H] bf16) holds, in the "fp8_block" forward, E4M3 rows
    [max_rows, H] at byte 0 and their fp32 scales [ceil(H/128), max_rows] at byte max_rows * H
    (cuda_src/moe/tasks/ep_fp8.cuh; it fits since 4 ceil(H/128) <= H)."""

    _fields_ = [
        ("base", ctypes.c_uint64 * MAX_EP_RANKS),
        *_pointers("base_array", "routed_offset", "slot_offset", "flags_offset", "end_pad_offset"),
        ("num_ranks", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("epoch", ctypes.c_int32),
        ("push_tasks", ctypes.c_int32),
        ("slot_rows", ctypes.c_int32),
        ("chunk_tokens", ctypes.c_int32),
    ]


class MoEForwardParams(ctypes.Structure):
    _fields_ = [
        ("sched", MoESchedule),
        ("w", MoEWeights),
        ("ctx", MoEContext),
        ("cnt", MoEForwardCounters),
        *_pointers(*_names(FORWARD_BUFFERS, ""), "err", "trace"),
        ("dims", MoEDims),
        ("plan", MoEForwardPlan),
        ("context_only", ctypes.c_int32),
        ("pad_", ctypes.c_int32),
        ("peers", MoEPeers),
    ]


class MoEBackwardCounters(ctypes.Structure):
    _fields_ = _pointers("task_next", "dx_done", "dsgu_done", "block_dy_ready", "block_dgu_ready",
                         "expert_dy_ready", "expert_dgu_ready", "token_dsgu_ready", "token_dxs_ready", "push_done",
                         "ctas_done")


class MoEWeightGrads(ctypes.Structure):
    _fields_ = _pointers(*_names(BACKWARD_BUFFERS, "grads"))


class MoEBackwardParams(ctypes.Structure):
    _fields_ = [
        ("sched", MoESchedule),
        ("w", MoEWeights),
        ("ctx", MoEContext),
        ("cnt", MoEBackwardCounters),
        ("grads", MoEWeightGrads),
        *_pointers(*_names(BACKWARD_BUFFERS, ""), "err", "trace"),
        ("dims", MoEDims),
        ("plan", MoEBackwardPlan),
        ("accumulate", ctypes.c_int32),
        ("grad_bf16", ctypes.c_int32),
        ("peers", MoEPeers),
    ]


assert SMEM_BYTES == 197800

# ---- tensor maps (cuda_src/moe/params_tma.cuh) --------------------------------------------------

FORWARD_MAP_NAMES = ("x_k", "x_routed_k", "sact_k", "act_k", "w_gate_k", "w_up_k", "w_down_k", "shared_gate_k",
                     "shared_up_k", "shared_down_k")
BACKWARD_MAP_NAMES = ("dy_routed_k", "d_out_k", "dgu_k", "dsgu_k", "w_down_mn", "shared_down_mn", "w_gate_mn",
                      "w_up_mn", "shared_gate_mn", "shared_up_mn", "dy_routed_mn", "act_mn", "dgu_mn", "x_routed_mn",
                      "d_out_mn", "sact_mn", "dsgu_mn", "x_mn")


class MoEForwardMaps(ctypes.Structure):
    _fields_ = [(n, TensorMapBytes) for n in FORWARD_MAP_NAMES]


class MoEBackwardMaps(ctypes.Structure):
    _fields_ = [(n, TensorMapBytes) for n in BACKWARD_MAP_NAMES]


def _tail(size: int) -> list[tuple[str, type]]:
    """C++ pads a struct holding alignas(64) maps to a multiple of 64 bytes; ctypes does not
    know that alignment, so the tail is explicit (the driver copies the C++ size)."""
    pad = -size % 64
    return [("tail_", ctypes.c_uint8 * pad)] if pad else []


class MoEForwardTmaParams(ctypes.Structure):
    _fields_ = [("maps", MoEForwardMaps), ("p", MoEForwardParams),
                *_tail(ctypes.sizeof(MoEForwardMaps) + ctypes.sizeof(MoEForwardParams))]


class MoEBackwardTmaParams(ctypes.Structure):
    _fields_ = [("maps", MoEBackwardMaps), ("p", MoEBackwardParams),
                *_tail(ctypes.sizeof(MoEBackwardMaps) + ctypes.sizeof(MoEBackwardParams))]


# Sizes and field offsets in bytes, static_assert-ed with the same numbers in params.cuh and
# params_tma.cuh.
LAYOUT = {
    MoESchedule: (64, {"route_rank": 56}),
    MoEDims: (56, {"tokens": 8, "swiglu_limit": 48}),
    MoEWeights: (48, {"shared_gate": 24}),
    MoEContext: (48, {"sgu": 32}),
    MoEForwardCounters: (64, {"ctas_done": 56}),
    MoEBackwardCounters: (88, {"ctas_done": 80}),
    MoEWeightGrads: (48, {"d_shared_gate": 24}),
    MoEPeers: (576, {"base_array": 512, "num_ranks": 552, "chunk_tokens": 572}),
    MoEForwardPlan: (120, {"total": 72, "wait_block_ready": 96, "wait_push_done": 116}),
    MoEBackwardPlan: (176, {"total": 104, "wait_block_dy_ready": 140, "wait_push_done": 172}),
    MoEForwardParams: (1032, {"w": 64, "ctx": 112, "cnt": 160, "x": 224, "err": 256, "dims": 272, "plan": 328,
                              "context_only": 448, "peers": 456}),
    MoEBackwardParams: (1208, {"w": 64, "ctx": 112, "cnt": 160, "grads": 248, "x": 296, "err": 376, "dims": 392,
                               "plan": 448, "accumulate": 624, "grad_bf16": 628,
                               "peers": 632}),
    MoEForwardMaps: (10 * TENSOR_MAP_BYTES, {}),
    MoEBackwardMaps: (18 * TENSOR_MAP_BYTES, {}),
    MoEForwardTmaParams: (2368, {"p": 1280}),
    MoEBackwardTmaParams: (3520, {"p": 2304}),
}
for _cls, (_size, _offsets) in LAYOUT.items():
    assert ctypes.sizeof(_cls) == _size, (_cls.__name__, ctypes.sizeof(_cls), _size)
    for _name, _at in _offsets.items():
        assert getattr(_cls, _name).offset == _at, (_cls.__name__, _name, getattr(_cls, _name).offset, _at)
