"""DLPack import/export, dtypes and the host Tensor (CPU only)."""
from __future__ import annotations

import gc
import sys
import weakref

import ml_dtypes
import numpy as np
import pytest

from mok_rt.interop import dlpack, dlpack_export

from mok_rt.interop import dtypes
from mok_rt.interop.dlpack import check, from_dlpack
from mok_rt.errors import ArgumentError
from mok_rt.interop.tensor import Tensor

from _dlpack_util import ALL, _Producer, _random, rng


# ----------------------------------------------------------------------------- dtypes
def test_dtype_codes_match_dlpack_h():
    assert dtypes.bfloat16.dlpack == (4, 16, 1)
    assert dtypes.float8_e4m3fn.dlpack == (10, 8, 1)
    assert dtypes.float8_e5m2.dlpack == (12, 8, 1)
    assert dtypes.float8_e8m0fnu.dlpack == (14, 8, 1)
    assert dtypes.float32.dlpack == (2, 32, 1)
    assert dtypes.int64.dlpack == (0, 64, 1)
    assert dtypes.uint8.dlpack == (1, 8, 1)
    assert dtypes.bool_.dlpack == (6, 8, 1)


@pytest.mark.parametrize("dt", ALL, ids=lambda d: d.name)
def test_dtype_lookups(dt):
    assert dtypes.as_dtype(dt.name) is dt
    assert dtypes.as_dtype(dt.numpy) is dt
    assert dtypes.as_dtype(dt) is dt
    assert dtypes.from_dlpack_code(*dt.dlpack) is dt
    assert dt.itemsize == dt.numpy.itemsize


def test_dtype_lookup_errors():
    with pytest.raises(ArgumentError, match="unsupported dtype"):
        dtypes.as_dtype("complex64")
    with pytest.raises(ArgumentError, match="unsupported dtype"):
        dtypes.as_dtype(np.complex64)
    with pytest.raises(ArgumentError, match="code=2, bits=32, lanes=4"):
        dtypes.from_dlpack_code(2, 32, 4)


# ----------------------------------------------------------------------------- numpy in
@pytest.mark.parametrize("dt", ALL, ids=lambda d: d.name)
def test_numpy_import_zero_copy(dt):
    arr = _random((3, 5), dt)
    view = from_dlpack(arr, name="x")
    assert view.ptr == arr.ctypes.data
    assert view.shape == (3, 5) and view.strides == (5, 1)
    assert view.dtype is dt and view.device == "cpu" and not view.readonly
    assert view.is_c_contiguous


def test_numpy_import_keeps_array_alive():
    arr = np.arange(8, dtype=np.float32)
    ref = weakref.ref(arr)
    view = from_dlpack(arr[2:], name="x")
    del arr
    gc.collect()
    assert ref() is not None
    del view
    gc.collect()
    assert ref() is None


def test_numpy_import_readonly_and_strides():
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)
    arr.flags.writeable = False
    view = from_dlpack(arr.T, name="x")
    assert view.readonly and view.strides == (1, 4) and not view.is_c_contiguous


# ----------------------------------------------------------------------------- producer calls
def test_stream_passed_only_to_cuda_producers():
    arr = np.zeros((2, 2), np.float32)

    def make(kw):
        return dlpack_export._export_capsule(ptr=arr.ctypes.data, shape=arr.shape, strides=(2, 1),
                                      dtype=dtypes.float32, device=(2, 0), owner=arr,
                                      versioned=True)

    cuda_prod = _Producer(make, device=(2, 0))
    view = from_dlpack(cuda_prod, name="x", stream=1234)
    assert cuda_prod.calls[-1] == {"max_version": (1, 1), "stream": 1234}
    assert view.device == ("cuda", 0)
    from_dlpack(cuda_prod, name="x")
    assert cuda_prod.calls[-1] == {"max_version": (1, 1)}
    from_dlpack(cuda_prod, name="x", stream=-1)
    assert cuda_prod.calls[-1]["stream"] == -1
    host_prod = _Producer(make, device=(1, 0))
    from_dlpack(host_prod, name="x", stream=1234)
    assert host_prod.calls[-1] == {"max_version": (1, 1)}
    legacy = _Producer(make, device=(2, 0), legacy_only=True)
    from_dlpack(legacy, name="x", stream=2)
    assert legacy.calls[-1] == {"stream": 2}
    from_dlpack(cuda_prod, name="x", stream=0)  # CUDA's 0: the legacy default stream
    assert cuda_prod.calls[-1]["stream"] == 1
    with pytest.raises(ArgumentError, match="stream: invalid DLPack stream -2"):
        from_dlpack(cuda_prod, name="x", stream=-2)

    class _S:  # cuda.core-style stream object
        def __cuda_stream__(self):
            return (0, 777)

    from_dlpack(cuda_prod, name="x", stream=_S())
    assert cuda_prod.calls[-1]["stream"] == 777


