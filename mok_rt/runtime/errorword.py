"""The device error word: how a kernel reports what only the device can see.

``int32[4]`` in the device's own memory.  Kernels poll it in their hot loops (every task grab,
every spin), so it must not live in host-mapped memory: measured on the H200 VMs here, one read
of host-mapped memory from a kernel costs tens of microseconds.  The host copies it out (on a
private non-blocking stream) after synchronising.  Layout and codes:
``cuda_src/common/errors.cuh`` (``[0]`` code, first error wins; ``[1..3]`` details).
"""
from __future__ import annotations

import contextlib
import ctypes

from mok_rt.runtime import driver as _driver
from mok_rt.errors import (ArgumentError, CapacityError, DeviceError, ExpertIdError, MokError, PeerTimeoutError,
                     TokenCountError)

__all__ = ["ErrorWord", "ErrorReports", "PrimaryContext", "device_error"]

# Mirrors mok::ErrorCode in cuda_src/common/errors.cuh.
ERR_NONE, ERR_EXPERT_ID, ERR_CAPACITY, ERR_TIMEOUT, ERR_TOKENS, ERR_INTERNAL = range(6)

_WORDS = 4
_NBYTES = 4 * _WORDS


class PrimaryContext:
    """A retained primary context of one device; ``with ctx.current():`` pushes it for a block.

    Pushing (rather than setting) leaves whatever context the caller had current untouched.
    """

    def __init__(self, device_id: int, *, api=None):
        self.api = api or _driver
        self.api.init()
        self.device_id = device_id
        self.device = self.api.call("cuDeviceGet", device_id)
        self.handle = self.api.call("cuDevicePrimaryCtxRetain", self.device)

    @contextlib.contextmanager
    def current(self):
        self.api.call("cuCtxPushCurrent", self.handle)
        try:
            yield self
        finally:
            self.api.call("cuCtxPopCurrent")

    def release(self) -> None:
        if self.handle is not None:
            self.handle = None
            self.api.call("cuDevicePrimaryCtxRelease", self.device)


