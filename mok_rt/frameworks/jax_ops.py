"""The MoE layer as a ``jax.custom_vjp`` running through XLA FFI custom calls: eager and under
``jax.jit``, on the GPU (CUDA backend) and on the CPU (reference backend).

    from mok_rt.frameworks import jax_ops
    out = jax_ops.moe_layer(ws, x, topk_ids, topk_weights, w_gate, w_up, w_down,
                            shared=(ws_gate, ws_up, ws_down))          # differentiable

    step = jax.jit(jax.value_and_grad(loss))                            # the layer runs inside XLA

This module imports jax (``pip install -e '.[jax]'``); ``import mok_rt`` never does.

**How.**  The forward and the backward are two XLA FFI custom calls (``jax.ffi.ffi_call``), whose
handlers are Python functions made callable from XLA with ctypes
(:mod:`mok_rt.frameworks.xla_ffi`: a mirror of XLA's FFI C API, no compiled extension) and
registered with ``jax.ffi.register_ffi_target`` the first time the layer is used, for two platforms:

* ``"CUDA"``: the handler runs mok_rt's kernels on XLA's stream (``XLA_FFI_Stream_Get``), for a
  ``backend="cuda"`` workspace.  Nothing waits; XLA's buffers are read and written in place
  (``out``, ``dx`` and ``d_topk_weights`` are copied from mok_rt's per-call block on the same
  stream).  See :mod:`mok_rt.frameworks.ffi_layer` for why the per-call memory is safe under
  XLA's stream ordering.
* ``"cpu"``: the handler runs the NumPy reference backend on XLA's host buffers, for a
  ``backend="reference"`` workspace (put the arrays on the CPU device).

Eager calls go through the same custom calls (JAX compiles the one primitive and caches it), so
eager and jitted results are bitwise equal.  The handlers are registered as **not**
command-buffer compatible: they run Python at execution time and allocate per-call results, so
XLA must call them at every execution rather than replay a captured CUDA graph of them.

**Errors.**  A Python exception in a handler (a bad argument, a workspace of the wrong backend
for the platform, a closed or collected workspace) becomes the custom call's ``XLA_FFI_Error``:
the XLA program fails and JAX raises ``jax.errors.JaxRuntimeError`` (``ValueError`` where its C++
dispatch sees the failure synchronously), whose message starts with
the target and the mok_rt exception's type (``mok_rt_moe_forward: ArgumentError: ...``).  What
only the device sees (an expert id out of range, capacity exceeded) sets the workspace's error
word as in any asynchronous mok_rt call -- the reference backend records it the same way -- and
``ws.synchronize()`` (which waits for XLA's stream too) or ``ws.check()`` raises
``ExpertIdError``, ``CapacityError``, ...: call one after each step, as after any mok_rt call.
XLA runs programs asynchronously (on the CPU too): wait for the results
(``jax.block_until_ready``, ``float(loss)``) before the workspace closes.

The workspace travels as its int handle (``ws._handle``), a static ``nondiff_argnums`` argument of
the ``custom_vjp`` and an i64 attribute (``handle``) of each custom call: ``jax.jit`` bakes it into
the program, and the handlers look the workspace up (:func:`mok_rt.api.workspace.from_handle`)
when they run.  The registry holds workspaces weakly: keep the workspace alive (and open) for as
long as jitted functions that use it run.  Expert parallelism under XLA is untested; with one
process driving several ranks (``ws.rank(i)``) do not use it: XLA gives no guarantee that every
rank's call is issued before anything waits on one of them (see docs/API.md, ``WorkspaceRank``).

**The backward recomputes the forward.**  A mok :class:`~mok_rt.Context` is a host object holding
mok-owned buffers; it cannot be a residual of a jitted ``custom_vjp``.  So the residuals are the
inputs only (x, the ids, topk_weights, the weights) and the backward custom call re-runs
``schedule`` + ``recompute_context`` + ``backward``: activation checkpointing by construction.
Cost: one extra schedule and one extra forward pass (context only, without ``out``) per backward,
about a third more layer FLOPs per training step, in exchange for no layer activations held
between forward and backward.  (``samples/jax_custom_vjp.py`` without ``--jit`` shows an eager
wrapper that keeps the context instead.)

Gradients reach ``x``, ``topk_weights`` and every weight; the integer ids get none (``None``
in the ``custom_vjp`` backward, a ``float0`` zero to JAX's callers).  Dtypes, as in
:mod:`mok_rt.frameworks.torch_ops`: on CUDA the layer computes in bf16 with fp32 routing
weights; on the reference backend in ``x``'s dtype when it is float32 or float64, else float32,
unless the workspace is ``strict`` (it then takes the CUDA dtypes only, and gets them).
The casts happen in JAX around the custom calls.  ``out`` and ``dx`` have ``x``'s dtype;
``d_topk_weights`` and the weight gradients come out of the kernel in the routing / gradient
compute dtype (fp32, or float64 for float64 inputs on the reference backend; bf16 on CUDA or a
strict reference workspace when every weight is bf16) and are then cast to each input's dtype.
"""
from __future__ import annotations

import threading
from functools import partial

import numpy as np
import jax
import jax.numpy as jnp

import mok_rt as mok
from mok_rt.api.workspace import from_handle as _from_handle
from mok_rt.api.workspace import handle_of
from mok_rt.frameworks import ffi_layer, xla_ffi
from mok_rt.frameworks.common import bf16_gradients, dtype_backend, shared_parts

