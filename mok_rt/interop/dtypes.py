"""Element types mok_rt understands, with their DLPack and NumPy spellings.

A :class:`DType` is a small immutable description: a name, the DLPack ``(code, bits, lanes)``
triple and the NumPy dtype used on the host (``ml_dtypes`` supplies bfloat16 and the fp8 types,
which NumPy lacks).  Look one up with :func:`as_dtype` (a name, a NumPy dtype or a DType) or
:func:`from_dlpack_code` (a DLPack triple).
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from mok_rt.errors import ArgumentError

__all__ = [
    "DType", "as_dtype", "from_dlpack_code", "all_dtypes",
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu",
    "int64", "int32", "int16", "int8", "uint16", "uint8", "bool_",
    "kDLInt", "kDLUInt", "kDLFloat", "kDLBfloat", "kDLBool",
    "kDLFloat8_e4m3fn", "kDLFloat8_e5m2", "kDLFloat8_e8m0fnu",
]

# DLDataTypeCode values from dlpack.h (the fp8 codes exist since DLPack 1.1).
kDLInt = 0
kDLUInt = 1
kDLFloat = 2
kDLBfloat = 4
kDLBool = 6
kDLFloat8_e4m3fn = 10
kDLFloat8_e5m2 = 12
kDLFloat8_e8m0fnu = 14


@dataclass(frozen=True)
class DType:
    """One element type: ``name``, DLPack ``code``/``bits``/``lanes`` and the host NumPy dtype."""

    name: str
    code: int
    bits: int
    numpy: np.dtype
    lanes: int = 1

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.bits * self.lanes // 8

    @property
    def dlpack(self) -> tuple[int, int, int]:
        """The DLPack ``(code, bits, lanes)`` triple."""
        return (self.code, self.bits, self.lanes)

    @property
    def is_floating(self) -> bool:
        return self.code in _FLOAT_CODES

    @property
    def dtype(self) -> np.dtype:
        """The host NumPy dtype; lets NumPy take a DType wherever it takes a dtype
        (``np.dtype(mok_rt.bfloat16)``, ``np.zeros(3, mok_rt.float32)``)."""
        return self.numpy

    def __eq__(self, other) -> bool:
        """Equal to the same element type spelled any way: a DType, a NumPy dtype or scalar
        type (``np.float32``, ``np.dtype("float32")``, ``ml_dtypes.bfloat16``) or a name."""
        if isinstance(other, DType):
            return self.name == other.name
        if isinstance(other, str):
            found = _BY_NAME.get(other)
            if found is not None:
                return found.name == self.name
        elif other is None or isinstance(other, (bool, int, float)):
            return False  # np.dtype(None) is float64; never equal to "no dtype"
        try:
            return np.dtype(other) == self.numpy
        except (TypeError, ValueError):
            return NotImplemented

    def __post_init__(self):
        # The hash, once: the argument checks' memo hashes DTypes for every tensor of every call,
        # and a NumPy dtype's hash is not cheap.
        object.__setattr__(self, "_hash", hash(self.numpy))

    def __hash__(self) -> int:
        # As the NumPy dtype's, so a DType and its np.dtype share dict/set entries.
        return self._hash

    def __reduce__(self):
        # By name: the cached hash is the NumPy dtype's, which depends on the process's hash seed.
        return (as_dtype, (self.name,))

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"mok_rt.{self.name}"


_FLOAT_CODES = frozenset({kDLFloat, kDLBfloat, kDLFloat8_e4m3fn, kDLFloat8_e5m2, kDLFloat8_e8m0fnu})

float64 = DType("float64", kDLFloat, 64, np.dtype(np.float64))
float32 = DType("float32", kDLFloat, 32, np.dtype(np.float32))
float16 = DType("float16", kDLFloat, 16, np.dtype(np.float16))
bfloat16 = DType("bfloat16", kDLBfloat, 16, np.dtype(ml_dtypes.bfloat16))
float8_e4m3fn = DType("float8_e4m3fn", kDLFloat8_e4m3fn, 8, np.dtype(ml_dtypes.float8_e4m3fn))
float8_e5m2 = DType("float8_e5m2", kDLFloat8_e5m2, 8, np.dtype(ml_dtypes.float8_e5m2))
float8_e8m0fnu = DType("float8_e8m0fnu", kDLFloat8_e8m0fnu, 8, np.dtype(ml_dtypes.float8_e8m0fnu))
int64 = DType("int64", kDLInt, 64, np.dtype(np.int64))
int32 = DType("int32", kDLInt, 32, np.dtype(np.int32))
int16 = DType("int16", kDLInt, 16, np.dtype(np.int16))
int8 = DType("int8", kDLInt, 8, np.dtype(np.int8))
uint16 = DType("uint16", kDLUInt, 16, np.dtype(np.uint16))
uint8 = DType("uint8", kDLUInt, 8, np.dtype(np.uint8))
bool_ = DType("bool", kDLBool, 8, np.dtype(np.bool_))

_ALL = (float64, float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, float8_e8m0fnu,
        int64, int32, int16, int8, uint16, uint8, bool_)
_BY_NAME = {d.name: d for d in _ALL}
_BY_NAME["bool_"] = bool_
_BY_NUMPY = {d.numpy: d for d in _ALL}
_BY_DLPACK = {d.dlpack: d for d in _ALL}
# Some producers export bool as kDLUInt/kDLInt with 8 bits; those stay uint8/int8 (same bytes).


def all_dtypes() -> tuple[DType, ...]:
    """Every DType mok_rt knows."""
    return _ALL


def as_dtype(spec, *, argument: str = "dtype") -> DType:
    """The DType for ``spec``: a DType, a name (``"bfloat16"``), or a NumPy dtype / scalar type."""
    if isinstance(spec, DType):
        return spec
    if isinstance(spec, str):
        found = _BY_NAME.get(spec)
        if found is not None:
            return found
    else:
        try:
            found = _BY_NUMPY.get(np.dtype(spec))
        except TypeError:
            found = None
        if found is not None:
            return found
    known = ", ".join(d.name for d in _ALL)
    raise ArgumentError(argument, f"unsupported dtype {spec!r} (supported: {known})")


def from_dlpack_code(code: int, bits: int, lanes: int = 1, *, argument: str = "dtype") -> DType:
    """The DType for a DLPack ``(code, bits, lanes)`` triple."""
    found = _BY_DLPACK.get((int(code), int(bits), int(lanes)))
    if found is None:
        raise ArgumentError(
            argument, f"unsupported DLPack dtype (code={code}, bits={bits}, lanes={lanes})")
    return found
