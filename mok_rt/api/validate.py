"""Validation of a layer call's tensor arguments: the one place where they are checked.

Each check runs on the host before anything is launched and names the argument it rejects; the
backends trust what it returns.  The CUDA contract (bf16 activations and weights, f32 routing
weights, fp32 or bf16 weight gradients, int32/int64 ids) holds on every backend; the reference backend
also takes float32/float64 tensors unless the workspace is ``strict``.
"""
from __future__ import annotations

from dataclasses import dataclass

from mok_rt.errors import ArgumentError
from mok_rt.interop import dtypes
from mok_rt.interop.dlpack import TensorView, check, from_dlpack
from mok_rt.types import ExpertWeights, QuantizedWeights

__all__ = ["LayerArgs", "import_layer_args", "import_ids", "import_d_out", "import_grad_buffers"]

_CUDA_FLOAT = (dtypes.bfloat16,)
_ORACLE_FLOAT = (dtypes.bfloat16, dtypes.float32, dtypes.float64)
_IDS = (dtypes.int32, dtypes.int64)
GRAD_NAMES = ("dw_gate", "dw_up", "dw_down", "d_shared_gate", "d_shared_up", "d_shared_down")


@dataclass(frozen=True)
class LayerArgs:
    """Validated views of a layer call's tensors (the shared expert's are None without one)."""

    x: TensorView
    topk_weights: TensorView
    w_gate: TensorView
    w_up: TensorView
    w_down: TensorView
    shared_gate: TensorView | None = None
    shared_up: TensorView | None = None
    shared_down: TensorView | None = None
    quantized: object = None   # a mok_rt.QuantizedWeights given as experts (then every w_* is None)


def _oracle(ws) -> bool:
    return ws.backend == "reference" and not ws.strict


def _device(ws):
    return "cpu" if ws.backend == "reference" else ("cuda", ws.device_id)


def _floats(ws):
    return _ORACLE_FLOAT if _oracle(ws) else _CUDA_FLOAT


def _f32(ws):
    return (dtypes.float32, dtypes.float64) if _oracle(ws) else (dtypes.float32,)


# Signatures of views that passed check(): a pure function of the view's shape, strides, dtype,
# device and pointer alignment and of what was asked, so a call that repeats them skips it.
_CHECKED: set = set()
_CHECKED_MAX = 512


def _check(v, name, dtype, shape, device) -> None:
    sig = (name, v.shape, v.strides, v.dtype, v.device_type, v.device_id, v.ptr % 16, dtype, shape, device)
    if sig in _CHECKED:
        return
    check(v, name=name, dtype=dtype, shape=shape, device=device)
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()
    _CHECKED.add(sig)


def _view(ws, obj, name, *, shape, dtype, stream, writable=False):
    if obj is None:
        raise ArgumentError(name, "is required")
    try:
        v = from_dlpack(obj, name=name, stream=stream)
    except ArgumentError as ex:
        # A dtype mok_rt has no DType for (uint32, complex ...): say what this argument takes,
        # not every dtype mok_rt knows.
        if ex.argument == name and "unsupported" in str(ex) and "dtype" in str(ex):
            want = " or ".join(d.name for d in dtype)
            got = getattr(obj, "dtype", None)
            raise ArgumentError(name, f"expected dtype {want}, got {got if got is not None else ex}") from None
        raise
    _check(v, name, dtype, shape, _device(ws))
    if writable and v.readonly:
        raise ArgumentError(name, "is read-only; mok_rt writes the gradient into it")
    return v


def _triple(obj, name: str) -> ExpertWeights:
    if isinstance(obj, ExpertWeights):
        return obj
    raise ArgumentError(name, f"expected mok_rt.ExpertWeights(gate=, up=, down=), got {type(obj).__name__}")


def import_ids(ws, topk_ids, *, stream) -> TensorView:
    v = _view(ws, topk_ids, "topk_ids", shape=(None, ws.config.top_k), dtype=_IDS, stream=stream)
    if v.shape[0] > ws.max_tokens:
        raise ArgumentError("topk_ids", f"{v.shape[0]} tokens exceed the workspace's max_tokens={ws.max_tokens}")
    return v


def import_d_out(ws, d_out, *, tokens: int, stream) -> TensorView:
    return _view(ws, d_out, "d_out", shape=(tokens, ws.config.hidden), dtype=_floats(ws), stream=stream)


