"""DLPack export and the lifetime of exported and consumed tensors (CPU only)."""
from __future__ import annotations

import ctypes
import gc
import sys
import weakref

import ml_dtypes
import numpy as np
import pytest

from mok_rt.interop import dlpack, dlpack_abi, dlpack_export
from mok_rt.interop import dtypes
from mok_rt.interop.dlpack import from_dlpack
from mok_rt.errors import ArgumentError
from mok_rt.interop.tensor import Tensor
from _dlpack_util import ALL, NUMPY_EXPORTABLE, _capsule_name, _Producer, _random


# ----------------------------------------------------------------------------- host export
@pytest.mark.parametrize("name", NUMPY_EXPORTABLE)
@pytest.mark.parametrize("versioned", [True, False])
def test_host_tensor_to_numpy_zero_copy(name, versioned):
    dt = dtypes.as_dtype(name)
    arr = _random((4, 6), dt)
    t = Tensor.from_numpy(arr)
    if versioned:
        out = np.from_dlpack(t)  # numpy asks for max_version (1, 0): versioned capsule
    else:
        out = np.from_dlpack(_Producer(lambda kw: t.__dlpack__()))
    assert out.ctypes.data == arr.ctypes.data == t.ptr
    assert out.dtype == arr.dtype and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)
    if versioned:
        out[1, 2] = 7
        assert arr[1, 2] == 7
    else:  # numpy marks arrays from legacy (unversioned) capsules read-only
        assert not out.flags.writeable
    arr[3, 5] = 9
    assert out[3, 5] == 9


def test_capsule_names_and_version():
    t = Tensor.from_numpy(np.zeros((2, 3), np.float32))
    assert _capsule_name(t.__dlpack__()) == "dltensor"
    assert _capsule_name(t.__dlpack__(max_version=(1, 0))) == "dltensor_versioned"
    cap = t.__dlpack__(max_version=(1, 1))
    assert _capsule_name(cap) == "dltensor_versioned"
    view = dlpack._consume_capsule(cap, "x")
    assert _capsule_name(cap) == "used_dltensor_versioned"
    assert view.ptr == t.ptr and view.shape == (2, 3) and view.dtype is dtypes.float32


@pytest.mark.parametrize("dt", ALL, ids=lambda d: d.name)
@pytest.mark.parametrize("versioned", [True, False])
def test_tensor_round_trip_through_own_consumer(dt, versioned):
    arr = _random((2, 3, 4), dt)
    t = Tensor.from_numpy(arr)
    producer = _Producer(lambda kw: t.__dlpack__(**kw), legacy_only=not versioned)
    view = from_dlpack(producer, name="x")
    assert view.ptr == arr.ctypes.data
    assert view.dtype is dt  # real DLPack codes, bf16/fp8 included
    assert view.shape == (2, 3, 4) and view.strides == (12, 4, 1)
    back = Tensor._from_view(view).to_numpy()
    assert back.ctypes.data == arr.ctypes.data
    np.testing.assert_array_equal(back.view(np.uint8), arr.view(np.uint8))


def test_exported_dltensor_fields_bf16():
    arr = _random((5, 2), dtypes.bfloat16)
    cap = Tensor.from_numpy(arr).__dlpack__(max_version=(1, 1))
    addr = dlpack._PyCapsule_GetPointer(cap, b"dltensor_versioned")
    m = dlpack.DLManagedTensorVersioned.from_address(addr)
    assert (m.version.major, m.version.minor) == (1, 1)
    t = m.dl_tensor
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (4, 16, 1)
    assert (t.device.device_type, t.device.device_id) == (1, 0)
    assert t.ndim == 2 and [t.shape[i] for i in range(2)] == [5, 2]
    assert [t.strides[i] for i in range(2)] == [2, 1]
    assert t.data == arr.ctypes.data and t.byte_offset == 0


def test_readonly_and_copy_flags():
    arr = np.arange(6, dtype=np.float32)
    arr.flags.writeable = False
    t = Tensor.from_numpy(arr)
    assert t.readonly
    assert from_dlpack(_Producer(lambda kw: t.__dlpack__(**kw)), name="x").readonly
    assert not np.from_dlpack(t).flags.writeable
    cap = t.__dlpack__(max_version=(1, 1), copy=True)
    m = dlpack.DLManagedTensorVersioned.from_address(
        dlpack._PyCapsule_GetPointer(cap, b"dltensor_versioned"))
    assert m.flags & dlpack.DLPACK_FLAG_BITMASK_IS_COPIED
    assert m.dl_tensor.data != arr.ctypes.data
    copied = np.from_dlpack(t, copy=True)
    assert copied.ctypes.data != arr.ctypes.data
    np.testing.assert_array_equal(copied, arr)


def test_export_rejects_foreign_device_and_stream():
    t = Tensor.from_numpy(np.zeros(3, np.float32))
    assert t.__dlpack_device__() == (1, 0)
    with pytest.raises(BufferError):
        t.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError):
        t.__dlpack__(stream=5)
    t.__dlpack__(dl_device=(1, 0), stream=-1)


