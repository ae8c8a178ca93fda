"""The MoE layer's XLA FFI handler bodies: from a decoded call (:class:`~mok_rt.frameworks.xla_ffi.FfiCall`)
to mok_rt calls whose results land in XLA's result buffers.  No jax here (jax_ops registers these).

Two targets, each one call of the layer on one workspace rank named by the ``handle`` attribute
(an i64 ``ws._handle``):

* **forward**: args ``x, topk_ids, topk_weights, w_gate, w_up, w_down[, ws_gate, ws_up, ws_down]``,
  result ``out``; runs ``schedule`` + ``forward``.
* **backward**: args ``d_out`` then the forward's args, results ``dx, d_topk_weights, dw_gate,
  dw_up, dw_down[, dws_gate, dws_up, dws_down]``; runs ``schedule`` + ``recompute_context`` +
  ``backward`` (the residuals of the jax.custom_vjp are its inputs only).

The arguments already have the kernel dtypes (jax_ops casts around the call).

**CUDA platform** (``backend="cuda"`` workspaces): every mok_rt call is enqueued on XLA's stream
(``XLA_FFI_Stream_Get``) and nothing waits.  XLA's buffers are wrapped as mok tensors without a
producer stream: XLA has ordered their producers on that stream already.  The weight gradients
are written straight into XLA's result buffers (``backward(dw=...)``); ``out``, ``dx`` and
``d_topk_weights`` come in mok_rt's per-call block and are copied into XLA's buffers on the same
stream (``cuMemcpyDtoDAsync``).  Memory safety with respect to XLA's stream ordering:

* the per-call block is allocated from the device's stream-ordered pool *on XLA's stream*, and
  when its tensors are dropped at the end of the handler it goes to the rank's graveyard, freed on
  that stream by the rank's next call: after our copies, in stream order;
* the rank's scratch is shared by all of its calls; the backend orders a call on XLA's stream after
  the rank's previous call on any other stream (``runtime/memory.StreamOrder``), and later calls
  after this one, so XLA's stream is one more eager stream to it;
* the inputs are XLA's buffers, read only by kernels enqueued on XLA's stream before the handler
  returns, and no mok object keeps them past the handler (the context is dropped with the call).

Errors the device reports (an expert id out of range, capacity) set the rank's error word as in
any eager call: ``ws.synchronize()`` (which also waits for XLA's stream: the backend notes every
stream it ran on) or ``ws.check()`` raises them.  Errors the host sees (bad arguments, a workspace
of the wrong backend, a closed or collected workspace) raise here and become the XLA call's error.

**CPU platform** (``backend="reference"`` workspaces): the buffers are host memory, viewed as NumPy
arrays without a copy, and the reference backend computes synchronously.  It records what the
device would report (``ExpertIdError``, ``CapacityError``) the same way, to be raised by
``ws.check()`` / ``ws.synchronize()`` (the call's results are NaN then).

The handlers run Python at execution time and take their per-call results from mok_rt's pool, so
they are registered as **not** command-buffer compatible: XLA runs them on its stream at every
execution instead of capturing them into a CUDA graph it would replay without calling us.
"""
from __future__ import annotations

import numpy as np

import mok_rt as mok
from mok_rt.api.workspace import from_handle
from mok_rt.errors import ArgumentError
from mok_rt.frameworks.xla_ffi import FfiBuffer, FfiCall

__all__ = ["PLATFORM_BACKENDS", "run_forward", "run_backward"]

# XLA platform name (as jax.ffi.register_ffi_target takes it) -> the workspace backend it runs.
PLATFORM_BACKENDS = {"cpu": "reference", "CUDA": "cuda"}


