"""DLPack in and out, in pure ctypes (no C extension).

Import: :func:`from_dlpack` turns any object with ``__dlpack__`` (CuPy, JAX, PyTorch, a mok_rt
:class:`~mok_rt.interop.tensor.Tensor`) -- or a NumPy array, read directly so that ``ml_dtypes``
bfloat16/fp8 arrays work too -- into a :class:`TensorView`: pointer, shape, strides, dtype and
device, plus a private keep-alive that calls the producer's deleter once when the view is gone.
:func:`check` validates a view and raises :class:`~mok_rt.errors.ArgumentError` naming the
argument.

Export (:mod:`mok_rt.interop.dlpack_export`): :func:`_export_capsule` builds a (versioned or legacy) capsule for a mok_rt tensor; the
capsule keeps its owner alive until the consumer's call to the deleter, or until the capsule
itself is destroyed unconsumed.

The capsule is NumPy's own (``ndarray.__dlpack__`` of an unsigned-integer carrier array over the
same bytes, whose base keeps the owner alive), with the DLTensor's device, dtype, data pointer,
version and flags then set to ours.  So its deleter and capsule destructor are NumPy's C
functions, which keep a consumer's pending exception intact.  A Python (ctypes) callback cannot:
when a consumer drops the capsule while it is raising (``numpy.from_dlpack`` refusing bfloat16,
an expression failing on a consumed array), CPython would report the consumer's exception as
"Exception ignored" and the consumer would fail with a SystemError.  Only where NumPy cannot make
the capsule (NumPy < 2.1 asked for a versioned one) are ctypes callbacks used instead.
"""
from __future__ import annotations

import atexit
import ctypes
import math
import struct
from dataclasses import dataclass, field
from typing import Union

import numpy as np

from mok_rt.interop import dtypes as _dt
from mok_rt.interop.dlpack_abi import (  # noqa: F401  (the ABI names are part of this module's API)
    _CALL_DELETER, _NAME_LEGACY, _NAME_LEGACY_USED, _NAME_V, _NAME_V_USED, DLPACK_FLAG_BITMASK_IS_COPIED,
    DLPACK_FLAG_BITMASK_READ_ONLY, DLPACK_VERSION, DLDataType, DLDevice, DLManagedTensor,
    DLManagedTensorVersioned, DLPackVersion, DLTensor, _PyCapsule_GetPointer, _PyCapsule_IsValid,
    _PyCapsule_SetName, kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged)
from mok_rt.interop.dtypes import DType
from mok_rt.interop.producers import current_stream_framework
from mok_rt.errors import ArgumentError

__all__ = [
    "DLDevice", "DLDataType", "DLTensor", "DLManagedTensor", "DLPackVersion",
    "DLManagedTensorVersioned", "TensorView", "from_dlpack", "check", "as_view",
    "kDLCPU", "kDLCUDA", "kDLCUDAHost", "kDLCUDAManaged",
    "DLPACK_FLAG_BITMASK_READ_ONLY", "DLPACK_FLAG_BITMASK_IS_COPIED", "DLPACK_VERSION",
]


# --------------------------------------------------------------------------- import side
class _Imported:
    """Keeps a consumed DLPack tensor alive; calls the producer's deleter once when dropped.

    A ``__del__`` rather than a ``weakref.finalize`` (this is on every layer call's path, and a
    finalizer costs several times more to set up).  At interpreter exit the producer's library may
    already be torn down, so once exit has begun the deleter is skipped: the memory leaks instead,
    as weakref.finalize(atexit=False) did."""

    __slots__ = ("_managed", "_deleter", "__weakref__")

    def __init__(self, managed_addr: int, deleter_addr: int | None):
        self._managed, self._deleter = managed_addr, deleter_addr

    def __del__(self):
        deleter, self._deleter = self._deleter, None
        if deleter and not _exiting:   # the spec allows a NULL deleter
            fn = _deleters.get(deleter)
            if fn is None:
                fn = _deleters[deleter] = _CALL_DELETER(deleter)
            fn(self._managed)


_exiting = False
_deleters: dict[int, object] = {}   # deleter address -> its ctypes function object (a handful per process)


def _at_exit() -> None:
    global _exiting
    _exiting = True


atexit.register(_at_exit)


@dataclass(frozen=True)
class TensorView:
    """A borrowed tensor: where its elements are and how to read them.

    ``strides`` are in elements.  The memory stays valid while the view (or a copy of it) lives.
    """

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: DType
    device_type: int
    device_id: int
    readonly: bool = False
    _keepalive: object = field(default=None, repr=False, compare=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)   # plain ints: no NumPy reduction on the host path

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def device(self):
        """``("cuda", id)`` for device memory, ``"cpu"`` for host memory."""
        if self.device_type in (kDLCUDA, kDLCUDAManaged):
            return ("cuda", self.device_id)
        if self.device_type in (kDLCPU, kDLCUDAHost):
            return "cpu"
        return (f"dlpack_device_{self.device_type}", self.device_id)

    @property
    def is_c_contiguous(self) -> bool:
        return _is_c_contiguous(self.shape, self.strides)


def _c_strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def _is_c_contiguous(shape, strides) -> bool:
    if any(n == 0 for n in shape):
        return True
    expected = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _stream_handle(stream, *, argument: str = "stream") -> int | None:
    """A CUstream handle as an int: from an int, a cuda.core Stream (``__cuda_stream__``) or a
    cuda.bindings CUstream; None stays None."""
    if stream is None:
        return None
    if isinstance(stream, bool):
        raise ArgumentError(argument, f"expected a CUDA stream, got {stream!r}")
    if isinstance(stream, (int, np.integer)):
        return int(stream)
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int(proto()[1])
    # int() below is for cuda.bindings' CUstream; it would also parse "5" and truncate 1.5.
    if not isinstance(stream, (str, bytes, bytearray, float, np.floating)):
        try:
            return int(stream)
        except (TypeError, ValueError):
            pass
    raise ArgumentError(argument, f"expected a CUDA stream (int handle or object with "
                                  f"__cuda_stream__), got {type(stream).__name__}")


