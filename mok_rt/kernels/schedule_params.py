"""ctypes mirror of cuda_src/moe/schedule_params.cuh."""
from __future__ import annotations

import ctypes

MAX_RANKS = 64
SCHEDULE_CHUNK = 4096
SCHEDULE_THREADS = 1024


class ScheduleParams(ctypes.Structure):
    _fields_ = [
        ("err", ctypes.c_void_p),
        ("chunk_count", ctypes.c_void_p),
        ("expert_total", ctypes.c_void_p),
        ("expert_row_base", ctypes.c_void_p),
        ("expert_count", ctypes.c_void_p),
        ("expert_offset", ctypes.c_void_p),
        ("totals", ctypes.c_void_p),
        ("block_expert", ctypes.c_void_p),
        ("row_src_rank", ctypes.c_void_p),
        ("row_slot", ctypes.c_void_p),
        ("route_row", ctypes.c_void_p),
        ("route_rank", ctypes.c_void_p),
        ("num_ranks", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("num_experts", ctypes.c_int),
        ("experts_per_rank", ctypes.c_int),
        ("top_k", ctypes.c_int),
        ("block_m", ctypes.c_int),
        ("max_rows", ctypes.c_int),
        ("max_chunks", ctypes.c_int),
        ("ids_int64", ctypes.c_int),
        ("tokens_on_device", ctypes.c_int),
        ("src_ids", ctypes.c_uint64 * MAX_RANKS),
        ("src_tokens", ctypes.c_int * MAX_RANKS),
        ("src_tokens_at", ctypes.c_uint64 * MAX_RANKS),
    ]


ROUTING_IDS_OFFSET = 16   # kRoutingIdsOffset: int32 ids start 16 bytes into a routing area


class ExchangeParams(ctypes.Structure):
    """Mirror of mok::ExchangeParams (schedule_params.cuh)."""

    _fields_ = [
        ("peer_bases", ctypes.c_uint64),
        ("ids", ctypes.c_uint64),
        ("err", ctypes.c_uint64),
        ("area_offset", ctypes.c_uint64),
        ("pad_offset", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("tokens", ctypes.c_int),
        ("top_k", ctypes.c_int),
        ("ids_int64", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("num_ranks", ctypes.c_int),
        ("pad_", ctypes.c_int),
    ]


class BlockOrderParams(ctypes.Structure):
    """Mirror of mok::BlockOrderParams (schedule_params.cuh)."""

    _fields_ = [
        ("row_slot", ctypes.c_uint64),
        ("totals", ctypes.c_uint64),
        ("block_order", ctypes.c_uint64),
        ("max_blocks", ctypes.c_int),
        ("block_m", ctypes.c_int),
        ("wave_routes", ctypes.c_int),
        ("keyed", ctypes.c_int),
    ]


ORDER_KEYS = 256   # kOrderKeys

assert ctypes.sizeof(ScheduleParams) == 12 * 8 + 10 * 4 + MAX_RANKS * 20
assert ctypes.sizeof(BlockOrderParams) == 3 * 8 + 4 * 4
assert ctypes.sizeof(ExchangeParams) == 6 * 8 + 6 * 4
