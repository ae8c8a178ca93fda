"""The CUDA backend: the schedule kernels and the fused forward/backward megakernels of one rank.

Memory, per call and per rank:
  * results (the schedule's arrays; the forward's context and ``out``; ``dx``, ``d_topk_weights``
    and new weight gradients) come in one block per call: when eager, from the device's
    stream-ordered pool or a block of an earlier call whose results are all gone, reused on the
    stream it was last used on, or on any once a synchronize drained it (cuda_calls.Recycler);
    from the workspace's graph arena while the stream captures a CUDA graph (runtime/memory.py:
    kept until the workspace closes, each replay rewrites them);
  * scratch (counters, fp32 partial sums, the backward's routed rows) is the rank's own, reused
    by every eager call and grown to the largest token count seen; eager calls on different
    streams are ordered (runtime/memory.StreamOrder), so sharing it is safe.  A captured call's
    scratch is its own, from the graph arena (its replays run on streams the rank never sees).
    See cuda_scratch.py, also for what ``poison_outputs`` fills there.
Plans, sizes and block layouts are cached per token count, and the prepared launches (filled
parameter structs, tensor maps, grids) per call signature: kind, flags, token count, stream and
every pointer (cuda_calls.PreparedCalls), so a call that repeats one of the last few enqueues its
launches without rebuilding them.  Nothing here waits for the GPU or reads a routing-dependent
count.  With expert parallelism (``ep``: a :class:`mok_rt.dist.ep.EPRank`) the
rows that travel between ranks live in the workspace's symmetric heap (see ep.py).
"""
from __future__ import annotations

import collections
import contextlib
import functools
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from mok_rt.errors import ArgumentError
from mok_rt.interop import dtypes
from mok_rt.interop.tensor import Tensor
from mok_rt.kernels import moe_launch as L
from mok_rt.kernels import moe_params as P
from mok_rt.kernels.moe_params import GRAD_NAMES
from mok_rt.kernels import trace as _trace
from mok_rt.kernels.schedule import (Schedule, build_schedule, build_schedule_ep, output_shapes, poison_schedule,
                                     scratch_words)
from mok_rt.backends.cuda_calls import ForwardState, Layout, PreparedCalls, Recycler, device_ptr
from mok_rt.backends.cuda_fp8 import Fp8Calls
from mok_rt.backends.cuda_scratch import RankScratch
from mok_rt.runtime.device import activate
from mok_rt.runtime.driver import call, driver, ready
from mok_rt.runtime.errorword import ErrorReports, ErrorWord, device_error
from mok_rt.runtime.launch import multiprocessor_count
from mok_rt.runtime.memory import GraphArena, StreamOrder, is_capturing

_MAX_PENDING_TRACES = 64   # traced launches kept until take_traces() (the oldest are dropped)
_DTYPES = {"bf16": dtypes.bfloat16, "f32": dtypes.float32, "i32": dtypes.int32}
_FORWARD = {b.name: b for b in P.FORWARD_BUFFERS}
_BACKWARD = {b.name: b for b in P.BACKWARD_BUFFERS}


@dataclass(frozen=True)
class _Shapes:
    """What one token count fixes: the launch dims, the byte sizes of every buffer, the scratch
    each call kind needs and the layouts of its result blocks (filled as they are first needed)."""

    dims: L.LayerDims
    forward: dict
    backward: dict
    schedule_scratch: dict      # bytes of each scratch array of the schedule's passes (one GPU)
    forward_scratch: dict
    backward_scratch: dict      # one GPU: the heap rows are scratch too
    backward_scratch_ep: dict   # expert parallelism: the heap rows live in the symmetric heap
    layouts: dict = field(default_factory=dict)   # result blocks by call kind (and flags)

    def layout(self, key, parts) -> Layout:
        lay = self.layouts.get(key)
        if lay is None:
            lay = self.layouts[key] = Layout(parts())
        return lay


