"""The MoE layer as PyTorch custom ops: eager, ``torch.compile(fullgraph=True)`` and CUDA graphs.

    from mok_rt.frameworks import torch_ops
    out = torch_ops.moe_layer(ws, x, topk_ids, topk_weights, w_gate, w_up, w_down,
                              shared=(ws_gate, ws_up, ws_down))        # differentiable

Two ``torch.library`` custom ops are registered the first time this module is imported (it
imports torch; ``import mok_rt`` never does):

* ``mok_rt::moe_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate?, ws_up?,
  ws_down?, handle) -> out``;
* ``mok_rt::moe_backward(d_out, <the same inputs>, handle) -> [dx, d_topk_weights, dw_gate,
  dw_up, dw_down (, dws_gate, dws_up, dws_down)]``.

Custom ops take tensors and plain values only, so the workspace travels as an int ``handle``
(:func:`register_workspace`; :func:`moe_layer` does it for you).  Both ops run on torch's current
stream and return torch-owned tensors.  ``register_fake`` gives their exact output metadata and
``register_autograd`` wires the backward: gradients reach ``x``, ``topk_weights`` and every
weight (none for the ids), each in its input's dtype.

**The backward recomputes the forward.**  A mok :class:`~mok_rt.Context` holds mok-owned device
buffers and cannot flow through a compiled graph, so the forward op keeps nothing but its output
and the backward op re-runs ``schedule`` + ``recompute_context`` + ``backward`` from the saved
inputs: activation checkpointing by construction.  Cost: one extra schedule and one extra forward
megakernel launch (context only, without ``out``) per backward, about a third more layer FLOPs
per training step (plus the weights' bf16 casts, made again when the masters are fp32), in
exchange for no layer activations held between forward and backward: autograd keeps only the
inputs (x, the ids, topk_weights, the weights).  On the GPU ``out``, ``dx`` and
``d_topk_weights`` are copied into torch's allocator, so that each call's mok block (which holds
the activations, or the call's inputs) is released at once.

Dtypes.  On the CUDA backend the kernels compute in bf16 with fp32 routing weights: ``x``, the
weights and ``d_out`` are cast to bf16 and ``topk_weights`` to fp32 inside the ops (a no-op when
they already are), so fp32 master weights work and their gradients come back in fp32 without a
bf16 round trip; bf16 weights get bf16 gradients from the kernel (the fp32 sums rounded once).
The reference backend (CPU tensors) computes in ``x``'s dtype when it is float32 or float64, else
in float32, unless the workspace is ``strict``: it then takes the CUDA dtypes only, and the ops
cast as on CUDA.  Outputs: ``out`` and ``dx`` like ``x``; ``d_topk_weights`` and the weight
gradients in the compute dtype of the routing weights / gradients (fp32 on CUDA; on the reference
backend float32, or float64 for float64 inputs); autograd then casts each gradient to its input's
dtype.
"""
from __future__ import annotations

from typing import List, Optional

import torch

import mok_rt as mok
from mok_rt.api.workspace import from_handle as _from_handle
from mok_rt.api.workspace import handle_of
from mok_rt.frameworks.common import bf16_gradients, dtype_backend, shared_parts

__all__ = ["moe_layer", "register_workspace", "workspace_handle", "lookup_workspace", "moe_forward",
           "moe_backward", "kernel_dtypes"]

# --------------------------------------------------------------------------- workspace handles
def register_workspace(ws) -> int:
    """The int handle the custom ops know ``ws`` (a ``Workspace`` or a ``WorkspaceRank``) by.

    Every workspace has one from birth (``ws._handle``, unique in the process, never reused);
    the registry behind it holds workspaces weakly, so a handle stops resolving once its
    workspace is garbage-collected (the ops then raise ``ArgumentError("handle")``)."""
    return handle_of(ws)


workspace_handle = register_workspace


