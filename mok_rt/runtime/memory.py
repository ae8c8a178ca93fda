"""Device memory for the backends: stream-ordered in eager mode, graph-safe while a stream is
being captured into a CUDA graph.

Eager calls take their buffers from the device's stream-ordered pool (cuda.core), freed when the
last reference goes.  That pool refuses to work on a capturing stream, and a graph needs its
buffers at fixed addresses for every replay anyway, so while a stream captures, buffers come from
a :class:`GraphArena`: plain ``cuMemAlloc`` blocks (allocated with the thread's capture mode
relaxed, as CUDA requires for non-stream-ordered calls during a capture) that stay allocated until
the arena is closed with its workspace.  A captured call's results therefore live as long as the
workspace, and each replay of the graph rewrites them.
"""
from __future__ import annotations

from mok_rt.runtime.driver import call, driver

__all__ = ["is_capturing", "GraphArena", "StreamOrder"]

_ACTIVE = driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE


_CUSTREAMS: dict[int, object] = {}   # int handle -> its driver.CUstream (a plain value wrapper)


def is_capturing(handle: int) -> bool:
    """Whether stream ``handle`` is capturing into a graph (legacy and per-thread handles included).
    Asked of the driver on every call: a stream may begin or end a capture at any time."""
    s = _CUSTREAMS.get(handle)
    if s is None:
        if len(_CUSTREAMS) >= 64:
            _CUSTREAMS.clear()
        s = _CUSTREAMS[handle] = driver.CUstream(int(handle))
    return call("cuStreamIsCapturing", s) == _ACTIVE


class GraphArena:
    """Device blocks for captured calls, kept until :meth:`close`."""

    def __init__(self, device_id: int):
        self.device_id = device_id
        self._blocks: list[int] = []
        self.nbytes = 0

    def allocate(self, nbytes: int) -> int:
        """A device pointer to ``nbytes`` (256-byte aligned, as every cuMemAlloc)."""
        if nbytes <= 0:
            return 0
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        previous = call("cuThreadExchangeStreamCaptureMode", mode)
        try:
            ptr = int(call("cuMemAlloc", nbytes))
        finally:
            call("cuThreadExchangeStreamCaptureMode", previous)
        self._blocks.append(ptr)
        self.nbytes += nbytes
        return ptr

    def close(self) -> None:
        """Free every block (the graphs that use them must not be replayed afterwards).  Every
        block is freed even if one free fails (the first error is raised afterwards): a failure
        must not leak the blocks after it."""
        blocks, self._blocks, self.nbytes = self._blocks, [], 0
        first = None
        for ptr in blocks:
            try:
                call("cuMemFree", driver.CUdeviceptr(ptr))
            except Exception as e:
                first = first or e
        if first is not None:
            raise first


class StreamOrder:
    """Orders the eager calls of one rank, which share its scratch buffers: when a call comes on
    another stream than the previous one, the new stream first waits for the old one's work (an
    event).  Captured calls take no part: their scratch is their own (a captured stream may not
    wait on work outside its graph)."""

    def __init__(self):
        self._event = None
        self._last: int | None = None

    def enter(self, handle: int) -> None:
        last, self._last = self._last, handle
        if last is None or last == handle:
            return
        if self._event is None:
            self._event = call("cuEventCreate", int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        call("cuEventRecord", self._event, driver.CUstream(last))
        call("cuStreamWaitEvent", driver.CUstream(handle), self._event, 0)

    def drained(self) -> None:
        """Every stream's work has finished (a synchronize): the next call needs no order, and the
        previous call's stream is forgotten -- its owner may destroy it now, and an event recorded
        on a dead handle (or on another stream that reuses it) would fail or order the wrong work."""
        self._last = None

    def close(self) -> None:
        # Dropped before it is destroyed: a failed destroy is not retried on a dead handle.
        event, self._event, self._last = self._event, None, None
        if event is not None:
            call("cuEventDestroy", event)
