"""The tensor type mok_rt returns.

A :class:`Tensor` owns (or views) device memory allocated through cuda.core, or a host NumPy
array (the reference backend).  It exports itself through DLPack with its real dtype (bfloat16
and fp8 included) and honours the consumer's stream.  A device tensor has a producer stream
(the one it was allocated on): a consumer on another stream is made to wait for it with an event
(cuEventRecord + cuStreamWaitEvent), and a write of ours on another stream is joined back into
it, so the producer stream is always ordered after every write we made (the stream-ordered free
included).  Writes a DLPack consumer makes on its own streams are the consumer's to order.
"""
from __future__ import annotations

import ctypes
import enum
import math
from typing import Union

import numpy as np

from mok_rt.interop import dtypes as _dt
from mok_rt.runtime.driver import call, driver
from mok_rt.interop.dlpack import (
    DLPACK_VERSION, TensorView, kDLCPU, kDLCUDA, _c_strides, _is_c_contiguous, _stream_handle,
)
from mok_rt.interop.dlpack_export import _export_capsule
from mok_rt.interop.dtypes import DType
from mok_rt.errors import ArgumentError

__all__ = ["Tensor"]

StreamLike = Union[int, object]  # a CUstream int, a cuda.core Stream, anything with __cuda_stream__

_LEGACY_STREAM = 1  # CU_STREAM_LEGACY as a handle value


def _activate(device_id: int):
    """Make ``device_id``'s primary context current (what cuda.core expects before use)."""
    from cuda.core import Device

    dev = Device(device_id)
    dev.set_current()
    return dev


def _core_stream(stream):
    """A cuda.core Stream for ``stream`` (cuda.core's allocator wants one)."""
    from cuda.core import LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Stream

    if isinstance(stream, Stream):
        return stream
    handle = _stream_handle(stream)
    if handle in (0, _LEGACY_STREAM):
        return LEGACY_DEFAULT_STREAM
    if handle == 2:
        return PER_THREAD_DEFAULT_STREAM
    return Stream.from_handle(handle)


def _check_shape(shape) -> tuple[int, ...]:
    dims = shape if isinstance(shape, (tuple, list)) else (shape,)
    # Integers only: int() would turn 2.9 into 2 and True into 1, a shape nobody asked for.
    if any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) for n in dims):
        raise ArgumentError("shape", f"expected a tuple of ints, got {shape!r}")
    out = tuple(int(n) for n in dims)
    if any(n < 0 for n in out):
        raise ArgumentError("shape", f"dimensions must be >= 0, got {out}")
    return out


def _host_array(ptr: int, shape, strides, dtype: DType, keep) -> np.ndarray:
    """A NumPy array over host memory at ``ptr`` that keeps ``keep`` alive."""
    item = dtype.itemsize
    if any(n == 0 for n in shape) or not ptr:
        return np.empty(shape, dtype.numpy)
    lo = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
    buf = (ctypes.c_char * ((hi - lo + 1) * item)).from_address(ptr + lo * item)
    buf._mok_keepalive = keep  # the array's base chain now ends at the owner
    return np.ndarray(shape, dtype.numpy, buffer=buf, offset=-lo * item,
                      strides=tuple(s * item for s in strides))


def _requested_version(max_version) -> tuple[bool, tuple[int, int]]:
    """``__dlpack__``'s ``max_version``: (versioned capsule?, the version to write in it)."""
    if max_version is None:
        return False, (1, 0)
    if not (isinstance(max_version, tuple) and len(max_version) == 2
            and all(_is_int(v) for v in max_version)):
        raise TypeError(f"__dlpack__: max_version must be None or a (major, minor) tuple of ints, "
                        f"got {max_version!r}")
    if max_version[0] < 1:   # a pre-1.0 consumer reads only the legacy struct
        return False, (1, 0)
    return True, (DLPACK_VERSION if tuple(max_version) >= DLPACK_VERSION else (1, 0))


