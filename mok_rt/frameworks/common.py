"""What the framework adapters share (no framework imported here)."""
from __future__ import annotations

from mok_rt.types import ExpertWeights

__all__ = ["shared_parts", "bf16_gradients"]


def shared_parts(shared) -> tuple:
    """``(gate, up, down)`` of the shared expert given as an ExpertWeights, a triple or None
    (then three Nones): the adapters pass the three tensors separately, as their ops take them."""
    if shared is None:
        return None, None, None
    if isinstance(shared, ExpertWeights):
        return shared.gate, shared.up, shared.down
    sg, su, sd = shared
    return sg, su, sd


def bf16_gradients(backend: str, weights_are_bf16: bool) -> bool:
    """Whether an adapter asks the kernel for bf16 weight gradients: bf16 parameters on CUDA get
    them straight from the kernel (the fp32 sums rounded once, half the bytes written, no cast
    after: bitwise what casting the fp32 gradients would give); otherwise the kernels' dtype."""
    return backend == "cuda" and weights_are_bf16
