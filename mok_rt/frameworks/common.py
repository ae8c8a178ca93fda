"""What the framework adapters share (no framework imported here)."""
from __future__ import annotations

from mok_rt.types import ExpertWeights

__all__ = ["shared_parts", "dtype_backend", "bf16_gradients"]


def shared_parts(shared) -> tuple:
    """``(gate, up, down)`` of the shared expert given as an ExpertWeights, a triple or None
    (then three Nones): the adapters pass the three tensors separately, as their ops take them."""
    if shared is None:
        return None, None, None
    if isinstance(shared, ExpertWeights):
        return shared.gate, shared.up, shared.down
    sg, su, sd = shared
    return sg, su, sd


def dtype_backend(ws) -> str:
    """The backend whose kernel dtypes an adapter casts to for ``ws`` (a workspace or workspace
    rank): ``"cuda"`` for a strict one, else its backend.  A strict reference workspace accepts
    only what the CUDA kernels take (bf16 activations, weights and ``d_out``, fp32 routing
    weights), so the reference's own dtypes (x's float32/float64) would be refused there."""
    return "cuda" if ws.strict else ws.backend


def bf16_gradients(backend: str, weights_are_bf16: bool) -> bool:
    """Whether an adapter asks the kernel for bf16 weight gradients (``backend``: what
    :func:`dtype_backend` says): bf16 parameters on CUDA (or a strict reference) get them straight
    from the kernel (the fp32 sums rounded once, half the bytes written, no cast after: bitwise
    what casting the fp32 gradients would give); otherwise the kernels' dtype."""
    return backend == "cuda" and weights_are_bf16
