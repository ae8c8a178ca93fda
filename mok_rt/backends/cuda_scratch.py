"""The scratch of one rank of the CUDA backend (mok_rt/backends/cuda.py): counters, fp32 partial
sums, the backward's routed rows and the FP8 backward's quantised operands, one buffer per (call
kind, name).  Eager calls share them: reused while large enough, replaced by a larger one when a
call needs more (eager calls on different streams are ordered by runtime/memory.StreamOrder, so
sharing is safe).  A captured call's scratch is its own, from the graph arena.

Under ``Workspace(poison_outputs=True)`` every call's scratch is filled with 0xFF bytes before
its launch (:meth:`RankScratch.ptrs`), except the dependency counters, which every launch zeroes
itself right before its kernel (the kernels need them at zero).  Every other buffer is written by
the kernels before they read it -- padding rows and quantised zero blocks included; where a map
runs past what a kernel writes, TMA zero-fills (maps that end at T) or the launch zeroes it
(moe_fp8_bwd.pad_rows) -- so poison cannot change a result, only expose a kernel that no longer
writes what the GPU tests read back.  Eager calls reuse an earlier call's scratch anyway: none
may count on finding zeros or anything else there.
"""
from __future__ import annotations

from mok_rt.interop import dtypes
from mok_rt.interop.tensor import Tensor
from mok_rt.runtime.driver import call, driver

__all__ = ["RankScratch", "ZEROED_BY_LAUNCH"]

ZEROED_BY_LAUNCH = frozenset({"counters"})   # scratch every launch zeroes itself: never poisoned


class RankScratch:
    """One rank's scratch buffers.  ``buffers``: (kind, name) -> (pointer, bytes, owning Tensor)
    (the same dict for the rank's lifetime).  ``note_peak()`` is called after every allocation,
    ``stream_int(stream)`` gives a stream's handle (for the poison's memsets)."""

    def __init__(self, device_id: int, arena, *, poison: bool, note_peak, stream_int):
        self.device_id, self.arena, self.poison = device_id, arena, poison
        self._note_peak, self._stream_int = note_peak, stream_int
        self.buffers: dict[tuple, tuple] = {}
        self._gen = 0                            # buffers replaced so far
        self._last: dict[str, tuple] = {}        # kind -> (sizes, generation, pointers, as a tuple)

    @property
    def nbytes(self) -> int:
        return sum(v[1] for v in self.buffers.values())

    def ptrs(self, kind: str, sizes: dict, stream, capturing: bool) -> tuple[dict, tuple]:
        """The buffers of ``kind`` ("schedule", "forward", "backward", ...) by name for ``sizes``
        (name -> bytes), and their pointers as a tuple (for the prepared calls' keys): reused while
        large enough, replaced by a larger one when a call needs more (the old one is freed in
        stream order after the calls that used it).  0 for a buffer of 0 bytes.  The dict may be
        shared with the other calls of the same sizes until a buffer is replaced: read only."""
        if capturing:
            # A captured call's scratch is its own, in the arena: a replay may run beside eager
            # calls or other graphs on streams this rank never sees, so nothing may share it.
            ptrs = {name: self.arena.allocate(nbytes) for name, nbytes in sizes.items()}
            self._note_peak()
            got = ptrs, tuple(ptrs.values())
        else:
            got = self._shared(kind, sizes, stream)
        if self.poison:
            self._poison(got[0], sizes, stream)   # captured: every replay poisons again
        return got

    def _shared(self, kind: str, sizes: dict, stream) -> tuple[dict, tuple]:
        """ptrs() for an eager call: the rank's buffers, grown where too small."""
        # The answer for these sizes while no buffer was replaced since (``sizes`` is held by the
        # entry, so comparing it by identity is sound).
        last = self._last.get(kind)
        if last is not None and last[0] is sizes and last[1] == self._gen:
            return last[2], last[3]
        out = {}
        buffers = self.buffers
        for name, nbytes in sizes.items():
            if not nbytes:
                out[name] = 0
                continue
            key = (kind, name)
            have = buffers.get(key)
            if have is None or have[1] < nbytes:
                if have is not None:
                    # Unregistered (and every memo invalidated) before it is freed: if the
                    # allocation below fails (out of memory), nothing names freed memory and the
                    # next call allocates again.  Freed first so that the pool may reuse it.
                    del buffers[key]
                    self._gen += 1
                    # Freed on this call's stream, which StreamOrder placed after every earlier
                    # call of the rank (the last users of the old buffer), whatever their streams.
                    have[2]._owner.close(stream)
                t = Tensor.empty((nbytes,), dtypes.uint8, device_id=self.device_id, stream=stream)
                have = buffers[key] = (t.ptr, nbytes, t)
                self._gen += 1
                self._note_peak()
            out[name] = have[0]
        values = tuple(out.values())
        self._last[kind] = (sizes, self._gen, out, values)
        return out, values

    def _poison(self, ptrs: dict, sizes: dict, stream) -> None:
        """0xFF bytes (NaN for bf16 / f32 / E4M3, -1 for ints) in the ``sizes`` bytes of every
        buffer the call is about to use, on its stream, every call (module doc)."""
        handle = driver.CUstream(self._stream_int(stream))
        for name, ptr in ptrs.items():
            if ptr and name not in ZEROED_BY_LAUNCH:
                call("cuMemsetD8Async", driver.CUdeviceptr(ptr), 0xFF, sizes[name], handle)

    def close(self, stream) -> None:
        """Free every buffer on ``stream`` (after every call's work: the rank's stream, alive as
        long as the workspace), each even when freeing another failed (the first error is raised)."""
        held = list(self.buffers.values())
        self.buffers.clear()
        self._last.clear()
        first = None
        for have in held:
            try:
                have[2]._owner.close(stream)
            except Exception as e:
                first = first or e
        if first is not None:
            raise first
