"""ctypes mirrors of the "fp8_block" backward megakernel's parameter struct
(cuda_src/moe/params_fp8_bwd.cuh) and the table of the buffers only it adds (docs/FP8_BACKWARD.md),
filled by kernels/moe_fp8_bwd.py (sizes and offsets asserted here and ``static_assert``-ed in the
header with the same numbers).

The struct is the bf16 backward's :class:`~mok_rt.kernels.moe_params.MoEBackwardParams` followed by
the transposed E4M3 weights (``wt``, from ``mok.quantize_weights(for_backward=True)``), the FP8
forward's quantised context (``qctx``, read-only), the FP8 scratch (``q``), three counters and the
plan extras (:class:`MoEFp8BackwardPlan`, filled by ``moe_plan.backward_plan(...,
precision="fp8_block").fp8_struct()``).
"""
from __future__ import annotations

import ctypes

from mok_rt.kernels import moe_params as P
from mok_rt.kernels.moe_params import Buffer
from mok_rt.kernels.moe_params_fp8 import KBLOCK, MoEFp8Context, token_ld, token_order
from mok_rt.runtime.tensormap import TensorMapBytes

__all__ = ["FP8_BACKWARD_BUFFERS", "FP8_BACKWARD_MAP_NAMES", "token_rows", "padded_inter", "MoEFp8WeightsT",
           "MoEFp8BackwardScratch", "MoEFp8BackwardPlan", "MoEFp8BackwardParams", "MoEFp8BackwardMaps",
           "MoEFp8BackwardTmaParams", "LAYOUT"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kb(n: int) -> int:
    return _cdiv(n, KBLOCK)


def token_rows(d) -> int:
    """Token-order rows in front of the routed rows in ``dq`` / ``dq_bf`` / ``xq_bf`` (one tensor
    map each): every token block's 128 rows with a shared expert or expert parallelism (the push
    tasks quantise d_out there; moe_params_fp8.token_order) (so routed tiles start 128-aligned),
    else none."""
    return d.token_blocks * P.BLOCK_M if token_order(d) else 0


def padded_inter(n: int) -> int:
    """Ip: I rounded up to a 128-column block, the up half's first column in dguq [R, 2 Ip] (no K
    block of the dX GEMM mixes gate and up scales)."""
    return _kb(n) * KBLOCK


_WT = tuple(
    Buffer(name, "wt", dt, shape, "input") for name, dt, shape in (
        ("gate_t", "u8", lambda d: (d.local_experts, d.hidden, d.intermediate)),
        ("up_t", "u8", lambda d: (d.local_experts, d.hidden, d.intermediate)),
        ("down_t", "u8", lambda d: (d.local_experts, d.intermediate, d.hidden)),
        ("shared_gate_t", "u8", lambda d: (d.hidden, d.shared_intermediate)),
        ("shared_up_t", "u8", lambda d: (d.hidden, d.shared_intermediate)),
        ("shared_down_t", "u8", lambda d: (d.shared_intermediate, d.hidden)),
        ("gate_t_s", "f32", lambda d: (d.local_experts, _kb(d.hidden), _kb(d.intermediate))),
        ("up_t_s", "f32", lambda d: (d.local_experts, _kb(d.hidden), _kb(d.intermediate))),
        ("down_t_s", "f32", lambda d: (d.local_experts, _kb(d.intermediate), _kb(d.hidden))),
        ("shared_gate_t_s", "f32", lambda d: (_kb(d.hidden), _kb(d.shared_intermediate))),
        ("shared_up_t_s", "f32", lambda d: (_kb(d.hidden), _kb(d.shared_intermediate))),
        ("shared_down_t_s", "f32", lambda d: (_kb(d.shared_intermediate), _kb(d.hidden))),
    ))
# dyq is a view (role "view": no bytes of its own) of dq's routed rows, dq + token_rows * H; likewise
# the bf16 struct's dy_routed and ctx.x_routed of dq_bf's and xq_bf's.
_Q = (
    Buffer("dq", "q", "u8", lambda d: (token_rows(d) + d.capacity_rows, d.hidden), "scratch"),
    Buffer("dyq", "q", "u8", lambda d: (d.capacity_rows, d.hidden), "view"),
    Buffer("dguq", "q", "u8", lambda d: (d.capacity_rows, 2 * padded_inter(d.intermediate)), "scratch"),
    Buffer("dsguq", "q", "u8", lambda d: (d.tokens, 2 * padded_inter(d.shared_intermediate)), "scratch"),
    Buffer("rs", "q", "f32", lambda d: (_kb(d.hidden) + 2 * _kb(d.intermediate), d.capacity_rows), "scratch"),
    Buffer("ts", "q", "f32", lambda d: (_kb(d.hidden) + 2 * _kb(d.shared_intermediate) if token_order(d) else 0,
                                        token_ld(d)),
           "scratch"),
    Buffer("dq_bf", "q", "bf16", lambda d: (token_rows(d) + d.capacity_rows, d.hidden), "scratch"),
    Buffer("xq_bf", "q", "bf16", lambda d: (token_rows(d) + d.capacity_rows, d.hidden), "scratch"),
)
# The bf16 struct's fields that become FP8-backward scratch (wgrad operands the bf16 forward's
# context or the bf16 dispatch would hold): ctx.act, ctx.sact, dgu, dsgu; ctx.x_routed and
# dy_routed point into xq_bf / dq_bf.
_BF16_SCRATCH = (
    Buffer("act", "ctx", "bf16", lambda d: (d.capacity_rows, d.intermediate), "scratch"),
    Buffer("sact", "ctx", "bf16", lambda d: (d.tokens, d.shared_intermediate), "scratch"),
    Buffer("dgu", "", "bf16", lambda d: (d.capacity_rows, 2 * d.intermediate), "scratch"),
    Buffer("dsgu", "", "bf16", lambda d: (d.tokens, 2 * d.shared_intermediate), "scratch"),
)
FP8_BACKWARD_BUFFERS: tuple[Buffer, ...] = (*_WT, *_Q, *_BF16_SCRATCH)


def _pointers(table, struct: str) -> list:
    return [(b.name, ctypes.c_uint64) for b in table if b.struct == struct]


class MoEFp8WeightsT(ctypes.Structure):
    _fields_ = _pointers(FP8_BACKWARD_BUFFERS, "wt")


class MoEFp8BackwardScratch(ctypes.Structure):
    _fields_ = _pointers(FP8_BACKWARD_BUFFERS, "q")


class MoEFp8BackwardPlan(ctypes.Structure):
    _fields_ = [("token_prep", P.PhaseRange), ("widen", P.PhaseRange), ("wait_token_dq_ready", ctypes.c_int32),
                ("wait_expert_widen_ready_per_block", ctypes.c_int32), ("wait_prep_done", ctypes.c_int32),
                ("token_ld", ctypes.c_int32), ("token_rows", ctypes.c_int32), ("ip_blocks", ctypes.c_int32),
                ("ips_blocks", ctypes.c_int32), ("pad_", ctypes.c_int32)]


class MoEFp8BackwardParams(ctypes.Structure):
    _fields_ = [("p", P.MoEBackwardParams), ("wt", MoEFp8WeightsT), ("qctx", MoEFp8Context),
                ("q", MoEFp8BackwardScratch), ("token_dq_ready", ctypes.c_uint64),
                ("expert_widen_ready", ctypes.c_uint64), ("prep_done", ctypes.c_uint64),
                ("plan8", MoEFp8BackwardPlan)]


FP8_BACKWARD_MAP_NAMES = ("dq_k", "dguq_k", "dsguq_k", "rs_s", "ts_s", "down_t_k", "gate_t_k", "up_t_k",
                          "shared_down_t_k", "shared_gate_t_k", "shared_up_t_k", "dy_mn", "x_mn", "act_mn",
                          "sact_mn", "dgu_mn", "dsgu_mn")


class MoEFp8BackwardMaps(ctypes.Structure):
    _fields_ = [(n, TensorMapBytes) for n in FP8_BACKWARD_MAP_NAMES]


class MoEFp8BackwardTmaParams(ctypes.Structure):
    # 2176 + 1504, padded to the maps' 64-byte alignment (the header's alignas(64) TensorMap).
    _fields_ = [("maps", MoEFp8BackwardMaps), ("p", MoEFp8BackwardParams), ("pad_", ctypes.c_uint8 * 32)]


LAYOUT = {
    MoEFp8WeightsT: (96, {"gate_t_s": 48}),
    MoEFp8BackwardScratch: (64, {"rs": 32}),
    MoEFp8BackwardPlan: (48, {"wait_token_dq_ready": 16}),
    MoEFp8BackwardParams: (1504, {"wt": 1208, "qctx": 1304, "q": 1368, "token_dq_ready": 1432, "plan8": 1456}),
    MoEFp8BackwardMaps: (17 * 128, {}),
    MoEFp8BackwardTmaParams: (3712, {"p": 2176}),
}
for _cls, (_size, _offsets) in LAYOUT.items():
    assert ctypes.sizeof(_cls) == _size, (_cls.__name__, ctypes.sizeof(_cls), _size)
    for _name, _at in _offsets.items():
        assert getattr(_cls, _name).offset == _at, (_cls.__name__, _name, getattr(_cls, _name).offset, _at)
assert ctypes.sizeof(MoEFp8BackwardTmaParams) <= 4096   # the classic kernel parameter limit