class CudaBackend(Fp8Calls):
    # What a backend that has made no call holds (check() reads them): no graph captured, no
    # stream to wait for.  __init__ gives every backend its own.
    _captured = False
    _streams = MappingProxyType({})

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
            fit = L.prepare(self.device_id)   # CTAs of a megakernel that fit on one SM
            if cfg.precision == "fp8_block":
                from mok_rt.kernels import fp8_quantize, moe_fp8, moe_fp8_bwd
                fit = min(fit, moe_fp8.prepare(self.device_id), moe_fp8_bwd.prepare(self.device_id))
                fp8_quantize.prepare(self.device_id)
            share = ep.shared.ranks_sharing_gpu(ep.rank)
            if share > 1:
                # Ranks sharing a GPU split its SMs, so that all their persistent grids are resident
                # at once (a rank waiting for a peer that cannot start would only time out): never
                # more CTAs per SM than fit, whatever ctas_per_sm asks for.
                per_sm = min(cfg.ctas_per_sm, fit)
                max_ctas = max(1, multiprocessor_count(self.device_id) * per_sm // share)
        self.knobs = L.KernelKnobs(ctas_per_sm=cfg.ctas_per_sm, max_ctas=max_ctas,
                                   timeout_ns=int(cfg.timeout_s * 1e9))
        self._streams: dict[int, object] = {}   # streams with mok_rt work since the last synchronize
        # Workspace(trace=True): (kind, phases, records) of the latest launches not yet taken.
        self._traces: collections.deque[tuple[str, tuple, Tensor]] = collections.deque(maxlen=_MAX_PENDING_TRACES)
        self._arena = GraphArena(self.device_id)
        self._order = StreamOrder()
        self._poison = bool(ws.poison_outputs)
        self._mem_scratch = RankScratch(self.device_id, self._arena, poison=self._poison, note_peak=self._note_peak,
                                        stream_int=ws._stream_int)   # cuda_scratch.py
        self._scratch = self._mem_scratch.buffers   # (kind, name) -> (pointer, bytes, owning Tensor)
        self._scratch_ptrs = self._mem_scratch.ptrs  # (kind, sizes, stream, capturing) -> (by name, as a tuple)
        self._shapes: dict[int, _Shapes] = {}
        self._captured = False                  # a graph was captured: synchronize waits for the device
        self._blocks = Recycler(self.device_id)  # eager calls' result blocks (cuda_calls.py)
        self._calls = PreparedCalls()           # prepared launches of calls that repeat (cuda_calls.py)
        self._peak = 0                          # memory_bytes()["peak"]
        self._fp8 = cfg.precision == "fp8_block"   # moe_forward_fp8 / moe_backward_fp8 (one rank; cuda_fp8.py)
        self._fp8_sizes: dict[tuple, tuple] = {}   # ("forward" / "backward", T) -> (buffer bytes, scratch's)

    @functools.cached_property
    def _reports(self) -> ErrorReports:
        """When check() may clear the error word (made on first use, then a plain attribute)."""
        return ErrorReports(self.error)

    # -- lifetime / errors ---------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the rank's work, then release everything it holds.  Every step is attempted
        even when one fails (the workspace marks itself closed first, so there is no second try),
        and the first error is raised afterwards."""
        errors = []

        def attempt(step, *args):
            try:
                step(*args)
            except BaseException as e:   # keep releasing
                errors.append(e)

        attempt(activate, self.device_id)
        attempt(self._sync_streams)
        if self._captured:
            attempt(call, "cuCtxSynchronize")
        attempt(self._order.close)
        attempt(self._arena.close)
        attempt(self._mem_scratch.close, self.ws.stream)   # drained: on the rank's stream
        self._calls.clear()
        attempt(self._blocks.clear)
        attempt(self._reports.close)
        if self.ep is None:   # an EP rank's error word belongs to the heap
            attempt(self.error.close)
        if errors:
            raise errors[0]

    def _sync_streams(self) -> None:
        """Wait for every stream the rank's eager calls used since the last time: their work, the
        blocks and the stream order no longer belong to them (their owners may destroy them)."""
        self.ws.stream.sync()
        streams = self._streams
        for h in list(streams):
            streams[h].sync()
            del streams[h]   # only once waited for: a failed wait leaves it to wait again
        self._order.drained()
        self._blocks.drained(self.ws.stream)

    def synchronize(self) -> None:
        self._sync_streams()
        self._blocks.recycle()
        if self._captured:   # replays run on streams mok_rt never sees
            activate(self.device_id)
            call("cuCtxSynchronize")
        self._check(_drained)

    def check(self) -> None:
        self._check(self._idle)

    def _idle(self) -> bool:
        """Whether no kernel of this rank can still be pending, without waiting: every stream its
        eager calls used since the last synchronize has finished (cuStreamQuery).  Never after a
        graph was captured: its replays run on streams mok_rt does not know."""
        if self._captured:
            return False
        return all(ready("cuStreamQuery", driver.CUstream(h)) for h in self._streams)

    def _check(self, idle) -> None:
        """Raise the error the kernels reported and check() / synchronize() has not raised yet;
        the word is cleared now if ``idle()``, else by the rank's next eager call
        (runtime/errorword.ErrorReports)."""
        info = self._reports.poll(idle)
        if info is None:
            return
        code, a, b, c = info
        where = f"device {self.device_id}" if self.ep is None else f"rank {self.ep.rank}, device {self.device_id}"
        err = device_error(code, (a, b, c), f"mok_rt ({where})")
        if self.ep is not None:
            note = self.ep.shared.health.record(code, str(err))
            err = device_error(code, (a, b, c), f"mok_rt ({where})", note=note)
        raise err

    def _check_usable(self) -> None:
        """With expert parallelism: refuse new calls once the state shared with the peers is undefined."""
        if self.ep is not None:
            self.ep.shared.health.check(self.ep.rank)

    def _begin(self, stream) -> tuple[bool, int]:
        """Every call starts here: refuse calls once an EP group's shared state is undefined,
        order the call after the previous one's stream, note the stream for synchronize.
        Returns whether the stream is capturing a graph, and the stream's handle."""
        if self.ep is not None:
            self._check_usable()
        activate(self.device_id)   # events, arena blocks and launches belong to this rank's device
        handle = self.ws._stream_int(stream)
        capturing = is_capturing(handle)
        if capturing:
            if self.ep is not None:
                raise ArgumentError("stream", "expert-parallel calls cannot be captured in a CUDA graph (each "
                                              "launch meets its peers under a new epoch); capture one-rank "
                                              "workspaces only")
            self._captured = True
            return True, handle
        self._streams[handle] = stream
        self._order.enter(handle)
        if self._reports.raised:   # an error raised while its step was pending: cleared before this call
            self._reports.before_call(handle)
        self._blocks.recycle()   # released blocks become spares; each frees on its own stream
        return False, handle

    # -- memory ------------------------------------------------------------------------------------
    def _results(self, total: int, stream, handle: int, capturing: bool, *, poison: bool = True, tag=None):
        """(base pointer, owner) of one block of ``total`` bytes for a call's results: from the
        graph arena while capturing (kept until the workspace closes), else a recycled block or
        a new one from the pool (cuda_calls.Recycler).  Poisoned when the workspace asks."""
        if not total:
            return 0, None
        if capturing:
            base, owner = self._arena.allocate(total), self._arena
            self._note_peak()
        else:
            before = self._blocks.allocations
            base, owner = self._blocks.take(total, stream, handle, tag)
            if self._blocks.allocations != before:   # the peak only moves when memory is allocated
                self._note_peak()
        if poison and self._poison:
            # NaN for bf16/f32, -1 for ints: an element the kernels fail to write cannot pass.
            call("cuMemsetD8Async", driver.CUdeviceptr(base), 0xFF, total, driver.CUstream(handle))
        return base, owner

    def _block(self, parts: dict, stream, capturing: bool, *, poison: bool, tag=None) -> dict:
        """One allocation for a call's results, carved into tensors: ``parts`` maps a name to
        (shape, DType); every part starts on a 256-byte boundary.  ``tag``: as for _results."""
        lay = Layout(parts)
        handle = self.ws._stream_int(stream)
        base, owner = self._results(lay.total, stream, handle, capturing, poison=poison, tag=tag)
        return lay.tensors(base, self.device_id, owner, None if capturing else stream, handle)

    def memory_bytes(self) -> dict:
        """Device memory this rank holds now: its scratch, its graph arena, the result blocks of
        eager calls (live results, and spares kept for reuse), and the peak of their sum."""
        # Memory held only grows at an allocation, and each one notes the peak: _peak >= _held().
        return {"scratch": self._mem_scratch.nbytes, "graph_arena": self._arena.nbytes,
                "results": self._blocks.held_bytes, "peak": self._peak}

    def _held(self) -> int:
        return self._mem_scratch.nbytes + self._arena.nbytes + self._blocks.held_bytes

    def _note_peak(self) -> None:
        """After a call's allocations: the high-water mark memory_bytes reports."""
        now = self._held()
        if now > self._peak:
            self._peak = now

    def _shapes_for(self, tokens: int) -> _Shapes:
        sh = self._shapes.get(tokens)
        if sh is None:
            dims = self._dims(tokens)
            fwd, bwd = L.forward_buffer_bytes(dims), L.backward_buffer_bytes(dims)
            scratch_roles = ("scratch", "counters", "heap")
            cfg = self.ws.config
            words = scratch_words(num_experts=cfg.num_experts, max_total_routes=max(tokens, 1) * cfg.top_k)
            sh = _Shapes(dims=dims, forward=fwd, backward=bwd, schedule_scratch={n: 4 * w for n, w in words.items()},
                         forward_scratch={n: nb for n, nb in fwd.items() if _FORWARD[n].role in ("scratch", "counters")},
                         backward_scratch={n: nb for n, nb in bwd.items() if _BACKWARD[n].role in scratch_roles},
                         backward_scratch_ep={n: nb for n, nb in bwd.items() if _BACKWARD[n].role in scratch_roles
                                              and n not in ("dy_routed", "dx_slot")})
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
                           rank=ws.rank_id, expert_parallel=self.ep is not None)

    @staticmethod
    def _sched_bufs(s) -> L.ScheduleBuffers:
        return L.ScheduleBuffers(expert_count=s.expert_count.ptr, expert_offset=s.expert_offset.ptr,
                                 num_blocks=s.totals.ptr, block_expert=s.block_expert.ptr,
                                 row_src_rank=s.row_src_rank.ptr, row_slot=s.row_slot.ptr,
                                 route_row=s.route_row.ptr, route_rank=s.route_rank.ptr)

    # -- the API -----------------------------------------------------------------------------------
    def schedule(self, ids, *, stream):
        capturing, handle = self._begin(stream)
        T = ids.shape[0]
        if self.ep is not None:
            s = self._schedule_ep(ids, T, stream, capturing)
            bufs = self._sched_bufs(s)
            key = tuple(getattr(bufs, n) for n in _SCHED_NAMES)
        else:
            s, bufs, key = self._schedule_one(ids, T, stream, handle, capturing)
        s._keep = ids
        s._launch_bufs, s._launch_key = bufs, key   # what the megakernels read, and it as a cache key
        return s

    def _schedule_args(self, ids, stream) -> dict:
        """The arguments build_schedule(_ep) share."""
        cfg, ws = self.ws.config, self.ws
        return dict(ids_int64=ids.dtype == dtypes.int64, num_experts=cfg.num_experts, top_k=cfg.top_k,
                    rank=ws.rank_id, block_m=cfg.block_m, max_rows=ws.capacity_rows, device_id=self.device_id,
                    stream=stream, err_ptr=self.error.device_ptr, poison=ws.poison_outputs)

    def _schedule_ep(self, ids, T: int, stream, capturing: bool):
        def outputs(parts):
            return self._block({n: (shape, dtypes.int32) for n, shape in parts.items()}, stream, capturing,
                               poison=False)

        def scratch(words):
            return self._scratch_ptrs("schedule", {n: 4 * w for n, w in words.items()}, stream, capturing)[0]

        return build_schedule_ep(ids.ptr, T, exchange=self.ep.exchange, num_ranks=self.ep.num_ranks,
                                 max_tokens=self.ws.max_tokens,
                                 wave_tokens=self.ep.shared.layout.chunk_tokens * self.ep.push_tasks_max,
                                 **self._schedule_args(ids, stream), outputs=outputs, scratch=scratch)

    def _schedule_one(self, ids, T: int, stream, handle: int, capturing: bool):
        """One GPU's schedule, its ScheduleBuffers and their key: its arrays in one block, its
        passes prepared once per (ids, block, scratch, stream) and enqueued again (with the
        ScheduleBuffers made for them) when a call repeats them."""
        cfg, ws = self.ws.config, self.ws
        sh = self._shapes_for(T)
        lay = sh.layouts.get("schedule") or sh.layout("schedule", lambda: {
            n: (shape, dtypes.int32) for n, shape in output_shapes(
                num_ranks=1, num_experts=cfg.num_experts, top_k=cfg.top_k, block_m=cfg.block_m,
                max_rows=ws.capacity_rows, tokens=T).items()})
        base, owner = self._results(lay.total, stream, handle, capturing, poison=False, tag="schedule")
        arrays = lay.tensors(base, self.device_id, owner, None if capturing else stream, handle)
        scratch, scratch_key = self._scratch_ptrs("schedule", sh.schedule_scratch, stream, capturing)
        cacheable = self._cacheable(capturing)
        key = ("schedule", T, handle, ids.ptr, ids.dtype == dtypes.int64, base, scratch_key) if cacheable else None
        hit = self._calls.get(key) if cacheable else None
        if hit is None:
            s = build_schedule([ids.ptr], [T], max_total_routes=max(T, 1) * cfg.top_k,
                               **self._schedule_args(ids, stream), outputs=lambda parts: arrays,
                               scratch=lambda w: {n: scratch[n] for n in w})
            bufs = self._sched_bufs(s)
            bufs_key = tuple(getattr(bufs, n) for n in _SCHED_NAMES)
            if cacheable:
                self._calls.put(key, (s._passes, bufs, bufs_key))
            return s, bufs, bufs_key
        passes, bufs, bufs_key = hit
        s = Schedule(num_ranks=1, rank=ws.rank_id, num_experts=cfg.num_experts, top_k=cfg.top_k,
                     block_m=cfg.block_m, max_rows=ws.capacity_rows, tokens=T, device_id=self.device_id, **arrays)
        if self._poison:
            poison_schedule(s, stream)
        for run in passes:
            run()
        return s, bufs, bufs_key

    @contextlib.contextmanager
    def _launch_epoch(self):
        """Around a launch that takes a new EP epoch (``ep.peers``): if it raises before it is
        enqueued (its trace buffer's allocation, its preparation, the launch call itself), the
        epoch goes back.  Every rank must give the same launch the same epoch (ep.py counts them
        on the host): advanced for a launch this rank never made, its next launch would wait for
        its peers under an epoch they are not at, and time out."""
        mark = None if self.ep is None else self.ep.mark()
        try:
            yield
        except BaseException:
            if mark is not None:
                self.ep.rewind(mark)
            raise

    def _cacheable(self, capturing: bool) -> bool:
        """Whether a call's prepared launch may be kept: not while capturing (its arena pointers are
        never seen again), not with traces (a new record buffer per launch) nor with expert
        parallelism (a new epoch per launch)."""
        return not capturing and self.ep is None and not self.ws.trace

    def _run_forward(self, sched, args, stream, *, context_only: bool):
        if self._fp8:
            return self._run_forward_fp8(sched, args, stream, context_only=context_only)
        capturing, handle = self._begin(stream)
        T = sched.tokens
        sh = self._shapes_for(T)
        dims = sh.dims
        # The context is owned by the returned state, `out` is returned: one block; the scratch is the rank's.
        kind = _FORWARD_KINDS[context_only]
        lay = sh.layouts.get(kind) or sh.layout(kind, lambda: self._forward_parts(sh, context_only))
        base, owner = self._results(lay.total, stream, handle, capturing, tag="forward")
        out = None if context_only else lay.tensor("out", base, self.device_id, owner,
                                                   None if capturing else stream, handle)
        scratch, scratch_key = self._scratch_ptrs("forward", sh.forward_scratch, stream, capturing)
        inputs = _input_ptrs(args)
        cacheable = self._cacheable(capturing)
        key = (kind, T, handle, base, sched._launch_key, inputs, scratch_key) if cacheable else None
        hit = self._calls.get(key) if cacheable else None
        with self._launch_epoch():   # the EP epoch goes back if nothing is enqueued
            if hit is None:
                ptrs = lay.pointers(base)
                out_ptr = ptrs.pop("out", 0)
                fb = L.ForwardBuffers(
                    x=inputs[0], topk_weights=inputs[1], w_gate=inputs[2], w_up=inputs[3], w_down=inputs[4],
                    shared_gate=inputs[5], shared_up=inputs[6], shared_down=inputs[7], out=out_ptr, **ptrs,
                    **scratch)
                # Only now the EP epoch advances.
                peers = None if self.ep is None else self.ep.peers(T)
                plan = L.forward_plan(dims, context_only=context_only,
                                      push_tasks=0 if peers is None else peers.push_tasks)
                trace = self._trace_buffer("recompute" if context_only else "forward", plan, stream, capturing)
                prep = L.prepare_forward(fb, sched._launch_bufs, dims, stream=stream, err_ptr=self.error.device_ptr,
                                         device_id=self.device_id, knobs=self.knobs, context_only=context_only,
                                         peers=peers, trace_ptr=trace, plan=plan)
                hit = (prep, ptrs, tuple(ptrs.values()))
                if cacheable:
                    self._calls.put(key, hit)
            prep, ptrs, ptrs_key = hit
            prep()
        return out, ForwardState(dims, ptrs, ptrs_key, (args, sched, owner))

    @staticmethod
    def _forward_parts(sh: _Shapes, context_only: bool) -> dict:
        parts = {n: ((nb,), dtypes.uint8) for n, nb in sh.forward.items() if _FORWARD[n].role == "context"}
        if not context_only:
            parts["out"] = ((sh.dims.tokens, sh.dims.hidden), dtypes.bfloat16)
        return parts

    def forward(self, sched, args, *, stream):
        return self._run_forward(sched, args, stream, context_only=False)

    def recompute(self, sched, args, *, stream):
        return self._run_forward(sched, args, stream, context_only=True)[1]

    def backward(self, sched, state: ForwardState, dout, args, *, out, grad_dtype, accumulate, stream):
        """Gradients by kernel name (dx, d_topk_weights, dw_gate ... d_shared_down); ``out``:
        the caller's validated buffers by the same names (None: allocate, in ``grad_dtype``)."""
        if self._fp8:   # moe_backward_fp8 (backends/cuda_fp8.py)
            return self._run_backward_fp8(sched, state, dout, args, out=out, grad_dtype=grad_dtype,
                                          accumulate=accumulate, stream=stream)
        capturing, handle = self._begin(stream)
        dims = state.dims
        T = dims.tokens
        sh = self._shapes_for(T)
        grads, base = self._gradient_results(sh, out, grad_dtype, stream, handle, capturing)
        dx, dtw = grads["dx"], grads["d_topk_weights"]
        # The rank's scratch; with EP the rows that travel (role "heap": dy_routed in, dx_slot back)
        # live in the symmetric heap.
        if self.ep is None:
            heap_rows = {}
            scratch, scratch_key = self._scratch_ptrs("backward", sh.backward_scratch, stream, capturing)
        else:
            heap_rows = {"dy_routed": self.ep.routed_ptr(), "dx_slot": self.ep.slot_ptr()}
            scratch, scratch_key = self._scratch_ptrs("backward", sh.backward_scratch_ep, stream, capturing)
        inputs = (dout.ptr,) + _input_ptrs(args)
        grad_ptrs = tuple([0 if g is None else g.ptr for g in map(grads.__getitem__, GRAD_NAMES)])
        cacheable = self._cacheable(capturing)
        grad_bf16 = grad_dtype == dtypes.bfloat16
        key = ("backward", bool(accumulate), grad_bf16, T, handle, base, sched._launch_key, state.bufs_key, inputs,
               grad_ptrs, scratch_key) if cacheable else None
        prep = self._calls.get(key) if cacheable else None
        with self._launch_epoch():   # the EP epoch goes back if nothing is enqueued
            if prep is None:
                bb = L.BackwardBuffers(
                    d_out=inputs[0], x=inputs[1], topk_weights=inputs[2], w_gate=inputs[3], w_up=inputs[4],
                    w_down=inputs[5], shared_gate=inputs[6], shared_up=inputs[7], shared_down=inputs[8], dx=dx.ptr,
                    d_topk_weights=dtw.ptr, **state.bufs, **dict(zip(GRAD_NAMES, grad_ptrs)), **scratch, **heap_rows)
                # Only now the EP epoch advances.
                peers = None if self.ep is None else self.ep.peers(T)
                plan = L.backward_plan(dims, push_tasks=0 if peers is None else peers.push_tasks)
                trace = self._trace_buffer("backward", plan, stream, capturing)
                prep = L.prepare_backward(bb, sched._launch_bufs, dims, stream=stream, err_ptr=self.error.device_ptr,
                                          device_id=self.device_id, knobs=self.knobs, accumulate=accumulate,
                                          grad_bf16=grad_bf16, peers=peers, trace_ptr=trace, plan=plan)
                if cacheable:
                    self._calls.put(key, prep)
            prep()
        dx._owner = (dx._owner, args, dout)   # keep the inputs alive with the result
        return grads

    def _gradient_results(self, sh: _Shapes, out: dict, grad_dtype, stream, handle: int, capturing: bool):
        """A backward's results by kernel name (dx, d_topk_weights, dw_gate ... d_shared_down) and the
        base of their block: dx, d_topk_weights and the weight gradients the caller did not pass
        (``out``: its validated buffers, None where not given) in one block; the caller's buffers;
        None for gradients of 0 bytes."""
        sizes = sh.backward
        given = tuple(n for n in GRAD_NAMES if sizes[n] and out.get(n) is not None) if any(out.values()) else ()
        kind = ("backward", given, grad_dtype.name)
        lay = sh.layouts.get(kind) or sh.layout(kind, lambda: self._backward_parts(sh, given, grad_dtype))
        base, owner = self._results(lay.total, stream, handle, capturing, tag="backward")
        grads = lay.tensors(base, self.device_id, owner, None if capturing else stream, handle)
        for n in GRAD_NAMES:
            if n not in grads:
                grads[n] = out[n] if n in given else None
        return grads, base

    @staticmethod
    def _backward_parts(sh: _Shapes, given: tuple, grad_dtype) -> dict:
        T, H, k = sh.dims.tokens, sh.dims.hidden, sh.dims.top_k
        parts = {"dx": ((T, H), dtypes.bfloat16), "d_topk_weights": ((T, k), dtypes.float32)}
        for b in P.BACKWARD_BUFFERS:
            if b.struct == "grads" and sh.backward[b.name] and b.name not in given:
                parts[b.name] = (b.shape(sh.dims), grad_dtype)
        return parts


def _input_ptrs(args) -> tuple:
    """x, topk_weights, the routed and the shared expert's weights (0: none)."""
    if args.shared_gate is None:
        return (args.x.ptr, args.topk_weights.ptr, device_ptr(args.w_gate), device_ptr(args.w_up),
                device_ptr(args.w_down), 0, 0, 0)
    return (args.x.ptr, args.topk_weights.ptr, device_ptr(args.w_gate), device_ptr(args.w_up),
            device_ptr(args.w_down), args.shared_gate.ptr, args.shared_up.ptr, args.shared_down.ptr)


_FORWARD_KINDS = {False: ("forward", False), True: ("forward", True)}   # layout and cache-key tags


def _drained() -> bool:
    """synchronize()'s answer to "may the error word be cleared now": it has waited for everything."""
    return True
_SCHED_NAMES = tuple(b.name for b in P.FORWARD_BUFFERS if b.role == "schedule")
