"""ctypes mirrors of the fused MoE kernels' parameter structs (cuda_src/moe/params.cuh).

Field order and types match the C++ structs exactly (pointers as 64-bit ints first, then 32-bit
fields); the sizes are asserted here and ``static_assert``-ed in the header, so a change on one
side that is not made on the other fails at import or at compile time.  Also the tiling
constants the host needs to size grids, shared memory and buffers.
"""
from __future__ import annotations

import ctypes

from ._tensormap import TENSOR_MAP_BYTES, TensorMapBytes

__all__ = [
    "BLOCK_M", "combine_parts", "THREADS", "TILE_N", "GATE_UP_COLS", "SMEM_BYTES", "FORWARD_MAP_NAMES", "BACKWARD_MAP_NAMES",
    "MoEForwardMaps", "MoEBackwardMaps", "MoEForwardTmaParams", "MoEBackwardTmaParams",
    "MoESchedule", "MoEDims", "MoEWeights", "MoEContext", "MoEForwardCounters", "MoEForwardParams",
    "MoEBackwardCounters", "MoEWeightGrads", "MoEBackwardParams", "MoEPeers", "MAX_EP_RANKS", "NUM_PEER_FLAGS",
]

# ---- tiling (cuda_src/moe/params.cuh, ws_pipeline.cuh) ------------------------------------------
BLOCK_M = 128          # rows per row block / token block; the schedule's block_m must equal it
THREADS = 384          # producer warpgroup + 2 worker warpgroups
TILE_N = 256           # GEMM tile width (128 x 256 tiles)
GATE_UP_COLS = 128     # intermediate columns per fused gate|up tile (128 gate + 128 up)
_BK, _STAGES = 64, 4
# 4-slot ring of (128 x 64 A + 256 x 64 B) bf16 + 1024 bytes of alignment slack + ring and queue
# mbarriers + 2 Jobs of 36 bytes (ws_pipeline.cuh asserts it).
SMEM_BYTES = _STAGES * (BLOCK_M + TILE_N) * _BK * 2 + 1024 + 2 * _STAGES * 8 + 2 * 2 * 8 + 2 * 36


def combine_parts(token_blocks: int) -> int:
    """Combine tasks per token block (params.cuh combine_parts): 1 from 128 token blocks, 2 from 64, else 4."""
    return 1 if token_blocks >= 128 else 2 if token_blocks >= 64 else 4


_ptr = ctypes.c_uint64


def _pointers(*names: str) -> list[tuple[str, type]]:
    return [(n, _ptr) for n in names]


