"""Kernel launch through ``cuLaunchKernelEx``.

Kernels take a single parameter struct by value (``const __grid_constant__ Params p``); the
Python side mirrors it with a :class:`ctypes.Structure`.  The launcher handles dynamic shared
memory above 48 KB (raising the kernel's limit once per device), thread-block clusters and
cooperative launches.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

from mok_rt.runtime import driver as _driver
from mok_rt.runtime.driver import call, driver
from mok_rt.runtime.cubins import Kernel
from mok_rt.errors import ArgumentError

__all__ = ["launch", "PreparedLaunch", "stream_handle", "max_shared_memory", "multiprocessor_count",
           "max_active_clusters"]

_smem_set: dict[tuple[int, int], int] = {}  # (kernel address, device) -> bytes allowed


def stream_handle(stream) -> int:
    """The raw ``CUstream`` of a cuda.core Stream, an object with ``__cuda_stream__``, or an int."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        _, handle = proto() if callable(proto) else proto
        return int(handle)
    handle = getattr(stream, "handle", None)
    if handle is not None:
        return int(handle)
    raise ArgumentError("stream", f"expected a cuda.core Stream, an object with __cuda_stream__ or an int, "
                                  f"got {type(stream).__name__}")


def _dim3(v, name: str) -> tuple[int, int, int]:
    if isinstance(v, int):
        v = (v,)
    v = tuple(int(a) for a in v) + (1,) * (3 - len(v))
    if len(v) != 3 or any(a < 1 for a in v):
        raise ArgumentError(name, f"expected 1 to 3 positive ints, got {v}")
    return v  # type: ignore[return-value]


def _attr_device(device_id: int):
    _driver.init()
    return call("cuDeviceGet", device_id)


def max_shared_memory(device_id: int) -> int:
    """Largest dynamic shared memory a block may opt in to on this device (bytes)."""
    a = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    return int(call("cuDeviceGetAttribute", a, _attr_device(device_id)))


def multiprocessor_count(device_id: int) -> int:
    a = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    return int(call("cuDeviceGetAttribute", a, _attr_device(device_id)))


def _ensure_shared_memory(kernel: Kernel, device_id: int, nbytes: int) -> None:
    key = (kernel.address, device_id)
    if _smem_set.get(key, 48 * 1024) >= nbytes:
        return
    limit = max_shared_memory(device_id)
    if nbytes > limit:
        raise ArgumentError("shared_mem", f"{nbytes} bytes requested, device {device_id} allows {limit}")
    call("cuKernelSetAttribute",
         driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
         nbytes, kernel.handle, _attr_device(device_id))
    _smem_set[key] = nbytes


class PreparedLaunch:
    """One kernel launch with everything fixed: kernel, grid, block, shared memory, stream and
    the by-value parameter struct, so that enqueueing it again is one driver call.  The struct is
    copied by the driver at each launch, so a PreparedLaunch may be enqueued any number of times
    (the caches of mok_rt/backends/cuda.py keep them for calls that repeat)."""

    __slots__ = ("kernel", "params", "_cfg", "_fn", "_args", "_kernel_params")

    def __init__(self, kernel: Kernel, *, grid, block, params: ctypes.Structure | None, stream, device_id: int = 0,
                 shared_mem: int = 0, cluster: Sequence[int] | int | None = None, cooperative: bool = False):
        gx, gy, gz = _dim3(grid, "grid")
        bx, by, bz = _dim3(block, "block")
        if bx * by * bz > 1024:
            raise ArgumentError("block", f"{bx * by * bz} threads per block exceeds 1024")
        if shared_mem > 48 * 1024:
            _ensure_shared_memory(kernel, device_id, shared_mem)

        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = gx, gy, gz
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = bx, by, bz
        cfg.sharedMemBytes = int(shared_mem)
        cfg.hStream = driver.CUstream(stream_handle(stream))
        attrs = []
        if cluster is not None:
            cx, cy, cz = _dim3(cluster, "cluster")
            a = driver.CUlaunchAttribute()
            a.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = cx, cy, cz
            attrs.append(a)
        if cooperative:
            a = driver.CUlaunchAttribute()
            a.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            a.value.cooperative = 1
            attrs.append(a)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        self.kernel, self.params, self._cfg = kernel, params, cfg
        self._fn = driver.CUfunction(kernel.address)
        if params is None:
            self._args, self._kernel_params = None, 0
        else:
            # kernelParams is an array of pointers, one per kernel argument: here the one struct.
            # Both stay referenced by self, so the addresses stay valid for every enqueue.
            self._args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
            self._kernel_params = ctypes.addressof(self._args)

    def __call__(self) -> None:
        """Enqueue the launch (asynchronous; nothing waits)."""
        call("cuLaunchKernelEx", self._cfg, self._fn, self._kernel_params, 0)


def launch(kernel: Kernel, *, grid, block, params: ctypes.Structure | None, stream, device_id: int = 0,
           shared_mem: int = 0, cluster: Sequence[int] | int | None = None, cooperative: bool = False) -> None:
    """Launch ``kernel`` on ``stream`` (asynchronous; nothing waits).

    ``params`` is passed by value as the kernel's one argument (``None`` for kernels without
    arguments).  The stream's context must be current (the workspace makes its device's primary
    context current before it launches).
    """
    PreparedLaunch(kernel, grid=grid, block=block, params=params, stream=stream, device_id=device_id,
                   shared_mem=shared_mem, cluster=cluster, cooperative=cooperative)()


def max_active_clusters(kernel: Kernel, *, block, cluster: Sequence[int] | int, shared_mem: int = 0,
                        device_id: int = 0) -> int:
    """How many clusters of ``cluster`` CTAs of ``kernel`` (``block`` threads, ``shared_mem`` bytes
    of dynamic shared memory each) the device runs at once (cuOccupancyMaxActiveClusters).  A
    persistent kernel launched on clusters must size its grid by this, not by the SM count: the
    GPCs' SM counts need not be multiples of the cluster size."""
    p = PreparedLaunch(kernel, grid=cluster, block=block, params=None, stream=0, device_id=device_id,
                       shared_mem=shared_mem, cluster=cluster)
    return int(call("cuOccupancyMaxActiveClusters", p._fn, p._cfg))
