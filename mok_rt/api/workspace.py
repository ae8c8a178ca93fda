"""Workspace: everything the ranks of one process need to run MoE layers, sized once for a maximum
token count; :class:`WorkspaceRank`: one of those ranks, what the functional API runs on."""
from __future__ import annotations

import functools
import itertools
import weakref

from mok_rt.api.config import MoEConfig, is_int
from mok_rt.api.validate import check_backend_precision, check_flag
from mok_rt.errors import ArgumentError, MokError

__all__ = ["Workspace", "WorkspaceRank", "BACKENDS"]

BACKENDS = ("cuda", "reference")

# Every Workspace and WorkspaceRank gets an int handle when it is made, never reused in this process:
# framework glue that can pass only plain values (torch custom ops, mok_rt/frameworks/torch_ops.py)
# names the workspace by it.  Held weakly: a handle stops resolving when its workspace is collected.
_LIVE: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def _register(obj) -> int:
    handle = next(_HANDLES)
    _LIVE[handle] = obj
    return handle


def from_handle(handle: int):
    """The live Workspace or WorkspaceRank whose ``_handle`` is ``handle``."""
    # Not int(handle): it would take handle + 0.9 for handle, and fail on "abc" with a bare error.
    if not is_int(handle):
        raise ArgumentError("handle", f"expected a workspace's int handle, got {handle!r} ({type(handle).__name__})")
    obj = _LIVE.get(int(handle))
    if obj is None:
        raise ArgumentError("handle", f"no live mok_rt workspace has handle {handle} (was it garbage-collected?)")
    return obj


def handle_of(ws) -> int:
    """The int handle of ``ws`` (a Workspace, a WorkspaceRank, or already a live handle): how
    framework adapters name a workspace where only ints may travel (custom ops, static args)."""
    if is_int(ws):
        from_handle(ws)
        return int(ws)
    if not isinstance(ws, (Workspace, WorkspaceRank)):
        raise ArgumentError("ws", f"expected a Workspace, a WorkspaceRank or a handle, got {type(ws).__name__}")
    return ws._handle


def _group_layout(group) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(device of every rank, ranks this process drives) for a ProcessGroup or a duck-typed one.
    A ProcessGroup checked its own; a duck-typed one is checked here, since what is read from it
    sizes the workspace (no ranks: a division by zero; a local rank past the devices: an index
    error)."""
    if group is None:
        return (0,), (0,)
    name = type(group).__name__
    devices = getattr(group, "devices", None)
    if devices is not None:
        devices = _ints(devices, f"{name}.devices", limit=None)
        local = getattr(group, "local_ranks", _ALL)
        local = tuple(range(len(devices))) if local is _ALL else _ints(local, f"{name}.local_ranks",
                                                                        limit=len(devices))
        if len(set(local)) != len(local):
            raise ArgumentError("group", f"{name}.local_ranks {list(local)} name a rank twice")
        return devices, local
    dev = getattr(group, "device_id", None)
    if dev is None:
        raise ArgumentError("group", f"{name} has neither 'devices' nor 'device_id'")
    if not is_int(dev) or dev < 0:
        raise ArgumentError("group", f"{name}.device_id must be a device ordinal (an int >= 0), got {dev!r}")
    return (int(dev),), (0,)


_ALL = object()   # a duck-typed group without local_ranks: this process drives every rank


def _ints(values, what: str, *, limit: int | None) -> tuple[int, ...]:
    """A group's non-empty sequence of ints >= 0 (below ``limit`` where given), as plain ints."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ArgumentError("group", f"{what} must be a sequence of ints, got {values!r}")
    values = tuple(values)
    if not values:
        raise ArgumentError("group", f"{what} is empty: a group has at least one rank")
    for v in values:
        if not is_int(v) or v < 0 or (limit is not None and v >= limit):
            want = "an int >= 0" if limit is None else f"a rank in [0, {limit})"
            raise ArgumentError("group", f"{what} holds {v!r}; each must be {want}")
    return tuple(int(v) for v in values)