def import_layer_args(ws, *, tokens: int, x, topk_weights, experts, shared, stream) -> LayerArgs:
    """Import and check every tensor of a forward or recompute call."""
    cfg = ws.config
    H, I, Is, k, El = cfg.hidden, cfg.intermediate, cfg.shared_intermediate, cfg.top_k, ws.experts_per_rank
    f = _floats(ws)
    views = dict(
        x=_view(ws, x, "x", shape=(tokens, H), dtype=f, stream=stream),
        topk_weights=_view(ws, topk_weights, "topk_weights", shape=(tokens, k), dtype=_f32(ws), stream=stream))
    if isinstance(experts, QuantizedWeights):
        check_quantized(ws, experts, shared)
        return LayerArgs(**views, w_gate=None, w_up=None, w_down=None, quantized=experts)
    experts = _triple(experts, "experts")
    views.update(
        w_gate=_view(ws, experts.gate, "experts.gate", shape=(El, I, H), dtype=f, stream=stream),
        w_up=_view(ws, experts.up, "experts.up", shape=(El, I, H), dtype=f, stream=stream),
        w_down=_view(ws, experts.down, "experts.down", shape=(El, H, I), dtype=f, stream=stream))
    if shared is not None and not cfg.has_shared:
        raise ArgumentError("shared", "the config has no shared expert (shared_intermediate=0)")
    if cfg.has_shared:
        if shared is None:
            raise ArgumentError("shared", f"the config has a shared expert of {Is}: pass "
                                          f"shared=mok_rt.ExpertWeights(gate=, up=, down=)")
        shared = _triple(shared, "shared")
        views.update(
            shared_gate=_view(ws, shared.gate, "shared.gate", shape=(Is, H), dtype=f, stream=stream),
            shared_up=_view(ws, shared.up, "shared.up", shape=(Is, H), dtype=f, stream=stream),
            shared_down=_view(ws, shared.down, "shared.down", shape=(H, Is), dtype=f, stream=stream))
    return LayerArgs(**views)


def _grad_dtypes(ws):
    return (dtypes.float32, dtypes.bfloat16) + ((dtypes.float64,) if _oracle(ws) else ())


def import_grad_buffers(ws, dw, dw_shared, *, accumulate: bool, stream) -> tuple[dict, dtypes.DType]:
    """Caller-owned weight-gradient buffers by internal name (None: the backend allocates one), and
    the call's gradient dtype.  fp32 or bf16 (float64 too on the reference backend), all of one
    dtype: the kernel writes every weight gradient of a call in one dtype, and the backend
    allocates the ones not passed in it (fp32 when none is passed)."""
    cfg = ws.config
    H, I, Is, El = cfg.hidden, cfg.intermediate, cfg.shared_intermediate, ws.experts_per_rank
    out = dict.fromkeys(GRAD_NAMES)
    if dw_shared is not None and not cfg.has_shared:
        raise ArgumentError("dw_shared", "the config has no shared expert")
    groups = [("dw", dw, ((El, I, H), (El, I, H), (El, H, I)), GRAD_NAMES[:3])]
    if cfg.has_shared:
        groups.append(("dw_shared", dw_shared, ((Is, H), (Is, H), (H, Is)), GRAD_NAMES[3:]))
    first = None   # (label, dtype) of the first buffer given
    for name, given, shapes, names in groups:
        if given is None:
            if accumulate:
                raise ArgumentError(name, "accumulate=True needs the buffers to add into")
            continue
        given = _triple(given, name)
        for part, obj, shape, key in zip(("gate", "up", "down"), given, shapes, names):
            label = f"{name}.{part}"
            v = out[key] = _view(ws, obj, label, shape=shape, dtype=_grad_dtypes(ws), stream=stream, writable=True)
            if first is None:
                first = (label, v.dtype)
            elif v.dtype != first[1]:
                raise ArgumentError(label, f"has dtype {v.dtype.name} but {first[0]} is {first[1].name}: the "
                                           f"weight gradients of one call share one dtype")
    return out, (dtypes.float32 if first is None else first[1])


def check_backend_precision(backend: str, precision: str) -> None:
    """Raise ``ArgumentError("precision", ...)`` where ``backend`` cannot run ``precision``."""
    if backend != "cuda" or precision == "bf16":
        return
    if precision == "mxfp8":
        raise ArgumentError("precision", "'mxfp8' needs a Blackwell GPU (sm_100a); Hopper supports 'bf16' (and "
                                         "'fp8_block' once its kernels land). backend='reference' emulates it")
    if precision == "fp8_block":
        raise ArgumentError("precision", "the CUDA kernels for 'fp8_block' are not built yet; use "
                                         "backend='reference' to emulate it")
    raise ArgumentError("precision", f"the CUDA backend runs 'bf16' only, got {precision!r}")


def check_quantized(rank, qw: QuantizedWeights, shared) -> None:
    """Validate a :class:`QuantizedWeights` passed as ``experts`` to a layer call."""
    cfg = rank.config
    if shared is not None:
        raise ArgumentError("shared", "the QuantizedWeights passed as experts already hold the shared expert: "
                                      "pass no shared=")
    if cfg.precision == "bf16":
        raise ArgumentError("experts", "QuantizedWeights need a workspace with an FP8 precision; this one "
                                       "computes in 'bf16' (pass ExpertWeights)")
    if qw.precision != cfg.precision:
        raise ArgumentError("experts", f"quantised for {qw.precision!r}, but the workspace's precision is "
                                       f"{cfg.precision!r}")
    H, I, Is, El = cfg.hidden, cfg.intermediate, cfg.shared_intermediate, rank.experts_per_rank
    want = (((El, I, H), (El, I, H), (El, H, I)), ((Is, H), (Is, H), (H, Is)) if cfg.has_shared else None)
    if tuple(qw.shapes) != want:
        raise ArgumentError("experts", f"quantised weights of shapes {qw.shapes} do not fit this workspace "
                                       f"(expected {want})")
