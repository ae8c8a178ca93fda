"""What the framework adapters share (no framework imported here)."""
from __future__ import annotations

from mok_rt.types import ExpertWeights

__all__ = ["shared_parts"]


def shared_parts(shared) -> tuple:
    """``(gate, up, down)`` of the shared expert given as an ExpertWeights, a triple or None
    (then three Nones): the adapters pass the three tensors separately, as their ops take them."""
    if shared is None:
        return None, None, None
    if isinstance(shared, ExpertWeights):
        return shared.gate, shared.up, shared.down
    sg, su, sd = shared
    return sg, su, sd
