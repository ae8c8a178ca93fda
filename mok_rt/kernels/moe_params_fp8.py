"""ctypes mirrors of the "fp8_block" forward megakernel's parameter struct (cuda_src/moe/params_fp8.cuh)
and the table of the buffers it takes (docs/FP8_DESIGN.md).

The FP8 forward's struct is the bf16 forward's :class:`~mok_rt.kernels.moe_params.MoEForwardParams`
followed by the E4M3 weight copies (``wq``), the quantised activations (``qctx``), one more counter
and the FP8 plan extras.  Sizes and offsets are asserted here and ``static_assert``-ed in the
header with the same numbers.
"""
from __future__ import annotations

import ctypes

from mok_rt.kernels import moe_params as P
from mok_rt.kernels.moe_params import Buffer
from mok_rt.runtime.tensormap import TensorMapBytes

__all__ = ["KBLOCK", "FP8_TILE_N", "FP8_FORWARD_BUFFERS", "FP8_FORWARD_MAP_NAMES", "FP8_STAGED_MAP_NAMES", "token_ld",
           "token_order", "MoEFp8Weights", "MoEFp8Context", "MoEFp8Plan", "MoEFp8ForwardParams", "MoEFp8ForwardMaps",
           "MoEFp8StagedMaps", "MoEFp8ForwardTmaParams"]

KBLOCK = 128       # fp8_block scale block (1 x 128 activations, 128 x 128 weights) = one K stage
FP8_TILE_N = 256   # FP8 GEMM tile width (128 x 256, two 128-wide sub-tiles per A stage): the down GEMMs' hidden tiles


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def token_ld(d) -> int:
    """Row pitch of the token-order scale arrays [K/128, token_ld]: a multiple of 4 (TMA's
    16-byte stride), >= T."""
    return d.token_blocks * P.BLOCK_M


def token_order(d) -> bool:
    """Whether the token-order E4M3 copies (x's ``xq``; the backward's dq rows in front of the
    routed ones) exist: with a shared expert (its A operands), and with expert parallelism (the
    push tasks quantise each token row once there, then send it: cuda_src/moe/tasks/ep_fp8.cuh)."""
    return bool(d.shared_intermediate) or d.expert_parallel


def _tok(d, n: int) -> int:
    return n if token_order(d) else 0


def _kb(n: int) -> int:
    return _cdiv(n, KBLOCK)


# (name, struct, dtype, shape(d), role) as in moe_params; "wq": the E4M3 weights (mok.quantize_weights),
# "qctx": the quantised activations (context).  The bf16 struct's w, ctx.x_routed, ctx.act and
# ctx.sact are null in an FP8 launch.
_WQ = (
    Buffer("gate", "wq", "u8", lambda d: (d.local_experts, d.intermediate, d.hidden), "input"),
    Buffer("up", "wq", "u8", lambda d: (d.local_experts, d.intermediate, d.hidden), "input"),
    Buffer("down", "wq", "u8", lambda d: (d.local_experts, d.hidden, d.intermediate), "input"),
    Buffer("shared_gate", "wq", "u8", lambda d: (d.shared_intermediate, d.hidden), "input"),
    Buffer("shared_up", "wq", "u8", lambda d: (d.shared_intermediate, d.hidden), "input"),
    Buffer("shared_down", "wq", "u8", lambda d: (d.hidden, d.shared_intermediate), "input"),
    Buffer("gate_s", "wq", "f32", lambda d: (d.local_experts, _kb(d.intermediate), _kb(d.hidden)), "input"),
    Buffer("up_s", "wq", "f32", lambda d: (d.local_experts, _kb(d.intermediate), _kb(d.hidden)), "input"),
    Buffer("down_s", "wq", "f32", lambda d: (d.local_experts, _kb(d.hidden), _kb(d.intermediate)), "input"),
    Buffer("shared_gate_s", "wq", "f32", lambda d: (_kb(d.shared_intermediate), _kb(d.hidden)), "input"),
    Buffer("shared_up_s", "wq", "f32", lambda d: (_kb(d.shared_intermediate), _kb(d.hidden)), "input"),
    Buffer("shared_down_s", "wq", "f32", lambda d: (_kb(d.hidden), _kb(d.shared_intermediate)), "input"),
)
_CTX = (
    Buffer("gu", "ctx", "bf16", lambda d: (d.capacity_rows, 2 * d.intermediate), "context"),
    Buffer("y_slot", "ctx", "bf16", lambda d: (d.tokens * d.top_k, d.hidden), "context"),
    Buffer("sgu", "ctx", "bf16", lambda d: (d.tokens, 2 * d.shared_intermediate), "context"),
)
_QCTX = (
    Buffer("xq", "qctx", "u8", lambda d: (_tok(d, d.tokens), d.hidden), "context"),
    Buffer("xq_s", "qctx", "f32", lambda d: (_tok(d, _kb(d.hidden)), token_ld(d)), "context"),
    Buffer("xrq", "qctx", "u8", lambda d: (d.capacity_rows, d.hidden), "context"),
    Buffer("xrq_s", "qctx", "f32", lambda d: (_kb(d.hidden), d.capacity_rows), "context"),
    Buffer("aq", "qctx", "u8", lambda d: (d.capacity_rows, d.intermediate), "context"),
    Buffer("aq_s", "qctx", "f32", lambda d: (_kb(d.intermediate), d.capacity_rows), "context"),
    Buffer("saq", "qctx", "u8", lambda d: (d.tokens, d.shared_intermediate), "context"),
    Buffer("saq_s", "qctx", "f32", lambda d: (_kb(d.shared_intermediate), token_ld(d)), "context"),
)
_FWD = {b.name: b for b in P.FORWARD_BUFFERS}
FP8_FORWARD_BUFFERS: tuple[Buffer, ...] = (
    *(b for b in P.FORWARD_BUFFERS if b.role == "schedule"), *_WQ, *_CTX, *_QCTX,
    _FWD["x"], _FWD["topk_weights"], _FWD["out"], _FWD["shared_y"], _FWD["counters"],
)
# The bf16 struct's fields the FP8 launch leaves null (the weights and the bf16 activations it does not make).
UNUSED_BF16_FIELDS = {"w": tuple(b.name for b in P.FORWARD_BUFFERS if b.struct == "w"),
                      "ctx": ("x_routed", "act", "sact")}
