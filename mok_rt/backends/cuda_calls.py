"""What the CUDA backend keeps between calls so that a call that repeats the previous ones is cheap
on the host: the layout of a call's result block, recycled result blocks, and prepared launches.

* :class:`Layout`: where each result of a call lies in its one block (256-byte offsets), with
  shapes and strides computed once per (call kind, token count).
* :class:`Recycler`: result blocks of eager calls whose last result has gone.  They are not freed
  at once (a free issued while another stream captures a graph would invalidate that capture) but
  wait in the *graveyard*; the rank's next eager call moves them to the *spares*, and a later
  call of the same size on the same stream takes one back instead of allocating.  That is what
  the stream-ordered pool would do (free on the block's stream, allocate again on it), without
  the pool's host cost, and it keeps the addresses stable, so the prepared launches below hit.
  A synchronize drains every stream: the blocks released by then belong to no stream any more
  (any call may take them; freed on the rank's own stream), since their streams' owners may
  destroy them and a new stream may get the same handle.
* :class:`PreparedCalls`: a small LRU of prepared launches (filled parameter structs, tensor maps,
  grid) keyed by everything they were built from: the call kind and flags, the token count, the
  stream, and every pointer the launch reads or writes.  A repeated call compares the key and
  enqueues the cached launch; anything that changes (a new pointer, shape, stream, a grown
  scratch buffer) is a different key.  Captured, traced and expert-parallel calls are not cached
  (their pointers are fresh per capture, their trace buffers and EP epochs per launch).
* :class:`ForwardState`: what a forward hands to its backward (the context's buffers).
"""
from __future__ import annotations

import math
from collections import OrderedDict

from mok_rt.interop import dtypes
from mok_rt.interop.dlpack import _c_strides
from mok_rt.interop.tensor import Tensor

__all__ = ["ALIGN", "Layout", "Recycler", "PreparedCalls", "ForwardState", "device_ptr"]

ALIGN = 256                 # byte alignment of every buffer carved from a call's block
_MAX_SPARES = 8             # recycled result blocks kept per rank (the oldest are freed)
_MAX_SPARE_AGE = 8          # eager calls a spare waits to be taken before it is freed
_PREPARED_CALLS = 16        # prepared launches kept per rank (a step is 3 calls; a few steps' buffers)


