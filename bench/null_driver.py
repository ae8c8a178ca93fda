"""A null CUDA driver for timing mok_rt's host path on a machine without a GPU.

Inside ``with null_driver():`` every ``cu*`` call that mok_rt makes through
``mok_rt.runtime.driver.call`` succeeds at once with dummy handles, and cuda.core's devices,
streams and pool allocations are replaced by small fakes.  Nothing runs and nothing is read: the
figure it gives is the Python cost of building and enqueueing the calls (the driver's own cost is
not included; cuda.bindings' argument types are still the real ones).

It lives in bench/, not in the package, and only patches module attributes for the duration of
the ``with`` block (restoring them afterwards), so the library's normal path never sees it.
Used by ``bench/host_profile.py --null-driver`` and by tests/test_prepared_calls.py.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools

from cuda.bindings import driver as _real

_OK = _real.CUresult.CUDA_SUCCESS
_attr = _real.CUdevice_attribute
_ATTRS = {
    _attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
    _attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
    _attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132,
    _attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 232448,
}


class _TensorMap:
    """What cuTensorMapEncodeTiled returns: 128 bytes behind getPtr()."""

    def __init__(self):
        self._raw = (ctypes.c_uint8 * 128)()

    def getPtr(self):   # noqa: N802 - the cuda.bindings name
        return ctypes.addressof(self._raw)


class NullDriver:
    """Stands in for ``cuda.bindings.driver`` behind ``mok_rt.runtime.driver.call``.  ``counts``
    tallies the calls by name; ``capturing`` makes cuStreamIsCapturing report an active capture
    (tests of the capture path)."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.launches: list = []      # (function, config, kernelParams) of every cuLaunchKernelEx
        self.memsets: list = []       # (pointer, value, words) of every cuMemsetD32Async
        self.memsets8: list = []      # (pointer, value, bytes) of every cuMemsetD8Async
        self.capturing = False
        self.record_launches = False
        self._ids = itertools.count(0x10)
        self._ptr = 1 << 40

    def __getattr__(self, name: str):
        if not name.startswith("cu"):
            return getattr(_real, name)
        special = getattr(self, "_" + name, None)

        def fn(*args):
            self.counts[name] = self.counts.get(name, 0) + 1
            return special(*args) if special is not None else (_OK,)
        return fn

    # -- the calls whose results mok_rt reads ----------------------------------------------------
    def _cuDeviceGetCount(self):
        return _OK, 1

    def _cuDeviceGet(self, ordinal):
        return _OK, int(ordinal)

    def _cuDeviceGetAttribute(self, attr, dev):
        return _OK, _ATTRS.get(attr, 1)

    def _cuDeviceGetName(self, n, dev):
        return _OK, b"null device\0"

    def _cuDevicePrimaryCtxRetain(self, dev):
        return _OK, next(self._ids)

    def _cuStreamCreate(self, flags):
        return _OK, next(self._ids)

    def _cuEventCreate(self, flags):
        return _OK, next(self._ids)

    def _cuMemAlloc(self, nbytes):
        self._ptr += -(-int(nbytes) // 4096) * 4096 + 4096
        return _OK, self._ptr

    def _cuLibraryLoadData(self, *args):
        return _OK, next(self._ids)

    def _cuLibraryGetKernel(self, lib, name):
        return _OK, next(self._ids)

    def _cuKernelGetFunction(self, k):
        return _OK, k

    def _cuOccupancyMaxActiveBlocksPerMultiprocessor(self, *args):
        return _OK, 1

    def _cuStreamIsCapturing(self, stream):
        status = _real.CUstreamCaptureStatus
        return _OK, (status.CU_STREAM_CAPTURE_STATUS_ACTIVE if self.capturing
                     else status.CU_STREAM_CAPTURE_STATUS_NONE)

    def _cuThreadExchangeStreamCaptureMode(self, mode):
        return _OK, mode

    def _cuTensorMapEncodeTiled(self, *args):
        return _OK, _TensorMap()

    def _cuLaunchKernelEx(self, cfg, fn, params, extra):
        if self.record_launches:
            self.launches.append((int(fn), int(cfg.hStream), params))
        return (_OK,)

    def _cuMemsetD32Async(self, ptr, value, words, stream):
        if self.record_launches:
            self.memsets.append((int(ptr), value, words))
        return (_OK,)

    def _cuMemsetD8Async(self, ptr, value, nbytes, stream):
        if self.record_launches:
            self.memsets8.append((int(ptr), value, nbytes))
        return (_OK,)

    def _cuGetErrorString(self, res):
        return _OK, b"null driver"


class _Buffer:
    """A cuda.core pool Buffer: a fake address, closed on a stream."""

    def __init__(self, ptr: int, nbytes: int, heap):
        self.handle, self.size, self._heap = ptr, nbytes, heap
        heap.live += 1

    def close(self, stream=None):
        if self._heap is not None:
            self._heap.live -= 1
            self._heap.freed.append(self.handle)
            self._heap = None

    def __del__(self):
        self.close()


class _Stream:
    """A cuda.core Stream: a handle, synchronised at once."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)

    def sync(self):
        pass


class _Device:
    """cuda.core's Device as mok_rt uses it: set_current, create_stream, allocate (a bump
    allocator that hands back the most recently freed address of the same size first, as a
    stream-ordered pool does)."""

    def __init__(self, device_id: int):
        self.device_id = device_id
        self.live = 0
        self.allocations = 0
        self.freed: list[int] = []
        self._sizes: dict[int, int] = {}
        self._next = (1 << 36) + (device_id << 34)
        self._streams = itertools.count(0x1000)

    def set_current(self):
        pass

    def create_stream(self, obj=None):
        return _Stream(next(self._streams))

    def allocate(self, nbytes: int, stream=None):
        self.allocations += 1
        for i in range(len(self.freed) - 1, -1, -1):
            p = self.freed[i]
            if self._sizes.get(p) == nbytes:
                del self.freed[i]
                return _Buffer(p, nbytes, self)
        p = self._next
        self._next += -(-nbytes // 4096) * 4096 + 4096
        self._sizes[p] = nbytes
        return _Buffer(p, nbytes, self)


@contextlib.contextmanager
def null_driver():
    """Patch mok_rt's driver and cuda.core entry points for the block; yields the NullDriver
    (``.devices[i]`` is the fake cuda.core Device of ordinal i)."""
    from mok_rt.interop import tensor as _tensor
    from mok_rt.runtime import cubins as _cubins
    from mok_rt.runtime import device as _device
    from mok_rt.runtime import driver as _driver

    fake = NullDriver()
    fake.devices = {}

    def device(device_id: int):
        d = fake.devices.get(device_id)
        if d is None:
            d = fake.devices[device_id] = _Device(device_id)
        return d

    @_cache
    def default_stream(device_id: int):
        return device(device_id).create_stream()

    def wrap_stream(stream, device_id: int):
        if stream is None:
            return default_stream(device_id)
        if isinstance(stream, _Stream):
            return stream
        proto = getattr(stream, "__cuda_stream__", None)
        return _Stream(int(proto()[1]) if proto is not None else int(stream))

    saved = [(_driver, "_drv", fake), (_device, "_device", device), (_device, "default_stream", default_stream),
             (_device, "wrap_stream", wrap_stream), (_tensor, "_activate", device),
             (_tensor, "_core_stream", lambda s: s)]
    saved = [(mod, name, getattr(mod, name), new) for mod, name, new in saved]
    caches = (_driver.init, _cubins.device_capability, _cubins.device_name, _cubins._library_at)
    for c in caches:
        c.cache_clear()
    handles, loaded = dict(_cubins._handles), set(_cubins._loaded)
    from mok_rt.kernels import moe_fp8 as _fp8
    from mok_rt.kernels import moe_fp8_bwd as _fp8_bwd
    from mok_rt.kernels import moe_launch as _launch
    from mok_rt.kernels import moe_maps as _maps
    from mok_rt.runtime import launch as _rlaunch
    memos = [(d, dict(d)) for d in (_launch._fit_cache, _launch._maps_cache, _maps._cache, _rlaunch._smem_set,
                                    _fp8._maps_cache, _fp8_bwd._maps_cache)]
    try:
        for mod, name, _, new in saved:
            setattr(mod, name, new)
        yield fake
    finally:
        for mod, name, old, _ in saved:
            setattr(mod, name, old)
        for c in caches:   # nothing learnt from the fake may survive it
            c.cache_clear()
        _cubins._handles.clear()
        _cubins._handles.update(handles)
        _cubins._loaded.clear()
        _cubins._loaded.update(loaded)
        for d, before in memos:   # occupancy, shared-memory limits, encoded maps: back as they were
            d.clear()
            d.update(before)


def _cache(fn):
    memo = {}

    def wrapped(key):
        if key not in memo:
            memo[key] = fn(key)
        return memo[key]
    return wrapped


def device_tensor(shape, dtype, *, device_id: int = 0, ptr: int):
    """A mok_rt Tensor over a fake device pointer (an input for the layer calls); it exports
    through DLPack like any device tensor."""
    from mok_rt.interop import dtypes
    from mok_rt.interop.tensor import Tensor
    return Tensor._from_pointer(ptr, shape, dtypes.as_dtype(dtype), device_id, None)


class FakeDeviceArray:
    """A DLPack producer over a fake device pointer that is about as cheap as CuPy's C
    ``__dlpack__`` (mok_rt's own Tensor export builds a carrier array per call, which would
    make the harness time the producer more than the consumer): the capsule is NumPy's, over a
    carrier array made once, with the device and data pointer set."""

    def __init__(self, shape, dtype, *, ptr: int, device_id: int = 0):
        import numpy as np
        from mok_rt.interop import dtypes
        from mok_rt.interop import dlpack
        self._dt = dtypes.as_dtype(dtype)
        self.shape, self.ptr, self.device_id = tuple(shape), ptr, device_id
        carrier = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[self._dt.itemsize]
        self._carrier = np.lib.stride_tricks.as_strided(np.zeros(1, carrier), shape, (0,) * len(shape))
        self._dlpack = dlpack

    def __dlpack_device__(self):
        return (self._dlpack.kDLCUDA, self.device_id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        d = self._dlpack
        versioned = max_version is not None and max_version[0] >= 1
        cap = self._carrier.__dlpack__(max_version=(1, 0)) if versioned else self._carrier.__dlpack__()
        name = d._NAME_V if versioned else d._NAME_LEGACY
        addr = d._PyCapsule_GetPointer(cap, name)
        m = (d.DLManagedTensorVersioned if versioned else d.DLManagedTensor).from_address(addr)
        t = m.dl_tensor
        t.data, t.device = self.ptr, d.DLDevice(d.kDLCUDA, self.device_id)
        t.dtype = d.DLDataType(self._dt.code, self._dt.bits, self._dt.lanes)
        if t.strides:   # NumPy writes the carrier's 0 strides; the array is C-contiguous
            acc = 1
            for i in range(len(self.shape) - 1, -1, -1):
                t.strides[i] = acc
                acc *= self.shape[i]
        return cap