def test_producer_error_names_argument():
    class Bad:
        def __dlpack__(self, **kw):
            raise BufferError("nope")

    with pytest.raises(ArgumentError, match=r"^w: __dlpack__ failed: BufferError: nope"):
        from_dlpack(Bad(), name="w")


# ----------------------------------------------------------------------------- check
def _view(shape=(5, 1024), dtype=np.float32):
    return from_dlpack(np.zeros(shape, dtype), name="x")


def test_check_accepts_good_tensor():
    v = _view((4, 8), ml_dtypes.bfloat16)
    assert check(v, name="x", dtype=dtypes.bfloat16, shape=("T", 8), device="cpu") is v
    check(v, name="x", dtype=("float32", "bfloat16"), ndim=2, shape=(None, 8))


def test_check_dtype():
    with pytest.raises(ArgumentError, match=r"^x: expected dtype bfloat16, got float32$"):
        check(_view(), name="x", dtype=dtypes.bfloat16)
    with pytest.raises(ArgumentError, match=r"^ids: expected dtype int32 or int64, got float32$"):
        check(_view(), name="ids", dtype=(dtypes.int32, dtypes.int64))


def test_check_shape_and_ndim():
    with pytest.raises(ArgumentError, match=r"^x: expected shape \(T, 2048\), got \(5, 1024\)$"):
        check(_view(), name="x", shape=("T", 2048))
    with pytest.raises(ArgumentError, match=r"^x: expected shape \(5, 1024, 1\), got"):
        check(_view(), name="x", shape=(5, 1024, 1))
    with pytest.raises(ArgumentError, match=r"^x: expected 3 dimensions, got 2"):
        check(_view(), name="x", ndim=3)


def test_check_device():
    v = _view()
    cuda_view = dlpack.TensorView(v.ptr, v.shape, v.strides, v.dtype, dlpack.kDLCUDA, 1)
    with pytest.raises(ArgumentError,
                       match=r"^x: tensor is on cuda:1, the workspace is on cuda:0$"):
        check(cuda_view, name="x", device=("cuda", 0))
    check(cuda_view, name="x", device=("cuda", 1))
    with pytest.raises(ArgumentError, match=r"^x: tensor is on cpu, the workspace is on cuda:0$"):
        check(v, name="x", device=("cuda", 0))
    with pytest.raises(ArgumentError, match=r"tensor is on cuda:1, the workspace is on cpu"):
        check(cuda_view, name="x", device="cpu")


def test_check_strides():
    arr = np.zeros((5, 1), np.float32)  # size-1 dims' strides do not matter
    check(from_dlpack(arr.T, name="x"), name="x")
    with pytest.raises(ArgumentError, match=r"^x: must be C-contiguous, got strides \(1, 5\)$"):
        check(from_dlpack(np.zeros((3, 5), np.float32).T, name="x"), name="x")
    check(from_dlpack(np.zeros((5, 3), np.float32).T, name="x"), name="x", contiguous=False)


def test_check_alignment():
    raw = np.zeros(64, np.uint8)
    base = raw.ctypes.data
    start = (-base) % 16 + 2  # a view 2 bytes past a 16-byte boundary
    arr = raw[start:start + 32].view(np.float16)
    with pytest.raises(ArgumentError, match=r"^x: data pointer 0x[0-9a-f]+ is not 16-byte aligned$"):
        check(from_dlpack(arr, name="x"), name="x")
    check(from_dlpack(arr, name="x"), name="x", alignment=2)


def test_check_empty_tensor_and_null_pointer():
    v = dlpack.TensorView(0, (0, 2048), (2048, 1), dtypes.bfloat16, dlpack.kDLCUDA, 0)
    check(v, name="x", dtype=dtypes.bfloat16, shape=("T", 2048), device=("cuda", 0))
    assert v.size == 0 and v.nbytes == 0
    e = from_dlpack(np.zeros((0, 3), np.float32)[:, ::2], name="x")
    check(e, name="x", shape=(0, 2))


