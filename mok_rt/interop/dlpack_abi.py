"""The DLPack ABI in ctypes: the C structs and constants of dlpack.h (versions 0.x and 1.x), the
capsule names, and the Python C-API functions the import and export sides call (private function
objects, so that no other code's change to ``ctypes.pythonapi`` argtypes affects them)."""
from __future__ import annotations

import ctypes

kDLCPU = 1
kDLCUDA = 2
kDLCUDAHost = 3
kDLCUDAManaged = 13

DLPACK_FLAG_BITMASK_READ_ONLY = 1 << 0
DLPACK_FLAG_BITMASK_IS_COPIED = 1 << 1
DLPACK_VERSION = (1, 1)  # the newest DLPack this module reads and writes

# Capsule names.  PyCapsule keeps the char* it is given, so these bytes must live forever.
_NAME_V = b"dltensor_versioned"
_NAME_V_USED = b"used_dltensor_versioned"
_NAME_LEGACY = b"dltensor"
_NAME_LEGACY_USED = b"used_dltensor"


# --------------------------------------------------------------------------- struct mirrors
class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    # deleter is a plain pointer here: reading it must not build a ctypes callback object.
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", DLTensor)]


assert ctypes.sizeof(DLTensor) == 48
assert ctypes.sizeof(DLManagedTensor) == 64
assert ctypes.sizeof(DLManagedTensorVersioned) == 80


# --------------------------------------------------------------------------- Python C API
# Private function objects (not the shared ctypes.pythonapi attributes, whose argtypes other
# code may change).  PYFUNCTYPE keeps the GIL and turns a set Python error into an exception.
def _capi(name, restype, *argtypes):
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_PyCapsule_New = _capi("PyCapsule_New", ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                       ctypes.c_void_p)
_PyCapsule_IsValid = _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
_PyCapsule_GetPointer = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object,
                              ctypes.c_char_p)
_PyCapsule_SetName = _capi("PyCapsule_SetName", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
# Inside a capsule destructor the capsule is being freed: pass it as a raw address so that no
# reference is ever taken to it.
_PyCapsule_IsValid_raw = _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)
_PyCapsule_GetPointer_raw = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_char_p)

# PyErr_Fetch without argtypes: with an exception pending, ctypes must not call any Python-level
# argument converter before the fetch has cleared it (that call would fail with SystemError).
_PyErr_Fetch = ctypes.pythonapi._FuncPtr(("PyErr_Fetch", ctypes.pythonapi))
_PyErr_Fetch.restype = None
_PyErr_Restore = ctypes.pythonapi._FuncPtr(("PyErr_Restore", ctypes.pythonapi))
_PyErr_Restore.restype = None
_ERR_SLOTS = (ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p())
_ERR_REFS = tuple(ctypes.byref(s) for s in _ERR_SLOTS)

_DELETER_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)        # void (*)(DLManagedTensor*)
_CAPSULE_DTOR_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)   # void (*)(PyObject*)
_CALL_DELETER = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)     # calling a producer's deleter
