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
        ("num_ranks", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("num_experts", ctypes.c_int),
        ("experts_per_rank", ctypes.c_int),
        ("top_k", ctypes.c_int),
        ("block_m", ctypes.c_int),
        ("max_rows", ctypes.c_int),
        ("max_chunks", ctypes.c_int),
        ("ids_int64", ctypes.c_int),
        ("pad_", ctypes.c_int),
        ("src_ids", ctypes.c_uint64 * MAX_RANKS),
        ("src_tokens", ctypes.c_int * MAX_RANKS),
    ]


assert ctypes.sizeof(ScheduleParams) == 11 * 8 + 10 * 4 + MAX_RANKS * 12
