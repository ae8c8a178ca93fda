"""The NumPy reference behind the public API: runs anywhere, serves as the oracle.

Computes in float64 (mok_rt.reference) whatever the input precision; results come back in the
inputs' precision (out and dx like x, rounded once from float64; d_topk_weights like
topk_weights; weight gradients fp32, or bf16 / float64 like the caller's buffers, a bf16 one
rounded from the fp32 value as the kernels do).  What the device reports through its error word
(an expert id out of range, capacity) is recorded the same way here, with the device's code and
info, and raised by ``ws.synchronize()`` / ``ws.check()``, not by ``schedule``: code written
against the reference then handles errors where it must on the GPU.  The calls in between run
and produce NaN, as on the device, except that gradient buffers being accumulated into keep
their contents (the kernels do no work then).
"""
from __future__ import annotations

import numpy as np

from mok_rt import reference

from mok_rt.reference import schedule as schedule_ref
from mok_rt.interop.dlpack import TensorView
from mok_rt.errors import ExpertIdError
from mok_rt.interop.tensor import Tensor, _host_array
from mok_rt.runtime.errorword import ERR_CAPACITY, ERR_EXPERT_ID, device_error


# The weight gradients by the kernels' names (what api/validate.py hands in, what the API reads).
GRAD_NAMES = ("dw_gate", "dw_up", "dw_down", "d_shared_gate", "d_shared_up", "d_shared_down")


# Where a device error names its origin: the CUDA backend says "mok_rt (device N)".
_CONTEXT = "mok_rt (reference)"


class _RefSchedule:
    def __init__(self, ids: np.ndarray, layout):
        self.ids = ids
        self.layout = layout   # None: the schedule failed (the error waits for synchronize)
        self.tokens = ids.shape[0]


def host_array(view: TensorView) -> np.ndarray:
    """A NumPy array over a host view's memory (zero copy); the array keeps the view alive."""
    keep = view._keepalive
    if isinstance(keep, np.ndarray) and keep.shape == view.shape and keep.dtype == view.dtype.numpy:
        return keep
    return _host_array(view.ptr, view.shape, view.strides, view.dtype, view)


def _np(view):
    return None if view is None else host_array(view)


