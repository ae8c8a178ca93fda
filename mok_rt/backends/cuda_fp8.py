"""The CUDA backend's "fp8_block" calls (docs/FP8_DESIGN.md): ``mok.quantize_weights``, the FP8
forward (moe_forward_fp8, kernels/moe_fp8.py) and the FP8 backward (moe_backward_fp8,
kernels/moe_fp8_bwd.py), on one rank or a rank of an expert-parallel group.

A mixin of :class:`mok_rt.backends.cuda.CudaBackend`, which owns what these use: the result blocks,
the rank's scratch, the graph arena, the prepared-call cache, the error word and the streams.

The backward reads the transposed E4M3 weight copies (the dgrad GEMMs' K-major B operands).
``mok.quantize_weights`` makes them by default; when the forward ran on bf16 master weights (it
quantises the forward copies only) or on ``quantize_weights(..., for_backward=False)``, the
backward quantises them first, from the master weights the forward (or quantize_weights) read:
one more ``fp8_quantize_weights`` launch whose jobs write the transposed copies alone (``q = s =
0``), into a block of the call's (recycled like every result block, so a training loop's repeated
backward gets the same addresses and its prepared launch back).  The master weights must still
hold the values the forward's copies were made from -- the same as the bf16 backward, which reads
them again.
"""
from __future__ import annotations

from mok_rt.errors import ArgumentError
from mok_rt.interop import dtypes
from mok_rt.kernels import fp8_quantize as Q8
from mok_rt.kernels import moe_fp8 as M8
from mok_rt.kernels import moe_fp8_bwd as MB
from mok_rt.kernels import moe_params as P
from mok_rt.backends.cuda_calls import ForwardState, device_ptr

__all__ = ["Fp8Calls"]

_QPARTS = ("gate", "up", "down")
_FP8_FORWARD = {b.name: b for b in M8.F.FP8_FORWARD_BUFFERS}
_FP8_BACKWARD = {b.name: b for b in MB.FP8_BACKWARD_TABLE}
_SIZES_KEPT = 64   # token counts whose buffer sizes are kept


