"""The layer functions: schedule, forward, backward, recompute_context (docs/API.md)."""
from __future__ import annotations

from mok_rt.api.validate import check_flag, import_d_out, import_grad_buffers, import_ids, import_layer_args
from mok_rt.api.workspace import as_rank, resolve_stream
from mok_rt.errors import ArgumentError
from mok_rt.types import Context, ExpertWeights, Gradients

__all__ = ["schedule", "forward", "backward", "recompute_context"]


def _check_schedule(rank, sched, argument="sched"):
    if getattr(sched, "_rank_owner", None) is not rank:
        what = "its schedule was" if argument == "ctx" else "was"
        raise ArgumentError(argument, f"{what} not made by mok_rt.schedule for this workspace (rank)")


def _handle(rank, s):
    """The int CUstream the inputs are imported on (computed once per call rather than once per
    tensor); None on the reference backend."""
    return None if s is None else rank._stream_int(s)


def _layer_call(ws, sched, x, topk_weights, experts, shared, stream):
    """What forward and recompute_context share: the rank, its backend, the validated tensors and
    the stream."""
    rank = as_rank(ws)
    impl = rank._backend()
    _check_schedule(rank, sched)
    s = resolve_stream(rank, stream)
    args = import_layer_args(rank, tokens=sched.tokens, x=x, topk_weights=topk_weights, experts=experts,
                             shared=shared, stream=_handle(rank, s))
    return rank, impl, args, s


def schedule(ws, topk_ids, *, stream=None):
    """Lay out this rank's routed rows from ``topk_ids`` ``[T, k]`` (int32 or int64 global
    expert ids), on the device.  Ids out of range are reported by ``ws.synchronize()`` /
    ``ws.check()`` as :class:`~mok_rt.ExpertIdError`.

    ``ws``: a Workspace driving one rank, or ``ws.rank(i)``.  With expert parallelism every rank
    calls it with its own tokens; the ranks exchange their routing on the device."""
    rank = as_rank(ws)
    impl = rank._backend()
    s = resolve_stream(rank, stream)
    sched = impl.schedule(import_ids(rank, topk_ids, stream=_handle(rank, s)), stream=s)
    sched._rank_owner = rank
    return sched


def forward(ws, sched, x, topk_weights, experts: ExpertWeights, *, shared: ExpertWeights | None = None,
            stream=None):
    """``out[t] = shared(x[t]) + Σ_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t])``.

    ``x`` ``[T, H]``, ``topk_weights`` ``[T, k]`` f32, ``experts`` this rank's routed experts,
    ``shared`` the shared expert (required exactly when the config has one).  Returns
    ``(out, ctx)``: ``out`` ``[T, H]`` in x's dtype and the context for :func:`backward`."""
    rank, impl, args, s = _layer_call(ws, sched, x, topk_weights, experts, shared, stream)
    out, saved = impl.forward(sched, args, stream=s)
    return out, Context(sched, args, saved)


def recompute_context(ws, sched, x, topk_weights, experts: ExpertWeights, *, shared: ExpertWeights | None = None,
                      stream=None) -> Context:
    """Rebuild the context of :func:`forward` from its inputs without producing ``out``
    (activation checkpointing): same arguments, same context."""
    rank, impl, args, s = _layer_call(ws, sched, x, topk_weights, experts, shared, stream)
    return Context(sched, args, impl.recompute(sched, args, stream=s), recomputed=True)


def backward(ws, ctx: Context, d_out, *, dw: ExpertWeights | None = None, dw_shared: ExpertWeights | None = None,
             accumulate: bool = False, stream=None) -> Gradients:
    """Gradients of the layer given ``d_out`` ``[T, H]``; the schedule, the inputs and the
    weights come from ``ctx``.

    Weight gradients are fp32.  ``dw=`` / ``dw_shared=`` (ExpertWeights of caller-owned buffers,
    fp32 or bf16, one dtype for all: bf16 gets the fp32 sums rounded once, and gradients not
    passed are allocated in it) are written in place, or added into with ``accumulate=True`` (gradient accumulation
    across micro-batches without copies); the returned :class:`Gradients` then holds them.  With
    expert parallelism ``dw`` is this rank's experts' gradients, from every rank's tokens."""
    rank = as_rank(ws)
    impl = rank._backend()
    if not isinstance(ctx, Context):
        raise ArgumentError("ctx", f"expected the Context returned by forward/recompute_context, "
                                   f"got {type(ctx).__name__}")
    _check_schedule(rank, ctx.schedule, "ctx")
    accumulate = check_flag("accumulate", accumulate)
    s = resolve_stream(rank, stream)
    h = _handle(rank, s)
    ordered = set()   # d_out and the gradient buffers: one order per framework (from_dlpack)
    dout = import_d_out(rank, d_out, tokens=ctx.tokens, stream=h, ordered=ordered)
    buffers, grad_dtype = import_grad_buffers(rank, dw, dw_shared, accumulate=accumulate, stream=h,
                                              ordered=ordered)
    g = impl.backward(ctx.schedule, ctx.saved, dout, ctx.inputs, out=buffers, grad_dtype=grad_dtype,
                      accumulate=accumulate, stream=s)
    routed = dw if dw is not None else _frozen(ExpertWeights, gate=g["dw_gate"], up=g["dw_up"], down=g["dw_down"])
    shared = None
    if rank.config.has_shared:
        shared = dw_shared if dw_shared is not None else _frozen(
            ExpertWeights, gate=g["d_shared_gate"], up=g["d_shared_up"], down=g["d_shared_down"])
    return _frozen(Gradients, dx=g["dx"], d_topk_weights=g["d_topk_weights"], dw=routed, dw_shared=shared)


def _frozen(cls, **fields):
    """``cls(**fields)`` for a frozen dataclass of plain fields, without its per-field
    ``object.__setattr__`` (a backward returns two): the same object the constructor makes."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj
