"""Validation of a layer call's tensor arguments: the one place where they are checked.

Each check runs on the host before anything is launched and names the argument it rejects; the
backends trust what it returns.  The CUDA contract (bf16 activations and weights, f32 routing
weights, fp32 or bf16 weight gradients, int32/int64 ids) holds on every backend; the reference backend
also takes float32/float64 tensors unless the workspace is ``strict``.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import numpy as np

from mok_rt.errors import ArgumentError
from mok_rt.interop import dtypes
from mok_rt.interop.dlpack import TensorView, check, from_dlpack
from mok_rt.interop.producers import immutable_framework
from mok_rt.types import ExpertWeights, QuantizedWeights

__all__ = ["LayerArgs", "import_layer_args", "import_ids", "import_d_out", "import_grad_buffers", "check_flag"]

_CUDA_FLOAT = (dtypes.bfloat16,)
_ORACLE_FLOAT = (dtypes.bfloat16, dtypes.float32, dtypes.float64)
_IDS = (dtypes.int32, dtypes.int64)
GRAD_NAMES = ("dw_gate", "dw_up", "dw_down", "d_shared_gate", "d_shared_up", "d_shared_down")
_NO_BUFFERS: Mapping = MappingProxyType(dict.fromkeys(GRAD_NAMES))   # a backward given no gradient buffers


class LayerArgs:
    """Validated views of a layer call's tensors (the shared expert's are None without one).
    A plain slotted class: one is made per forward call, where a frozen dataclass's field-by-field
    ``object.__setattr__`` would cost more than the rest of its import."""

    __slots__ = ("x", "topk_weights", "w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down",
                 "quantized")

    def __init__(self, x: TensorView, topk_weights: TensorView, w_gate: TensorView | None, w_up: TensorView | None,
                 w_down: TensorView | None, shared_gate: TensorView | None = None,
                 shared_up: TensorView | None = None, shared_down: TensorView | None = None,
                 quantized: object = None):   # a mok_rt.QuantizedWeights given as experts (then every w_* is None)
        self.x, self.topk_weights = x, topk_weights
        self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down
        self.shared_gate, self.shared_up, self.shared_down = shared_gate, shared_up, shared_down
        self.quantized = quantized

    def __repr__(self) -> str:
        return "LayerArgs(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__) + ")"


class _Accepts:
    """What one rank's calls accept: the device, the float / routing-weight / gradient dtypes.
    A function of the workspace's backend and ``strict`` (fixed when it is made), computed once per
    rank (the calls read it for every tensor)."""

    __slots__ = ("device", "floats", "f32", "grads", "hidden", "top_k", "max_tokens", "has_shared", "routed_shapes",
                 "shared_shapes")

    def __init__(self, ws):
        oracle = ws.backend == "reference" and not ws.strict
        self.device = "cpu" if ws.backend == "reference" else ("cuda", ws.device_id)
        self.floats = _ORACLE_FLOAT if oracle else _CUDA_FLOAT
        self.f32 = (dtypes.float32, dtypes.float64) if oracle else (dtypes.float32,)
        self.grads = (dtypes.float32, dtypes.bfloat16) + ((dtypes.float64,) if oracle else ())
        cfg = ws.config
        H, I, Is, El = cfg.hidden, cfg.intermediate, cfg.shared_intermediate, ws.experts_per_rank
        self.hidden, self.top_k, self.max_tokens, self.has_shared = H, cfg.top_k, ws.max_tokens, cfg.has_shared
        self.routed_shapes = ((El, I, H), (El, I, H), (El, H, I))   # gate, up, down
        self.shared_shapes = ((Is, H), (Is, H), (H, Is))


def _accepts(ws) -> _Accepts:
    a = ws.__dict__.get("_accepts")
    if a is None:
        a = ws.__dict__["_accepts"] = _Accepts(ws)
    return a


# Signatures of views that passed check(): a pure function of the view's shape, strides, dtype,
# device and pointer alignment and of what was asked, so a call that repeats them skips it.
_CHECKED: set = set()
_CHECKED_MAX = 512


def _view(a: _Accepts, obj, name, *, shape, dtype, stream, writable=False, ordered=None):
    """Import ``obj`` on ``stream`` and check it against ``shape``, ``dtype`` and the rank's
    device.  ``ordered``: the set the imports of one call share (see from_dlpack), None for an
    import on its own."""
    if obj is None:
        raise ArgumentError(name, "is required")
    if writable and (fw := immutable_framework(obj)) is not None:
        # Before the import: a JAX array's capsule is a legacy one, which has no read-only flag
        # (v.readonly below would be False), and writing into it would change an immutable array
        # that JAX may share, cache or have donated.
        raise ArgumentError(name, f"is a {fw} array, which is immutable, but mok_rt writes the gradient into it in "
                                  f"place: output buffers must be writable NumPy arrays, torch tensors, CuPy arrays "
                                  f"or mok_rt.Tensors. Pass no buffers to have mok_rt allocate the gradients (from "
                                  f"JAX, mok_rt.frameworks.jax_ops.moe_layer differentiates the layer)")
    try:
        v = from_dlpack(obj, name=name, stream=stream, ordered=ordered)
    except ArgumentError as ex:
        # A dtype mok_rt has no DType for (uint32, complex ...): say what this argument takes,
        # not every dtype mok_rt knows.
        if ex.argument == name and "unsupported" in str(ex) and "dtype" in str(ex):
            want = " or ".join(d.name for d in dtype)
            got = getattr(obj, "dtype", None)
            raise ArgumentError(name, f"expected dtype {want}, got {got if got is not None else ex}") from None
        raise
    sig = (name, v.shape, v.strides, v.dtype, v.device_type, v.device_id, v.ptr % 16, dtype, shape, a.device)
    if sig not in _CHECKED:
        check(v, name=name, dtype=dtype, shape=shape, device=a.device)
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED.add(sig)
    if writable and v.readonly:
        raise ArgumentError(name, "is read-only; mok_rt writes the gradient into it")
    return v


def check_flag(name: str, value) -> bool:
    """``value`` as a bool, where it is one (or a NumPy bool).  Not ``bool(value)``: the string
    "False", 0.0 or an array would be taken for a choice the caller did not make."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ArgumentError(name, f"expected True or False, got {value!r} ({type(value).__name__})")


