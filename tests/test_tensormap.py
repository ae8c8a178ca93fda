"""Host-side checks of mok_rt.runtime.tensormap (no GPU: encoding itself is exercised by
tests/test_gemm_probe_gpu.py)."""
from __future__ import annotations

import ctypes

import pytest

from mok_rt.runtime import tensormap as tm
from mok_rt.errors import ArgumentError

ADDR = 1 << 20


def _spec(**kw):
    args = dict(address=ADDR, dims=(64, 128, 1), strides=(128, 128 * 128), box=(64, 128, 1))
    args.update(kw)
    return tm.TensorMapSpec(**args)


def test_valid_spec_and_box_bytes():
    s = _spec()
    assert s.rank == 3 and s.box_bytes == 64 * 128 * 2 and s.swizzle == tm.Swizzle.B128


@pytest.mark.parametrize("kw, argument", [
    (dict(address=ADDR + 8), "address"),
    (dict(address=0), "address"),
    (dict(dims=(64, 0, 1)), "dims"),
    (dict(dims=(64, 2 ** 32 + 1, 1)), "dims"),
    (dict(dims=(1, 1, 1, 1, 1, 1), strides=(16,) * 5, box=(8,) * 6), "dims"),
    (dict(strides=(120, 128 * 128)), "strides"),          # not a multiple of 16
    (dict(strides=(128,)), "strides"),                     # one per outer dimension
    (dict(strides=(64, 128 * 128)), "strides"),            # shorter than a row
    (dict(strides=(128, 2 ** 40)), "strides"),
    (dict(box=(64, 257, 1)), "box"),
    (dict(box=(64, 0, 1)), "box"),
    (dict(box=(4, 128, 1)), "box"),                        # 8 bytes: not a multiple of 16
    (dict(box=(128, 128, 1), dims=(128, 128, 1), strides=(256, 256 * 128)), "box"),  # > 128B swizzle
    (dict(swizzle=48), "swizzle"),
    (dict(box=(64.0, 128, 1)), "box"),
])
def test_bad_specs_name_the_argument(kw, argument):
    with pytest.raises(ArgumentError) as ex:
        _spec(**kw)
    assert ex.value.argument == argument


def test_unswizzled_box_may_be_wide():
    s = _spec(dims=(256, 128, 1), strides=(512, 512 * 128), box=(256, 8, 1), swizzle=tm.Swizzle.NONE)
    assert s.box_bytes == 256 * 8 * 2


def test_gemm_operand_k_major():
    s = tm.gemm_operand(ADDR, major=tm.Major.K, rows=1536, k=2048, box_rows=256, groups=128)
    assert s.dims == (2048, 1536, 128)
    assert s.strides == (2048 * 2, 1536 * 2048 * 2)
    assert s.box == (64, 256, 1)
    assert s.box_bytes == 256 * 64 * 2


def test_gemm_operand_mn_major():
    s = tm.gemm_operand(ADDR, major=tm.Major.MN, rows=1536, k=2048, box_rows=256, groups=128, ld=1600)
    assert s.dims == (1536, 2048, 128)
    assert s.strides == (1600 * 2, 2048 * 1600 * 2)
    assert s.box == (64, 64, 1)


@pytest.mark.parametrize("kw, argument", [
    (dict(box_rows=96), "box_rows"),
    (dict(box_rows=512), "box_rows"),
    (dict(k=100), "k"),                  # K-major contiguous extent not a multiple of 8
    (dict(ld=1000), "ld"),
    (dict(groups=0), "groups"),
    (dict(rows=True), "rows"),
])
def test_gemm_operand_rejects(kw, argument):
    args = dict(major=tm.Major.K, rows=256, k=1024, box_rows=128)
    args.update(kw)
    with pytest.raises(ArgumentError) as ex:
        tm.gemm_operand(ADDR, **args)
    assert ex.value.argument == argument


def test_mn_major_rows_must_be_a_multiple_of_8():
    with pytest.raises(ArgumentError) as ex:
        tm.gemm_operand(ADDR, major=tm.Major.MN, rows=100, k=64, box_rows=128)
    assert ex.value.argument == "rows"


def test_ctypes_field_is_128_bytes():
    assert ctypes.sizeof(tm.TensorMapBytes) == 128


def test_encode_rejects_non_spec():
    with pytest.raises(ArgumentError):
        tm.encode({"address": ADDR})
