"""The NumPy reference of the MoE layer: the oracle every other path is tested against.

``forward`` / ``backward`` compute one rank's layer in float64; ``ep_forward`` / ``ep_backward``
simulate expert parallelism by partitioning the experts; :mod:`mok_rt.reference.schedule` is the
routing layout the device schedule must reproduce.
"""
from mok_rt.reference import fp8, layer
from mok_rt.reference.layer import Context, EPContext, Grads, ep_backward, ep_forward, silu


def forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, ws_gate=None, ws_up=None, ws_down=None,
            swiglu_limit=None, precision: str = "bf16"):
    """The layer's forward in float64 (reference/layer.py), or with the quantisation points of
    ``precision="fp8_block"`` / ``"mxfp8"`` (reference/fp8.py).  Returns ``(out, ctx)``."""
    if precision == "bf16":
        return layer.forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=ws_gate, ws_up=ws_up,
                             ws_down=ws_down, swiglu_limit=swiglu_limit)
    fp8.check_precision(precision)
    q, qs = fp8.quantize_weights_ref(precision, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    return fp8.forward_fp8(x, topk_ids, topk_weights, q, qs, swiglu_limit=swiglu_limit)


def backward(ctx, d_out):
    """Gradients of ``sum(out * d_out)`` w.r.t. every input of :func:`forward`, in the precision of
    the forward that made ``ctx``."""
    if isinstance(ctx, fp8.FP8Context):
        return fp8.backward_fp8(ctx, d_out)
    return layer.backward(ctx, d_out)


__all__ = ["Context", "Grads", "EPContext", "forward", "backward", "ep_forward", "ep_backward", "silu"]