def _requested_device(dl_device) -> tuple[int, int]:
    """``__dlpack__``'s ``dl_device`` (a ``__dlpack_device__()``-style tuple) as two ints."""
    if isinstance(dl_device, tuple) and len(dl_device) == 2:
        kind, index = dl_device
        if isinstance(kind, enum.Enum):   # the standard types it tuple[Enum, int]
            kind = kind.value
        if _is_int(kind) and _is_int(index):
            return int(kind), int(index)
    raise TypeError(f"__dlpack__: dl_device must be None or a (device_type, device_id) tuple as "
                    f"__dlpack_device__() returns, e.g. (1, 0) for the CPU, got {dl_device!r}")


def _requested_stream(stream) -> int | None:
    """``__dlpack__``'s ``stream`` as a handle: TypeError, not the ArgumentError the layer calls
    raise, for a value that is no stream at all."""
    try:
        return _stream_handle(stream)
    except ArgumentError:
        raise TypeError(f"__dlpack__: stream must be None, an int CUDA stream handle or an object "
                        f"with __cuda_stream__, got {stream!r}") from None


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


class Tensor:
    """A mok_rt tensor: device memory (``device == ("cuda", id)``) or a host array (``"cpu"``).

    Build one with :meth:`empty` or :meth:`from_numpy`.  Hand it to any DLPack consumer
    (``cupy.from_dlpack``, ``torch.from_dlpack``, ``numpy.from_dlpack`` for host tensors): no copy.
    """

    __slots__ = ("_shape", "_strides", "_dtype", "_device_id", "_ptr", "_owner", "_array",
                 "_readonly", "_producer_stream", "_stream_keep", "__weakref__")

    def __init__(self):
        raise TypeError("use Tensor.empty(...) or Tensor.from_numpy(...)")

    @classmethod
    def _new(cls, *, ptr: int, shape, strides, dtype: DType, device_id: int | None, owner,
             array: np.ndarray | None = None, stream=None, readonly: bool = False) -> "Tensor":
        self = object.__new__(cls)
        self._ptr = int(ptr or 0)
        self._shape = tuple(int(n) for n in shape)
        self._strides = tuple(int(s) for s in strides)
        self._dtype = dtype
        self._device_id = None if device_id is None else int(device_id)
        self._owner = owner
        self._array = array
        self._readonly = bool(readonly)
        self._producer_stream = None if stream is None else _stream_handle(stream)
        self._stream_keep = stream  # the handle stays valid while a Stream object is held
        return self

    @classmethod
    def _wrap(cls, ptr: int, shape: tuple, strides: tuple, dtype: DType, device_id: int, owner,
              stream_handle: int | None, stream) -> "Tensor":
        """:meth:`_new` for the hot path of the backends: every argument already normalised
        (int pointer, tuples of ints, the producer stream's handle computed once per call)."""
        self = object.__new__(cls)
        self._ptr, self._shape, self._strides, self._dtype = ptr, shape, strides, dtype
        self._device_id, self._owner, self._array, self._readonly = device_id, owner, None, False
        self._producer_stream, self._stream_keep = stream_handle, stream
        return self

    # ------------------------------------------------------------------ constructors
    @classmethod
    def empty(cls, shape, dtype, *, device_id: int | None, stream: StreamLike | None = None
              ) -> "Tensor":
        """Uninitialised C-contiguous tensor.

        ``device_id``: a CUDA device ordinal (memory from cuda.core, stream-ordered on
        ``stream``, which is then this tensor's producer stream; the device is made current),
        or None for host memory (a NumPy array; ``stream`` is ignored).
        """
        shape = _check_shape(shape)
        dt = _dt.as_dtype(dtype)
        strides = _c_strides(shape)
        if device_id is None:
            arr = np.empty(shape, dt.numpy)
            return cls._new(ptr=arr.ctypes.data, shape=shape, strides=strides, dtype=dt,
                            device_id=None, owner=arr, array=arr)
        if isinstance(device_id, bool) or not isinstance(device_id, (int, np.integer)) \
                or device_id < 0:
            raise ArgumentError("device_id", f"expected a CUDA device ordinal, got {device_id!r}")
        if stream is None:
            raise ArgumentError("stream", "device memory needs a stream (allocation is "
                                          "stream-ordered); pass e.g. 1 for the legacy default")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        core = _core_stream(stream)
        buf = None
        if nbytes:
            dev = _activate(int(device_id))
            buf = dev.allocate(nbytes, stream=core)
        return cls._new(ptr=int(buf.handle) if buf is not None else 0, shape=shape,
                        strides=strides, dtype=dt, device_id=int(device_id), owner=buf,
                        stream=core)

    @classmethod
    def from_numpy(cls, arr: np.ndarray) -> "Tensor":
        """A host tensor viewing ``arr`` (no copy; writes are visible both ways)."""
        if not isinstance(arr, np.ndarray):
            raise ArgumentError("arr", f"expected a numpy.ndarray, got {type(arr).__name__}")
        dt = _dt.as_dtype(arr.dtype, argument="arr")
        if any(s % dt.itemsize for s in arr.strides):
            raise ArgumentError("arr", f"strides {arr.strides} are not whole elements")
        strides = tuple(s // dt.itemsize for s in arr.strides)
        return cls._new(ptr=arr.ctypes.data, shape=arr.shape, strides=strides, dtype=dt,
                        device_id=None, owner=arr, array=arr, readonly=not arr.flags.writeable)

    @classmethod
    def _from_pointer(cls, ptr: int, shape, dtype, device_id: int, owner, *,
                      stream: StreamLike | None = None, strides=None,
                      readonly: bool = False) -> "Tensor":
        """Wrap existing device memory; ``owner`` is kept alive as long as the tensor.  Without
        ``stream`` no producer stream is known and exports do not synchronise."""
        shape = _check_shape(shape)
        return cls._new(ptr=ptr, shape=shape, dtype=_dt.as_dtype(dtype),
                        strides=_c_strides(shape) if strides is None else strides,
                        device_id=device_id, owner=owner, stream=stream, readonly=readonly)

    @classmethod
    def _from_view(cls, view: TensorView, *, stream: StreamLike | None = None) -> "Tensor":
        """Wrap an imported :class:`~mok_rt.interop.dlpack.TensorView` (keeps it alive)."""
        if view.device == "cpu":
            arr = _host_array(view.ptr, view.shape, view.strides, view.dtype, view)
            return cls._new(ptr=view.ptr, shape=view.shape, strides=view.strides,
                            dtype=view.dtype, device_id=None, owner=view, array=arr,
                            readonly=view.readonly)
        if view.device[0] != "cuda":
            raise ArgumentError("view", f"unsupported device {view.device}")
        return cls._new(ptr=view.ptr, shape=view.shape, strides=view.strides, dtype=view.dtype,
                        device_id=view.device_id, owner=view, stream=stream,
                        readonly=view.readonly)

    # ------------------------------------------------------------------ attributes
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in elements."""
        return self._strides

    @property
    def dtype(self) -> DType:
        return self._dtype

    @property
    def device(self):
        """``("cuda", id)`` or ``"cpu"``."""
        return "cpu" if self._device_id is None else ("cuda", self._device_id)

    @property
    def device_id(self) -> int | None:
        return self._device_id

    @property
    def ptr(self) -> int:
        return self._ptr

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return math.prod(self._shape)   # plain ints: no NumPy reduction on the host path

    @property
    def nbytes(self) -> int:
        return self.size * self._dtype.itemsize

    @property
    def readonly(self) -> bool:
        return self._readonly

    @property
    def is_c_contiguous(self) -> bool:
        return _is_c_contiguous(self._shape, self._strides)

    def __repr__(self) -> str:
        dev = "cpu" if self._device_id is None else f"cuda:{self._device_id}"
        return (f"Tensor(shape={self._shape}, dtype={self._dtype.name}, device={dev}, "
                f"ptr={self._ptr:#x})")

    # ------------------------------------------------------------------ streams
    def _stream_wait(self, waiter: int, signaller: int) -> None:
        """Make stream ``waiter`` wait for the work enqueued so far on ``signaller``."""
        _activate(self._device_id)
        event = call("cuEventCreate", int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        try:
            call("cuEventRecord", event, signaller)
            call("cuStreamWaitEvent", waiter, event, 0)
        finally:
            call("cuEventDestroy", event)  # safe: released once the recorded work completes

    def _order_before(self, consumer: int) -> None:
        """Make stream ``consumer`` wait for the work pending on the producer stream."""
        producer = self._producer_stream
        if producer is None or consumer == producer or consumer == -1:
            return
        self._stream_wait(consumer, producer)

    def _op_stream(self, stream) -> int:
        """The stream a copy/fill runs on (default: the producer stream), ordered after the
        producer stream's pending work."""
        if stream is None:
            return self._producer_stream if self._producer_stream is not None else _LEGACY_STREAM
        handle = _stream_handle(stream)
        if handle == 0:
            handle = _LEGACY_STREAM
        self._order_before(handle)
        return handle

    def _rejoin(self, handle: int, stream) -> None:
        """After a write on ``handle``: the producer stream waits for it, so the producer stream
        stays the one place later users (and the stream-ordered free) are ordered after."""
        if self._producer_stream is None:
            self._producer_stream, self._stream_keep = handle, stream
        elif handle != self._producer_stream:
            self._stream_wait(self._producer_stream, handle)

    # ------------------------------------------------------------------ DLPack
    def __dlpack_device__(self) -> tuple[int, int]:
        return (kDLCPU, 0) if self._device_id is None else (kDLCUDA, self._device_id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export as a DLPack capsule (versioned when ``max_version >= (1, 0)``).

        Device tensors: the consumer's ``stream`` (None = legacy default stream, a CUstream
        int, 1 legacy, 2 per-thread, -1 no synchronisation) waits for the producer stream.
        ``copy=True`` exports a fresh copy; ``dl_device`` must be this tensor's device.  A
        read-only tensor needs a versioned capsule (or ``copy=True``): a legacy one cannot say
        it is read-only.

        As the Python array API standard has it, an argument of the wrong type raises TypeError
        and a request this tensor cannot satisfy BufferError (which consumers handle, e.g. by
        asking for a copy): the caller is a DLPack consumer, not a mok_rt API user.
        """
        versioned, version = _requested_version(max_version)
        if copy is not None and not isinstance(copy, (bool, np.bool_)):
            raise TypeError(f"__dlpack__: copy must be None, True or False, got {copy!r}")
        if dl_device is not None and _requested_device(dl_device) != self.__dlpack_device__():
            raise BufferError(f"cannot export {self!r} to DLPack device {dl_device} without a "
                              f"cross-device copy")
        handle = _requested_stream(stream)
        if self._device_id is None:
            if handle is not None and handle != -1:
                raise BufferError(f"stream must be None for a host tensor, got {stream!r}")
            handle = -1
        else:
            if handle is None or handle == 0:  # 0 is disallowed by the spec; CUDA's stream 0 is
                handle = _LEGACY_STREAM        # the legacy stream
            if handle < -1:
                raise BufferError(f"invalid DLPack stream {handle}")
        if self._readonly and not versioned and not copy:
            # NumPy refuses this too: the consumer of a legacy capsule takes the memory for
            # writable, and would write into a read-only array (a gradient buffer, say).
            raise BufferError(f"cannot export read-only {self!r} as a legacy DLPack capsule, "
                              f"which has no read-only flag: pass max_version=(1, 0) or later, or "
                              f"copy=True for a writable copy")
        source = self._copy() if copy else self
        if handle != -1:
            source._order_before(handle)  # a copy runs on our producer stream, so after it
        return _export_capsule(
            ptr=source._ptr, shape=source._shape, strides=source._strides, dtype=source._dtype,
            device=source.__dlpack_device__(), owner=source, versioned=versioned,
            version=version, readonly=source._readonly, copied=bool(copy))

    def __array__(self, dtype=None, copy=None):
        """``np.asarray(t)``: a host tensor's array itself (bfloat16 as ``ml_dtypes.bfloat16``),
        converted or copied only as ``dtype`` / ``copy`` ask (NumPy 2 protocol).  A device
        tensor raises: NumPy cannot read device memory, and a hidden device-to-host copy would
        need a stream; ``to_numpy()`` makes that copy explicitly."""
        if self._device_id is not None:
            raise TypeError(f"{self!r} is in GPU memory, which NumPy cannot read; use "
                            f".to_numpy() for a host copy (or cupy/torch.from_dlpack to stay "
                            f"on the device)")
        arr = self._array
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            if copy is False:
                raise ValueError(f"converting {self._dtype.name} to {np.dtype(dtype)} needs a "
                                 f"copy, but copy=False")
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    def _copy(self) -> "Tensor":
        if self._device_id is None:
            return Tensor.from_numpy(np.array(self._array, copy=True))
        self._require_contiguous("copy")
        stream = self._stream_keep if self._stream_keep is not None else _LEGACY_STREAM
        out = Tensor.empty(self._shape, self._dtype, device_id=self._device_id, stream=stream)
        if self.nbytes:
            call("cuMemcpyDtoDAsync", out._ptr, self._ptr, self.nbytes, out._producer_stream)
        return out

    # ------------------------------------------------------------------ data movement
    def _require_contiguous(self, what: str) -> None:
        if not self.is_c_contiguous:
            raise ArgumentError("self", f"{what} needs a C-contiguous tensor, got strides "
                                        f"{self._strides}")

    def _require_writable(self) -> None:
        if self._readonly:
            raise ArgumentError("self", "tensor is read-only")

    def to_numpy(self, *, stream: StreamLike | None = None) -> np.ndarray:
        """Host tensor: the array itself.  Device tensor: a host copy, after waiting for the
        producer stream (or ``stream``)."""
        if self._device_id is None:
            return self._array
        self._require_contiguous("to_numpy")
        out = np.empty(self._shape, self._dtype.numpy)
        if self.nbytes:
            _activate(self._device_id)
            handle = self._op_stream(stream)
            call("cuMemcpyDtoHAsync", out.ctypes.data, self._ptr, self.nbytes, handle)
            call("cuStreamSynchronize", handle)
        return out

    def copy_from_numpy(self, arr: np.ndarray, *, stream: StreamLike | None = None) -> None:
        """Copy ``arr`` (same dtype and shape) into this tensor, on ``stream`` (default: the
        producer stream).  From pageable host memory the call returns once ``arr`` may be
        reused."""
        arr = np.asarray(arr)
        got = _dt.as_dtype(arr.dtype, argument="arr")
        if got != self._dtype:
            raise ArgumentError("arr", f"expected dtype {self._dtype.name}, got {got.name}")
        if tuple(arr.shape) != self._shape:
            raise ArgumentError("arr", f"expected shape {self._shape}, got {tuple(arr.shape)}")
        self._require_writable()
        if self._device_id is None:
            np.copyto(self._array, arr)
            return
        self._require_contiguous("copy_from_numpy")
        src = np.ascontiguousarray(arr)
        if self.nbytes:
            _activate(self._device_id)
            handle = self._op_stream(stream)
            call("cuMemcpyHtoDAsync", self._ptr, src.ctypes.data, self.nbytes, handle)
            self._rejoin(handle, stream)

    def fill_bytes(self, value: int, *, stream: StreamLike | None = None) -> None:
        """Set every byte to ``value`` (0..255), on ``stream`` (default: the producer stream)."""
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                or not 0 <= value <= 255:
            raise ArgumentError("value", f"expected a byte value 0..255, got {value!r}")
        self._require_writable()
        if self._device_id is None:
            if self._array.flags.c_contiguous:
                self._array.reshape(-1).view(np.uint8).fill(int(value))
            else:
                self._array[...] = np.frombuffer(bytes([int(value)]) * self._dtype.itemsize,
                                                 dtype=self._dtype.numpy)[0]
            return
        self._require_contiguous("fill_bytes")
        if self.nbytes:
            _activate(self._device_id)
            handle = self._op_stream(stream)
            call("cuMemsetD8Async", self._ptr, int(value), self.nbytes, handle)
            self._rejoin(handle, stream)

    def poison(self, *, stream: StreamLike | None = None) -> None:
        """Fill with 0xFF bytes: NaN for every floating dtype here, -1 / max for integers."""
        self.fill_bytes(0xFF, stream=stream)

    def fill_nan(self, *, stream: StreamLike | None = None) -> None:
        """Fill a floating-point tensor with NaN (so an unwritten element fails a test)."""
        if not self._dtype.is_floating:
            raise ArgumentError("self", f"fill_nan needs a floating dtype, got {self._dtype.name}")
        # 0xFF.. is a NaN in float64/32/16, bfloat16, e4m3fn, e5m2 and e8m0fnu alike.
        self.fill_bytes(0xFF, stream=stream)