def _check_disjoint(views: Mapping) -> None:
    """Raise naming the later of two buffers (by label, in order) whose memory overlaps: every
    output of one call is written by its own kernels, so shared memory would be raced on on the
    device (and summed on the reference backend).  The views passed check(): C-contiguous, so each
    is the byte range [ptr, ptr + nbytes); device pointers share one (unified) address space."""
    seen = []
    for label, v in views.items():
        if v is None or v.nbytes == 0:
            continue
        lo, hi = v.ptr, v.ptr + v.nbytes
        for other, (olo, ohi) in seen:
            if lo < ohi and olo < hi:
                raise ArgumentError(label, f"overlaps {other} in memory: each gradient buffer must be its own, "
                                           f"non-overlapping memory")
        seen.append((label, (lo, hi)))


def _triple(obj, name: str) -> ExpertWeights:
    if isinstance(obj, ExpertWeights):
        return obj
    raise ArgumentError(name, f"expected mok_rt.ExpertWeights(gate=, up=, down=), got {type(obj).__name__}")


def import_ids(ws, topk_ids, *, stream) -> TensorView:
    a = _accepts(ws)
    v = _view(a, topk_ids, "topk_ids", shape=(None, a.top_k), dtype=_IDS, stream=stream)
    if v.shape[0] > a.max_tokens:
        raise ArgumentError("topk_ids", f"{v.shape[0]} tokens exceed the workspace's max_tokens={a.max_tokens}")
    return v


def import_d_out(ws, d_out, *, tokens: int, stream, ordered=None) -> TensorView:
    a = _accepts(ws)
    return _view(a, d_out, "d_out", shape=(tokens, a.hidden), dtype=a.floats, stream=stream, ordered=ordered)


def import_layer_args(ws, *, tokens: int, x, topk_weights, experts, shared, stream) -> LayerArgs:
    """Import and check every tensor of a forward or recompute call (on ``stream``, ordered once
    per framework: see from_dlpack's ``ordered``)."""
    a = _accepts(ws)
    f = a.floats
    ordered = set()
    xv = _view(a, x, "x", shape=(tokens, a.hidden), dtype=f, stream=stream, ordered=ordered)
    tw = _view(a, topk_weights, "topk_weights", shape=(tokens, a.top_k), dtype=a.f32, stream=stream,
               ordered=ordered)
    if isinstance(experts, QuantizedWeights):
        check_quantized(ws, experts, shared)
        return LayerArgs(xv, tw, None, None, None, quantized=experts)
    experts = _triple(experts, "experts")
    g, u, d = a.routed_shapes
    gate = _view(a, experts.gate, "experts.gate", shape=g, dtype=f, stream=stream, ordered=ordered)
    up = _view(a, experts.up, "experts.up", shape=u, dtype=f, stream=stream, ordered=ordered)
    down = _view(a, experts.down, "experts.down", shape=d, dtype=f, stream=stream, ordered=ordered)
    if shared is not None and not a.has_shared:
        raise ArgumentError("shared", "the config has no shared expert (shared_intermediate=0)")
    if not a.has_shared:
        return LayerArgs(xv, tw, gate, up, down)
    if shared is None:
        raise ArgumentError("shared", f"the config has a shared expert of {a.shared_shapes[0][0]}: pass "
                                      f"shared=mok_rt.ExpertWeights(gate=, up=, down=)")
    shared = _triple(shared, "shared")
    g, u, d = a.shared_shapes
    return LayerArgs(xv, tw, gate, up, down,
                     _view(a, shared.gate, "shared.gate", shape=g, dtype=f, stream=stream, ordered=ordered),
                     _view(a, shared.up, "shared.up", shape=u, dtype=f, stream=stream, ordered=ordered),
                     _view(a, shared.down, "shared.down", shape=d, dtype=f, stream=stream, ordered=ordered))


