"""Helpers shared by the CPU DLPack tests (test_dlpack.py, test_dlpack_export.py)."""
from __future__ import annotations

import ctypes

import numpy as np

from mok_rt.interop import dtypes

ALL = dtypes.all_dtypes()
NUMPY_EXPORTABLE = ("float32", "float64", "int32", "int64", "uint8")
rng = np.random.default_rng()


def _random(shape, dt: dtypes.DType) -> np.ndarray:
    if dt.name == "bool":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dt.is_floating:
        vals = rng.standard_normal(shape)
        if dt.name == "float8_e8m0fnu":  # powers of two only
            vals = np.exp2(rng.integers(-8, 8, size=shape).astype(np.float64))
        return vals.astype(dt.numpy)
    info = np.iinfo(dt.numpy)
    return rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape).astype(dt.numpy)


def _capsule_name(capsule) -> str:
    get = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
        ("PyCapsule_GetName", ctypes.pythonapi))
    return get(capsule).decode()


class _Producer:
    """Hands out a prepared capsule and records how __dlpack__ was called."""

    def __init__(self, make, device=(1, 0), legacy_only=False):
        self.make, self.device, self.legacy_only, self.calls = make, device, legacy_only, []

    def __dlpack__(self, **kw):
        if self.legacy_only and "max_version" in kw:
            raise TypeError("unexpected keyword 'max_version'")
        self.calls.append(kw)
        return self.make(kw)

    def __dlpack_device__(self):
        return self.device