class _Buffers:
    """Turns XLA buffers into what the workspace's backend reads, and copies results into XLA's."""

    def __init__(self, ws, platform: str, call: FfiCall):
        backend = PLATFORM_BACKENDS[platform]
        if ws.backend != backend:
            where = "the CPU (jax.default_device(jax.devices('cpu')[0]))" if ws.backend == "reference" \
                else "a GPU"
            raise ArgumentError("ws", f"this XLA call runs on the {platform} platform, which runs backend="
                                      f"{backend!r} workspaces, but the workspace is backend={ws.backend!r}: "
                                      f"place the layer's arrays on {where}")
        self.cuda = backend == "cuda"
        self.stream = None
        if self.cuda:
            self.device_id = ws.device_id
            ordinal = call.device_ordinal()
            if ordinal is not None and ordinal != self.device_id:
                raise ArgumentError("ws", f"the workspace rank drives device {self.device_id} but XLA runs this "
                                          f"call on its device {ordinal}")
            self.stream = call.stream()

    @property
    def kw(self) -> dict:
        return {"stream": self.stream} if self.cuda else {}

    def wrap(self, b: FfiBuffer):
        if not self.cuda:
            return b.host_array()
        from mok_rt.interop.tensor import Tensor
        # No producer stream: XLA ordered the buffer's producers on its stream, where we run.
        return Tensor._from_pointer(b.ptr, b.shape, b.dtype, self.device_id, None)

    def copy(self, dst: FfiBuffer, src) -> None:
        """``src`` (a mok result) into XLA's result buffer ``dst``."""
        if tuple(src.shape) != dst.shape:
            raise ArgumentError("result", f"mok_rt produced shape {tuple(src.shape)}, XLA expects {dst.shape}")
        if not self.cuda:
            np.copyto(dst.host_array(), np.asarray(src.to_numpy()), casting="same_kind")
            return
        if src.nbytes != dst.nbytes:
            raise ArgumentError("result", f"mok_rt produced {src.dtype}, XLA expects {dst.dtype}")
        if dst.nbytes:
            from mok_rt.runtime.driver import call, driver
            call("cuMemcpyDtoDAsync", driver.CUdeviceptr(dst.ptr), driver.CUdeviceptr(src.ptr), dst.nbytes,
                 driver.CUstream(self.stream))


def _workspace(call: FfiCall):
    if "handle" not in call.attrs:
        raise ArgumentError("handle", "the XLA call carries no 'handle' attribute (the workspace's int handle)")
    return from_handle(call.attrs["handle"])


def _weights(bufs: _Buffers, ws_args: list):
    if len(ws_args) not in (3, 6):
        raise ArgumentError("weights", f"expected 3 or 6 weight buffers, got {len(ws_args)}")
    w = [bufs.wrap(b) for b in ws_args]
    return mok.ExpertWeights(*w[:3]), (mok.ExpertWeights(*w[3:]) if len(w) == 6 else None)


def _inputs(bufs: _Buffers, args: list):
    if len(args) < 6:
        raise ArgumentError("args", f"expected x, topk_ids, topk_weights and 3 or 6 weights, got {len(args)} buffers")
    x, ids, tw = (bufs.wrap(b) for b in args[:3])
    experts, shared = _weights(bufs, args[3:])
    return x, ids, tw, experts, shared


def run_forward(platform: str, call: FfiCall) -> None:
    """The forward target: ``out`` of schedule + forward into ``call.rets[0]``."""
    ws = _workspace(call)
    bufs = _Buffers(ws, platform, call)
    if len(call.rets) != 1:
        raise ArgumentError("rets", f"the forward has one result (out), XLA asks for {len(call.rets)}")
    x, ids, tw, experts, shared = _inputs(bufs, call.args)
    sched = mok.schedule(ws, ids, **bufs.kw)
    out, _ = mok.forward(ws, sched, x, tw, experts, shared=shared, **bufs.kw)
    bufs.copy(call.rets[0], out)


def run_backward(platform: str, call: FfiCall) -> None:
    """The backward target: ``dx, d_topk_weights`` and the weight gradients into ``call.rets``."""
    ws = _workspace(call)
    bufs = _Buffers(ws, platform, call)
    if not call.args:
        raise ArgumentError("args", "the backward takes d_out first")
    d_out = bufs.wrap(call.args[0])
    x, ids, tw, experts, shared = _inputs(bufs, call.args[1:])
    n_w = 6 if shared is not None else 3
    if len(call.rets) != 2 + n_w:
        raise ArgumentError("rets", f"the backward has {2 + n_w} results (dx, d_topk_weights, {n_w} weight "
                                    f"gradients), XLA asks for {len(call.rets)}")
    # The weight gradients straight into XLA's result buffers (written, not accumulated).
    dw, dws = _weights(bufs, call.rets[2:])
    sched = mok.schedule(ws, ids, **bufs.kw)
    ctx = mok.recompute_context(ws, sched, x, tw, experts, shared=shared, **bufs.kw)
    g = mok.backward(ws, ctx, d_out, dw=dw, dw_shared=dws, **bufs.kw)
    bufs.copy(call.rets[0], g.dx)
    bufs.copy(call.rets[1], g.d_topk_weights)
