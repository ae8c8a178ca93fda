"""Exceptions raised by mok_rt.

Every failure mok_rt can detect surfaces as a subclass of :class:`MokError`:

* :class:`ArgumentError` -- a bad argument caught on the host before anything is launched
  (wrong dtype, shape, device, stride, alignment, value).  It names the argument.
* :class:`CudaDriverError` -- a CUDA driver call failed; names the call and the CUresult.
* :class:`NoCubinError` -- no precompiled kernel for this device.
* :class:`DeviceError` and subclasses -- a condition only the device could see (an expert id
  out of range, capacity exceeded, a peer that never arrived).  The kernel sets an error word
  and exits; the runtime raises at the next synchronising call.
"""
from __future__ import annotations

__all__ = [
    "MokError", "ArgumentError", "CudaDriverError", "NoCubinError", "DeviceError",
    "ExpertIdError", "CapacityError", "PeerTimeoutError", "TokenCountError",
]


class MokError(Exception):
    """Base class of every mok_rt exception."""

    def __reduce__(self):
        # BaseException pickles as cls(*self.args), but the subclasses' constructors take other
        # arguments than their one formatted message (ArgumentError(argument, message),
        # CudaDriverError(call, result, detail)), so an error raised in a worker process could not
        # be unpickled and broke the pool.  Rebuild without __init__: the same args (hence the same
        # str()) and every attribute.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls, args, state):
    """The exception ``MokError.__reduce__`` saved (pickle and copy call it)."""
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    return err


class ArgumentError(MokError, ValueError):
    """A host-side argument failed validation; ``.argument`` names it."""

    def __init__(self, argument: str, message: str):
        self.argument = argument
        super().__init__(f"{argument}: {message}")


class CudaDriverError(MokError, RuntimeError):
    """A CUDA driver call returned an error."""

    def __init__(self, call: str, result, detail: str = ""):
        self.call = call
        self.result = result
        if result is None:
            msg = f"{call} failed"
        else:
            msg = f"{call} failed with {getattr(result, 'name', str(result))} ({int(result)})"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


class NoCubinError(MokError, RuntimeError):
    """No precompiled cubin matches the device's compute capability."""


class DeviceError(MokError, RuntimeError):
    """An error reported by a kernel through the workspace's error word."""

    def __init__(self, message: str, *, code: int = 0, info: tuple[int, ...] = ()):
        self.code = code
        self.info = info
        super().__init__(message)


class ExpertIdError(DeviceError):
    """A routed expert id is outside ``[0, num_experts)``."""


class CapacityError(DeviceError):
    """More rows were routed to a rank than its configured capacity."""


class TokenCountError(DeviceError):
    """A rank's token count exceeds the workspace's maximum."""


class PeerTimeoutError(DeviceError):
    """A peer rank did not arrive within the timeout; ``.rank`` names it."""

    def __init__(self, message: str, *, code: int = 0, info: tuple[int, ...] = (), rank: int = -1):
        super().__init__(message, code=code, info=info)
        self.rank = rank