def import_grad_buffers(ws, dw, dw_shared, *, accumulate: bool, stream, ordered=None) -> tuple[Mapping, dtypes.DType]:
    """Caller-owned weight-gradient buffers by internal name (None: the backend allocates one), and
    the call's gradient dtype.  fp32 or bf16 (float64 too on the reference backend), all of one
    dtype: the kernel writes every weight gradient of a call in one dtype, and the backend
    allocates the ones not passed in it (fp32 when none is passed).  Without any buffer (the
    usual call) the mapping is a shared read-only one of Nones."""
    a = _accepts(ws)
    if dw_shared is not None and not a.has_shared:
        raise ArgumentError("dw_shared", "the config has no shared expert")
    if dw is None and dw_shared is None:
        if accumulate:
            raise ArgumentError("dw", "accumulate=True needs the buffers to add into")
        return _NO_BUFFERS, dtypes.float32
    out = dict.fromkeys(GRAD_NAMES)
    groups = [("dw", dw, a.routed_shapes, GRAD_NAMES[:3])]
    if a.has_shared:
        groups.append(("dw_shared", dw_shared, a.shared_shapes, GRAD_NAMES[3:]))
    first = None   # (label, dtype) of the first buffer given
    labelled = {}  # label -> view, in argument order: for _check_disjoint
    for name, given, shapes, names in groups:
        if given is None:
            if accumulate:
                raise ArgumentError(name, "accumulate=True needs the buffers to add into")
            continue
        given = _triple(given, name)
        for part, obj, shape, key in zip(("gate", "up", "down"), given, shapes, names):
            label = f"{name}.{part}"
            v = out[key] = labelled[label] = _view(a, obj, label, shape=shape, dtype=a.grads, stream=stream,
                                                   writable=True, ordered=ordered)
            if first is None:
                first = (label, v.dtype)
            elif v.dtype != first[1]:
                raise ArgumentError(label, f"has dtype {v.dtype.name} but {first[0]} is {first[1].name}: the "
                                           f"weight gradients of one call share one dtype")
    _check_disjoint(labelled)
    return out, (dtypes.float32 if first is None else first[1])


def check_backend_precision(backend: str, precision: str, num_ranks: int = 1) -> None:
    """Raise ``ArgumentError("precision", ...)`` where ``backend`` cannot run ``precision``."""
    if backend != "cuda" or precision == "bf16":
        return
    if precision == "mxfp8":
        raise ArgumentError("precision", "'mxfp8' needs a Blackwell GPU (sm_100a); Hopper supports 'bf16' and "
                                         "'fp8_block'. backend='reference' emulates it")
    if precision == "fp8_block":   # one GPU or expert parallelism, forward and backward
        return
    raise ArgumentError("precision", f"the CUDA backend runs 'bf16' and 'fp8_block', got {precision!r}")


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
    # The shapes say whether there is a shared expert, but the tensors are what the backends read:
    # without this, QuantizedWeights(..., shared=None) would run with the shared expert dropped.
    if cfg.has_shared and qw.shared is None:
        raise ArgumentError("experts", f"the config has a shared expert of {Is}, but these QuantizedWeights hold "
                                       f"none (shared=None): quantise it too, mok.quantize_weights(ws, experts, "
                                       f"shared)")
    if qw.shared is not None and not cfg.has_shared:
        raise ArgumentError("experts", "these QuantizedWeights hold a shared expert, but the config has none "
                                       "(shared_intermediate=0)")
    # The quantised tensors are in the layout of the backend that made them.
    if rank.backend == "cuda":
        from mok_rt.kernels.fp8_quantize import DeviceQuantized
        for q in (qw.experts, qw.shared):
            if q is None:
                continue
            if not isinstance(q, DeviceQuantized):
                raise ArgumentError("experts", "these QuantizedWeights were made by another backend: quantise "
                                               "with mok.quantize_weights on this CUDA workspace")
            if q.device_id != rank.device_id:
                raise ArgumentError("experts", f"quantised on device {q.device_id}, but this rank runs on device "
                                               f"{rank.device_id}")
    else:
        from mok_rt.reference.quantize import QuantizedExperts
        for part, q in (("experts", qw.experts), ("shared", qw.shared)):
            if q is not None and not isinstance(q, QuantizedExperts):
                raise ArgumentError("experts", f"the QuantizedWeights' {part} is a {type(q).__name__}, not the "
                                               f"reference backend's layout (made by the CUDA backend?): quantise "
                                               f"with mok.quantize_weights on this reference workspace")