class WorkspaceRank:
    """One rank of a :class:`Workspace`: its device, stream and error word.

    The functional API (``mok.schedule``, ``mok.forward`` ...) takes it in place of the workspace
    when one process drives several ranks (``ws.rank(i)``); each rank's calls enqueue work on its
    own stream and return, so the caller issues every rank's call in turn and they run together.
    """

    def __init__(self, ws: "Workspace", rank_id: int, device_id: int):
        self._ws = ws
        self._handle = _register(self)
        self.rank_id = rank_id
        self.device_id = device_id
        self.stream = None
        self._impl = None
        self._own_stream = (None, None)   # (the rank's stream, its int handle): see _stream_int

    def _stream_int(self, stream) -> int:
        """The int CUstream of a cuda.core Stream (every call converts its stream twice).  The
        rank's own stream's is remembered with the object: the workspace owns that stream, or was
        given it for its lifetime, so its handle stays valid while the object is the same.  Any
        other stream is asked each time (the caller may close it between calls)."""
        own, handle = self._own_stream
        if stream is own:
            return handle
        handle = int(stream.handle)
        if stream is self.stream:
            self._own_stream = (stream, handle)
        return handle

    # What the API and the backends read; the same on every rank of the workspace.
    config = property(lambda self: self._ws.config)
    max_tokens = property(lambda self: self._ws.max_tokens)
    backend = property(lambda self: self._ws.backend)
    poison_outputs = property(lambda self: self._ws.poison_outputs)
    strict = property(lambda self: self._ws.strict)
    trace = property(lambda self: self._ws.trace)
    num_ranks = property(lambda self: self._ws.num_ranks)
    experts_per_rank = property(lambda self: self._ws.experts_per_rank)
    capacity_rows = property(lambda self: self._ws.capacity_rows)

    @property
    def workspace(self) -> "Workspace":
        return self._ws

    def _backend(self):
        if self._ws._closed:
            raise ArgumentError("ws", "the workspace is closed")
        return self._impl

    def synchronize(self) -> None:
        """Wait for this rank's stream and raise the first error its kernels reported."""
        self._backend().synchronize()

    def check(self) -> None:
        """Raise the error this rank's kernels reported, if any, without waiting."""
        self._backend().check()

    def memory_bytes(self) -> dict:
        """Device memory this rank holds now, in bytes: ``scratch`` (reused by every call, grown
        to the largest token count seen), ``graph_arena`` (the results and scratch of captured
        calls, kept until the workspace closes), ``results`` (the result blocks of eager calls:
        those whose results are still referenced, plus up to 8 released ones kept for the next
        calls to reuse, each freed after 8 calls that do not take it) and ``peak``, the largest
        sum of the three since the workspace was made (its memory high-water mark; the reference
        backend reports zeros)."""
        return self._backend().memory_bytes()

    def take_traces(self) -> list:
        """This rank's launch timelines since the last call (see :meth:`Workspace.take_traces`)."""
        return self._backend().take_traces()

    def __repr__(self) -> str:
        return f"WorkspaceRank(rank={self.rank_id}/{self.num_ranks}, device={self.device_id})"


