"""The group barrier over a symmetric heap's signal pad, as a kernel on a stream
(``symm_barrier`` in cuda_src/comm/symm_kernels.cu; its protocol in cuda_src/comm/barrier.cuh)."""
from __future__ import annotations

import ctypes
import math

from mok_rt.dist.symmetric import SignalPad, SymmetricHeap
from mok_rt.errors import ArgumentError
from mok_rt.runtime.errorword import ErrorWord

__all__ = ["device_barrier"]


class _BarrierParams(ctypes.Structure):
    """Mirror of mok::GroupBarrier (cuda_src/comm/barrier.cuh)."""

    _fields_ = [("peer_bases", ctypes.c_uint64), ("err", ctypes.c_uint64), ("pad_offset", ctypes.c_uint64),
                ("timeout_ns", ctypes.c_uint64), ("rank", ctypes.c_int32), ("size", ctypes.c_int32)]


assert ctypes.sizeof(_BarrierParams) == 40


def device_barrier(heap_or_pad: SymmetricHeap | SignalPad, *, rank: int, stream, timeout_s: float = 10.0,
                   error_word: ErrorWord | None = None, wait: bool = False) -> None:
    """Enqueue a group barrier for local rank ``rank`` on ``stream`` (every rank must launch one).

    A rank that has not arrived after ``timeout_s`` makes the kernel record a timeout naming it
    in ``error_word`` (default: ``heap.error_word(rank)``) and exit.  With ``wait=True`` this
    synchronises ``stream`` and raises :class:`~mok_rt.errors.PeerTimeoutError` naming the missing
    rank; otherwise check ``error_word.raise_if_set()`` after synchronising.  When one process
    drives several ranks, launch each rank's barrier on its own stream before waiting on any.
    """
    from mok_rt.runtime.cubins import get_kernel
    from mok_rt.runtime.launch import launch, stream_handle

    if isinstance(heap_or_pad, SymmetricHeap):
        pad = heap_or_pad.signal_pad
    elif isinstance(heap_or_pad, SignalPad):
        pad = heap_or_pad
    else:
        raise ArgumentError("heap_or_pad", f"expected a SymmetricHeap or SignalPad, got {type(heap_or_pad).__name__}")
    heap = pad.heap
    heap._check_open()
    heap.group.check_local(rank)
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
        raise ArgumentError("timeout_s", f"expected a positive number of seconds, got {timeout_s!r}")
    ew = error_word or heap.error_word(rank)
    device = heap.group.devices[rank]
    params = _BarrierParams(peer_bases=heap.peer_ptr_array(rank), err=ew.device_ptr, pad_offset=pad.offset,
                            timeout_ns=int(timeout_s * 1e9), rank=rank, size=heap.size)
    kernel = get_kernel("symm_kernels", "symm_barrier", device)
    with heap._ctx[device].current():
        launch(kernel, grid=1, block=32, params=params, stream=stream, device_id=device)
        if wait:
            heap._api.call("cuStreamSynchronize", stream_handle(stream))
    if wait:
        ew.raise_if_set(f"device_barrier(rank={rank})")