def lookup_workspace(handle: int):
    """The live workspace (or workspace rank) whose handle is ``handle``."""
    return _from_handle(handle)


# --------------------------------------------------------------------------- helpers
def kernel_dtypes(backend: str, x_dtype: torch.dtype):
    """(activation/weight dtype, routing-weight dtype, weight-gradient dtype) the layer computes in.
    ``backend``: ``"cuda"`` for the CUDA dtypes (what a strict reference workspace takes too: see
    frameworks.common.dtype_backend)."""
    if backend == "cuda":
        return torch.bfloat16, torch.float32, torch.float32
    dt = x_dtype if x_dtype in (torch.float32, torch.float64) else torch.float32
    return dt, dt, dt


def _stream(device: torch.device):
    """torch's current stream on ``device`` as a CUstream int (None on the CPU).  The default
    stream's handle 0 is spelled 1 (CU_STREAM_LEGACY, the same stream): DLPack reserves 0."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device).cuda_stream or 1


def _as(t, dtype):
    # detach: torch refuses to export a tensor that requires grad; .to is a no-op when equal.
    return None if t is None else t.detach().to(dtype).contiguous()


def _experts(dtype, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
    experts = mok.ExpertWeights(*(_as(t, dtype) for t in (w_gate, w_up, w_down)))
    shared = None if ws_gate is None else mok.ExpertWeights(*(_as(t, dtype) for t in (ws_gate, ws_up, ws_down)))
    return experts, shared


def _check_shared(ws_gate, ws_up, ws_down):
    if (ws_gate is None) != (ws_up is None) or (ws_gate is None) != (ws_down is None):
        raise mok.ArgumentError("shared", "pass all three shared-expert weights or none")


def _torch(t, dtype, ws):
    """A mok result as a torch-owned tensor of ``dtype``.

    On the CUDA backend a result lives in its call's block, with other results (``out`` shares
    it with the forward's activations, ``dx`` keeps the call's inputs alive): a copy into torch's
    allocator lets that block go at once.  The reference backend's results are fresh host arrays:
    wrapped without a copy."""
    v = torch.from_dlpack(t)
    if v.dtype != dtype:
        return v.to(dtype)
    return v.clone() if ws.backend == "cuda" else v


def _grad_dtype(backend: str, grad: torch.dtype, weights) -> torch.dtype:
    """The weight gradients' dtype (frameworks.common.bf16_gradients)."""
    return torch.bfloat16 if bf16_gradients(backend, all(w.dtype == torch.bfloat16 for w in weights)) else grad


# --------------------------------------------------------------------------- the ops
class _Call:
    """What both ops start with: the workspace, the kernels' dtypes, torch's stream, the schedule
    and the inputs cast for the kernels."""

    def __init__(self, handle, x, topk_ids, topk_weights, weights):
        self.ws = lookup_workspace(handle)
        _check_shared(*weights[3:])
        self.dtypes = dtype_backend(self.ws)   # "cuda" for a strict reference workspace too
        self.act, self.route, self.grad = kernel_dtypes(self.dtypes, x.dtype)
        self.stream = _stream(x.device)
        self.sched = mok.schedule(self.ws, topk_ids.detach().contiguous(), stream=self.stream)
        self.experts, self.shared = _experts(self.act, *weights)
        self.x, self.topk_weights = _as(x, self.act), _as(topk_weights, self.route)


@torch.library.custom_op("mok_rt::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                w_up: torch.Tensor, w_down: torch.Tensor, ws_gate: Optional[torch.Tensor],
                ws_up: Optional[torch.Tensor], ws_down: Optional[torch.Tensor], handle: int) -> torch.Tensor:
    """``out[t] = shared(x[t]) + Σ_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t])`` (like x)."""
    c = _Call(handle, x, topk_ids, topk_weights, (w_gate, w_up, w_down, ws_gate, ws_up, ws_down))
    out, _ = mok.forward(c.ws, c.sched, c.x, c.topk_weights, c.experts, shared=c.shared, stream=c.stream)
    return _torch(out, x.dtype, c.ws)