__all__ = ["moe_layer", "workspace_handle", "lookup_workspace", "kernel_dtypes", "register_targets",
           "FORWARD_TARGET", "BACKWARD_TARGET"]

FORWARD_TARGET = "mok_rt_moe_forward"
BACKWARD_TARGET = "mok_rt_moe_backward"


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
    as NumPy dtypes.  ``backend``: ``"cuda"`` for the CUDA dtypes (what a strict reference
    workspace takes too: see frameworks.common.dtype_backend)."""
    if backend == "cuda":
        return jnp.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(np.float32)
    x_dtype = np.dtype(x_dtype)
    dt = x_dtype if x_dtype in (np.float32, np.float64) else np.dtype(np.float32)
    return dt, dt, dt


def _check_shared(w):
    if (w[3] is None) != (w[4] is None) or (w[3] is None) != (w[5] is None):
        raise mok.ArgumentError("shared", "pass all three shared-expert weights or none")


def _present(w):
    return [a for a in w if a is not None]


# --------------------------------------------------------------------------- registration
_LOCK = threading.Lock()
_HANDLERS: dict = {}   # (target, platform) -> the ctypes handler; XLA keeps its address forever


def register_targets() -> tuple:
    """Register the forward and backward FFI targets for the CPU and CUDA platforms (once per
    process; later calls return at once).  Returns the XLA FFI API version the handlers report.
    Raises :class:`mok_rt.frameworks.xla_ffi.XlaFfiVersionError` for a jaxlib whose FFI API
    major version the ctypes mirror does not know."""
    with _LOCK:
        if _HANDLERS:
            return _HANDLERS["version"]
        version = xla_ffi.header_api_version(jax.ffi.include_dir())
        handlers = {"version": version}
        for platform in ffi_layer.PLATFORM_BACKENDS:
            for target, body in ((FORWARD_TARGET, ffi_layer.run_forward), (BACKWARD_TARGET, ffi_layer.run_backward)):
                h = xla_ffi.make_handler(partial(body, platform), name=target, api_version=version,
                                         command_buffer_compatible=False)
                # A jax without this platform's plugin keeps the registration for when it loads.
                jax.ffi.register_ffi_target(target, xla_ffi.capsule(h), platform=platform, api_version=1)
                handlers[target, platform] = h
        _HANDLERS.update(handlers)
        return version


# --------------------------------------------------------------------------- the custom calls
def _call_forward(handle, x, ids, tw, w):
    register_targets()
    act, route, _ = kernel_dtypes(dtype_backend(lookup_workspace(handle)), x.dtype)
    present = _present(w)
    out = jax.ffi.ffi_call(FORWARD_TARGET, jax.ShapeDtypeStruct(x.shape, act), vmap_method="sequential")(
        x.astype(act), ids, tw.astype(route), *(a.astype(act) for a in present), handle=np.int64(handle))
    return out.astype(x.dtype)


def _call_backward(handle, d_out, x, ids, tw, w):
    register_targets()
    backend = dtype_backend(lookup_workspace(handle))
    act, route, grad = kernel_dtypes(backend, x.dtype)
    present = _present(w)
    if bf16_gradients(backend, all(a.dtype == jnp.bfloat16 for a in present)):
        grad = jnp.dtype(jnp.bfloat16)
    shapes = (jax.ShapeDtypeStruct(x.shape, act), jax.ShapeDtypeStruct(tw.shape, route),
              *(jax.ShapeDtypeStruct(a.shape, grad) for a in present))
    return jax.ffi.ffi_call(BACKWARD_TARGET, shapes, vmap_method="sequential")(
        d_out.astype(act), x.astype(act), ids, tw.astype(route), *(a.astype(act) for a in present),
        handle=np.int64(handle))


# --------------------------------------------------------------------------- the custom_vjp
@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _moe(handle, x, ids, tw, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
    return _call_forward(handle, x, ids, tw, (w_gate, w_up, w_down, ws_gate, ws_up, ws_down))


def _moe_fwd(handle, x, ids, tw, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
    w = (w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    return _call_forward(handle, x, ids, tw, w), (x, ids, tw, w)   # residuals: the inputs only


def _moe_bwd(handle, res, d_out):
    x, ids, tw, w = res
    dx, dtw, *dws = _call_backward(handle, d_out, x, ids, tw, w)
    dws = iter(dws)
    dw = [None if a is None else next(dws).astype(a.dtype) for a in w]
    return (dx.astype(x.dtype), None, dtw.astype(tw.dtype), *dw)


_moe.defvjp(_moe_fwd, _moe_bwd)


# --------------------------------------------------------------------------- the user-facing call
def moe_layer(ws, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared=None):
    """The MoE layer as a differentiable JAX function.

    ``ws``: a ``Workspace``, a ``WorkspaceRank`` or its int handle (static: a jitted function
    closes over it).  ``shared``: the shared expert's ``(gate, up, down)`` (a tuple or a
    :class:`mok_rt.ExpertWeights`), or None.  Eager or under ``jax.jit``, on the GPU for a CUDA
    workspace and on the CPU for a reference one (see the module docstring)."""
    handle = workspace_handle(ws)
    sg, su, sd = shared_parts(shared)
    w = (w_gate, w_up, w_down, sg, su, sd)
    _check_shared(w)
    return _moe(handle, x, topk_ids, topk_weights, *w)
