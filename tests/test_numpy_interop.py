"""Getting results into NumPy: ``np.asarray``, ``np.from_dlpack`` and dtype comparisons."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from mok_rt.interop import dtypes
from mok_rt.interop.tensor import Tensor


def test_asarray_host_tensor_is_the_array():
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = Tensor.from_numpy(arr)
    out = np.asarray(t)
    assert out is arr
    assert np.array(t, copy=False) is arr


def test_asarray_bf16_host_tensor():
    arr = np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16)
    t = Tensor.from_numpy(arr)
    out = np.asarray(t)
    assert out.dtype == np.dtype(ml_dtypes.bfloat16) and out.shape == (2, 3)
    assert out.dtype != object
    np.testing.assert_array_equal(out.astype(np.float32), arr.astype(np.float32))


def test_array_protocol_dtype_and_copy():
    arr = np.arange(4, dtype=np.float32)
    t = Tensor.from_numpy(arr)
    copied = np.array(t)  # np.array copies by default
    assert copied is not arr and not np.shares_memory(copied, arr)
    as64 = np.asarray(t, dtype=np.float64)
    assert as64.dtype == np.float64 and not np.shares_memory(as64, arr)
    np.testing.assert_array_equal(as64, arr)
    with pytest.raises(ValueError, match="copy"):
        np.asarray(t, dtype=np.float64, copy=False)
    assert np.asarray(t, dtype=np.float32, copy=False) is arr


def test_array_protocol_keeps_read_only():
    arr = np.zeros(3, np.float32)
    arr.flags.writeable = False
    assert not np.asarray(Tensor.from_numpy(arr)).flags.writeable


def test_device_tensor_array_raises_clearly():
    # A device tensor without touching a GPU: only its device id matters to __array__.
    t = Tensor._new(ptr=0x1000, shape=(2,), strides=(1,), dtype=dtypes.bfloat16,
                    device_id=0, owner=None)
    with pytest.raises(TypeError, match=r"to_numpy\(\)"):
        np.asarray(t)


def test_from_dlpack_float32_host_tensor():
    arr = np.arange(6, dtype=np.float32)
    out = np.from_dlpack(Tensor.from_numpy(arr))
    assert out.ctypes.data == arr.ctypes.data
    np.testing.assert_array_equal(out, arr)


def test_from_dlpack_bf16_raises_cleanly():
    # In a fresh interpreter, to see exactly what reaches stderr.
    code = textwrap.dedent("""
        import ml_dtypes, numpy as np
        from mok_rt.interop.tensor import Tensor
        t = Tensor.from_numpy(np.zeros(3, ml_dtypes.bfloat16))
        try:
            got = np.from_dlpack(t)
        except SystemError as ex:
            raise SystemExit(f"SystemError: {ex}")
        except Exception as ex:
            print("BF16 raised", type(ex).__name__, ex)
        else:
            print("BF16 imported", got.dtype)
        try:
            np.from_dlpack(Tensor.from_numpy(np.zeros(3, np.float32))) + "text"
        except SystemError as ex:
            raise SystemExit(f"SystemError: {ex}")
        except TypeError:
            print("raised TypeError")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    # NumPy has no bf16: the bf16 export (kDLBfloat) must be refused, not read as float16
    assert "BF16 raised " in res.stdout and "BF16 imported" not in res.stdout, res.stdout
    assert "raised TypeError" in res.stdout, res.stdout
    assert "Exception ignored" not in res.stderr, res.stderr
    assert res.stderr == ""


@pytest.mark.parametrize("dt,spellings", [
    (dtypes.float32, [np.float32, np.dtype("float32"), "float32"]),
    (dtypes.bfloat16, [ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16), "bfloat16"]),
    (dtypes.int64, [np.int64, np.dtype("int64"), "int64"]),
    (dtypes.float8_e4m3fn, [ml_dtypes.float8_e4m3fn, "float8_e4m3fn"]),
])
def test_dtype_equals_numpy_spellings(dt, spellings):
    for other in spellings:
        assert dt == other and other == dt, other
        assert not dt != other
    assert hash(dt) == hash(np.dtype(dt.numpy))
    assert {dt: 1}[np.dtype(dt.numpy)] == 1
    assert np.dtype(dt) == dt.numpy


def test_dtype_unequal_to_other_types():
    assert dtypes.float32 != np.float64
    assert dtypes.bfloat16 != np.float16
    assert dtypes.bfloat16 != dtypes.float16
    assert dtypes.float32 != "bfloat16"
    assert dtypes.float64 != None  # noqa: E711 (np.dtype(None) would be float64)
    assert dtypes.float32 != object()
    assert dtypes.int32 != 4
