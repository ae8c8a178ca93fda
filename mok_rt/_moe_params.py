"""ctypes mirrors of the fused MoE kernels' parameter structs (cuda_src/moe/params.cuh).

Field order and types match the C++ structs exactly (pointers as 64-bit ints first, then 32-bit
fields); the sizes are asserted here and ``static_assert``-ed in the header, so a change on one
side that is not made on the other fails at import or at compile time.  Also the tiling
constants the host needs to size grids, shared memory and buffers.
"""
from __future__ import annotations

import ctypes

__all__ = [
    "BLOCK_M", "THREADS", "TILE_N", "GATE_UP_COLS", "SMEM_BYTES",
    "MoESchedule", "MoEDims", "MoEWeights", "MoEContext", "MoEForwardCounters", "MoEForwardParams",
    "MoEBackwardCounters", "MoEWeightGrads", "MoEBackwardParams", "MoEPeers", "MAX_EP_RANKS", "NUM_PEER_FLAGS",
]

# ---- tiling (cuda_src/moe/params.cuh, cuda_src/moe/gemm_tile.cuh) ----------------------------
BLOCK_M = 128          # rows per row block / token block; the schedule's block_m must equal it
THREADS = 256          # threads per CTA
TILE_N = 128           # GEMM tile width
GATE_UP_COLS = 64      # SwiGLU columns per fused gate|up forward tile
# The wgmma engine's ring: 6 slots of a 128x64 A and a 128x64 B bf16 slice (128B-swizzled,
# 1024-byte aligned: + 1024 bytes of slack); the fp32 C tile reuses it.  gemm_tile.cuh asserts it.
_BK, _STAGES = 64, 6
_RING_BYTES = _STAGES * 2 * BLOCK_M * _BK * 2
_C_BYTES = BLOCK_M * (TILE_N + 8) * 4
SMEM_BYTES = max(_RING_BYTES + 1024, _C_BYTES)   # dynamic shared memory per CTA (197632)

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
        *_pointers("x", "topk_weights", "out", "shared_y", "err"),
        ("dims", MoEDims),
        ("context_only", ctypes.c_int32),
        ("pad_", ctypes.c_int32),
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
                   "dx_shared", "err"),
        ("dims", MoEDims),
        ("accumulate", ctypes.c_int32),
        ("pad_", ctypes.c_int32),
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
assert ctypes.sizeof(MoEForwardParams) == 8 * 8 + 6 * 8 + 6 * 8 + 8 * 8 + 5 * 8 + (8 + 12 * 4) + 8 + _PEERS
assert ctypes.sizeof(MoEBackwardCounters) == 11 * 8
assert ctypes.sizeof(MoEWeightGrads) == 6 * 8
assert ctypes.sizeof(MoEBackwardParams) == (8 * 8 + 6 * 8 + 6 * 8 + 11 * 8 + 6 * 8 + 11 * 8 + (8 + 12 * 4) + 8
                                            + _PEERS)
assert SMEM_BYTES == 197632