class ErrorWord:
    """``int32[4]`` in the device memory of ``device_id`` (``cuMemAlloc``; module doc: not
    host-mapped), written by the kernels launched on that device.

    ``device_ptr`` goes into a kernel's parameters; after synchronising, :meth:`read` returns
    ``(code, a, b, c)`` and :meth:`raise_if_set` raises the matching :class:`DeviceError`.
    :meth:`clear` resets it (only while no kernel that may write it is running).
    """

    def __init__(self, device_id: int, *, _api=None):
        if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
            raise ArgumentError("device_id", f"expected a device ordinal, got {device_id!r}")
        self.device_id = device_id
        self._api = _api or _driver
        self._ctx = PrimaryContext(device_id, api=self._api)
        self.device_ptr = 0
        self._stream = None
        self._words = (ctypes.c_int32 * _WORDS)()
        try:
            with self._ctx.current():
                # A stream of its own: reading or clearing the word must not wait behind (or be
                # ordered with) a kernel that spins on another stream.
                self._stream = self._api.call("cuStreamCreate", self._api.driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
                self.device_ptr = int(self._api.call("cuMemAlloc", _NBYTES))
            self.clear()
        except BaseException:
            self.close()
            raise

    def read(self) -> tuple[int, int, int, int]:
        """``(code, a, b, c)``; code 0 means no error.  Reflects the kernels that have finished."""
        self._check_open()
        with self._ctx.current():
            self._api.call("cuMemcpyDtoHAsync", ctypes.addressof(self._words), self.device_ptr, _NBYTES,
                           self._stream)
            self._api.call("cuStreamSynchronize", self._stream)
        return tuple(int(v) for v in self._words)  # type: ignore[return-value]

    def clear(self) -> None:
        """Reset to "no error" (only while no kernel that may write it is running)."""
        self._check_open()
        with self._ctx.current():
            self._api.call("cuMemsetD32Async", self.device_ptr, 0, _WORDS, self._stream)
            self._api.call("cuStreamSynchronize", self._stream)

    def raise_if_set(self, context: str = "kernel", *, note: str = "") -> None:
        """Raise the :class:`DeviceError` subclass for the recorded code, if any (``note`` is
        appended to the message)."""
        code, a, b, c = self.read()
        if code == ERR_NONE:
            return
        raise device_error(code, (a, b, c), context, note=note)

    def _check_open(self) -> None:
        if not self.device_ptr:
            raise MokError("the error word is closed")

    @property
    def closed(self) -> bool:
        return not self.device_ptr

    def close(self) -> None:
        """Free the device memory and the stream (idempotent)."""
        ctx, self._ctx = getattr(self, "_ctx", None), None
        ptr, self.device_ptr = getattr(self, "device_ptr", 0), 0
        stream, self._stream = getattr(self, "_stream", None), None
        if ctx is None:
            return
        try:
            with ctx.current():
                try:
                    if ptr:
                        self._api.call("cuMemFree", ptr)
                finally:
                    if stream is not None:
                        self._api.call("cuStreamDestroy", stream)
        finally:
            ctx.release()

    def __enter__(self) -> "ErrorWord":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else str(self.read())
        return f"ErrorWord(device_id={self.device_id}, {state})"


class ErrorReports:
    """When a backend's ``check()`` may clear its error word (docs/SEMANTICS.md §8).

    A kernel that finds an error sets the word, and every kernel launched after it exits at once
    while the word is set.  Clearing it while kernels of the failed step are still pending would
    let them run as if nothing had failed (a backward with ``accumulate=True`` adding a stale
    layout into the caller's buffers; with expert parallelism, ranks that diverge).  So an error
    is cleared by the host only when nothing can still read the word (``idle``); otherwise it is
    left set and remembered as *raised*: it is not raised again, and the next eager call clears
    it on its own stream (:meth:`before_call`), after every earlier call of the rank
    (runtime/memory.StreamOrder) and before its own kernels, so calls made after the report run.
    An event recorded after that clear tells, without waiting, when the word may hold a new error.
    """

    def __init__(self, word: ErrorWord):
        self.word = word
        self.raised = False      # the word holds an error already raised, not cleared yet
        self._enqueued = False   # ... whose clear is enqueued, followed by _event
        self._event = None

    def poll(self, idle) -> tuple | None:
        """The error to raise now, ``(code, a, b, c)``, or None (none, or the one already raised).
        ``idle()``: whether no work of the rank can still be pending (asked only when the word is
        set); then the word is cleared now."""
        info = self.word.read()
        if self.raised and self._enqueued and _driver.ready("cuEventQuery", self._event):
            # The clear enqueued since has run, after the read above or before it: read again,
            # what the word holds now came after the clear.
            self.raised = self._enqueued = False
            info = self.word.read()
        if not info[0]:
            return None
        if self.raised:   # the error already raised: the clear enqueued has not run yet
            if not self._enqueued and idle():
                self.word.clear()
                self.raised = False
            return None
        if idle():
            self.word.clear()
        else:
            self.raised = True
        return info

    def before_call(self, handle: int) -> None:
        """An eager call on stream ``handle`` begins (ordered after every earlier call of the rank):
        enqueue the clear of an error already raised, once."""
        if not self.raised or self._enqueued:
            return
        drv = _driver.driver
        stream = drv.CUstream(handle)
        _driver.call("cuMemsetD32Async", drv.CUdeviceptr(self.word.device_ptr), 0, _WORDS, stream)
        if self._event is None:
            self._event = _driver.call("cuEventCreate", int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        # Enqueued only once recorded: a failed record leaves the next call to clear again (no
        # kernel ran in between, so a second clear loses nothing).
        _driver.call("cuEventRecord", self._event, stream)
        self._enqueued = True

    def close(self) -> None:
        event, self._event = self._event, None
        self.raised = self._enqueued = False
        if event is not None:
            _driver.call("cuEventDestroy", event)


def device_error(code: int, info: tuple, context: str, *, note: str = "") -> DeviceError:
    """The :class:`DeviceError` subclass for an error word ``code`` with ``info`` (a, b, c)."""
    e = _device_error(code, tuple(info), context)
    if note:
        e.args = (f"{e.args[0]}{note}",) + e.args[1:]
    return e


def _device_error(code: int, info: tuple, context: str) -> DeviceError:
    a, b, c = info
    if code == ERR_TIMEOUT:
        # A local wait reports -1: one of its rank's own tasks never finished (most likely
        # blocked behind a peer whose own wait reported first, or a kernel fault).
        who = "an unknown rank" if b < 0 else f"rank {b}"
        return PeerTimeoutError(f"{context}: rank {a} timed out waiting for {who} (epoch/stage {c}); "
                                f"did every rank launch it?", code=code, info=info, rank=b)
    if code == ERR_EXPERT_ID:
        return ExpertIdError(f"{context}: rank {a}, token {b}: expert id {c} is out of range",
                             code=code, info=info)
    if code == ERR_CAPACITY:
        return CapacityError(f"{context}: rank {a} received {b} rows, more than its capacity of {c}",
                             code=code, info=info)
    if code == ERR_TOKENS:
        return TokenCountError(f"{context}: rank {a} has {b} tokens, more than the maximum {c}",
                               code=code, info=info)
    if code == ERR_INTERNAL:
        return DeviceError(f"{context}: internal error at line {a} ({b}, {c})", code=code, info=info)
    return DeviceError(f"{context}: unknown device error code {code} {info}", code=code, info=info)