def test_not_a_tensor():
    with pytest.raises(ArgumentError, match=r"^x: expected a DLPack tensor .*got list$"):
        from_dlpack([1.0, 2.0], name="x")
    with pytest.raises(ArgumentError, match=r"^x: expected a DLPack tensor"):
        dlpack.as_view(3.0, name="x", dtype="float32")


def test_unsupported_numpy_dtype():
    with pytest.raises(ArgumentError, match=r"^x: unsupported dtype"):
        from_dlpack(np.zeros(3, np.complex64), name="x")


# ----------------------------------------------------------------------------- host Tensor
def test_host_tensor_helpers():
    t = Tensor.empty((3, 4), "float32", device_id=None)
    assert t.device == "cpu" and t.shape == (3, 4) and t.strides == (4, 1)
    assert t.nbytes == 48 and t.dtype is dtypes.float32
    assert t.to_numpy().ctypes.data == t.ptr
    t.fill_nan()
    assert np.isnan(t.to_numpy()).all()
    src = rng.standard_normal((3, 4)).astype(np.float32)
    t.copy_from_numpy(src)
    np.testing.assert_array_equal(t.to_numpy(), src)
    t.fill_bytes(0)
    assert (t.to_numpy() == 0).all()
    assert "Tensor(shape=(3, 4), dtype=float32, device=cpu" in repr(t)
    with pytest.raises(ArgumentError, match="arr: expected dtype float32, got float64"):
        t.copy_from_numpy(np.zeros((3, 4)))
    with pytest.raises(ArgumentError, match=r"arr: expected shape \(3, 4\)"):
        t.copy_from_numpy(np.zeros((4, 3), np.float32))
    with pytest.raises(ArgumentError, match="value"):
        t.fill_bytes(256)
    with pytest.raises(ArgumentError, match="shape"):
        Tensor.empty((-1,), "float32", device_id=None)
    with pytest.raises(ArgumentError, match="stream"):
        Tensor.empty((2,), "float32", device_id=0)  # device memory needs a stream
    with pytest.raises(TypeError):
        Tensor()


@pytest.mark.parametrize("dt", [d for d in ALL if d.is_floating], ids=lambda d: d.name)
def test_fill_nan_every_float_dtype(dt):
    t = Tensor.from_numpy(np.zeros((2, 3), dt.numpy))
    t.fill_nan()
    assert np.isnan(t.to_numpy().astype(np.float32)).all()
    strided = Tensor.from_numpy(np.zeros((4, 3), dt.numpy)[::2])
    strided.fill_nan()
    assert np.isnan(strided.to_numpy().astype(np.float32)).all()


def test_fill_nan_rejects_integers_and_readonly():
    with pytest.raises(ArgumentError, match="floating"):
        Tensor.from_numpy(np.zeros(2, np.int32)).fill_nan()
    t = Tensor.from_numpy(np.zeros(2, np.int32))
    t.poison()
    assert (t.to_numpy() == -1).all()
    ro = np.zeros(2, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ArgumentError, match="read-only"):
        Tensor.from_numpy(ro).fill_nan()


def test_from_view_host_keeps_producer_alive():
    base = dlpack_export._live_exports()
    src = Tensor.from_numpy(np.arange(6, dtype=np.int64).reshape(2, 3))
    ref = weakref.ref(src)
    wrapped = Tensor._from_view(from_dlpack(src, name="x"))
    arr = wrapped.to_numpy()
    del src, wrapped
    gc.collect()
    assert ref() is not None
    assert arr.ctypes.data == ref().ptr
    np.testing.assert_array_equal(arr, np.arange(6).reshape(2, 3))
    del arr
    gc.collect()
    assert ref() is None and dlpack_export._live_exports() == base


# ----------------------------------------------------------------------------- stream protocol
class _FakeDriver:
    """Records the driver calls of a device Tensor (no GPU needed)."""

    def __init__(self):
        self.calls, self.events = [], 0

    def __call__(self, name, *args):
        if name == "cuEventCreate":
            self.events += 1
            ev = f"ev{self.events}"
            self.calls.append((name,))
            return ev
        self.calls.append((name, *args))
        return None


@pytest.fixture
def fake_driver(monkeypatch):
    from mok_rt.interop import tensor as tensor_mod

    drv = _FakeDriver()
    monkeypatch.setattr(tensor_mod, "call", drv)
    monkeypatch.setattr(tensor_mod, "_activate", lambda device_id: None)
    return drv


