"""Devices and streams: the thin layer over cuda.core that the rest of mok_rt uses."""
from __future__ import annotations

import functools

from mok_rt.runtime import driver as _driver
from mok_rt.errors import ArgumentError

__all__ = ["activate", "default_stream", "wrap_stream"]


@functools.lru_cache(maxsize=None)
def _device(device_id: int):
    from cuda.core import Device
    _driver.init()
    n = _driver.device_count()
    if not 0 <= device_id < n:
        raise ArgumentError("device", f"CUDA device {device_id} does not exist ({n} visible)")
    return Device(device_id)


def activate(device_id: int):
    """Make ``device_id``'s primary context current on this thread; returns the cuda.core Device."""
    dev = _device(device_id)
    dev.set_current()
    return dev


@functools.lru_cache(maxsize=None)
def default_stream(device_id: int):
    """A non-blocking stream per device, owned by mok_rt (the workspace's default)."""
    return activate(device_id).create_stream()


def wrap_stream(stream, device_id: int):
    """A cuda.core Stream for ``stream`` (None: the device's mok_rt stream; a cuda.core Stream; any
    object with ``__cuda_stream__`` such as a CuPy or PyTorch stream)."""
    if stream is None:
        return default_stream(device_id)
    from cuda.core import LEGACY_DEFAULT_STREAM, Stream
    if isinstance(stream, Stream):
        return stream
    dev = activate(device_id)
    proto = getattr(stream, "__cuda_stream__", None)
    handle = int(proto()[1]) if proto is not None else stream
    if isinstance(handle, int) and not isinstance(handle, bool) and handle in (0, 1):
        # CUstream 0 is the legacy default stream (DLPack spells it 1); e.g. torch's default stream.
        return LEGACY_DEFAULT_STREAM
    if proto is not None:
        return dev.create_stream(stream)
    if isinstance(stream, int) and not isinstance(stream, bool):
        return Stream.from_handle(stream)
    raise ArgumentError("stream", f"expected None, a cuda.core Stream or an object with __cuda_stream__, "
                                  f"got {type(stream).__name__}")
