"""Validation of the layer's tensor arguments, shared by every backend.

Each check runs on the host before anything is launched and names the argument it rejects.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import dtypes
from .dlpack import TensorView, check, from_dlpack
from .errors import ArgumentError

__all__ = ["LayerArgs", "import_layer_args", "import_ids", "import_d_out"]

CUDA_FLOAT = (dtypes.bfloat16,)
REFERENCE_FLOAT = (dtypes.bfloat16, dtypes.float32, dtypes.float64)


@dataclass(frozen=True)
class LayerArgs:
    """Validated views of a layer call's tensors (shared-expert views are None when absent)."""

    x: TensorView | None
    topk_weights: TensorView | None
    w_gate: TensorView
    w_up: TensorView
    w_down: TensorView | None
    ws_gate: TensorView | None
    ws_up: TensorView | None
    ws_down: TensorView | None


def _device(ws):
    return "cpu" if ws.backend == "reference" else ("cuda", ws.device_id)


def _lenient(ws) -> bool:
    """The reference backend takes wider dtypes unless the workspace is strict (as CUDA always is)."""
    return ws.backend == "reference" and not getattr(ws, "strict", False)


def _floats(ws):
    return REFERENCE_FLOAT if _lenient(ws) else CUDA_FLOAT


def _weights_dtype(ws):
    return (dtypes.float32, dtypes.float64) if _lenient(ws) else (dtypes.float32,)


def _view(ws, obj, name, *, shape, dtype, stream):
    if obj is None:
        raise ArgumentError(name, "is required")
    try:
        v = from_dlpack(obj, name=name, stream=stream)
    except ArgumentError as ex:
        # A dtype mok_rt has no DType for (uint32, complex ...): say what this argument takes,
        # not every dtype mok_rt knows.
        if ex.argument == name and "unsupported" in str(ex) and "dtype" in str(ex):
            want = " or ".join(d.name for d in (dtype if isinstance(dtype, tuple) else (dtype,)))
            got = getattr(obj, "dtype", None)
            raise ArgumentError(name, f"expected dtype {want}, got {got if got is not None else str(ex)}") \
                from None
        raise
    check(v, name=name, dtype=dtype, shape=shape, device=_device(ws))
    return v


def import_ids(ws, topk_ids, *, stream) -> TensorView:
    cfg = ws.config
    v = _view(ws, topk_ids, "topk_ids", shape=(None, cfg.top_k), dtype=(dtypes.int32, dtypes.int64),
              stream=stream)
    if v.shape[0] > ws.max_tokens:
        raise ArgumentError("topk_ids", f"{v.shape[0]} tokens exceed the workspace's max_tokens={ws.max_tokens}")
    return v


def import_d_out(ws, d_out, *, tokens: int, stream) -> TensorView:
    return _view(ws, d_out, "d_out", shape=(tokens, ws.config.hidden), dtype=_floats(ws), stream=stream)


def import_layer_args(ws, *, tokens: int, x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                      stream, need_x: bool = True, need_weights: bool = True,
                      need_down: bool = True) -> LayerArgs:
    """Import and check every tensor of a forward/backward/recompute call."""
    cfg = ws.config
    H, I, k = cfg.hidden, cfg.intermediate, cfg.top_k
    El = ws.experts_per_rank
    f = _floats(ws)
    x_v = _view(ws, x, "x", shape=(tokens, H), dtype=f, stream=stream) if need_x else None
    tw_v = None
    if need_weights:
        tw_v = _view(ws, topk_weights, "topk_weights", shape=(tokens, k), dtype=_weights_dtype(ws), stream=stream)
    wg = _view(ws, w_gate, "w_gate", shape=(El, I, H), dtype=f, stream=stream)
    wu = _view(ws, w_up, "w_up", shape=(El, I, H), dtype=f, stream=stream)
    wd = _view(ws, w_down, "w_down", shape=(El, H, I), dtype=f, stream=stream) if need_down else None
    shared = (ws_gate, ws_up, ws_down) if need_down else (ws_gate, ws_up)
    given = [s is not None for s in shared]
    Is = cfg.shared_intermediate
    if any(given) and not cfg.has_shared:
        raise ArgumentError("ws_gate", "the config has no shared expert (shared_intermediate=0) but shared "
                                       "weights were given")
    if cfg.has_shared and not all(given):
        missing = [n for n, g in zip(("ws_gate", "ws_up", "ws_down"), given) if not g]
        raise ArgumentError(missing[0], f"the config has a shared expert of {Is}: ws_gate, ws_up"
                                        f"{', ws_down' if need_down else ''} are all required")
    sg = su = sd = None
    if cfg.has_shared:
        sg = _view(ws, ws_gate, "ws_gate", shape=(Is, H), dtype=f, stream=stream)
        su = _view(ws, ws_up, "ws_up", shape=(Is, H), dtype=f, stream=stream)
        if need_down:
            sd = _view(ws, ws_down, "ws_down", shape=(H, Is), dtype=f, stream=stream)
    return LayerArgs(x=x_v, topk_weights=tw_v, w_gate=wg, w_up=wu, w_down=wd, ws_gate=sg, ws_up=su, ws_down=sd)
