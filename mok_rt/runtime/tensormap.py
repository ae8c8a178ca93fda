"""TMA tensor maps (``CUtensorMap``) for the Hopper GEMM engine (cuda_src/moe/gemm_wgmma.cuh).

A tensor map describes a bf16 (or, for the FP8 kernels, uint8 / fp32) tensor in global memory (sizes innermost dimension first, byte
strides of the outer dimensions) and the box that one TMA load copies into shared memory.
:func:`encode` runs ``cuTensorMapEncodeTiled`` through :func:`mok_rt.runtime.driver.call` and returns
the 128 opaque bytes, which travel inside a kernel's by-value parameter struct: C++
``alignas(64) mok::TensorMap`` (cuda_src/common/tma.cuh), ctypes :data:`TensorMapBytes` placed at
a 64-byte aligned offset of the struct.

Host-side checks mirror the driver's rules (so a bad map fails here, naming the argument, rather
than as CUDA_ERROR_INVALID_VALUE): a 16-byte aligned address, sizes in [1, 2**32], strides that
are multiples of 16 below 2**40, box sizes in [1, 256] whose inner extent is a multiple of 16
bytes and, with a swizzle, at most the swizzle span (128 bytes = 64 bf16 for SWIZZLE_128B).
"""
from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

from mok_rt.runtime import driver as _driver
from mok_rt.runtime.driver import call, driver
from mok_rt.errors import ArgumentError

__all__ = ["TENSOR_MAP_BYTES", "TensorMapBytes", "Swizzle", "Major", "TensorMapSpec", "encode",
           "gemm_operand", "GEMM_BK"]

TENSOR_MAP_BYTES = 128
TensorMapBytes = ctypes.c_uint8 * TENSOR_MAP_BYTES   # a ctypes field; put it at a 64-byte aligned offset
GEMM_BK = 64                                           # k per stage of the engine (one 128-byte line)
_BF16 = 2
_MAX_RANK = 5
# Element types a map may describe: bf16 (the default), u8 (E4M3 bytes), f32 (FP8 scales).
_ELEM = {"bf16": (2, "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16"), "u8": (1, "CU_TENSOR_MAP_DATA_TYPE_UINT8"),
         "f32": (4, "CU_TENSOR_MAP_DATA_TYPE_FLOAT32")}


class Swizzle(enum.IntEnum):
    """Shared-memory swizzle of the box, by its span in bytes."""

    NONE = 0
    B32 = 32
    B64 = 64
    B128 = 128


class Major(enum.IntEnum):
    """Contiguous dimension of a GEMM operand (values match gemm_wgmma.cuh ``wg::Major``)."""

    K = 0    # rows x K, K contiguous (weights [N, K], activations [M, K])
    MN = 1   # K x rows, rows contiguous (an activation read transposed)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(name: str, v, length: int | None = None) -> tuple[int, ...]:
    try:
        t = tuple(v)
    except TypeError:
        raise ArgumentError(name, f"expected a sequence of ints, got {v!r}") from None
    if not all(_is_int(x) for x in t):
        raise ArgumentError(name, f"expected ints, got {t!r}")
    if length is not None and len(t) != length:
        raise ArgumentError(name, f"expected {length} values, got {len(t)}")
    return t


@dataclass(frozen=True)
class TensorMapSpec:
    """A tensor (``dtype``: "bf16", "u8" or "f32") and the box of one TMA load.

    ``dims``: elements per dimension, innermost (contiguous) first, 1 to 5 of them.
    ``strides``: bytes between consecutive indices of ``dims[1:]`` (one per outer dimension).
    ``box``: elements one load copies per dimension (may reach past ``dims``: zeros are loaded).
    """

    address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: Swizzle = Swizzle.B128
    dtype: str = "bf16"

    def __post_init__(self):
        if self.dtype not in _ELEM:
            raise ArgumentError("dtype", f"expected one of {tuple(_ELEM)}, got {self.dtype!r}")
        esize = _ELEM[self.dtype][0]
        if not _is_int(self.address) or self.address <= 0 or self.address % 16:
            raise ArgumentError("address", f"expected a 16-byte aligned device pointer, got {self.address!r}")
        dims = _ints("dims", self.dims)
        rank = len(dims)
        if not 1 <= rank <= _MAX_RANK:
            raise ArgumentError("dims", f"expected 1 to {_MAX_RANK} dimensions, got {rank}")
        strides = _ints("strides", self.strides, rank - 1)
        box = _ints("box", self.box, rank)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "strides", strides)
        object.__setattr__(self, "box", box)
        try:
            object.__setattr__(self, "swizzle", Swizzle(self.swizzle))
        except ValueError:
            raise ArgumentError("swizzle", f"expected one of {[s.value for s in Swizzle]}, got {self.swizzle!r}") \
                from None
        for i, d in enumerate(dims):
            if not 1 <= d <= 2 ** 32:
                raise ArgumentError("dims", f"dims[{i}] = {d} outside [1, 2**32]")
        for i, s in enumerate(strides):
            if s <= 0 or s % 16 or s >= 2 ** 40:
                raise ArgumentError("strides", f"strides[{i}] = {s} bytes: must be a positive multiple of 16 "
                                               f"below 2**40")
        if rank > 1 and strides[0] < dims[0] * esize:
            raise ArgumentError("strides", f"strides[0] = {strides[0]} bytes is shorter than a row of "
                                           f"{dims[0]} {self.dtype} ({dims[0] * esize} bytes)")
        for i, b in enumerate(box):
            if not 1 <= b <= 256:
                raise ArgumentError("box", f"box[{i}] = {b} outside [1, 256]")
        inner = box[0] * esize
        if inner % 16:
            raise ArgumentError("box", f"inner box extent {inner} bytes is not a multiple of 16")
        if self.swizzle != Swizzle.NONE and inner > self.swizzle:
            raise ArgumentError("box", f"inner box extent {inner} bytes exceeds the {int(self.swizzle)}-byte swizzle")

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def box_bytes(self) -> int:
        """Bytes one load writes to shared memory (and credits to its mbarrier)."""
        n = _ELEM[self.dtype][0]
        for b in self.box:
            n *= b
        return n