class MoESchedule(ctypes.Structure):
    _fields_ = _pointers("expert_count", "expert_offset", "num_blocks", "block_expert", "row_src_rank",
                         "row_slot", "route_row", "route_rank")


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
    _fields_ = _pointers("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


class MoEContext(ctypes.Structure):
    _fields_ = _pointers("x_routed", "gu", "act", "y_slot", "sgu", "sact")


class MoEForwardCounters(ctypes.Structure):
    _fields_ = _pointers("task_next", "down_done", "block_ready", "block_act_ready", "token_sact_ready",
                         "token_shared_done", "push_done", "ctas_done")


MAX_EP_RANKS = 64      # kMaxEpRanks
NUM_PEER_FLAGS = 4     # kNumPeerFlags: forward rows, forward return, backward rows, backward return


class MoEPeers(ctypes.Structure):
    """Expert parallelism: every rank's symmetric block and the layout inside it (params.cuh)."""

    _fields_ = [
        ("base", ctypes.c_uint64 * MAX_EP_RANKS),
        *_pointers("base_array", "routed_offset", "slot_offset", "flags_offset", "end_pad_offset"),
        ("num_ranks", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("epoch", ctypes.c_int32),
        ("push_tasks", ctypes.c_int32),
        ("slot_rows", ctypes.c_int32),
        ("pad_", ctypes.c_int32),
    ]


class MoEForwardParams(ctypes.Structure):
    _fields_ = [
        ("sched", MoESchedule),
        ("w", MoEWeights),
        ("ctx", MoEContext),
        ("cnt", MoEForwardCounters),
        *_pointers("x", "topk_weights", "out", "shared_y", "err", "trace"),
        ("dims", MoEDims),
        ("context_only", ctypes.c_int32),
        ("trace_tasks", ctypes.c_int32),
        ("peers", MoEPeers),
    ]


class MoEBackwardCounters(ctypes.Structure):
    _fields_ = _pointers("task_next", "dx_done", "dsgu_done", "block_dy_ready", "block_dgu_ready",
                         "expert_dy_ready", "expert_dgu_ready", "token_dsgu_ready", "token_dxs_ready", "push_done",
                         "ctas_done")


class MoEWeightGrads(ctypes.Structure):
    _fields_ = _pointers("dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")


class MoEBackwardParams(ctypes.Structure):
    _fields_ = [
        ("sched", MoESchedule),
        ("w", MoEWeights),
        ("ctx", MoEContext),
        ("cnt", MoEBackwardCounters),
        ("grads", MoEWeightGrads),
        *_pointers("x", "topk_weights", "d_out", "dx", "d_topk_weights", "dy_routed", "dgu", "dx_slot", "dsgu",
                   "dx_shared", "err", "trace"),
        ("dims", MoEDims),
        ("accumulate", ctypes.c_int32),
        ("trace_tasks", ctypes.c_int32),
        ("peers", MoEPeers),
    ]


# Sizes as static_assert-ed in params.cuh.
_PEERS = MAX_EP_RANKS * 8 + 5 * 8 + 6 * 4
assert ctypes.sizeof(MoESchedule) == 8 * 8
assert ctypes.sizeof(MoEDims) == 8 + 12 * 4
assert ctypes.sizeof(MoEWeights) == 6 * 8
assert ctypes.sizeof(MoEContext) == 6 * 8
assert ctypes.sizeof(MoEForwardCounters) == 8 * 8
assert ctypes.sizeof(MoEPeers) == _PEERS
assert ctypes.sizeof(MoEForwardParams) == 8 * 8 + 6 * 8 + 6 * 8 + 8 * 8 + 6 * 8 + (8 + 12 * 4) + 8 + _PEERS
assert ctypes.sizeof(MoEBackwardCounters) == 11 * 8
assert ctypes.sizeof(MoEWeightGrads) == 6 * 8
assert ctypes.sizeof(MoEBackwardParams) == (8 * 8 + 6 * 8 + 6 * 8 + 11 * 8 + 6 * 8 + 12 * 8 + (8 + 12 * 4) + 8
                                            + _PEERS)
assert SMEM_BYTES == 197800

# ---- tensor maps (cuda_src/moe/params_tma.cuh) --------------------------------------------------

FORWARD_MAP_NAMES = ("x_k", "x_routed_k", "sact_k", "act_k", "w_gate_k", "w_up_k", "w_down_k", "ws_gate_k",
                     "ws_up_k", "ws_down_k")
BACKWARD_MAP_NAMES = ("dy_routed_k", "d_out_k", "dgu_k", "dsgu_k", "w_down_mn", "ws_down_mn", "w_gate_mn",
                      "w_up_mn", "ws_gate_mn", "ws_up_mn", "dy_routed_mn", "act_mn", "dgu_mn", "x_routed_mn",
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


# Sizes as static_assert-ed in params_tma.cuh / ws_pipeline.cuh.
assert ctypes.sizeof(MoEForwardMaps) == 10 * TENSOR_MAP_BYTES
assert ctypes.sizeof(MoEBackwardMaps) == 18 * TENSOR_MAP_BYTES
assert ctypes.sizeof(MoEForwardTmaParams) == 2240
assert ctypes.sizeof(MoEBackwardTmaParams) == 3392
