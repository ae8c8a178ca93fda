"""The NumPy reference of the MoE layer: the oracle every other path is tested against.

``forward`` / ``backward`` compute one rank's layer in float64; ``ep_forward`` / ``ep_backward``
simulate expert parallelism by partitioning the experts; :mod:`mok_rt.reference.schedule` is the
routing layout the device schedule must reproduce.
"""
from mok_rt.reference.layer import Context, EPContext, Grads, backward, ep_backward, ep_forward, forward, silu

__all__ = ["Context", "Grads", "EPContext", "forward", "backward", "ep_forward", "ep_backward", "silu"]
