"""The small public types the layer functions take and return."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ExpertWeights", "Gradients", "Context", "QuantizedWeights"]


@dataclass(frozen=True)
class ExpertWeights:
    """The three projections of SwiGLU experts, or their gradients.

    Routed experts (this rank's ``E_l`` of them): ``gate`` and ``up`` ``[E_l, I, H]``, ``down``
    ``[E_l, H, I]``.  The shared expert: ``gate`` and ``up`` ``[I_s, H]``, ``down`` ``[H, I_s]``.
    Each field is any DLPack tensor (weights, bf16) or a :class:`~mok_rt.Tensor` (fp32
    gradients)."""

    gate: Any
    up: Any
    down: Any

    def __iter__(self):
        return iter((self.gate, self.up, self.down))


@dataclass(frozen=True)
class Gradients:
    """What :func:`mok_rt.backward` returns: ``dx`` ``[T, H]`` (x's dtype), ``d_topk_weights``
    ``[T, k]`` f32, ``dw`` the routed experts' gradients (fp32, or bf16 into bf16 buffers),
    ``dw_shared`` the shared expert's (None without one).  Where the caller passed gradient buffers, these are those buffers."""

    dx: Any
    d_topk_weights: Any
    dw: ExpertWeights
    dw_shared: ExpertWeights | None = None


class Context:
    """What :func:`mok_rt.backward` needs from :func:`mok_rt.forward` or
    :func:`mok_rt.recompute_context`: the schedule, references to the inputs (``x``,
    ``topk_weights``, the weights; not copies, so do not change them in place before the
    backward) and the saved activations.  Opaque; pass it on unchanged."""

    __slots__ = ("schedule", "tokens", "inputs", "saved", "recomputed")

    def __init__(self, schedule, inputs, saved, *, recomputed: bool = False):
        self.schedule = schedule
        self.tokens = schedule.tokens
        self.inputs = inputs
        self.saved = saved
        self.recomputed = recomputed

    def __repr__(self) -> str:
        return f"Context(tokens={self.tokens}, recomputed={self.recomputed})"


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
