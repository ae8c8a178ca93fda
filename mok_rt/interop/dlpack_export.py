"""DLPack export: capsules for mok_rt tensors (:func:`_export_capsule`), built as the module
:mod:`mok_rt.interop.dlpack` describes (NumPy's own capsule over a carrier array where it can,
ctypes callbacks otherwise)."""
from __future__ import annotations

import ctypes
import weakref

import numpy as np

from mok_rt.interop.dlpack_abi import (
    _CAPSULE_DTOR_FN, _DELETER_FN, _ERR_REFS, _ERR_SLOTS, _NAME_LEGACY, _NAME_V,
    DLPACK_FLAG_BITMASK_IS_COPIED, DLPACK_FLAG_BITMASK_READ_ONLY, DLPACK_VERSION, DLDataType, DLDevice,
    DLManagedTensor, DLManagedTensorVersioned, DLPackVersion, DLTensor, _PyCapsule_GetPointer,
    _PyCapsule_GetPointer_raw, _PyCapsule_IsValid, _PyCapsule_IsValid_raw, _PyCapsule_New, _PyErr_Fetch,
    _PyErr_Restore)
from mok_rt.interop.dtypes import DType

class _Export:
    """What a consumer's DLManagedTensor pointer refers to; dropping it frees all of it."""

    __slots__ = ("managed", "shape", "strides", "owner")

    def __init__(self, managed, shape, strides, owner):
        self.managed, self.shape, self.strides, self.owner = managed, shape, strides, owner


_EXPORTS: dict[int, _Export] = {}  # managed-struct address -> record


def _callback_prologue():
    """Take (and clear) an exception the caller may have pending; see the module caveat."""
    # Must stay the first thing a callback does, before any other call.
    _PyErr_Fetch(_ERR_REFS[0], _ERR_REFS[1], _ERR_REFS[2])
    saved = (_ERR_SLOTS[0].value, _ERR_SLOTS[1].value, _ERR_SLOTS[2].value)
    _ERR_SLOTS[0].value = _ERR_SLOTS[1].value = _ERR_SLOTS[2].value = None
    return saved


def _callback_epilogue(saved):
    if saved[0]:
        # Hands the references back; the re-raised error is then reported by ctypes.
        _PyErr_Restore(ctypes.c_void_p(saved[0]), ctypes.c_void_p(saved[1]),
                       ctypes.c_void_p(saved[2]))


def _export_deleter(managed_addr):
    saved = _callback_prologue()
    try:
        _EXPORTS.pop(managed_addr, None)
    except BaseException:  # interpreter shutdown: nothing sensible left to do
        pass
    _callback_epilogue(saved)


def _capsule_destructor(capsule_addr):
    saved = _callback_prologue()
    try:
        for name in (_NAME_V, _NAME_LEGACY):
            # A renamed ("used_...") capsule was consumed: its consumer calls the deleter.
            if _PyCapsule_IsValid_raw(capsule_addr, name):
                _EXPORTS.pop(_PyCapsule_GetPointer_raw(capsule_addr, name), None)
                break
    except BaseException:
        pass
    _callback_epilogue(saved)


# The C function pointers must outlive every capsule: module-level references.
_EXPORT_DELETER = _DELETER_FN(_export_deleter)
_CAPSULE_DESTRUCTOR = _CAPSULE_DTOR_FN(_capsule_destructor)
_EXPORT_DELETER_ADDR = ctypes.cast(_EXPORT_DELETER, ctypes.c_void_p).value
_CAPSULE_DESTRUCTOR_ADDR = ctypes.cast(_CAPSULE_DESTRUCTOR, ctypes.c_void_p).value


def _fill_dltensor(t: DLTensor, ptr, shape_arr, strides_arr, ndim, dtype: DType, device):
    t.data = ptr or None
    t.device = DLDevice(device[0], device[1])
    t.ndim = ndim
    t.dtype = DLDataType(dtype.code, dtype.bits, dtype.lanes)
    t.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0


_CARRIER_TYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_CARRIERS: dict[int, weakref.ref] = {}  # id -> carrier arrays of exports not yet released