def _view_from_numpy(arr: np.ndarray, name: str) -> TensorView:
    # Read directly: NumPy's own __dlpack__ refuses ml_dtypes (bfloat16, fp8) arrays.
    dtype = _dt.as_dtype(arr.dtype, argument=name)
    iface = arr.__array_interface__
    ptr = int(iface["data"][0] or 0)
    shape = tuple(int(n) for n in arr.shape)
    if iface.get("strides") is None:
        strides = _c_strides(shape)
    else:
        item = dtype.itemsize
        if any(s % item for s in arr.strides):
            raise ArgumentError(name, f"strides {arr.strides} (bytes) are not a whole number of "
                                      f"{item}-byte elements")
        strides = tuple(int(s) // item for s in arr.strides)
    return TensorView(ptr, shape, strides, dtype, kDLCPU, 0, not arr.flags.writeable, arr)


def _on_cuda(obj) -> bool:
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is None:
        return True  # unknown: trust the caller who passed a stream
    try:
        return int(dev()[0]) in (kDLCUDA, kDLCUDAManaged)
    except Exception:
        return True


def from_dlpack(obj, *, name: str, stream: Union[int, None, object] = None,
                ordered: set | None = None) -> TensorView:
    """Borrow ``obj``'s memory through DLPack (zero copy) as a :class:`TensorView`.

    ``stream`` is the consumer's CUDA stream handed to a CUDA producer so that it orders its
    pending writes before work on that stream: None (not passed), a CUstream int, 1 (legacy
    default stream; 0 is taken to mean it too), 2 (per-thread default stream) or -1 (no
    synchronisation).  NumPy arrays (ml_dtypes ones included) are read directly.  ``name``
    names the argument in errors.

    ``ordered``: for a run of imports on one stream (one layer call), a set shared by them: the
    frameworks whose current stream ``stream`` already waits for (interop/producers.py).  An
    array of such a framework is then exported with ``stream=-1``; the first one adds its
    framework once its export has ordered the stream.
    """
    if isinstance(obj, TensorView):
        return obj
    if isinstance(obj, np.ndarray):
        return _view_from_numpy(obj, name)
    export = getattr(obj, "__dlpack__", None)
    if export is None:
        raise ArgumentError(name, f"expected a DLPack tensor (an object with __dlpack__), got "
                                  f"{type(obj).__name__}")
    # An int (what the layer calls pass) skips the conversion.
    handle = stream if type(stream) is int else _stream_handle(stream)
    if handle == 0:  # the spec forbids 0; in CUDA it names the legacy default stream
        handle = 1
    elif handle is not None and handle < -1:
        raise ArgumentError("stream", f"invalid DLPack stream {handle} (a CUstream, 1 for the "
                                      f"legacy default stream, 2 for per-thread, -1 for none)")
    framework = None
    if handle is not None and handle != -1 and ordered is not None:
        framework = current_stream_framework(obj)
        if framework is not None and framework in ordered:
            handle = -1   # this call already waits for the framework's current stream
    to_stream = handle is not None and (framework is not None or _on_cuda(obj))
    try:
        if to_stream:
            try:
                capsule = export(stream=handle, max_version=DLPACK_VERSION)
            except TypeError:  # a producer older than DLPack 1.0: no max_version keyword
                capsule = export(stream=handle)
        else:
            try:
                capsule = export(max_version=DLPACK_VERSION)
            except TypeError:
                capsule = export()
    except ArgumentError:
        raise
    except Exception as e:
        raise ArgumentError(name, f"__dlpack__ failed: {type(e).__name__}: {e}") from e
    if framework is not None:
        ordered.add(framework)
    return _consume_capsule(capsule, name)


# The managed tensors read with one unpack each (a ctypes Structure builds an object per field
# read).  DLTensor: data, device type and id, ndim, dtype code, bits, lanes, shape, strides,
# byte offset; versioned: version, manager_ctx, deleter, flags, then the DLTensor; legacy: the
# DLTensor, manager_ctx, deleter.
_MANAGED_V = struct.Struct("<IIQQQ" "QiiiBBHQQQ")
_MANAGED_LEGACY = struct.Struct("<" "QiiiBBHQQQ" "QQ")
_MANAGED_V_BYTES = ctypes.c_char * ctypes.sizeof(DLManagedTensorVersioned)
_MANAGED_LEGACY_BYTES = ctypes.c_char * ctypes.sizeof(DLManagedTensor)
assert (_MANAGED_V.size, _MANAGED_LEGACY.size) == (80, 64)
_INT64S = {n: ctypes.c_int64 * n for n in range(1, 9)}   # shape and strides of ndim n (more: made then)


def _consume_capsule(capsule, name: str) -> TensorView:
    # Versioned first (what DLPack >= 1.0 producers return): one C call, no IsValid before it.
    try:
        addr = _PyCapsule_GetPointer(capsule, _NAME_V)
        versioned = True
    except ValueError:   # not a capsule, or another name
        if not _PyCapsule_IsValid(capsule, _NAME_LEGACY):
            raise ArgumentError(name, "__dlpack__ did not return an unconsumed DLPack capsule") from None
        addr = _PyCapsule_GetPointer(capsule, _NAME_LEGACY)
        versioned = False
    if versioned:
        (major, minor, _, deleter, flags, data, device_type, device_id, ndim, code, bits, lanes, shape_at,
         strides_at, offset) = _MANAGED_V.unpack_from(_MANAGED_V_BYTES.from_address(addr))
        if major != 1:
            # Not consumed: the producer's capsule destructor frees it.
            raise ArgumentError(name, f"unsupported DLPack version {major}.{minor}")
        readonly = bool(flags & DLPACK_FLAG_BITMASK_READ_ONLY)
        used = _NAME_V_USED
    else:
        (data, device_type, device_id, ndim, code, bits, lanes, shape_at, strides_at, offset, _,
         deleter) = _MANAGED_LEGACY.unpack_from(_MANAGED_LEGACY_BYTES.from_address(addr))
        readonly = False
        used = _NAME_LEGACY_USED
    dtype = _dt._BY_DLPACK.get((code, bits, lanes)) or _dt.from_dlpack_code(code, bits, lanes, argument=name)
    if ndim:
        if ndim < 0 or not shape_at:
            # Not consumed: the producer's capsule destructor frees it.
            raise ArgumentError(name, f"malformed DLPack tensor (ndim {ndim}, shape pointer "
                                      f"{'null' if not shape_at else 'set'})")
        # Sliced, not iterated: iterating a ctypes array calls __getitem__ per element.
        int64s = _INT64S.get(ndim) or ctypes.c_int64 * ndim
        shape = tuple(int64s.from_address(shape_at)[:])
        strides = tuple(int64s.from_address(strides_at)[:]) if strides_at else _c_strides(shape)
    else:
        shape = strides = ()
    # From here on we own it: rename so the producer's destructor leaves it alone.
    if _PyCapsule_SetName(capsule, used) != 0:  # pragma: no cover - cannot fail for a capsule
        raise ArgumentError(name, "could not mark the DLPack capsule as consumed")
    # The TensorView the constructor would make, without the frozen dataclass's per-field
    # object.__setattr__ (one view per tensor argument of every call).
    v = object.__new__(TensorView)
    v.__dict__.update(ptr=data + offset, shape=shape, strides=strides, dtype=dtype, device_type=device_type,
                      device_id=device_id, readonly=readonly, _keepalive=_Imported(addr, deleter))
    return v


# --------------------------------------------------------------------------- validation
def _device_str(device_type: int, device_id: int) -> str:
    if device_type == kDLCPU:
        return "cpu"
    if device_type == kDLCUDA:
        return f"cuda:{device_id}"
    if device_type == kDLCUDAHost:
        return "cuda_host (pinned cpu)"
    if device_type == kDLCUDAManaged:
        return f"cuda_managed:{device_id}"
    return f"dlpack device type {device_type}:{device_id}"


def _shape_str(spec) -> str:
    parts = ["*" if d is None else str(d) for d in spec]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def _device_matches(view: TensorView, device) -> bool:
    if isinstance(device, str) and device == "cpu":
        return view.device_type in (kDLCPU, kDLCUDAHost)
    # Checked before unpacking: "gpu" would unpack into three letters (a bare ValueError), and
    # ("cuda", "0") or ("cuda", 0.5) would be taken for device 0.
    if not (isinstance(device, (tuple, list)) and len(device) == 2 and device[0] == "cuda"
            and isinstance(device[1], (int, np.integer)) and not isinstance(device[1], bool)):
        raise ArgumentError("device", f"expected ('cuda', id) or 'cpu', got {device!r}")
    return view.device_type in (kDLCUDA, kDLCUDAManaged) and view.device_id == int(device[1])


def check(view: TensorView, *, name: str, dtype=None, ndim: int | None = None, shape=None,
          device=None, contiguous: bool = True, alignment: int | None = 16) -> TensorView:
    """Validate ``view``; raise :class:`ArgumentError` naming ``name`` on the first mismatch.

    ``dtype``: one dtype or a tuple of allowed ones.  ``shape``: a tuple whose entries are ints
    (must match), None or a string label such as ``"T"`` (any size).  ``device``: ``("cuda", id)``
    or ``"cpu"``.  ``contiguous``: C order, ignoring the strides of size-1 dimensions.
    ``alignment``: the data pointer's alignment in bytes.  Empty tensors pass the pointer and
    stride checks.  Returns ``view``.
    """
    if device is not None and not _device_matches(view, device):
        want = "cpu" if device == "cpu" else f"cuda:{int(device[1])}"
        raise ArgumentError(name, f"tensor is on {_device_str(view.device_type, view.device_id)}, "
                                  f"the workspace is on {want}")
    if dtype is not None:
        allowed = tuple(_dt.as_dtype(d) for d in (dtype if isinstance(dtype, (tuple, list))
                                                  else (dtype,)))
        if view.dtype not in allowed:
            want = " or ".join(d.name for d in allowed)
            raise ArgumentError(name, f"expected dtype {want}, got {view.dtype.name}")
    if ndim is not None and view.ndim != ndim:
        raise ArgumentError(name, f"expected {ndim} dimension{'s' if ndim != 1 else ''}, got "
                                  f"{view.ndim} (shape {_shape_str(view.shape)})")
    if shape is not None:
        ok = len(shape) == view.ndim and all(
            want is None or isinstance(want, str) or int(want) == got
            for want, got in zip(shape, view.shape))
        if not ok:
            raise ArgumentError(name, f"expected shape {_shape_str(shape)}, got "
                                      f"{_shape_str(view.shape)}")
    if view.size == 0:
        return view
    if contiguous and not view.is_c_contiguous:
        raise ArgumentError(name, f"must be C-contiguous, got strides {_shape_str(view.strides)}")
    if alignment and view.ptr % alignment:
        raise ArgumentError(name, f"data pointer {view.ptr:#x} is not {alignment}-byte aligned")
    return view


def as_view(obj, *, name: str, stream=None, **checks) -> TensorView:
    """:func:`from_dlpack` then :func:`check` (keyword arguments of :func:`check`)."""
    return check(from_dlpack(obj, name=name, stream=stream), name=name, **checks)