class ReferenceBackend:
    def __init__(self, ws):
        self.ws = ws
        self._error = None   # the first error since the last synchronize/check, like the device's

    def close(self) -> None:
        pass

    def synchronize(self) -> None:
        self.check()

    def check(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise err

    def _record(self, err) -> None:
        if self._error is None:
            self._error = err

    def take_traces(self) -> list:
        return []   # no kernels, no timelines

    def memory_bytes(self) -> dict:
        return {"scratch": 0, "graph_arena": 0, "results": 0, "peak": 0}

    def schedule(self, ids_view, *, stream):
        cfg, ws = self.ws.config, self.ws
        ids = np.array(host_array(ids_view), dtype=np.int64, copy=True)
        bad = np.argwhere((ids < 0) | (ids >= cfg.num_experts))
        if bad.size:
            t, j = (int(v) for v in bad[0])
            self._record(ExpertIdError(
                f"topk_ids[{t}, {j}] = {ids[t, j]} is outside [0, {cfg.num_experts}) "
                f"(rank {ws.rank_id}, token {t})", code=ERR_EXPERT_ID, info=(ws.rank_id, t, int(ids[t, j]))))
            return _RefSchedule(ids, None)
        try:
            layout = schedule_ref.schedule_reference([ids], num_experts=cfg.num_experts, num_ranks=ws.num_ranks,
                                                     block_m=cfg.block_m, rank=ws.rank_id,
                                                     capacity_rows=ws.capacity_rows)
        except schedule_ref.CapacityOverflow as ex:
            # The device's error word and wording (code, (rank, rows, capacity)), so that handlers
            # written against the reference read the same fields as on the GPU (SEMANTICS.md §8).
            self._record(device_error(ERR_CAPACITY, (ex.rank, ex.rows, ex.capacity), _CONTEXT))
            return _RefSchedule(ids, None)
        return _RefSchedule(ids, layout)

    def _nan(self, shape, dtype) -> Tensor:
        return Tensor.from_numpy(np.full(shape, np.nan, dtype=dtype))

    def _run_forward(self, sched, args):
        if self.ws.config.precision != "bf16":   # FP8 emulation (docs/SEMANTICS.md §10)
            from mok_rt.reference.fp8 import run_forward
            return run_forward(self.ws.config, sched.ids, args, _np)
        return reference.forward(_np(args.x), sched.ids, _np(args.topk_weights), _np(args.w_gate), _np(args.w_up),
                                 _np(args.w_down), ws_gate=_np(args.shared_gate), ws_up=_np(args.shared_up),
                                 ws_down=_np(args.shared_down), swiglu_limit=self.ws.config.swiglu_limit)

    def forward(self, sched, args, *, stream):
        if sched.layout is None:   # a failed schedule: NaN, the error waits for synchronize
            return self._nan((sched.tokens, self.ws.config.hidden), args.x.dtype.numpy), None
        out, _ = self._run_forward(sched, args)
        return Tensor.from_numpy(np.ascontiguousarray(out.astype(args.x.dtype.numpy))), None

    def recompute(self, sched, args, *, stream):
        return None   # the reference saves no activations: the backward recomputes from its inputs

    def backward(self, sched, saved, dout_view, args, *, out, grad_dtype, accumulate, stream):
        """Gradients by name; ``out``: validated caller buffers by name (None: a new array of
        ``grad_dtype``)."""
        grad_np = grad_dtype.numpy
        if sched.layout is None:
            return self._nan_gradients(sched, args, out, grad_np, accumulate)
        _, rctx = self._run_forward(sched, args)
        g = reference.backward(rctx, _np(dout_view))
        x_dtype, tw_dtype = args.x.dtype.numpy, args.topk_weights.dtype.numpy
        result = {"dx": Tensor.from_numpy(np.ascontiguousarray(g.dx.astype(x_dtype))),
                  "d_topk_weights": Tensor.from_numpy(np.ascontiguousarray(g.d_topk_weights.astype(tw_dtype)))}
        for name, ref_name in zip(GRAD_NAMES, ("dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")):
            val = getattr(g, ref_name)
            view = out.get(name)
            if val is None or view is None:
                result[name] = None if val is None else Tensor.from_numpy(np.ascontiguousarray(_grad_as(val, grad_np)))
                continue
            arr = host_array(view)
            if accumulate:   # as the kernel adds: in fp32 (float64 buffers: float64), then into the buffer
                wide = np.float64 if arr.dtype == np.float64 else np.float32
                arr[...] = (arr.astype(wide) + val.astype(wide)).astype(arr.dtype)
            else:
                arr[...] = _grad_as(val, arr.dtype)
            result[name] = view
        return result

    def _nan_gradients(self, sched, args, out, grad_np, accumulate: bool) -> dict:
        """What a backward on a failed schedule leaves (the error is pending): NaN in what this
        call owns (dx, d_topk_weights, new gradients) and in caller buffers it would overwrite.
        Buffers it would add into keep their contents: the kernels exit without doing any work,
        so on the device the sums accumulated over earlier micro-batches survive."""
        cfg, ws = self.ws.config, self.ws
        T, H, I, El = sched.tokens, cfg.hidden, cfg.intermediate, ws.experts_per_rank
        shapes = {"dw_gate": (El, I, H), "dw_up": (El, I, H), "dw_down": (El, H, I)}
        if cfg.has_shared:
            Is = cfg.shared_intermediate
            shapes.update(d_shared_gate=(Is, H), d_shared_up=(Is, H), d_shared_down=(H, Is))
        result = {"dx": self._nan((T, H), args.x.dtype.numpy),
                  "d_topk_weights": self._nan((T, cfg.top_k), args.topk_weights.dtype.numpy)}
        for name in GRAD_NAMES:
            if name not in shapes:
                result[name] = None
            elif out.get(name) is None:
                result[name] = self._nan(shapes[name], grad_np)
            else:
                if not accumulate:
                    host_array(out[name])[...] = np.nan
                result[name] = out[name]
        return result


def _grad_as(val: np.ndarray, dtype) -> np.ndarray:
    """A float64 weight gradient as ``dtype``; narrower than fp32 (bf16): through fp32, so that a
    bf16 gradient is bitwise the fp32 one rounded (SEMANTICS.md §4: the kernels round their fp32
    sums).  A direct float64 -> bf16 cast differs where fp32 rounding lands on a bf16 tie."""
    dtype = np.dtype(dtype)
    if dtype.itemsize < 4:
        return val.astype(np.float32).astype(dtype)
    return val.astype(dtype)