@moe_forward.register_fake
def _(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, handle):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("mok_rt::moe_backward", mutates_args=())
def moe_backward(d_out: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, ws_gate: Optional[torch.Tensor],
                 ws_up: Optional[torch.Tensor], ws_down: Optional[torch.Tensor], handle: int) -> List[torch.Tensor]:
    """``[dx, d_topk_weights, dw_gate, dw_up, dw_down]`` (+ the three shared-expert gradients
    when there is a shared expert), recomputing the forward's context first."""
    c = _Call(handle, x, topk_ids, topk_weights, (w_gate, w_up, w_down, ws_gate, ws_up, ws_down))
    ctx = mok.recompute_context(c.ws, c.sched, c.x, c.topk_weights, c.experts, shared=c.shared, stream=c.stream)
    # Weight gradients land straight in torch-owned buffers (mok_rt writes through DLPack).
    weights = [w for w in (w_gate, w_up, w_down, ws_gate, ws_up, ws_down) if w is not None]
    gdt = _grad_dtype(c.dtypes, c.grad, weights)
    bufs = [torch.empty(w.shape, dtype=gdt, device=w.device) for w in weights]
    dw_shared = mok.ExpertWeights(*bufs[3:]) if len(bufs) == 6 else None
    g = mok.backward(c.ws, ctx, _as(d_out, c.act), dw=mok.ExpertWeights(*bufs[:3]), dw_shared=dw_shared,
                     stream=c.stream)
    return [_torch(g.dx, x.dtype, c.ws), _torch(g.d_topk_weights, c.route, c.ws), *bufs]


@moe_backward.register_fake
def _(d_out, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, handle):
    backend = dtype_backend(lookup_workspace(handle))
    _, route, grad = kernel_dtypes(backend, x.dtype)
    weights = [w for w in (w_gate, w_up, w_down, ws_gate, ws_up, ws_down) if w is not None]
    gdt = _grad_dtype(backend, grad, weights)
    return [torch.empty_like(x, memory_format=torch.contiguous_format),
            topk_weights.new_empty(topk_weights.shape, dtype=route),
            *(w.new_empty(w.shape, dtype=gdt) for w in weights)]


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, handle = inputs
    ctx.handle = handle
    ctx.has_shared = ws_gate is not None
    ctx.save_for_backward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)


def _backward(ctx, d_out):
    x, topk_ids, topk_weights, *w = ctx.saved_tensors
    grads = moe_backward(d_out.contiguous(), x, topk_ids, topk_weights, *w, ctx.handle)
    dx, dtw, *dws = grads
    dws = dws + [None] * (6 - len(dws))
    dws = [None if g is None else g.to(p.dtype) for g, p in zip(dws, w)]
    return (dx.to(x.dtype), None, dtw.to(topk_weights.dtype), *dws, None)


moe_forward.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- the user-facing call
def moe_layer(ws, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared=None) -> torch.Tensor:
    """The MoE layer as a differentiable torch function, through ``mok_rt::moe_forward``.

    ``ws``: a ``Workspace``, a ``WorkspaceRank`` or a handle from :func:`register_workspace`
    (under ``torch.compile`` prefer registering once and passing the int, or keep the
    workspace as a module attribute: both trace without a graph break).  ``shared``: the shared
    expert's ``(gate, up, down)`` (a tuple or a :class:`mok_rt.ExpertWeights`), or None.
    Works in eager mode, under ``torch.compile(fullgraph=True)`` and under ``torch.cuda.graph``
    capture (CUDA backend, one rank)."""
    # A plain attribute read: dynamo guards on its value, so another workspace recompiles.
    handle = ws if isinstance(ws, int) else ws._handle
    sg, su, sd = shared_parts(shared)
    return moe_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, sg, su, sd, handle)