def _carrier(ptr: int, shape, strides, itemsize: int, owner) -> np.ndarray:
    """An unsigned-integer array over the tensor's bytes whose base keeps ``owner`` alive.

    Nothing reads through it (the pointer may be device memory): it only carries the lifetime.
    """
    carrier = np.dtype(_CARRIER_TYPES[itemsize])
    byte_strides = tuple(s * itemsize for s in strides)
    if any(n == 0 for n in shape) or not ptr:
        buf = (ctypes.c_char * 1)()
        offset = 0
    else:
        lo = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
        hi = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
        buf = (ctypes.c_char * ((hi - lo + 1) * itemsize)).from_address(ptr + lo * itemsize)
        offset = -lo * itemsize
    buf._mok_keepalive = owner
    return np.ndarray(shape, carrier, buffer=buf, offset=offset, strides=byte_strides)


def _export_capsule(*, ptr: int, shape, strides, dtype: DType, device: tuple[int, int],
                    owner, versioned: bool, version: tuple[int, int] = DLPACK_VERSION,
                    readonly: bool = False, copied: bool = False):
    """A new ``dltensor_versioned`` (or legacy ``dltensor``) capsule that keeps ``owner`` alive.

    ``device`` is the DLPack ``(device_type, device_id)``; ``strides`` are in elements.
    """
    kwargs = dict(ptr=ptr, shape=shape, strides=strides, dtype=dtype, device=device,
                  owner=owner, versioned=versioned, version=version, readonly=readonly,
                  copied=copied)
    if dtype.itemsize not in _CARRIER_TYPES:
        return _export_capsule_ctypes(**kwargs)
    arr = _carrier(ptr, shape, strides, dtype.itemsize, owner)
    try:
        cap = arr.__dlpack__(max_version=(1, 0)) if versioned else arr.__dlpack__()
    except TypeError:  # NumPy < 2.1: no versioned capsules
        return _export_capsule_ctypes(**kwargs)
    name = _NAME_V if versioned else _NAME_LEGACY
    if not _PyCapsule_IsValid(cap, name):
        return _export_capsule_ctypes(**kwargs)
    addr = _PyCapsule_GetPointer(cap, name)
    if versioned:
        managed = DLManagedTensorVersioned.from_address(addr)
        managed.version = DLPackVersion(*version)
        managed.flags = ((DLPACK_FLAG_BITMASK_READ_ONLY if readonly else 0)
                         | (DLPACK_FLAG_BITMASK_IS_COPIED if copied else 0))
    else:
        managed = DLManagedTensor.from_address(addr)
    t = managed.dl_tensor
    t.data = ptr or None
    t.byte_offset = 0
    t.device = DLDevice(device[0], device[1])
    t.dtype = DLDataType(dtype.code, dtype.bits, dtype.lanes)
    key = id(arr)
    _CARRIERS[key] = weakref.ref(arr, lambda _, key=key: _CARRIERS.pop(key, None))
    return cap


def _export_capsule_ctypes(*, ptr: int, shape, strides, dtype: DType, device: tuple[int, int],
                    owner, versioned: bool, version: tuple[int, int] = DLPACK_VERSION,
                    readonly: bool = False, copied: bool = False):
    """:func:`_export_capsule` with ctypes callbacks as deleter and capsule destructor."""
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides_arr = (ctypes.c_int64 * max(ndim, 1))(*strides)
    if versioned:
        managed = DLManagedTensorVersioned()
        managed.version = DLPackVersion(*version)
        managed.flags = ((DLPACK_FLAG_BITMASK_READ_ONLY if readonly else 0)
                         | (DLPACK_FLAG_BITMASK_IS_COPIED if copied else 0))
        name = _NAME_V
    else:
        managed = DLManagedTensor()
        name = _NAME_LEGACY
    _fill_dltensor(managed.dl_tensor, ptr, shape_arr, strides_arr, ndim, dtype, device)
    managed.manager_ctx = None
    managed.deleter = _EXPORT_DELETER_ADDR
    addr = ctypes.addressof(managed)
    _EXPORTS[addr] = _Export(managed, shape_arr, strides_arr, owner)
    try:
        return _PyCapsule_New(addr, name, _CAPSULE_DESTRUCTOR_ADDR)
    except BaseException:
        _EXPORTS.pop(addr, None)
        raise


def _live_exports() -> int:
    """Number of exported tensors not yet released (for leak tests)."""
    return len(_EXPORTS) + len(_CARRIERS)