_SWIZZLE_ENUM = {
    Swizzle.NONE: "CU_TENSOR_MAP_SWIZZLE_NONE",
    Swizzle.B32: "CU_TENSOR_MAP_SWIZZLE_32B",
    Swizzle.B64: "CU_TENSOR_MAP_SWIZZLE_64B",
    Swizzle.B128: "CU_TENSOR_MAP_SWIZZLE_128B",
}


def encode(spec: TensorMapSpec) -> bytes:
    """The 128-byte ``CUtensorMap`` of ``spec`` (``cuTensorMapEncodeTiled``; needs the driver,
    not a context).  Out-of-range elements load as zeros; L2 lines are fetched 256 bytes wide."""
    if not isinstance(spec, TensorMapSpec):
        raise ArgumentError("spec", f"expected a TensorMapSpec, got {type(spec).__name__}")
    _driver.init()
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    tmap = call(
        "cuTensorMapEncodeTiled",
        getattr(driver.CUtensorMapDataType, _ELEM[spec.dtype][1]),
        spec.rank,
        spec.address,
        [u64(d) for d in spec.dims],
        [u64(s) for s in spec.strides],
        [u32(b) for b in spec.box],
        [u32(1)] * spec.rank,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle, _SWIZZLE_ENUM[spec.swizzle]),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    raw = ctypes.string_at(int(tmap.getPtr()), TENSOR_MAP_BYTES)
    assert len(raw) == TENSOR_MAP_BYTES
    return raw


def gemm_operand(address: int, *, major: Major, rows: int, k: int, box_rows: int, ld: int | None = None,
                 groups: int = 1, group_stride: int | None = None) -> TensorMapSpec:
    """The map of one operand of the wgmma engine, always 3D with the group outermost.

    ``major=Major.K``: each group is ``rows x k`` with k contiguous, row pitch ``ld`` elements
    (default k); dims {k, rows, groups}, box {64, box_rows, 1} (box_rows = 128 for A, BN for B).
    ``major=Major.MN``: each group is ``k x rows`` with rows contiguous, pitch ``ld`` (default
    rows); dims {rows, k, groups}, box {64, 64, 1} (the engine loads box_rows / 64 panels).
    ``group_stride``: elements between groups (default: one packed group).
    """
    major = Major(major)
    for name, v in (("rows", rows), ("k", k), ("box_rows", box_rows), ("groups", groups)):
        if not _is_int(v) or v < 1:
            raise ArgumentError(name, f"expected a positive int, got {v!r}")
    if box_rows % 64 or box_rows > 256:
        raise ArgumentError("box_rows", f"expected 64, 128, 192 or 256, got {box_rows}")
    inner, outer = (k, rows) if major == Major.K else (rows, k)
    if inner % 8:
        raise ArgumentError("k" if major == Major.K else "rows",
                            f"the contiguous extent {inner} must be a multiple of 8 (16-byte rows)")
    ld = inner if ld is None else ld
    if not _is_int(ld) or ld < inner:
        raise ArgumentError("ld", f"expected an int >= {inner}, got {ld!r}")
    group_stride = outer * ld if group_stride is None else group_stride
    if not _is_int(group_stride) or group_stride < 1:
        raise ArgumentError("group_stride", f"expected a positive int, got {group_stride!r}")
    box = (GEMM_BK, box_rows, 1) if major == Major.K else (64, GEMM_BK, 1)
    return TensorMapSpec(address=address, dims=(inner, outer, groups), strides=(ld * _BF16, group_stride * _BF16),
                         box=box, swizzle=Swizzle.B128)