def _fake_device_tensor(stream=7):
    owner = np.zeros(16, np.float32)  # stands in for device memory; never dereferenced
    return Tensor._from_pointer(owner.ctypes.data, (4, 4), "float32", device_id=0, owner=owner,
                                stream=stream)


def test_export_orders_consumer_stream_after_producer(fake_driver):
    t = _fake_device_tensor(stream=7)
    assert t.device == ("cuda", 0) and t.__dlpack_device__() == (2, 0)
    view = from_dlpack(t, name="t", stream=5)
    assert view.ptr == t.ptr and view.device == ("cuda", 0)
    assert fake_driver.calls == [("cuEventCreate",), ("cuEventRecord", "ev1", 7),
                                 ("cuStreamWaitEvent", 5, "ev1", 0), ("cuEventDestroy", "ev1")]
    fake_driver.calls.clear()
    t.__dlpack__(stream=7)   # the producer stream itself: nothing to order
    t.__dlpack__(stream=-1)  # the consumer asked for no synchronisation
    assert fake_driver.calls == []
    t.__dlpack__(stream=None, max_version=(1, 1))  # None: the legacy default stream
    t.__dlpack__(stream=0)   # 0 (outside the spec) is read as the legacy stream too
    assert [c for c in fake_driver.calls if c[0] == "cuStreamWaitEvent"] == [
        ("cuStreamWaitEvent", 1, "ev2", 0), ("cuStreamWaitEvent", 1, "ev3", 0)]


def test_write_on_other_stream_is_joined_back(fake_driver):
    t = _fake_device_tensor(stream=7)
    t.fill_bytes(0xAB, stream=9)
    assert fake_driver.calls == [
        ("cuEventCreate",), ("cuEventRecord", "ev1", 7), ("cuStreamWaitEvent", 9, "ev1", 0),
        ("cuEventDestroy", "ev1"),
        ("cuMemsetD8Async", t.ptr, 0xAB, 64, 9),
        ("cuEventCreate",), ("cuEventRecord", "ev2", 9), ("cuStreamWaitEvent", 7, "ev2", 0),
        ("cuEventDestroy", "ev2")]
    fake_driver.calls.clear()
    t.fill_nan()  # default: the producer stream, no events
    assert fake_driver.calls == [("cuMemsetD8Async", t.ptr, 0xFF, 64, 7)]
    fake_driver.calls.clear()
    out = t.to_numpy()
    assert out.shape == (4, 4) and out.dtype == np.float32
    assert fake_driver.calls == [("cuMemcpyDtoHAsync", out.ctypes.data, t.ptr, 64, 7),
                                 ("cuStreamSynchronize", 7)]
    fake_driver.calls.clear()
    src = np.ones((4, 4), np.float32)
    t.copy_from_numpy(src)
    assert fake_driver.calls[0][0] == "cuMemcpyHtoDAsync" and fake_driver.calls[0][4] == 7


def test_device_tensor_without_producer_stream_adopts_first_writer(fake_driver):
    t = _fake_device_tensor(stream=None)
    t.__dlpack__(stream=5)
    assert fake_driver.calls == []  # nothing known to wait for
    t.fill_bytes(1, stream=11)
    assert fake_driver.calls == [("cuMemsetD8Async", t.ptr, 1, 64, 11)]
    assert t._producer_stream == 11


def test_null_shape_pointer_is_an_argument_error_not_a_crash():
    t = Tensor.from_numpy(np.zeros((2, 3), np.float32))

    def corrupt(kw):
        cap = t.__dlpack__(**kw)
        name = b"dltensor_versioned" if "max_version" in kw else b"dltensor"
        addr = dlpack._PyCapsule_GetPointer(cap, name)
        cls = dlpack.DLManagedTensorVersioned if name == b"dltensor_versioned" else dlpack.DLManagedTensor
        cls.from_address(addr).dl_tensor.shape = None   # ndim 2, shape pointer null
        return cap

    with pytest.raises(ArgumentError, match=r"x.*malformed DLPack tensor"):
        from_dlpack(_Producer(corrupt), name="x")


def test_dtype_pickles_by_name_across_hash_seeds():
    import os
    import pickle
    import subprocess
    blob = pickle.dumps(dtypes.bfloat16)
    code = ("import pickle, sys; from mok_rt.interop import dtypes as d; "
            "x = pickle.loads(sys.stdin.buffer.read()); "
            "print(x is d.bfloat16, hash(x) == hash(d.bfloat16), x in {d.bfloat16})")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    res = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [b"True", b"True", b"True"]