assert {b.name for b in _CTX} | set(UNUSED_BF16_FIELDS["ctx"]) == {n for n, _ in P.MoEContext._fields_}


def _pointers(table, struct: str) -> list:
    return [(b.name, ctypes.c_uint64) for b in table if b.struct == struct]


class MoEFp8Weights(ctypes.Structure):
    _fields_ = _pointers(FP8_FORWARD_BUFFERS, "wq")


class MoEFp8Context(ctypes.Structure):
    _fields_ = _pointers(FP8_FORWARD_BUFFERS, "qctx")


class MoEFp8Plan(ctypes.Structure):
    _fields_ = [("quant_x", P.PhaseRange), ("wait_token_xq_ready", ctypes.c_int32), ("token_ld", ctypes.c_int32)]


class MoEFp8ForwardParams(ctypes.Structure):
    _fields_ = [("p", P.MoEForwardParams), ("wq", MoEFp8Weights), ("qctx", MoEFp8Context),
                ("token_xq_ready", ctypes.c_uint64), ("plan8", MoEFp8Plan)]


FP8_FORWARD_MAP_NAMES = ("xq_k", "xrq_k", "saq_k", "aq_k", "xq_s", "xrq_s", "saq_s", "aq_s", "gate_k", "up_k",
                         "down_k", "shared_gate_k", "shared_up_k", "shared_down_k")
FP8_STAGED_MAP_NAMES = ("gu_st", "sgu_st")   # read only by moe_forward_fp8_staged


class MoEFp8ForwardMaps(ctypes.Structure):
    _fields_ = [(n, TensorMapBytes) for n in FP8_FORWARD_MAP_NAMES]


class MoEFp8StagedMaps(ctypes.Structure):
    _fields_ = [(n, TensorMapBytes) for n in FP8_STAGED_MAP_NAMES]


class MoEFp8ForwardTmaParams(ctypes.Structure):
    # The staged kernel's maps last, so that the direct kernel's parameters keep their offsets.
    _fields_ = [("maps", MoEFp8ForwardMaps), ("p", MoEFp8ForwardParams), ("staged", MoEFp8StagedMaps)]


LAYOUT = {
    MoEFp8Weights: (96, {"gate_s": 48}),
    MoEFp8Context: (64, {"aq": 32}),
    MoEFp8Plan: (16, {}),
    MoEFp8ForwardParams: (1216, {"wq": 1032, "qctx": 1128, "token_xq_ready": 1192, "plan8": 1200}),
    MoEFp8ForwardMaps: (14 * 128, {}),
    MoEFp8StagedMaps: (2 * 128, {}),
    MoEFp8ForwardTmaParams: (3264, {"p": 1792, "staged": 3008}),
}
for _cls, (_size, _offsets) in LAYOUT.items():
    assert ctypes.sizeof(_cls) == _size, (_cls.__name__, ctypes.sizeof(_cls), _size)
    for _name, _at in _offsets.items():
        assert getattr(_cls, _name).offset == _at, (_cls.__name__, _name, getattr(_cls, _name).offset, _at)
