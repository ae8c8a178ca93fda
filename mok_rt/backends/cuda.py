"""The CUDA backend: the schedule kernels and the fused forward/backward megakernels of one rank.

Every buffer a call writes is allocated per call from the device's stream-ordered memory pool
(so a workspace can serve several layers, and a context lives exactly as long as the caller keeps
it); nothing here waits for the GPU or reads a routing-dependent count.  With expert parallelism
(``ep``: a :class:`mok_rt.dist.ep.EPRank`) the rows that travel between ranks go through the
workspace's symmetric heap instead (see ep.py); everything else stays per call and local.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from mok_rt.kernels import moe_launch as L
from mok_rt.kernels import moe_params as P
from mok_rt.kernels import trace as _trace
from mok_rt.interop import dtypes
from mok_rt.runtime.errorword import ErrorWord, device_error
from mok_rt.runtime.device import activate
from mok_rt.runtime.launch import multiprocessor_count
from mok_rt.kernels.schedule import build_schedule, build_schedule_ep
from mok_rt.interop.tensor import Tensor

_MAX_PENDING_TRACES = 64   # traced launches kept until take_traces() (the oldest are dropped)


@dataclass
class _ForwardState:
    """The forward's context buffers (owned), and the inputs that must outlive the launch."""

    dims: L.LayerDims
    bufs: dict
    keep: tuple = field(default=(), repr=False)


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

    # -- lifetime / errors ---------------------------------------------------------------------
    def close(self) -> None:
        try:
            self._sync_streams()
        finally:
            if self.ep is None:   # an EP rank's error word belongs to the heap
                self.error.close()

    def _used(self, stream) -> None:
        self._streams[int(stream.handle)] = stream

    def _sync_streams(self) -> None:
        self.ws.stream.sync()
        streams, self._streams = self._streams, {}
        for s in streams.values():
            s.sync()

    def synchronize(self) -> None:
        self._sync_streams()
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

    # -- traces (Workspace(trace=True)) --------------------------------------------------------------
    def _trace_buffer(self, kind: str, plan, stream) -> int:
        """Zeroed records for one launch, one per task of its plan (0: tracing is off)."""
        if not self.ws.trace:
            return 0
        buf = self._bytes(max(plan.total, 1) * _trace.RECORD_BYTES, stream, poison=False)
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

    # -- helpers -----------------------------------------------------------------------------------
    def _empty(self, shape, dtype, stream, *, poison=True):
        t = Tensor.empty(shape, dtype, device_id=self.device_id, stream=stream)
        if poison and self.ws.poison_outputs and t.nbytes:
            t.fill_bytes(0xFF, stream=stream)   # NaN for bf16/f32, -1 for ints
        return t

    def _bytes(self, nbytes, stream, *, poison=True):
        return self._empty((nbytes,), dtypes.uint8, stream, poison=poison)

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
        self._check_usable()
        self._used(stream)
        cfg, ws = self.ws.config, self.ws
        T = ids.shape[0]
        common = dict(ids_int64=ids.dtype == dtypes.int64, num_experts=cfg.num_experts, top_k=cfg.top_k,
                      rank=ws.rank_id, block_m=cfg.block_m, max_rows=ws.capacity_rows, device_id=self.device_id,
                      stream=stream, err_ptr=self.error.device_ptr, poison=ws.poison_outputs)
        if self.ep is None:
            s = build_schedule([ids.ptr], [T], max_total_routes=max(T, 1) * cfg.top_k, **common)
        else:
            s = build_schedule_ep(ids.ptr, T, exchange=self.ep.exchange(), max_tokens=ws.max_tokens, **common)
        s._keep = ids
        return s

    def _run_forward(self, sched, args, stream, *, context_only: bool):
        self._check_usable()
        self._used(stream)
        T = sched.tokens
        dims = self._dims(T)
        peers = None if self.ep is None else self.ep.peers(T)
        plan = L.forward_plan(dims, context_only=context_only, push_tasks=0 if peers is None else peers.push_tasks)
        sizes = L.forward_buffer_bytes(dims)
        # The buffers the launch writes, by role (_moe_params.FORWARD_BUFFERS): the context is owned
        # by the returned state, `out` is returned, the scratch lives as long as the launch.
        roles = {b.name: b.role for b in P.FORWARD_BUFFERS}
        bufs = {n: self._bytes(sizes[n], stream) for n in sizes if roles[n] == "context"}
        out = None if context_only else self._empty((T, dims.hidden), dtypes.bfloat16, stream)
        scratch = {n: self._bytes(sizes[n], stream, poison=False) for n in sizes
                   if roles[n] in ("scratch", "counters")}
        ptr = lambda v: 0 if v is None else v.ptr  # noqa: E731
        fb = L.ForwardBuffers(
            x=args.x.ptr, topk_weights=ptr(args.topk_weights), w_gate=args.w_gate.ptr, w_up=args.w_up.ptr,
            w_down=args.w_down.ptr, shared_gate=ptr(args.shared_gate), shared_up=ptr(args.shared_up),
            shared_down=ptr(args.shared_down), out=ptr(out), **{n: v.ptr for n, v in {**bufs, **scratch}.items()})
        trace = self._trace_buffer("recompute" if context_only else "forward", plan, stream)
        L.launch_forward(fb, self._sched_bufs(sched), dims, stream=stream, err_ptr=self.error.device_ptr,
                         device_id=self.device_id, knobs=self.knobs, context_only=context_only, peers=peers,
                         trace_ptr=trace)
        state = _ForwardState(dims=dims, bufs=bufs, keep=(args, scratch))
        return out, state

    def forward(self, sched, args, *, stream):
        return self._run_forward(sched, args, stream, context_only=False)

    def recompute(self, sched, args, *, stream):
        return self._run_forward(sched, args, stream, context_only=True)[1]

    def backward(self, sched, state: _ForwardState, dout, args, *, out, accumulate, stream):
        """Gradients by kernel name (dx, d_topk_weights, dw_gate ... d_shared_down); ``out``:
        the caller's validated buffers by the same names (None: allocate)."""
        self._check_usable()
        self._used(stream)
        dims = state.dims
        T, H, k = dims.tokens, dims.hidden, dims.top_k
        sizes = L.backward_buffer_bytes(dims)
        grads = {}
        for b in P.BACKWARD_BUFFERS:   # the weight gradients: the caller's (accumulate / out=) or new
            if b.struct != "grads":
                continue
            if sizes[b.name] == 0:
                grads[b.name] = None
                continue
            given = out.get(b.name)
            grads[b.name] = given if given is not None else self._empty(b.shape(dims), dtypes.float32, stream)
        dx = self._empty((T, H), dtypes.bfloat16, stream)
        dtw = self._empty((T, k), dtypes.float32, stream)
        # Scratch per launch; with EP the rows that travel (role "heap": dy_routed in, dx_slot back)
        # live in the symmetric heap.
        roles = {b.name: b.role for b in P.BACKWARD_BUFFERS}
        heap_rows = {} if self.ep is None else {"dy_routed": self.ep.routed_ptr(), "dx_slot": self.ep.slot_ptr()}
        scratch = {n: self._bytes(sizes[n], stream, poison=False) for n in sizes
                   if roles[n] in ("scratch", "counters") or (roles[n] == "heap" and n not in heap_rows)}
        ptr = lambda v: 0 if v is None else v.ptr  # noqa: E731
        b = state.bufs
        bb = L.BackwardBuffers(
            d_out=dout.ptr, x=args.x.ptr, topk_weights=args.topk_weights.ptr, w_gate=args.w_gate.ptr,
            w_up=args.w_up.ptr, w_down=args.w_down.ptr, shared_gate=ptr(args.shared_gate), shared_up=ptr(args.shared_up),
            shared_down=ptr(args.shared_down), dx=dx.ptr, d_topk_weights=dtw.ptr,
            **{n: (v.ptr if v.nbytes else 0) for n, v in b.items()}, **{n: ptr(v) for n, v in grads.items()},
            **{n: v.ptr for n, v in scratch.items()}, **heap_rows)
        peers = None if self.ep is None else self.ep.peers(T)
        plan = L.backward_plan(dims, push_tasks=0 if peers is None else peers.push_tasks)
        trace = self._trace_buffer("backward", plan, stream)
        L.launch_backward(bb, self._sched_bufs(sched), dims, stream=stream, err_ptr=self.error.device_ptr,
                          device_id=self.device_id, knobs=self.knobs, accumulate=accumulate, peers=peers,
                          trace_ptr=trace)
        dx._owner = (dx._owner, scratch, args, dout)   # keep inputs and scratch alive with the result
        return dict(dx=dx, d_topk_weights=dtw, **grads)
