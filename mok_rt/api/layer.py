"""The MoE layer's functional API (DESIGN.md §4): schedule, forward, backward, recompute_context."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mok_rt.api.validate import import_d_out, import_ids, import_layer_args
from mok_rt.errors import ArgumentError

__all__ = ["Gradients", "Context", "schedule", "forward", "backward", "recompute_context"]


@dataclass(frozen=True)
class Gradients:
    """What :func:`backward` returns.  Weight gradients are fp32; shared-expert ones are None
    without a shared expert."""

    dx: Any
    d_topk_weights: Any
    dw_gate: Any
    dw_up: Any
    dw_down: Any
    dws_gate: Any = None
    dws_up: Any = None
    dws_down: Any = None


@dataclass
class Context:
    """What the backward needs from the forward (owned device buffers or reference arrays)."""

    schedule: Any
    tokens: int
    data: Any
    recomputed: bool = False


def _rank(ws):
    """The WorkspaceRank a call runs on (a single-rank Workspace stands for its rank)."""
    from mok_rt.api.workspace import as_rank
    return as_rank(ws)


def _stream(ws, stream):
    if stream is None or ws.backend == "reference":
        return ws.stream
    from mok_rt.runtime.device import wrap_stream
    return wrap_stream(stream, ws.device_id)


def _check_schedule(ws, sched):
    if getattr(sched, "_rank_owner", None) is not ws:
        raise ArgumentError("sched", "was not made by mok_rt.schedule for this workspace (rank)")


def schedule(ws, topk_ids, *, stream=None):
    """Lay out this rank's routed rows from ``topk_ids`` [T, k] (int32 or int64 global expert
    ids), on the device.  Ids out of range are reported through :meth:`Workspace.synchronize`
    (cuda) or raised at once (reference) as :class:`~mok_rt.ExpertIdError`.

    ``ws``: a Workspace driving one rank, or ``ws.rank(i)``.  With expert parallelism every rank
    calls it (with its own tokens); the ranks exchange their routing on the device."""
    ws = _rank(ws)
    impl = ws._backend()
    s = _stream(ws, stream)
    ids = import_ids(ws, topk_ids, stream=s)
    sched = impl.schedule(ids, stream=s)
    sched._rank_owner = ws
    return sched


def forward(ws, sched, x, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None, *,
            stream=None):
    """``out[t] = shared(x[t]) + Σ_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t])``.

    Returns ``(out, ctx)``: ``out`` [T, H] in x's dtype, ``ctx`` for :func:`backward`."""
    ws = _rank(ws)
    impl = ws._backend()
    _check_schedule(ws, sched)
    s = _stream(ws, stream)
    args = import_layer_args(ws, tokens=sched.tokens, x=x, topk_weights=topk_weights, w_gate=w_gate, w_up=w_up,
                             w_down=w_down, ws_gate=ws_gate, ws_up=ws_up, ws_down=ws_down, stream=s)
    return impl.forward(sched, args, stream=s)


def recompute_context(ws, sched, x, w_gate, w_up, ws_gate=None, ws_up=None, *, w_down=None, ws_down=None,
                      topk_weights=None, stream=None):
    """Rebuild the forward's context from ``x`` (activation checkpointing) without producing ``out``.

    With ``w_down=`` (and ``ws_down=``) the rebuild is enqueued now; without them (DESIGN §4's
    signature) it is enqueued at the start of :func:`backward`, which receives them."""
    ws = _rank(ws)
    impl = ws._backend()
    _check_schedule(ws, sched)
    s = _stream(ws, stream)
    need_down = w_down is not None
    args = import_layer_args(ws, tokens=sched.tokens, x=x, topk_weights=topk_weights, w_gate=w_gate, w_up=w_up,
                             w_down=w_down, ws_gate=ws_gate, ws_up=ws_up, ws_down=ws_down, stream=s,
                             need_weights=topk_weights is not None, need_down=need_down)
    return impl.recompute(sched, args, stream=s)


_GRAD_NAMES = ("dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")


def backward(ws, sched, ctx, d_out, x, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
             ws_down=None, *, dw_gate=None, dw_up=None, dw_down=None, dws_gate=None, dws_up=None, dws_down=None,
             accumulate: bool = False, stream=None) -> Gradients:
    """Gradients of the layer given ``d_out`` [T, H].

    Weight gradients are fp32.  Pass caller-owned fp32 buffers (``dw_gate=...`` etc.) to have
    them written in place, or added into with ``accumulate=True`` (gradient accumulation across
    micro-batches without copies); the returned :class:`Gradients` then holds those buffers.
    With expert parallelism ``dw_*`` are this rank's experts' gradients (from every rank's tokens).
    """
    ws = _rank(ws)
    impl = ws._backend()
    _check_schedule(ws, sched)
    if not isinstance(ctx, Context) or ctx.schedule is not sched:
        raise ArgumentError("ctx", "must be the context returned by forward/recompute_context for this schedule")
    s = _stream(ws, stream)
    args = import_layer_args(ws, tokens=sched.tokens, x=x, topk_weights=topk_weights, w_gate=w_gate, w_up=w_up,
                             w_down=w_down, ws_gate=ws_gate, ws_up=ws_up, ws_down=ws_down, stream=s)
    dout = import_d_out(ws, d_out, tokens=sched.tokens, stream=s)
    given = dict(zip(_GRAD_NAMES, (dw_gate, dw_up, dw_down, dws_gate, dws_up, dws_down)))
    if accumulate and any(v is None for n, v in given.items() if ws.config.has_shared or not n.startswith("dws")):
        missing = [n for n, v in given.items() if v is None and (ws.config.has_shared or not n.startswith("dws"))]
        raise ArgumentError(missing[0], "accumulate=True needs every weight-gradient buffer to add into")
    if not ws.config.has_shared:
        for n in ("dws_gate", "dws_up", "dws_down"):
            if given[n] is not None:
                raise ArgumentError(n, "the config has no shared expert")
    return impl.backward(sched, ctx, dout, args, out=given, accumulate=bool(accumulate), stream=s)
