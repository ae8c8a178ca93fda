"""The MoE layer as a ``jax.custom_vjp``: eager everywhere, ``jax.jit`` on the reference backend.

    from mok_rt.frameworks import jax_ops
    out = jax_ops.moe_layer(ws, x, topk_ids, topk_weights, w_gate, w_up, w_down,
                            shared=(ws_gate, ws_up, ws_down))          # differentiable

This module imports jax (``pip install -e '.[jax]'``); ``import mok_rt`` never does.

Where it runs:

* **Reference backend** (``Workspace(..., backend="reference")``, the NumPy backend for machines
  without a GPU): the forward and the backward are ``jax.pure_callback`` host calls with exact
  ``jax.ShapeDtypeStruct`` result shapes, so the layer works eagerly **and** under ``jax.jit``
  (``jax.jit(jax.value_and_grad(loss))`` included).  The callbacks receive NumPy arrays, which
  mok_rt reads without a copy.
* **CUDA backend**: eager only.  With concrete ``jax.Array`` inputs the layer runs mok_rt's
  DLPack path (zero copy, mok_rt on the workspace's stream, DLPack ordering JAX's stream and
  ours).  Under ``jax.jit`` (tracers) it raises ``TypeError``: running the kernels inside an XLA
  program needs XLA FFI custom-call handlers launching on XLA's stream, which mok_rt does not
  ship yet.  A ``pure_callback`` would move every tensor through host memory, so it is not used
  on the GPU.

The workspace travels as its int handle (``ws._handle``), a static ``nondiff_argnums`` argument of
the ``custom_vjp``: it is never a traced value, ``jax.jit`` closes over it, and the callbacks look
the workspace up (:func:`mok_rt.api.workspace.from_handle`) when they run.  The registry holds
workspaces weakly: keep the workspace alive for as long as jitted functions that use it run.

**The backward recomputes the forward.**  A mok :class:`~mok_rt.Context` is a host object holding
mok-owned buffers; it cannot be a residual of a jitted ``custom_vjp``.  So the residuals are the
inputs only (x, the ids, topk_weights, the weights) and the backward re-runs ``schedule`` +
``recompute_context`` + ``backward``: activation checkpointing by construction.  Cost: one extra
schedule and one extra forward pass (context only, without ``out``) per backward, about a third
more layer FLOPs per training step, in exchange for no layer activations held between forward
and backward.  (``samples/jax_custom_vjp.py`` without ``--jit`` shows the eager wrapper that
keeps the context instead.)

Gradients reach ``x``, ``topk_weights`` and every weight; the integer ids get none (``None``
in the ``custom_vjp`` backward, a ``float0`` zero to JAX's callers).  Dtypes, as in
:mod:`mok_rt.frameworks.torch_ops`: on CUDA the layer computes in bf16 with fp32 routing
weights; on the reference backend in ``x``'s dtype when it is float32 or float64, else float32.
``out`` and ``dx`` have ``x``'s dtype; ``d_topk_weights`` and the weight gradients come out of the
kernel in the routing / gradient compute dtype (fp32, or float64 for float64 inputs on the
reference backend) and are then cast to each input's dtype.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import jax
import jax.numpy as jnp

import mok_rt as mok
from mok_rt.api.workspace import from_handle as _from_handle
from mok_rt.api.workspace import handle_of
from mok_rt.frameworks.common import shared_parts

__all__ = ["moe_layer", "workspace_handle", "lookup_workspace", "kernel_dtypes", "check_traceable",
           "JIT_UNSUPPORTED"]

JIT_UNSUPPORTED = (
    "mok_rt's JAX layer on the CUDA backend runs eagerly only: under jax.jit it would need XLA FFI "
    "custom calls (jax.ffi handlers launching the kernels on XLA's stream), which mok_rt does not ship "
    "yet. Call the layer outside jax.jit (jit the rest of the model around it), or use a "
    "backend='reference' workspace, which works under jax.jit through jax.pure_callback.")


# --------------------------------------------------------------------------- workspace handles
def workspace_handle(ws) -> int:
    """The int handle of ``ws`` (a ``Workspace``, a ``WorkspaceRank`` or already a handle)."""
    return handle_of(ws)


def lookup_workspace(handle: int):
    """The live workspace (or workspace rank) whose handle is ``handle``."""
    return _from_handle(handle)


# --------------------------------------------------------------------------- helpers
def kernel_dtypes(backend: str, x_dtype):
    """(activation/weight dtype, routing-weight dtype, weight-gradient dtype) the layer computes in,
    as NumPy dtypes."""
    if backend == "cuda":
        return jnp.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(np.float32)
    x_dtype = np.dtype(x_dtype)
    dt = x_dtype if x_dtype in (np.float32, np.float64) else np.dtype(np.float32)
    return dt, dt, dt


def _is_tracer(a) -> bool:
    return isinstance(a, jax.core.Tracer)


def check_traceable(backend: str, *arrays) -> None:
    """Raise ``TypeError`` (:data:`JIT_UNSUPPORTED`) when ``backend`` is ``"cuda"`` and any of
    ``arrays`` is a tracer (under ``jax.jit``, ``jax.vmap``, ...); the reference backend runs
    through ``jax.pure_callback`` and accepts tracers."""
    if backend == "cuda" and any(_is_tracer(a) for a in arrays if a is not None):
        raise TypeError(JIT_UNSUPPORTED)


def _check_shared(w):
    if (w[3] is None) != (w[4] is None) or (w[3] is None) != (w[5] is None):
        raise mok.ArgumentError("shared", "pass all three shared-expert weights or none")


def _experts(cast, w):
    """(routed, shared) ExpertWeights of the six weights (shared ones None) after ``cast``."""
    wk = [None if a is None else cast(a) for a in w]
    return mok.ExpertWeights(*wk[:3]), (None if wk[3] is None else mok.ExpertWeights(*wk[3:]))


def _np(t, dtype) -> np.ndarray:
    """A reference-backend result (host memory) as a NumPy array of ``dtype``."""
    return np.asarray(t.to_numpy()).astype(dtype, copy=False)


# --------------------------------------------------------------------------- host (reference) calls
def _host_forward(handle, x, ids, tw, *w):
    """``out`` like ``x``: schedule + forward on NumPy arrays (the pure_callback body)."""
    ws = lookup_workspace(handle)
    act, route, _ = kernel_dtypes(ws.backend, x.dtype)
    sched = mok.schedule(ws, np.ascontiguousarray(ids))
    experts, shared = _experts(lambda a: np.ascontiguousarray(a, act), w)
    out, _ = mok.forward(ws, sched, np.ascontiguousarray(x, act), np.ascontiguousarray(tw, route), experts,
                         shared=shared)
    return _np(out, x.dtype)


def _host_backward(handle, d_out, x, ids, tw, *w):
    """``(dx, d_topk_weights, *weight gradients)``, the context recomputed from the inputs."""
    ws = lookup_workspace(handle)
    act, route, grad = kernel_dtypes(ws.backend, x.dtype)
    sched = mok.schedule(ws, np.ascontiguousarray(ids))
    experts, shared = _experts(lambda a: np.ascontiguousarray(a, act), w)
    ctx = mok.recompute_context(ws, sched, np.ascontiguousarray(x, act), np.ascontiguousarray(tw, route),
                                experts, shared=shared)
    # Weight gradients straight into NumPy buffers of the gradient dtype (mok_rt writes through
    # DLPack; left to itself the reference backend would allocate float32 ones).
    bufs = [np.empty(a.shape, grad) for a in w if a is not None]
    dw_shared = mok.ExpertWeights(*bufs[3:]) if len(bufs) == 6 else None
    g = mok.backward(ws, ctx, np.ascontiguousarray(d_out, act), dw=mok.ExpertWeights(*bufs[:3]),
                     dw_shared=dw_shared)
    return (_np(g.dx, x.dtype), _np(g.d_topk_weights, route), *bufs)


def _present(w):
    return [a for a in w if a is not None]


def _callback_forward(handle, x, ids, tw, w):
    def host(x, ids, tw, *ws_):
        return _host_forward(handle, x, ids, tw, *ws_, *([None] * (6 - len(ws_))))

    return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ids, tw, *_present(w),
                             vmap_method="sequential")


def _callback_backward(handle, d_out, x, ids, tw, w):
    _, route, grad = kernel_dtypes("reference", x.dtype)
    present = _present(w)
    shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(tw.shape, route),
              *(jax.ShapeDtypeStruct(a.shape, grad) for a in present))

    def host(d_out, x, ids, tw, *ws_):
        return _host_backward(handle, d_out, x, ids, tw, *ws_, *([None] * (6 - len(ws_))))

    return jax.pure_callback(host, shapes, d_out, x, ids, tw, *present, vmap_method="sequential")


# --------------------------------------------------------------------------- eager (cuda) calls
def _to_jax(t):
    return jax.dlpack.from_dlpack(t)   # zero copy: the array keeps the mok_rt tensor alive


def _eager_forward(ws, x, ids, tw, w):
    act, route, _ = kernel_dtypes(ws.backend, x.dtype)
    sched = mok.schedule(ws, ids)
    experts, shared = _experts(lambda a: a.astype(act), w)
    out, _ = mok.forward(ws, sched, x.astype(act), tw.astype(route), experts, shared=shared)
    return _to_jax(out).astype(x.dtype)


def _eager_backward(ws, d_out, x, ids, tw, w):
    act, route, grad = kernel_dtypes(ws.backend, x.dtype)
    sched = mok.schedule(ws, ids)
    experts, shared = _experts(lambda a: a.astype(act), w)
    ctx = mok.recompute_context(ws, sched, x.astype(act), tw.astype(route), experts, shared=shared)
    g = mok.backward(ws, ctx, d_out.astype(act))
    dws = tuple(g.dw) + (tuple(g.dw_shared) if g.dw_shared is not None else ())
    # Copies (astype to the same dtype is not one): let the call's mok block go at once.
    return (jnp.array(_to_jax(g.dx), dtype=x.dtype), jnp.array(_to_jax(g.d_topk_weights), dtype=route),
            *(jnp.array(_to_jax(d), dtype=grad) for d in dws))


# --------------------------------------------------------------------------- the custom_vjp
def _forward(handle, x, ids, tw, w):
    ws = lookup_workspace(handle)
    check_traceable(ws.backend, x, ids, tw, *w)
    if ws.backend == "reference":
        return _callback_forward(handle, x, ids, tw, w)
    return _eager_forward(ws, x, ids, tw, w)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _moe(handle, x, ids, tw, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
    return _forward(handle, x, ids, tw, (w_gate, w_up, w_down, ws_gate, ws_up, ws_down))


def _moe_fwd(handle, x, ids, tw, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
    w = (w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    return _forward(handle, x, ids, tw, w), (x, ids, tw, w)   # residuals: the inputs only


def _moe_bwd(handle, res, d_out):
    x, ids, tw, w = res
    ws = lookup_workspace(handle)
    check_traceable(ws.backend, d_out, x, ids, tw, *w)
    if ws.backend == "reference":
        grads = _callback_backward(handle, d_out, x, ids, tw, w)
    else:
        grads = _eager_backward(ws, d_out, x, ids, tw, w)
    dx, dtw, *dws = grads
    dws = iter(dws)
    dw = [None if a is None else next(dws).astype(a.dtype) for a in w]
    return (dx.astype(x.dtype), None, dtw.astype(tw.dtype), *dw)


_moe.defvjp(_moe_fwd, _moe_bwd)


# --------------------------------------------------------------------------- the user-facing call
def moe_layer(ws, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared=None):
    """The MoE layer as a differentiable JAX function.

    ``ws``: a ``Workspace``, a ``WorkspaceRank`` or its int handle (static: a jitted function
    closes over it).  ``shared``: the shared expert's ``(gate, up, down)`` (a tuple or a
    :class:`mok_rt.ExpertWeights`), or None.  Eager on every backend; under ``jax.jit`` on the
    reference backend only (``TypeError`` on CUDA, see the module docstring)."""
    handle = workspace_handle(ws)
    sg, su, sd = shared_parts(shared)
    w = (w_gate, w_up, w_down, sg, su, sd)
    _check_shared(w)
    return _moe(handle, x, topk_ids, topk_weights, *w)
