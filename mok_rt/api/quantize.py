"""FP8 weights for the layer calls: :func:`quantize_weights` and :class:`QuantizedWeights`
(docs/API.md, docs/SEMANTICS.md §10); and which backend runs which ``MoEConfig.precision``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mok_rt.errors import ArgumentError

__all__ = ["QuantizedWeights", "quantize_weights", "check_backend_precision"]


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


@dataclass(frozen=True, eq=False)
class QuantizedWeights:
    """Expert weights quantised once (per optimizer step) for a workspace's FP8 precision; pass
    it to :func:`mok_rt.forward` / :func:`mok_rt.recompute_context` in place of ``experts``
    (and then no ``shared=``: the shared expert's weights are inside), for every micro-batch.

    ``precision`` ("fp8_block" or "mxfp8"), ``shapes`` (the master weights' shapes: routed
    gate, up, down, then the shared expert's or None); the quantised tensors themselves are in
    a backend-specific layout (every copy the kernels read) and are not part of the API.
    Quantising again after the master weights change is the caller's job."""

    precision: str
    shapes: tuple
    experts: Any
    shared: Any = None

    def __repr__(self) -> str:
        return f"QuantizedWeights(precision={self.precision!r}, shapes={self.shapes})"


def _host_weights(rank, weights, name, shapes, stream):
    from mok_rt.api.validate import _floats, _triple, _view
    from mok_rt.backends.reference import host_array
    w = _triple(weights, name)
    return [host_array(_view(rank, obj, f"{name}.{part}", shape=shape, dtype=_floats(rank), stream=stream))
            for part, obj, shape in zip(("gate", "up", "down"), w, shapes)]


def quantize_weights(ws, experts, shared=None, *, stream=None) -> QuantizedWeights:
    """Quantise bf16 master weights (``ExpertWeights``; the shared expert's too when the config
    has one) into every layout the workspace's FP8 kernels read; returns a
    :class:`QuantizedWeights` for ``forward`` / ``recompute_context``."""
    from mok_rt.api.layer import _stream
    from mok_rt.api.workspace import as_rank
    rank = as_rank(ws)
    rank._backend()
    cfg = rank.config
    if cfg.precision == "bf16":
        raise ArgumentError("precision", "the workspace computes in 'bf16': there is nothing to quantise "
                                         "(pass the ExpertWeights themselves)")
    check_backend_precision(rank.backend, cfg.precision)   # (a CUDA workspace could not exist)
    H, I, Is, El = cfg.hidden, cfg.intermediate, cfg.shared_intermediate, rank.experts_per_rank
    if shared is not None and not cfg.has_shared:
        raise ArgumentError("shared", "the config has no shared expert (shared_intermediate=0)")
    if cfg.has_shared and shared is None:
        raise ArgumentError("shared", f"the config has a shared expert of {Is}: pass "
                                      f"shared=mok_rt.ExpertWeights(gate=, up=, down=)")
    s = _stream(rank, stream)
    from mok_rt.reference.quantize import quantize_experts
    routed_shapes = ((El, I, H), (El, I, H), (El, H, I))
    routed = quantize_experts(*_host_weights(rank, experts, "experts", routed_shapes, s), cfg.precision)
    qs, shared_shapes = None, None
    if cfg.has_shared:
        shared_shapes = ((Is, H), (Is, H), (H, Is))
        qs = quantize_experts(*_host_weights(rank, shared, "shared", shared_shapes, s), cfg.precision)
    return QuantizedWeights(cfg.precision, (routed_shapes, shared_shapes), routed, qs)


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
