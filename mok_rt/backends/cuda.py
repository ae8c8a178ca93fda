"""The CUDA backend: the schedule kernels and the fused forward/backward megakernels of one rank.

Memory, per call and per rank:
  * results (the schedule's arrays; the forward's context and ``out``; ``dx``, ``d_topk_weights``
    and new weight gradients) come in one block per call: from the device's stream-ordered pool
    when eager, freed with the last result that uses it; from the workspace's graph arena while
    the stream captures a CUDA graph (runtime/memory.py: kept until the workspace closes, each
    replay rewrites them);
  * scratch (counters, fp32 partial sums, the backward's routed rows) is the rank's own, reused
    by every eager call and grown to the largest token count seen; eager calls on different
    streams are ordered (runtime/memory.StreamOrder), so sharing it is safe.  A captured call's
    scratch is its own, from the graph arena (its replays run on streams the rank never sees).
Plans and sizes are cached per token count.  Nothing here waits for the GPU or reads a
routing-dependent count.  With expert parallelism (``ep``: a :class:`mok_rt.dist.ep.EPRank`) the
rows that travel between ranks live in the workspace's symmetric heap (see ep.py).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from mok_rt.errors import ArgumentError
from mok_rt.interop import dtypes
from mok_rt.interop.tensor import Tensor
from mok_rt.kernels import fp8_quantize as Q8
from mok_rt.kernels import moe_fp8 as M8
from mok_rt.kernels import moe_launch as L
from mok_rt.kernels import moe_params as P
from mok_rt.kernels import trace as _trace
from mok_rt.kernels.schedule import build_schedule, build_schedule_ep
from mok_rt.runtime.device import activate
from mok_rt.runtime.driver import call, driver
from mok_rt.runtime.errorword import ErrorWord, device_error
from mok_rt.runtime.launch import multiprocessor_count
from mok_rt.runtime.memory import GraphArena, StreamOrder, is_capturing

_MAX_PENDING_TRACES = 64   # traced launches kept until take_traces() (the oldest are dropped)
_ALIGN = 256               # byte alignment of every buffer carved from a call's block
_DTYPES = {"bf16": dtypes.bfloat16, "f32": dtypes.float32, "i32": dtypes.int32}
_FORWARD = {b.name: b for b in P.FORWARD_BUFFERS}
_BACKWARD = {b.name: b for b in P.BACKWARD_BUFFERS}
_QPARTS = ("gate", "up", "down")
_FP8_FORWARD = {b.name: b for b in M8.F.FP8_FORWARD_BUFFERS}


@dataclass
class _ForwardState:
    """The forward's context buffers (views of the call's block), and the inputs that must
    outlive the launch."""

    dims: L.LayerDims
    bufs: dict
    keep: tuple = field(default=(), repr=False)


class _Block:
    """Owns a call's block of pool memory; when the last result using it goes, the block is not
    freed at once but handed to the rank's graveyard, emptied by its next eager call.  A free is a
    stream operation, and one issued while some stream captures a graph (a result of the previous
    step dropped during the capture of this one) would invalidate that capture."""

    __slots__ = ("tensor", "graveyard")

    def __init__(self, tensor, graveyard: list):
        self.tensor, self.graveyard = tensor, graveyard

    def __del__(self):
        self.graveyard.append(self.tensor)


@dataclass(frozen=True)
class _Shapes:
    """What one token count fixes: the launch dims and the byte sizes of every buffer (``forward``:
    the workspace precision's forward, bf16 or FP8)."""

    dims: L.LayerDims
    forward: dict
    backward: dict


class CudaBackend:
    def __init__(self, ws, ep=None):
        self.ws = ws
        self.ep = ep
        cfg = ws.config
        self.device_id = ws.device_id
        activate(self.device_id)
        max_ctas = None
        if ep is None:
            self.error = ErrorWord(self.device_id)
        else:
            self.error = ep.error   # the heap's, one per local rank
            from mok_rt.kernels.schedule import prepare
            prepare(self.device_id, cfg.num_experts)
            L.prepare(self.device_id)
            share = ep.shared.ranks_sharing_gpu(ep.rank)
            if share > 1:
                # Ranks sharing a GPU split its SMs, so that all their persistent grids are resident
                # at once (a rank waiting for a peer that cannot start would only time out).
                max_ctas = max(1, multiprocessor_count(self.device_id) * cfg.ctas_per_sm // share)
        self.knobs = L.KernelKnobs(ctas_per_sm=cfg.ctas_per_sm, max_ctas=max_ctas,
                                   timeout_ns=int(cfg.timeout_s * 1e9))
        self._streams: dict[int, object] = {}   # streams with mok_rt work since the last synchronize
        # Workspace(trace=True): (kind, phases, records) of the latest launches not yet taken.
        self._traces: collections.deque[tuple[str, tuple, Tensor]] = collections.deque(maxlen=_MAX_PENDING_TRACES)
        self._arena = GraphArena(self.device_id)
        self._order = StreamOrder()
        self._scratch: dict[str, tuple] = {}    # "kind.name" -> (pointer, bytes, owning Tensor or None)
        self._shapes: dict[int, _Shapes] = {}
        self._captured = False                  # a graph was captured: synchronize waits for the device
        self._graveyard: list = []              # pool blocks released since the last eager call (_Block)
        self._fp8 = cfg.precision == "fp8_block"  # the forward runs moe_forward_fp8 (one rank; no backward yet)

    # -- lifetime / errors ---------------------------------------------------------------------
    def close(self) -> None:
        try:
            activate(self.device_id)
            self._sync_streams()
            if self._captured:
                call("cuCtxSynchronize")
        finally:
            self._order.close()
            self._arena.close()
            self._scratch.clear()
            self._graveyard.clear()
            if self.ep is None:   # an EP rank's error word belongs to the heap
                self.error.close()

    def _sync_streams(self) -> None:
        self.ws.stream.sync()
        streams, self._streams = self._streams, {}
        for s in streams.values():
            s.sync()

    def synchronize(self) -> None:
        self._sync_streams()
        self._graveyard.clear()
        if self._captured:   # replays run on streams mok_rt never sees
            activate(self.device_id)
            call("cuCtxSynchronize")
        self.check()

    def check(self) -> None:
        code, a, b, c = self.error.read()
        if not code:
            return
        try:
            where = f"device {self.device_id}" if self.ep is None else f"rank {self.ep.rank}, device {self.device_id}"
            err = device_error(code, (a, b, c), f"mok_rt ({where})")
            if self.ep is not None:
                note = self.ep.shared.health.record(code, str(err))
                err = device_error(code, (a, b, c), f"mok_rt ({where})", note=note)
        finally:
            self.error.clear()
        raise err

    def _check_usable(self) -> None:
        """With expert parallelism: refuse new calls once the state shared with the peers is undefined."""
        if self.ep is not None:
            self.ep.shared.health.check(self.ep.rank)

    def _begin(self, stream) -> bool:
        """Every call starts here: refuse calls once an EP group's shared state is undefined,
        order the call after the previous one's stream, note the stream for synchronize.
        Returns whether the stream is capturing a graph."""
        self._check_usable()
        activate(self.device_id)   # events, arena blocks and launches belong to this rank's device
        handle = int(stream.handle)
        capturing = is_capturing(handle)
        if capturing:
            if self.ep is not None:
                raise ArgumentError("stream", "expert-parallel calls cannot be captured in a CUDA graph (each "
                                              "launch meets its peers under a new epoch); capture one-rank "
                                              "workspaces only")
            self._captured = True
            return True
        self._streams[handle] = stream
        self._order.enter(handle)
        self._graveyard.clear()   # each block frees on the stream it was allocated on
        return False

    # -- memory ------------------------------------------------------------------------------------
    def _block(self, parts: dict, stream, capturing: bool, *, poison: bool) -> dict:
        """One allocation for a call's results, carved into tensors: ``parts`` maps a name to
        (shape, DType); every part starts on a 256-byte boundary."""
        offsets, total = {}, 0
        for name, (shape, dt) in parts.items():
            offsets[name] = total
            n = dt.itemsize
            for d in shape:
                n *= d
            total += -(-n // _ALIGN) * _ALIGN
        if capturing:
            base, owner = self._arena.allocate(total), self._arena
        elif total:
            t = Tensor.empty((total,), dtypes.uint8, device_id=self.device_id, stream=stream)
            base, owner = t.ptr, _Block(t, self._graveyard)
        else:
            base, owner = 0, None
        if poison and self.ws.poison_outputs and total:
            # NaN for bf16/f32, -1 for ints: an element the kernels fail to write cannot pass.
            call("cuMemsetD8Async", driver.CUdeviceptr(base), 0xFF, total, driver.CUstream(int(stream.handle)))
        # A captured call's results are written by replays on whatever stream replays the graph:
        # they name no producer stream, and the caller orders its reads after the replay.
        producer = None if capturing else stream
        return {name: Tensor._from_pointer(base + offsets[name] if total else 0, shape, dt, self.device_id, owner,
                                           stream=producer)
                for name, (shape, dt) in parts.items()}

    def _scratch_ptrs(self, kind: str, sizes: dict, stream, capturing: bool) -> dict:
        """This rank's scratch buffers of ``kind`` ("schedule", "forward", "backward") by name:
        reused while large enough, replaced by a larger one when a call needs more (the old one is
        freed in stream order after the calls that used it).  0 for a buffer of 0 bytes."""
        if capturing:
            # A captured call's scratch is its own, in the arena: a replay may run beside eager
            # calls or other graphs on streams this rank never sees, so nothing may share it.
            return {name: self._arena.allocate(nbytes) for name, nbytes in sizes.items()}
        out = {}
        for name, nbytes in sizes.items():
            key = f"{kind}.{name}"
            have = self._scratch.get(key)
            if nbytes and (have is None or have[1] < nbytes):
                if have is not None:
                    # Freed on this call's stream, which StreamOrder placed after every earlier
                    # call of the rank (the last users of the old buffer), whatever their streams.
                    have[2]._owner.close(stream)
                t = Tensor.empty((nbytes,), dtypes.uint8, device_id=self.device_id, stream=stream)
                have = self._scratch[key] = (t.ptr, nbytes, t)
            out[name] = have[0] if nbytes else 0
        return out

    def memory_bytes(self) -> dict:
        """Device memory this rank holds between calls: its scratch and its graph arena."""
        return {"scratch": sum(v[1] for v in self._scratch.values()), "graph_arena": self._arena.nbytes}

    def _shapes_for(self, tokens: int) -> _Shapes:
        sh = self._shapes.get(tokens)
        if sh is None:
            dims = self._dims(tokens)
            fwd = M8.forward_buffer_bytes(dims) if self._fp8 else L.forward_buffer_bytes(dims)
            sh = _Shapes(dims=dims, forward=fwd, backward=L.backward_buffer_bytes(dims))
            if len(self._shapes) > 64:
                self._shapes.clear()
            self._shapes[tokens] = sh
        return sh

    # -- traces (Workspace(trace=True)) --------------------------------------------------------------
    def _trace_buffer(self, kind: str, plan, stream, capturing: bool) -> int:
        """Zeroed records for one launch, one per task of its plan (0: tracing is off)."""
        if not self.ws.trace:
            return 0
        if capturing:
            raise ArgumentError("stream", "Workspace(trace=True) records launches eagerly; capture without it")
        buf = self._block({"t": ((max(plan.total, 1) * _trace.RECORD_BYTES,), dtypes.uint8)}, stream, False,
                          poison=False)["t"]
        buf.fill_bytes(0, stream=stream)
        self._traces.append((kind, plan.phase_table(), buf))
        return buf.ptr

    def take_traces(self) -> list:
        """The decoded timelines of the launches since the last call (waits for the streams).
        Every traced launch keeps its records on the device until then, the latest
        _MAX_PENDING_TRACES of them (a traced loop that never takes them stays bounded)."""
        self._sync_streams()
        rank = 0 if self.ep is None else self.ep.rank
        out = [_trace.LaunchTrace.decode(buf.to_numpy().view(np.uint64)[:4 * sum(c for _, c in phases)],
                                         kind=kind, phases=phases, rank=rank,
                                         device_id=self.device_id)
               for kind, phases, buf in self._traces]
        self._traces.clear()   # only once every launch decoded: an error keeps them for another try
        return out

    def _dims(self, tokens: int) -> L.LayerDims:
        cfg, ws = self.ws.config, self.ws
        return L.LayerDims(tokens=tokens, hidden=cfg.hidden, intermediate=cfg.intermediate, top_k=cfg.top_k,
                           local_experts=ws.experts_per_rank, capacity_rows=ws.capacity_rows,
                           shared_intermediate=cfg.shared_intermediate, swiglu_limit=cfg.swiglu_limit,
                           rank=ws.rank_id)

    @staticmethod
    def _sched_bufs(s) -> L.ScheduleBuffers:
        return L.ScheduleBuffers(expert_count=s.expert_count.ptr, expert_offset=s.expert_offset.ptr,
                                 num_blocks=s.totals.ptr, block_expert=s.block_expert.ptr,
                                 row_src_rank=s.row_src_rank.ptr, row_slot=s.row_slot.ptr,
                                 route_row=s.route_row.ptr, route_rank=s.route_rank.ptr)

    # -- the API -----------------------------------------------------------------------------------
    def schedule(self, ids, *, stream):
        capturing = self._begin(stream)
        cfg, ws = self.ws.config, self.ws
        T = ids.shape[0]

        def outputs(parts):
            return self._block({n: (shape, dtypes.int32) for n, shape in parts.items()}, stream, capturing,
                               poison=False)

        def scratch(words):
            return self._scratch_ptrs("schedule", {n: 4 * w for n, w in words.items()}, stream, capturing)

        common = dict(ids_int64=ids.dtype == dtypes.int64, num_experts=cfg.num_experts, top_k=cfg.top_k,
                      rank=ws.rank_id, block_m=cfg.block_m, max_rows=ws.capacity_rows, device_id=self.device_id,
                      stream=stream, err_ptr=self.error.device_ptr, poison=ws.poison_outputs,
                      outputs=outputs, scratch=scratch)
        if self.ep is None:
            s = build_schedule([ids.ptr], [T], max_total_routes=max(T, 1) * cfg.top_k, **common)
        else:
            s = build_schedule_ep(ids.ptr, T, exchange=self.ep.exchange(), max_tokens=ws.max_tokens, **common)
        s._keep = ids
        return s

    def quantize(self, groups, *, stream) -> dict:
        """``mok.quantize_weights``: ``groups`` [(name, (gate, up, down) bf16 views)] ->
        {name: DeviceQuantized}, the forward copies and scales in one block (one launch)."""
        capturing = self._begin(stream)
        parts = {}
        for name, views in groups:
            for part, v in zip(_QPARTS, views):
                parts[f"{name}.{part}"] = (v.shape, dtypes.float8_e4m3fn)
                parts[f"{name}.{part}_scale"] = (Q8.scale_shape(v.shape), dtypes.float32)
        block = self._block(parts, stream, capturing, poison=False)
        pairs = [(v.ptr, Q8.as_shape3(v.shape), block[f"{name}.{part}"].ptr, block[f"{name}.{part}_scale"].ptr)
                 for name, views in groups for part, v in zip(_QPARTS, views)]
        Q8.launch_quantize(pairs, stream=stream, device_id=self.device_id)
        out = {}
        for name, views in groups:
            t = {k: block[f"{name}.{k}"] for k in (*_QPARTS, *(f"{p}_scale" for p in _QPARTS))}
            t["gate"]._owner = (t["gate"]._owner, tuple(views))   # the sources outlive the launch
            out[name] = Q8.DeviceQuantized(**t, device_id=self.device_id)
        return out

    def _run_forward(self, sched, args, stream, *, context_only: bool):
        if self._fp8:
            return self._run_forward_fp8(sched, args, stream, context_only=context_only)
        capturing = self._begin(stream)
        T = sched.tokens
        shapes = self._shapes_for(T)
        dims, sizes = shapes.dims, shapes.forward
        # The context is owned by the returned state, `out` is returned: one block; the scratch is the rank's.
        parts = {n: ((nb,), dtypes.uint8) for n, nb in sizes.items() if _FORWARD[n].role == "context"}
        if not context_only:
            parts["out"] = ((T, dims.hidden), dtypes.bfloat16)
        block = self._block(parts, stream, capturing, poison=True)
        out = block.pop("out", None)
        scratch = self._scratch_ptrs("forward", {n: nb for n, nb in sizes.items()
                                                 if _FORWARD[n].role in ("scratch", "counters")}, stream, capturing)
        ptr = lambda v: 0 if v is None else v.ptr  # noqa: E731
        fb = L.ForwardBuffers(
            x=args.x.ptr, topk_weights=ptr(args.topk_weights), w_gate=args.w_gate.ptr, w_up=args.w_up.ptr,
            w_down=args.w_down.ptr, shared_gate=ptr(args.shared_gate), shared_up=ptr(args.shared_up),
            shared_down=ptr(args.shared_down), out=ptr(out),
            **{n: (v.ptr if sizes[n] else 0) for n, v in block.items()}, **scratch)
        # Only now the EP epoch advances: an allocation that failed above leaves the ranks in step.
        peers = None if self.ep is None else self.ep.peers(T)
        plan = L.forward_plan(dims, context_only=context_only, push_tasks=0 if peers is None else peers.push_tasks)
        trace = self._trace_buffer("recompute" if context_only else "forward", plan, stream, capturing)
        L.launch_forward(fb, self._sched_bufs(sched), dims, stream=stream, err_ptr=self.error.device_ptr,
                         device_id=self.device_id, knobs=self.knobs, context_only=context_only, peers=peers,
                         trace_ptr=trace, plan=plan)
        return out, _ForwardState(dims=dims, bufs=block, keep=(args, sched))

    def _run_forward_fp8(self, sched, args, stream, *, context_only: bool):
        """The "fp8_block" forward (moe_forward_fp8): on QuantizedWeights, or on bf16 master weights
        quantised for this call first (one more launch; mok.quantize_weights once per step saves it)."""
        capturing = self._begin(stream)
        T = sched.tokens
        shapes = self._shapes_for(T)
        dims, sizes = shapes.dims, shapes.forward
        if args.quantized is not None:
            routed, shared = args.quantized.experts, args.quantized.shared
        else:
            groups = [("experts", (args.w_gate, args.w_up, args.w_down))]
            if args.shared_gate is not None:
                groups.append(("shared", (args.shared_gate, args.shared_up, args.shared_down)))
            q = self.quantize(groups, stream=stream)
            routed, shared = q["experts"], q.get("shared")
        parts = {n: ((nb,), dtypes.uint8) for n, nb in sizes.items() if _FP8_FORWARD[n].role == "context"}
        if not context_only:
            parts["out"] = ((T, dims.hidden), dtypes.bfloat16)
        block = self._block(parts, stream, capturing, poison=True)
        out = block.pop("out", None)
        scratch = self._scratch_ptrs("forward_fp8", {n: nb for n, nb in sizes.items()
                                                     if _FP8_FORWARD[n].role in ("scratch", "counters")},
                                     stream, capturing)
        wq = {}
        for prefix, g in (("", routed), ("shared_", shared)):
            for part in _QPARTS:
                wq[prefix + part] = 0 if g is None else getattr(g, part).ptr
                wq[f"{prefix}{part}_s"] = 0 if g is None else getattr(g, f"{part}_scale").ptr
        ptr = lambda v: 0 if v is None else v.ptr  # noqa: E731
        fb = M8.Fp8ForwardBuffers(x=args.x.ptr, topk_weights=ptr(args.topk_weights), out=ptr(out), **wq,
                                  **{n: (v.ptr if sizes[n] else 0) for n, v in block.items()}, **scratch)
        plan = M8.forward_plan(dims, context_only=context_only)
        trace = self._trace_buffer("recompute" if context_only else "forward", plan, stream, capturing)
        M8.launch_forward_fp8(fb, self._sched_bufs(sched), dims, stream=stream, err_ptr=self.error.device_ptr,
                              device_id=self.device_id, knobs=self.knobs, context_only=context_only,
                              trace_ptr=trace, plan=plan)
        return out, _ForwardState(dims=dims, bufs=block, keep=(args, sched, routed, shared))

    def forward(self, sched, args, *, stream):
        return self._run_forward(sched, args, stream, context_only=False)

    def recompute(self, sched, args, *, stream):
        return self._run_forward(sched, args, stream, context_only=True)[1]

    def backward(self, sched, state: _ForwardState, dout, args, *, out, accumulate, stream):
        """Gradients by kernel name (dx, d_topk_weights, dw_gate ... d_shared_down); ``out``:
        the caller's validated buffers by the same names (None: allocate)."""
        if self._fp8:
            # Refused before anything is launched: running the bf16 backward on an FP8 context would
            # silently compute other gradients (docs/FP8_DESIGN.md "What is not built yet").
            raise ArgumentError("precision", "the CUDA backward of 'fp8_block' is not built yet (missing: the FP8 "
                                             "dA / dX GEMMs, the dSwiGLU quantisation, the transposed weight "
                                             "copies and the wgrad operands); the CUDA backend runs the FP8 "
                                             "forward and recompute_context only. Use backend='reference' for "
                                             "FP8 gradients")
        capturing = self._begin(stream)
        dims = state.dims
        T, H, k = dims.tokens, dims.hidden, dims.top_k
        sizes = self._shapes_for(T).backward
        # dx, d_topk_weights and the weight gradients the caller did not pass: one block.
        parts = {"dx": ((T, H), dtypes.bfloat16), "d_topk_weights": ((T, k), dtypes.float32)}
        # One dtype for every weight gradient of the call (api/validate.py): the caller's, else fp32.
        grad_dtype = next((v.dtype for v in out.values() if v is not None), dtypes.float32)
        grads = {}
        for b in P.BACKWARD_BUFFERS:
            if b.struct != "grads":
                continue
            if sizes[b.name] == 0:
                grads[b.name] = None
            elif out.get(b.name) is not None:
                grads[b.name] = out[b.name]
            else:
                parts[b.name] = (b.shape(dims), grad_dtype)
        results = self._block(parts, stream, capturing, poison=True)
        grads.update({n: v for n, v in results.items() if n not in ("dx", "d_topk_weights")})
        dx, dtw = results["dx"], results["d_topk_weights"]
        # The rank's scratch; with EP the rows that travel (role "heap": dy_routed in, dx_slot back)
        # live in the symmetric heap.
        heap_rows = {} if self.ep is None else {"dy_routed": self.ep.routed_ptr(), "dx_slot": self.ep.slot_ptr()}
        scratch = self._scratch_ptrs("backward", {n: nb for n, nb in sizes.items() if n not in heap_rows and
                                                  _BACKWARD[n].role in ("scratch", "counters", "heap")},
                                     stream, capturing)
        ptr = lambda v: 0 if v is None else v.ptr  # noqa: E731
        b = state.bufs
        bb = L.BackwardBuffers(
            d_out=dout.ptr, x=args.x.ptr, topk_weights=args.topk_weights.ptr, w_gate=args.w_gate.ptr,
            w_up=args.w_up.ptr, w_down=args.w_down.ptr, shared_gate=ptr(args.shared_gate),
            shared_up=ptr(args.shared_up), shared_down=ptr(args.shared_down), dx=dx.ptr, d_topk_weights=dtw.ptr,
            **{n: (v.ptr if v.nbytes else 0) for n, v in b.items()}, **{n: ptr(v) for n, v in grads.items()},
            **scratch, **heap_rows)
        peers = None if self.ep is None else self.ep.peers(T)
        plan = L.backward_plan(dims, push_tasks=0 if peers is None else peers.push_tasks)
        trace = self._trace_buffer("backward", plan, stream, capturing)
        L.launch_backward(bb, self._sched_bufs(sched), dims, stream=stream, err_ptr=self.error.device_ptr,
                          device_id=self.device_id, knobs=self.knobs, accumulate=accumulate,
                          grad_bf16=grad_dtype == dtypes.bfloat16, peers=peers,
                          trace_ptr=trace, plan=plan)
        dx._owner = (dx._owner, args, dout)   # keep the inputs alive with the result
        return dict(dx=dx, d_topk_weights=dtw, **grads)