# ----------------------------------------------------------------------------- lifetime
def test_unconsumed_capsule_keeps_tensor_alive_then_frees():
    base = dlpack_export._live_exports()
    t = Tensor.from_numpy(np.ones(4, np.float32))
    ref = weakref.ref(t)
    caps = [t.__dlpack__(), t.__dlpack__(max_version=(1, 1))]
    del t
    gc.collect()
    assert ref() is not None and dlpack_export._live_exports() == base + 2
    caps.pop()
    assert ref() is not None
    caps.pop()
    gc.collect()
    assert ref() is None and dlpack_export._live_exports() == base


@pytest.mark.parametrize("versioned", [True, False])
def test_consumed_capsule_lives_until_consumer_deleter(versioned):
    base = dlpack_export._live_exports()
    t = Tensor.from_numpy(np.ones(4, np.float64))
    ref = weakref.ref(t)
    producer = _Producer(lambda kw: t.__dlpack__(**kw), legacy_only=not versioned)
    out = np.from_dlpack(producer)
    del t, producer
    gc.collect()
    assert ref() is not None
    del out
    gc.collect()
    assert ref() is None and dlpack_export._live_exports() == base
    t = Tensor.from_numpy(np.ones(4, np.float64))
    ref = weakref.ref(t)
    view = from_dlpack(_Producer(lambda kw: t.__dlpack__(**kw), legacy_only=not versioned),
                       name="x")
    del t
    gc.collect()
    assert ref() is not None
    view2 = view  # copies share one keep-alive
    del view
    gc.collect()
    assert ref() is not None
    del view2
    gc.collect()
    assert ref() is None and dlpack_export._live_exports() == base


class _CountingCapsule:
    """A foreign producer's versioned tensor whose deleter counts its calls."""

    def __init__(self, arr, version=(1, 1)):
        self.arr, self.calls = arr, []
        self.shape = (ctypes.c_int64 * arr.ndim)(*arr.shape)
        self.managed = dlpack.DLManagedTensorVersioned()
        self.managed.version = dlpack.DLPackVersion(*version)
        t = self.managed.dl_tensor
        t.data = arr.ctypes.data
        t.device = dlpack.DLDevice(1, 0)
        t.ndim = arr.ndim
        t.dtype = dlpack.DLDataType(2, 32, 1)
        t.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = None  # NULL: compact row-major
        t.byte_offset = 4
        self.deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self.calls.append)
        self.managed.deleter = ctypes.cast(self.deleter, ctypes.c_void_p).value
        self.capsule = dlpack_abi._PyCapsule_New(ctypes.addressof(self.managed),
                                             b"dltensor_versioned", None)


def test_foreign_deleter_called_exactly_once():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    fake = _CountingCapsule(arr)
    view = from_dlpack(_Producer(lambda kw: fake.capsule), name="x")
    assert _capsule_name(fake.capsule) == "used_dltensor_versioned"
    assert view.ptr == arr.ctypes.data + 4 and view.strides == (4, 1)
    assert fake.calls == []
    del view
    gc.collect()
    assert fake.calls == [ctypes.addressof(fake.managed)]
    gc.collect()
    assert len(fake.calls) == 1


def test_unsupported_major_version_not_consumed():
    fake = _CountingCapsule(np.zeros((2, 2), np.float32), version=(2, 0))
    with pytest.raises(ArgumentError, match="unsupported DLPack version 2.0"):
        from_dlpack(_Producer(lambda kw: fake.capsule), name="x")
    assert _capsule_name(fake.capsule) == "dltensor_versioned"  # left to its producer
    assert fake.calls == []
    used = Tensor.from_numpy(np.zeros(2, np.float32)).__dlpack__()
    keep = dlpack._consume_capsule(used, "y")
    with pytest.raises(ArgumentError, match="^x: __dlpack__ did not return an unconsumed"):
        from_dlpack(_Producer(lambda kw: used), name="x")
    with pytest.raises(ArgumentError, match="^x: __dlpack__ did not return an unconsumed"):
        from_dlpack(_Producer(lambda kw: object()), name="x")
    del keep


def test_release_while_consumer_is_raising(monkeypatch):
    # numpy refuses bfloat16 and drops our capsule with its error pending: still no leak.
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    base = dlpack_export._live_exports()
    t = Tensor.from_numpy(np.zeros(3, ml_dtypes.bfloat16))
    ref = weakref.ref(t)
    with pytest.raises(Exception) as info:
        np.from_dlpack(t)
    assert not isinstance(info.value, SystemError)  # numpy's own error reaches the caller
    del t
    gc.collect()
    assert ref() is None and dlpack_export._live_exports() == base
    assert not reported  # nothing printed as "Exception ignored"


def test_consumer_deleter_runs_while_raising(monkeypatch):
    # A temporary numpy array over our tensor dies inside a failing expression: the deleter
    # runs with numpy's error pending and must still release the tensor.
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    base = dlpack_export._live_exports()
    t = Tensor.from_numpy(np.arange(4.0))
    ref = weakref.ref(t)
    with pytest.raises(TypeError):  # the original error, not a SystemError
        np.from_dlpack(t) + "not a number"
    del t
    gc.collect()
    assert ref() is None and dlpack_export._live_exports() == base
    assert not reported