class Layout:
    """A call's results in one block: ``parts`` maps a name to (shape, DType); every part starts
    on a 256-byte boundary.  ``total`` is the block's size in bytes."""

    __slots__ = ("entries", "index", "total")

    def __init__(self, parts: dict):
        entries, total = [], 0
        for name, (shape, dt) in parts.items():
            shape = tuple(int(n) for n in shape)
            nbytes = math.prod(shape) * dt.itemsize
            entries.append((name, shape, _c_strides(shape), dt, total, nbytes))
            total += -(-nbytes // ALIGN) * ALIGN
        self.entries, self.total = tuple(entries), total
        self.index = {e[0]: e for e in entries}

    def pointers(self, base: int) -> dict:
        """Each part's address in a block at ``base`` (0 for a part of 0 bytes)."""
        return {name: (base + off if nbytes else 0) for name, _, _, _, off, nbytes in self.entries}

    def tensor(self, name: str, base: int, device_id: int, owner, stream, handle) -> Tensor:
        """Part ``name`` as a Tensor (see :meth:`tensors`)."""
        _, shape, strides, dt, off, _ = self.index[name]
        return Tensor._wrap(base + off if self.total else 0, shape, strides, dt, device_id, owner,
                            None if stream is None else handle, stream)

    def tensors(self, base: int, device_id: int, owner, stream, handle) -> dict:
        """Each part as a Tensor owning ``owner`` (the block), produced on ``stream`` (None: a
        captured call, whose results name no producer stream)."""
        if stream is None:
            handle = None
        return {name: Tensor._wrap(base + off if self.total else 0, shape, strides, dt, device_id, owner, handle,
                                   stream)
                for name, shape, strides, dt, off, _ in self.entries}


class _Block:
    """Owns a call's block of pool memory; when the last result using it goes, the block goes to
    the rank's graveyard (see :class:`Recycler`) with the tag of the call kind that used it."""

    __slots__ = ("tensor", "tag", "graveyard")

    def __init__(self, tensor, tag, graveyard: list):
        self.tensor, self.tag, self.graveyard = tensor, tag, graveyard

    def __del__(self):
        self.graveyard.append((self.tensor, self.tag))


class Recycler:
    """The result blocks of one rank's eager calls (module docstring).  A spare that no call of
    the last ``max_age`` eager calls took is freed, and at most ``limit`` are kept: a loop whose
    token count changes does not hold the blocks of sizes it no longer uses."""

    def __init__(self, device_id: int, limit: int = _MAX_SPARES, max_age: int = _MAX_SPARE_AGE):
        self.device_id = device_id
        self.limit, self.max_age = limit, max_age
        self.graveyard: list = []      # (Tensor, tag) of blocks released since the last eager call
        self.spares: list = []         # reusable blocks, oldest first: [Tensor, tag, call index when released]
        self.allocations = 0           # blocks taken from the pool (tests)
        self.held_bytes = 0            # bytes of every block from the pool not yet freed (live or spare)
        self._calls = 0                # eager calls so far
        self._home = None              # the rank's own stream: drained blocks are freed on it

    def take(self, nbytes: int, stream, handle: int, tag=None):
        """(pointer, owner) of a block of ``nbytes`` for a call on ``stream``: a spare of that size
        last used on that stream or drained since (:meth:`drained`), preferably one a call of the
        same ``tag`` used, so that each call kind keeps getting the same block and its prepared
        launch keeps hitting; else a new one from the pool.  Only during an eager call."""
        spares = self.spares
        found = -1
        for i in range(len(spares) - 1, -1, -1):
            t = spares[i][0]
            last = t._producer_stream   # None: drained, any stream's
            if (last == handle or last is None) and t._shape[0] == nbytes:
                found = i
                if spares[i][1] == tag:
                    break
        if found >= 0:
            t = spares.pop(found)[0]
            # Now this stream's (a drained block's work is done: it may serve any stream).
            t._producer_stream, t._stream_keep = handle, stream
        else:
            t = Tensor.empty((nbytes,), dtypes.uint8, device_id=self.device_id, stream=stream)
            self.allocations += 1
            self.held_bytes += nbytes
        return t._ptr, _Block(t, tag, self.graveyard)

    def recycle(self) -> None:
        """Graveyard to spares; spares too old or too many are freed (on their own streams, like
        every pool block).  Once per eager call, never during a capture: it may free."""
        self._calls += 1
        now = self._calls
        spares = self.spares
        if self.graveyard:
            spares.extend([t, tag, now] for t, tag in self.graveyard)
            self.graveyard.clear()
        if spares and (now - spares[0][2] > self.max_age or len(spares) > self.limit):
            keep = [s for s in spares if now - s[2] <= self.max_age]
            keep = keep[max(0, len(keep) - self.limit):]
            kept = {id(s[0]) for s in keep}
            gone = [s[0] for s in spares if id(s[0]) not in kept]
            self.held_bytes -= sum(t._shape[0] for t in gone)
            spares[:] = keep
            self._free(gone)

    def drained(self, home) -> None:
        """Every stream of the rank has finished its work (a synchronize).  The blocks released
        by now belong to no stream any more: a call on any stream may take them, and one freed is
        freed on ``home`` (the rank's own stream, alive as long as the workspace).  Their last
        streams' owners may destroy those streams now, and a new stream may get the same handle:
        matched or freed by that handle, a block would be tied to a stream it has nothing to do
        with, or freed on a dead one.  Blocks whose results are still held keep their stream."""
        self._home = home
        for t in [s[0] for s in self.spares] + [g[0] for g in list(self.graveyard)]:
            t._producer_stream = t._stream_keep = None

    def _free(self, blocks) -> None:
        """Free ``blocks`` now, each on its stream (a drained one on the rank's), not whenever the
        garbage collector gets to them on the stream they were allocated on."""
        first = None
        for t in blocks:
            try:   # every block, even after a failed free
                if t._owner is not None:
                    t._owner.close(self._home if t._producer_stream is None else t._stream_keep)
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    def clear(self) -> None:
        blocks = [s[0] for s in self.spares] + [g[0] for g in self.graveyard]
        self.graveyard.clear()
        self.spares.clear()
        self.held_bytes = 0
        self._free(blocks)


class PreparedCalls:
    """A small LRU: key -> prepared launch(es)."""

    def __init__(self, size: int = _PREPARED_CALLS):
        self.size = size
        self._entries: OrderedDict = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key):
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        self._entries[key] = value
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class ForwardState:
    """The forward's context buffers and what must outlive the launch (the block's owner, the
    inputs).  bf16: ``bufs`` their addresses in the call's block (0 for a buffer of 0 bytes),
    ``bufs_key`` the same as a tuple (the backward's cache key), shared with the other calls of the
    same prepared forward: read only.  fp8_block: ``bufs`` Tensors, ``weights`` the forward's
    (routed, shared) DeviceQuantized; () for bf16."""

    __slots__ = ("dims", "bufs", "bufs_key", "keep", "weights")

    def __init__(self, dims, bufs: dict, bufs_key: tuple = (), keep: tuple = (), weights: tuple = ()):
        self.dims, self.bufs, self.bufs_key, self.keep, self.weights = dims, bufs, bufs_key, keep, weights


def device_ptr(v) -> int:
    """A view's or tensor's device address; 0 for None."""
    return 0 if v is None else v.ptr
