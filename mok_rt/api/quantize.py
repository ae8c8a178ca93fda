"""FP8 weights for the layer calls: :func:`quantize_weights` (docs/API.md, docs/SEMANTICS.md §10).
The type it returns is :class:`mok_rt.types.QuantizedWeights`; its checks live in api/validate.py."""
from __future__ import annotations

from mok_rt.api.validate import _accepts, _triple, _view, check_backend_precision, check_flag
from mok_rt.api.workspace import as_rank, resolve_stream
from mok_rt.errors import ArgumentError
from mok_rt.types import QuantizedWeights

__all__ = ["quantize_weights"]


def _host_weights(rank, weights, name, shapes, stream):
    from mok_rt.backends.reference import host_array   # the reference layout: host arrays
    w = _triple(weights, name)
    a = _accepts(rank)
    return [host_array(_view(a, obj, f"{name}.{part}", shape=shape, dtype=a.floats, stream=stream))
            for part, obj, shape in zip(("gate", "up", "down"), w, shapes)]


def quantize_weights(ws, experts, shared=None, *, for_backward: bool = True, stream=None) -> QuantizedWeights:
    """Quantise bf16 master weights (``ExpertWeights``; the shared expert's too when the config
    has one) into every layout the workspace's FP8 kernels read; returns a
    :class:`QuantizedWeights` for ``forward`` / ``recompute_context`` (and the backward).

    On the CUDA backend ("fp8_block") one kernel launch on ``stream`` writes the forward copies
    (E4M3, 128 x 128 fp32 scales) into device memory the result owns; nothing synchronises.
    ``for_backward`` (default) also writes the transposed copies the input-gradient GEMMs read
    (K-major for FP8 wgmma): one more byte per weight.  ``for_backward=False`` (inference) saves
    those bytes.  The reference backend always keeps every copy (host memory, the oracle)."""
    rank = as_rank(ws)
    impl = rank._backend()
    cfg = rank.config
    if cfg.precision == "bf16":
        raise ArgumentError("precision", "the workspace computes in 'bf16': there is nothing to quantise "
                                         "(pass the ExpertWeights themselves)")
    check_backend_precision(rank.backend, cfg.precision)   # (a CUDA workspace could not exist otherwise)
    for_backward = check_flag("for_backward", for_backward)
    H, I, Is, El = cfg.hidden, cfg.intermediate, cfg.shared_intermediate, rank.experts_per_rank
    if shared is not None and not cfg.has_shared:
        raise ArgumentError("shared", "the config has no shared expert (shared_intermediate=0)")
    if cfg.has_shared and shared is None:
        raise ArgumentError("shared", f"the config has a shared expert of {Is}: pass "
                                      f"shared=mok_rt.ExpertWeights(gate=, up=, down=)")
    s = resolve_stream(rank, stream)
    routed_shapes = ((El, I, H), (El, I, H), (El, H, I))
    shared_shapes = ((Is, H), (Is, H), (H, Is)) if cfg.has_shared else None
    if rank.backend == "cuda":
        groups = [("experts", _device_weights(rank, experts, "experts", routed_shapes, s))]
        if cfg.has_shared:
            groups.append(("shared", _device_weights(rank, shared, "shared", shared_shapes, s)))
        q = impl.quantize(groups, stream=s, for_backward=for_backward)
        return QuantizedWeights(cfg.precision, (routed_shapes, shared_shapes), q["experts"], q.get("shared"))
    from mok_rt.reference.quantize import quantize_experts
    routed = quantize_experts(*_host_weights(rank, experts, "experts", routed_shapes, s), cfg.precision)
    qs = None
    if cfg.has_shared:
        qs = quantize_experts(*_host_weights(rank, shared, "shared", shared_shapes, s), cfg.precision)
    return QuantizedWeights(cfg.precision, (routed_shapes, shared_shapes), routed, qs)


def _device_weights(rank, weights, name, shapes, stream):
    """The three bf16 device views of one group (checked: device, dtype, shape, alignment)."""
    w = _triple(weights, name)
    a = _accepts(rank)
    return [_view(a, obj, f"{name}.{part}", shape=shape, dtype=a.floats, stream=stream)
            for part, obj, shape in zip(("gate", "up", "down"), w, shapes)]