class Fp8Calls:
    """The "fp8_block" methods of CudaBackend (module doc)."""

    def _fp8_bytes(self, kind: str, dims) -> tuple[dict, dict]:
        """Byte sizes of moe_forward_fp8's ("forward") or moe_backward_fp8's ("backward") buffers
        at ``dims``, and those of the rank's scratch among them (roles "scratch", "counters"),
        cached per token count: the same scratch dict every call lets _scratch_ptrs answer from
        its last result."""
        key = (kind, dims.tokens)
        hit = self._fp8_sizes.get(key)
        if hit is None:
            if len(self._fp8_sizes) > _SIZES_KEPT:
                self._fp8_sizes.clear()
            fn, table = ((M8.forward_buffer_bytes, _FP8_FORWARD) if kind == "forward"
                         else (MB.backward_buffer_bytes, _FP8_BACKWARD))
            sizes = fn(dims)
            # With EP the backward's dx_slot is the symmetric block's slot rows, not scratch.
            scratch = {n: nb for n, nb in sizes.items() if table[n].role in ("scratch", "counters")
                       and not (self.ep is not None and n == "dx_slot")}
            hit = self._fp8_sizes[key] = (sizes, scratch)
        return hit

    # -- quantize_weights -------------------------------------------------------------------------
    def quantize(self, groups, *, stream, for_backward: bool = True) -> dict:
        """``mok.quantize_weights``: ``groups`` [(name, (gate, up, down) bf16 views)] ->
        {name: DeviceQuantized}, the forward copies and scales (and with ``for_backward`` the
        transposed input-gradient copies) in one block, one launch."""
        capturing, _ = self._begin(stream)
        parts = {}
        for name, views in groups:
            for part, v in zip(_QPARTS, views):
                parts[f"{name}.{part}"] = (v.shape, dtypes.float8_e4m3fn)
                parts[f"{name}.{part}_scale"] = (Q8.scale_shape(v.shape), dtypes.float32)
                if for_backward:
                    vt = Q8.transposed_shape(v.shape)
                    parts[f"{name}.{part}_t"] = (vt, dtypes.float8_e4m3fn)
                    parts[f"{name}.{part}_t_scale"] = (Q8.scale_shape(vt), dtypes.float32)
        # Poisoned under Workspace(poison_outputs=True) like every result: the kernel writes every
        # byte and scale, all-zero blocks included, and a test that reads them must see that it did.
        block = self._block(parts, stream, capturing, poison=True)

        def dst(name, part):
            t = (block[f"{name}.{part}"].ptr, block[f"{name}.{part}_scale"].ptr)
            return t + ((block[f"{name}.{part}_t"].ptr, block[f"{name}.{part}_t_scale"].ptr) if for_backward else ())

        pairs = [(v.ptr, Q8.as_shape3(v.shape), *dst(name, part))
                 for name, views in groups for part, v in zip(_QPARTS, views)]
        Q8.launch_quantize(pairs, stream=stream, device_id=self.device_id)
        names = [*_QPARTS, *(f"{p}_scale" for p in _QPARTS)]
        if for_backward:
            names += [*(f"{p}_t" for p in _QPARTS), *(f"{p}_t_scale" for p in _QPARTS)]
        out = {}
        for name, views in groups:
            t = {k: block[f"{name}.{k}"] for k in names}
            t["gate"]._owner = (t["gate"]._owner, tuple(views))   # the sources outlive the launch
            # The sources, for a backward that has to make the transposed copies (for_backward=False).
            out[name] = Q8.DeviceQuantized(**t, device_id=self.device_id, sources=tuple(views))
        return out

    # -- forward / recompute_context ----------------------------------------------------------------
    def _run_forward_fp8(self, sched, args, stream, *, context_only: bool):
        """The "fp8_block" forward (moe_forward_fp8): on QuantizedWeights, or on bf16 master weights
        quantised for this call first (one more launch; mok.quantize_weights once per step saves it).
        Not through the prepared-call cache: every call fills its parameters anew."""
        capturing, _ = self._begin(stream)
        T = sched.tokens
        dims = self._shapes_for(T).dims
        sizes, scratch_sizes = self._fp8_bytes("forward", dims)
        if args.quantized is not None:
            routed, shared = args.quantized.experts, args.quantized.shared
        else:
            groups = [("experts", (args.w_gate, args.w_up, args.w_down))]
            if args.shared_gate is not None:
                groups.append(("shared", (args.shared_gate, args.shared_up, args.shared_down)))
            # Forward copies only: a forward on master weights does not pay for the backward's copies
            # (the FP8 backward quantises them from ctx.inputs' weights when they are missing).
            q = self.quantize(groups, stream=stream, for_backward=False)
            routed, shared = q["experts"], q.get("shared")
        parts = {n: ((nb,), dtypes.uint8) for n, nb in sizes.items() if _FP8_FORWARD[n].role == "context"}
        if not context_only:
            parts["out"] = ((T, dims.hidden), dtypes.bfloat16)
        block = self._block(parts, stream, capturing, poison=True)
        out = block.pop("out", None)
        scratch, _ = self._scratch_ptrs("forward_fp8", scratch_sizes, stream, capturing)
        wq = {}
        for prefix, g in (("", routed), ("shared_", shared)):
            for part in _QPARTS:
                wq[prefix + part] = 0 if g is None else getattr(g, part).ptr
                wq[f"{prefix}{part}_s"] = 0 if g is None else getattr(g, f"{part}_scale").ptr
        fb = M8.Fp8ForwardBuffers(x=args.x.ptr, topk_weights=device_ptr(args.topk_weights), out=device_ptr(out),
                                  **wq, **{n: (v.ptr if sizes[n] else 0) for n, v in block.items()}, **scratch)
        with self._launch_epoch():   # the EP epoch goes back if nothing is enqueued
            # Only now the EP epoch advances.
            peers = None if self.ep is None else M8.fp8_peers(self.ep.peers(T), dims)
            plan = M8.forward_plan(dims, context_only=context_only,
                                   push_tasks=0 if peers is None else peers.push_tasks)
            trace = self._trace_buffer("recompute" if context_only else "forward", plan, stream, capturing)
            M8.launch_forward_fp8(fb, sched._launch_bufs, dims, stream=stream, err_ptr=self.error.device_ptr,
                                  device_id=self.device_id, knobs=self.knobs, context_only=context_only,
                                  trace_ptr=trace, plan=plan, peers=peers)
        return out, ForwardState(dims=dims, bufs=block, keep=(args, sched, routed, shared),
                                 weights=(routed, shared))

    # -- backward -----------------------------------------------------------------------------------
    def _transposed_weights(self, state: ForwardState, args, stream, capturing: bool) -> tuple[dict, object]:
        """The ``wt`` pointers of moe_backward_fp8 (MoEFp8WeightsT): the QuantizedWeights' transposed
        copies, or (missing there) quantised now on ``stream`` from the master weights (module doc);
        and the block holding copies made here (None if none), to keep until the launch is enqueued."""
        routed, shared = state.weights
        masters = {"": (args.w_gate, args.w_up, args.w_down),
                   "shared_": (args.shared_gate, args.shared_up, args.shared_down)}
        wt, todo, block = {}, [], None
        for prefix, g in (("", routed), ("shared_", shared)):
            for part in _QPARTS:
                wt[f"{prefix}{part}_t"] = wt[f"{prefix}{part}_t_s"] = 0
            if g is None:
                continue
            if g.for_backward:
                for part in _QPARTS:
                    wt[f"{prefix}{part}_t"] = getattr(g, f"{part}_t").ptr
                    wt[f"{prefix}{part}_t_s"] = getattr(g, f"{part}_t_scale").ptr
                continue
            src = masters[prefix] if args.quantized is None else g.sources
            if src is None or any(v is None for v in src):
                raise ArgumentError("experts", "the FP8 backward needs the transposed weight copies: quantise with "
                                               "mok.quantize_weights(..., for_backward=True) (the default)")
            todo += [(f"{prefix}{part}", v) for part, v in zip(_QPARTS, src)]
        if todo:
            parts = {}
            for name, v in todo:
                vt = Q8.transposed_shape(tuple(v.shape))
                parts[f"{name}_t"] = (vt, dtypes.float8_e4m3fn)
                parts[f"{name}_t_s"] = (Q8.scale_shape(vt), dtypes.float32)
            block = self._block(parts, stream, capturing, poison=True, tag="fp8_weights_t")
            Q8.launch_quantize([(v.ptr, Q8.as_shape3(tuple(v.shape)), 0, 0, block[f"{name}_t"].ptr,
                                 block[f"{name}_t_s"].ptr) for name, v in todo],
                               stream=stream, device_id=self.device_id)
            wt.update({n: t.ptr for n, t in block.items()})
        return wt, block

    def _run_backward_fp8(self, sched, state: ForwardState, dout, args, *, out, grad_dtype, accumulate: bool,
                          stream):
        """The "fp8_block" backward (moe_backward_fp8) of a context of the FP8 forward or of
        recompute_context; the same results as the bf16 backward (CudaBackend.backward)."""
        if not state.weights:
            raise ArgumentError("ctx", "is not the context of an 'fp8_block' forward or recompute_context")
        capturing, handle = self._begin(stream)
        dims = state.dims
        T = dims.tokens
        sh = self._shapes_for(T)
        scratch_sizes = self._fp8_bytes("backward", dims)[1]
        grads, base = self._gradient_results(sh, out, grad_dtype, stream, handle, capturing)
        dx, dtw = grads["dx"], grads["d_topk_weights"]
        scratch, scratch_key = self._scratch_ptrs("backward_fp8", scratch_sizes, stream, capturing)
        wt, copies = self._transposed_weights(state, args, stream, capturing)
        fwd = self._fp8_bytes("forward", dims)[0]
        ctx = {n: (t.ptr if fwd[n] else 0) for n, t in state.bufs.items()}
        grad_ptrs = tuple(device_ptr(grads[n]) for n in P.GRAD_NAMES)
        grad_bf16 = grad_dtype == dtypes.bfloat16
        cacheable = self._cacheable(capturing)
        key = ("backward_fp8", bool(accumulate), grad_bf16, T, handle, base, sched._launch_key,
               tuple(ctx.values()), dout.ptr, args.topk_weights.ptr, tuple(wt.values()), grad_ptrs,
               scratch_key)
        prep = self._calls.get(key) if cacheable else None
        with self._launch_epoch():   # the EP epoch goes back if nothing is enqueued
            if prep is None:
                # With EP dx returns into the slot rows of the symmetric block (as in the bf16 EP backward).
                heap = {} if self.ep is None else {"dx_slot": self.ep.slot_ptr()}
                bb = MB.Fp8BackwardBuffers(d_out=dout.ptr, topk_weights=args.topk_weights.ptr, dx=dx.ptr,
                                           d_topk_weights=dtw.ptr, **ctx, **wt, **dict(zip(P.GRAD_NAMES, grad_ptrs)),
                                           **scratch, **heap)
                # Only now the EP epoch advances.
                peers = None if self.ep is None else M8.fp8_peers(self.ep.peers(T), dims)
                plan = MB.backward_plan(dims, push_tasks=0 if peers is None else peers.push_tasks)
                trace = self._trace_buffer("backward", plan, stream, capturing)
                prep = MB.prepare_backward_fp8(bb, sched._launch_bufs, dims, stream=stream,
                                               err_ptr=self.error.device_ptr, device_id=self.device_id,
                                               knobs=self.knobs, accumulate=accumulate, grad_bf16=grad_bf16,
                                               trace_ptr=trace, plan=plan, peers=peers)
                if cacheable:
                    self._calls.put(key, prep)
            prep()
        # Copies made for this call are released now: like every result block, reused only by a
        # later call on this stream (after this launch in stream order) or freed on it.
        del copies
        dx._owner = (dx._owner, args, dout)   # keep the inputs alive with the result
        return grads