class Workspace:
    """The buffers, streams and error words of this process's ranks, reusable across the layers of a
    model.

    ``Workspace(cfg, group, max_tokens=T_max, backend="cuda")``: ``group`` says which ranks share
    the experts (``None``: one rank on device 0; a group of P ranks: expert parallelism, each rank
    holding ``num_experts / P`` experts); ``max_tokens`` bounds the tokens of one call on one rank
    and sizes every buffer; ``backend="reference"`` runs the NumPy reference behind the same API
    on any machine (one rank).  Calls enqueue work on ``stream`` (default: a stream the workspace
    owns per rank) and return without waiting; :meth:`synchronize` waits and raises any error a
    kernel reported.  Use it as a context manager or call :meth:`close`.  ``poison_outputs=True``
    (for tests) fills every result and context buffer with NaN before the kernels write it.
    ``trace=True`` (profiling) records a per-task timeline of every megakernel launch:
    :meth:`take_traces`.  ``strict=True`` makes the reference backend accept exactly what the
    CUDA backend accepts (bf16 ``x``, weights and ``d_out``, fp32 ``topk_weights`` and weight
    gradient buffers, int32/int64 ids) instead of also fp32/fp64; the CUDA backend is always
    strict.  Errors the device reports (expert id, capacity) are raised by :meth:`synchronize`
    / :meth:`check` on both backends.

    Expert parallelism: creating the workspace is collective (every rank's process must create it,
    with the same config and ``max_tokens``; a mismatch raises :class:`ArgumentError` on every rank,
    and any other failure of one process while creating it raises on every process: there its own
    error, elsewhere a :class:`MokError` naming its rank).  Every rank then makes the same sequence
    of ``schedule`` / ``forward`` / ``recompute_context`` / ``backward`` calls, each rank's calls
    ordered on one stream; the kernels meet their peers on the device (no host synchronisation).  A
    rank that does not make a call makes its peers raise :class:`~mok_rt.PeerTimeoutError` naming it
    after ``cfg.timeout_s``; the workspace then refuses further calls (the state the ranks share is
    undefined) and must be closed and recreated on every rank.  An expert-id or capacity error is
    reported by every rank alike and leaves the workspace usable.  With one process per rank
    (MPIGroup, CallableGroup) pass the workspace itself to the API; when one process drives several
    ranks (``SingleProcessGroup(devices=[0, 1])``, or ``[0, 0]``: ranks sharing a GPU split its SMs)
    pass ``ws.rank(i)``, and issue one step's calls of every rank before waiting for any of them:
    nothing that synchronises the device (``cudaDeviceSynchronize``, a copy on the legacy default
    stream, ``ws.rank(i).synchronize()``) may come between rank 0's call and rank 1's, since rank
    0's kernels wait on the device for rank 1's (they would time out).
    """

    def __init__(self, config: MoEConfig, group=None, *, max_tokens: int, backend: str = "cuda", stream=None,
                 poison_outputs: bool = False, trace: bool = False, strict: bool = False):
        self._closed = True   # until everything exists: close() must work on a half-built workspace
        self._ep = None
        self._ranks = {}
        self._handle = _register(self)
        devices, local = _group_layout(group)
        step = _alone
        if len(devices) > 1:
            from mok_rt.dist.ep import check_same_config
            from mok_rt.dist.group import ProcessGroup
            if not isinstance(group, ProcessGroup):
                raise ArgumentError("group", f"expert parallelism needs a ProcessGroup, got {type(group).__name__}")
            # Collective, first: the checks below then fail alike on every rank.
            check_same_config(group, config, max_tokens, backend)
            # What follows can still fail on this process alone (a flag, a stream, a device this
            # node lacks, a driver call); its peers would then wait forever in the heap's first
            # collective.  So each per-process part runs as a status exchange: a failure anywhere
            # raises on every process, naming the failing rank.
            step = functools.partial(_collective, group)
        try:
            step("check the arguments and set up the local ranks",
                 lambda: self._prepare(config, group, devices, local, max_tokens=max_tokens, backend=backend,
                                       stream=stream, poison_outputs=poison_outputs, trace=trace, strict=strict))
            if self.num_ranks > 1:
                from mok_rt.dist.ep import EPShared
                # Collective itself; every step of it that can fail on one process is exchanged.
                self._ep = EPShared(self.group, config=self.config, max_tokens=self.max_tokens,
                                    capacity_rows=self.capacity_rows)
            step("create the backends", self._make_backends)
        except BaseException:
            self.close()
            raise

    def _prepare(self, config, group, devices, local, *, max_tokens, backend, stream, poison_outputs, trace,
                 strict) -> None:
        """This process's part of creating the workspace before the shared heap: the arguments,
        its ranks and their streams."""
        if not isinstance(config, MoEConfig):
            raise ArgumentError("config", f"expected a MoEConfig, got {type(config).__name__}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ArgumentError("max_tokens", f"expected an int >= 0, got {max_tokens!r}")
        if backend not in BACKENDS:
            raise ArgumentError("backend", f"expected one of {BACKENDS}, got {backend!r}")
        check_backend_precision(backend, config.precision)
        self.config = config
        self.group = group
        self.max_tokens = max_tokens
        self.backend = backend
        # Testing aid: fill every buffer mok_rt allocates for a result or a context with NaN
        # (0xFF bytes) before the kernels run, so an element they fail to write cannot pass.
        self.poison_outputs = check_flag("poison_outputs", poison_outputs)
        # Profiling aid: every megakernel launch records when each task was grabbed, ready and
        # done, on which SM (32 bytes per task; see take_traces).
        self.trace = check_flag("trace", trace)
        # The CUDA backend's dtype contract, on the reference backend too (CUDA: always).
        self.strict = check_flag("strict", strict) or backend == "cuda"
        self.num_ranks = len(devices)
        self.experts_per_rank = config.experts_per_rank(self.num_ranks)
        self.capacity_rows = config.capacity_rows(max_tokens=max_tokens, num_ranks=self.num_ranks)
        check_backend_precision(backend, config.precision, self.num_ranks)
        if self.num_ranks > 1:
            if backend != "cuda":
                raise ArgumentError("backend", f"the {backend!r} backend runs one rank; expert parallelism over "
                                               f"{self.num_ranks} ranks needs backend='cuda'")
        self._ranks = {r: WorkspaceRank(self, r, devices[r]) for r in local}
        streams = self._streams(stream)
        self._closed = False
        self._open_streams(streams)

    def _streams(self, stream) -> dict:
        ranks = list(self._ranks)
        if stream is None or not isinstance(stream, (list, tuple)):
            if stream is not None and len(ranks) > 1:
                raise ArgumentError("stream", f"this process drives ranks {ranks}: pass one stream per rank (a list)")
            return {r: stream for r in ranks}
        if len(stream) != len(ranks):
            raise ArgumentError("stream", f"expected {len(ranks)} streams (one per local rank), got {len(stream)}")
        return dict(zip(ranks, stream))

    def _open_streams(self, streams: dict) -> None:
        if self.backend == "reference":
            for s in streams.values():
                check_stream(s)   # ignored (the reference computes on the host), but not a typo
            return
        from mok_rt.runtime.device import activate, wrap_stream
        several = len(self._ranks) > 1
        for rid, r in self._ranks.items():
            s = streams[rid]
            # Ranks driven by one process need their own streams: each waits for its peers on the device.
            r.stream = activate(r.device_id).create_stream() if s is None and several else \
                wrap_stream(s, r.device_id)

    def _make_backends(self) -> None:
        if self.backend == "reference":
            from mok_rt.backends.reference import ReferenceBackend
            for r in self._ranks.values():
                r._impl = ReferenceBackend(r)
            return
        from mok_rt.backends.cuda import CudaBackend
        if self._ep is None:
            r = next(iter(self._ranks.values()))
            r._impl = CudaBackend(r)
            return
        from mok_rt.dist.ep import EPRank
        for rid, r in self._ranks.items():
            ep = EPRank(self._ep, rid, timeout_s=self.config.timeout_s, push_tasks=self.config.comm_sms)
            r._impl = CudaBackend(r, ep=ep)

    # -- ranks -----------------------------------------------------------------------------------
    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks this process drives."""
        return tuple(self._ranks)

    def rank(self, i: int) -> WorkspaceRank:
        """Rank ``i`` of this workspace (driven by this process): pass it to the functional API."""
        if isinstance(i, bool) or not isinstance(i, int) or i not in self._ranks:
            raise ArgumentError("rank", f"expected one of this process's ranks {list(self._ranks)}, got {i!r}")
        return self._ranks[i]

    def _single(self) -> WorkspaceRank:
        if len(self._ranks) != 1:
            raise ArgumentError("ws", f"this workspace drives ranks {list(self._ranks)}: pass ws.rank(i) to the "
                                      f"functional API")
        return next(iter(self._ranks.values()))

    # Attributes of the one rank a single-rank workspace drives (the usual one-process-per-GPU case).
    @property
    def rank_id(self) -> int:
        return self._single().rank_id

    @property
    def device_id(self) -> int:
        return self._single().device_id

    @property
    def stream(self):
        return self._single().stream

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Release every buffer (after the work already enqueued has finished); idempotent.
        Not collective, but with expert parallelism close a workspace only once every rank's
        calls have finished (its peers may still be writing into this rank's memory)."""
        if getattr(self, "_released", False):
            return
        self._released = True
        self._closed = True
        errors = []
        for r in getattr(self, "_ranks", {}).values():
            impl, r._impl = r._impl, None
            if impl is not None:
                try:
                    impl.close()
                except BaseException as e:  # keep releasing
                    errors.append(e)
        ep, self._ep = self._ep, None
        if ep is not None:
            try:
                ep.close()
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _backend(self):
        if self._closed:
            raise ArgumentError("ws", "the workspace is closed")
        return self._single()._backend()

    # -- errors and waiting ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every local rank's stream and raise the first error a kernel reported (every
        rank's error word is read and cleared)."""
        self._each("synchronize")

    def check(self) -> None:
        """Raise the error a kernel reported, if any, without waiting (see :meth:`synchronize`)."""
        self._each("check")

    def memory_bytes(self) -> dict:
        """Device memory the workspace's local ranks hold, summed over them (see
        :meth:`WorkspaceRank.memory_bytes`; ``peak`` is the sum of the ranks' peaks)."""
        if self._closed:
            raise ArgumentError("ws", "the workspace is closed")
        total = {"scratch": 0, "graph_arena": 0, "results": 0, "peak": 0}
        for r in self._ranks.values():
            for k, v in r.memory_bytes().items():
                total[k] += v
        return total

    def take_traces(self) -> list:
        """The per-task timelines (``mok_rt.kernels.trace.LaunchTrace``: ``summary()``, ``phase_stats()``,
        ``chrome_events()``) of every local rank's megakernel launches since the last call, after
        waiting for their streams; empty unless the workspace was made with ``trace=True`` (and
        always with the reference backend, which launches no kernels).  Each rank keeps the
        records of its latest 64 launches until then (32 bytes per task, on the device)."""
        if self._closed:
            raise ArgumentError("ws", "the workspace is closed")
        out = []
        for r in self._ranks.values():
            out.extend(r.take_traces())
        return out

    def _each(self, what: str) -> None:
        if self._closed:
            raise ArgumentError("ws", "the workspace is closed")
        first = None
        for r in self._ranks.values():
            try:
                getattr(r, what)()
            except MokError as e:
                first = first or e
        if first is not None:
            raise first

    def __repr__(self) -> str:
        c = self.config
        where = (lambda w: "cpu") if self.backend == "reference" else (lambda w: f"cuda:{w.device_id}")
        ranks = ", ".join(f"{r}:{where(w)}" for r, w in self._ranks.items())
        return (f"Workspace(backend={self.backend!r}, ranks=[{ranks}] of {self.num_ranks}, "
                f"H={c.hidden}, I={c.intermediate}, E={c.num_experts}, k={c.top_k}, max_tokens={self.max_tokens})")


def _alone(what: str, fn):
    """A setup step of a workspace without peers: nobody to tell when it fails."""
    return fn()


def _collective(group, what: str, fn):
    """A setup step of an expert-parallel workspace, followed by a status all-gather: when it
    fails on any process every process raises (there: its own error; elsewhere a MokError naming
    the failing rank and its error) rather than some waiting for the others forever."""
    from mok_rt.dist.group import collective_step
    return collective_step(group, f"Workspace: {what}", fn)[0]


def as_rank(ws) -> WorkspaceRank:
    """The rank the functional API runs on: ``ws`` itself, or a single-rank workspace's rank."""
    if isinstance(ws, WorkspaceRank):
        return ws
    if isinstance(ws, Workspace):
        return ws._single()
    raise ArgumentError("ws", f"expected a Workspace or a WorkspaceRank, got {type(ws).__name__}")


def check_stream(stream) -> None:
    """The type checks of runtime.device.wrap_stream, which need no GPU: what a reference
    workspace does for the ``stream`` it then ignores, so that code run on it first does not pass
    a stream the CUDA backend would refuse."""
    if stream is None or getattr(stream, "__cuda_stream__", None) is not None:
        return
    if isinstance(stream, int) and not isinstance(stream, bool):
        return
    raise ArgumentError("stream", f"expected None, a cuda.core Stream, an object with __cuda_stream__ or an int "
                                  f"CUstream, got {stream!r} ({type(stream).__name__})")


def resolve_stream(rank: WorkspaceRank, stream):
    """The stream a call of ``rank`` runs on: ``stream`` (any stream-like) or the rank's own."""
    if rank.backend == "reference":
        check_stream(stream)
        return rank.stream
    if stream is None:
        return rank.stream
    from mok_rt.runtime.device import wrap_stream
    return wrap_stream(stream, rank.device_id)
