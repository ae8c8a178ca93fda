"""DLPack with CuPy on a GPU: import, export, lifetime and stream ordering."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from mok_rt.interop import dlpack, dlpack_export

from mok_rt.interop import dtypes
from mok_rt.interop.dlpack import check, from_dlpack
from mok_rt.interop.tensor import Tensor

pytestmark = pytest.mark.gpu
from _gpu import cp  # noqa: E402  (CuPy is imported when a test first uses it)

rng = np.random.default_rng()
SPIN_NS = 300_000_000  # 0.3 s: far longer than anything else a test enqueues

_SPIN_SRC = r"""
extern "C" __global__ void spin_then_fill(float* out, long long n, unsigned long long ns,
                                          float value) {
    if (threadIdx.x == 0) {
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    }
    __syncthreads();
    for (long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = value;
}
"""


@pytest.fixture(scope="module")
def device():
    from cuda.core import Device

    dev = Device(0)
    dev.set_current()
    cp.cuda.Device(0).use()
    return dev


@pytest.fixture(scope="module")
def streams(device):
    # Module scope: the streams outlive every tensor allocated on them.
    return cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)


@pytest.fixture(scope="module")
def spin(device):
    try:
        kernel = cp.RawKernel(_SPIN_SRC, "spin_then_fill")
        kernel.compile()
    except Exception as e:  # no NVRTC for CuPy on this machine
        pytest.skip(f"cannot compile the spin kernel with CuPy: {e}")

    def run(arr, value, stream):
        with stream:
            kernel((1,), (256,), (arr, np.int64(arr.size), np.uint64(SPIN_NS), np.float32(value)))
    return run


def _random(shape, dt: dtypes.DType) -> np.ndarray:
    if dt.name == "bool":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dt.name == "float8_e8m0fnu":
        return np.exp2(rng.integers(-8, 8, size=shape).astype(np.float64)).astype(dt.numpy)
    if dt.is_floating:
        return rng.standard_normal(shape).astype(dt.numpy)
    return rng.integers(-100 if dt.code == dtypes.kDLInt else 0, 100, size=shape).astype(dt.numpy)


_RAW = {1: dtypes.uint8, 2: dtypes.uint16}


def _to_cupy(host: np.ndarray, dt: dtypes.DType):
    """CuPy copy of ``host``; bit-typed (uint8/uint16) when CuPy lacks the dtype."""
    try:
        return cp.asarray(host), dt
    except Exception:
        raw = _RAW[dt.itemsize]
        return cp.asarray(host.view(raw.numpy)), raw


def _cupy_supports(dt: dtypes.DType) -> bool:
    try:
        cp.zeros(1, dtype=dt.numpy)
        return True
    except Exception:
        return False


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


# ----------------------------------------------------------------------------- import
@pytest.mark.parametrize("dt", dtypes.all_dtypes(), ids=lambda d: d.name)
def test_cupy_to_view(device, dt):
    host = _random((3, 5), dt)
    x, expected = _to_cupy(host, dt)
    view = from_dlpack(x, name="x", stream=1)  # CuPy's null stream is the legacy stream
    assert view.ptr == x.data.ptr
    assert view.shape == (3, 5) and view.strides == (5, 1)
    if expected is dtypes.bool_ and view.dtype is dtypes.uint8:
        expected = dtypes.uint8  # an older CuPy exports bool as 8-bit unsigned
    assert view.dtype is expected and view.device == ("cuda", 0)
    check(view, name="x", dtype=expected, shape=(3, 5), device=("cuda", 0))
    got = Tensor._from_view(view, stream=1).to_numpy()
    assert np.array_equal(_bits(got), _bits(host))  # raw bits through our view


def test_cupy_to_view_rejects_strided_and_wrong_device(device):
    x = cp.zeros((4, 6), dtype=cp.float32)
    with pytest.raises(ValueError, match=r"x: must be C-contiguous"):
        dlpack.as_view(x.T, name="x", device=("cuda", 0))
    with pytest.raises(ValueError, match=r"x: tensor is on cuda:0, the workspace is on cuda:1"):
        dlpack.as_view(x, name="x", device=("cuda", 1))


def test_cupy_producer_orders_consumer_stream(device, streams, spin):
    a, b = streams
    with a:
        x = cp.zeros(1 << 20, dtype=cp.float32)
    spin(x, 42.0, a)
    with a:  # CuPy's current stream (a) is the producer: it must make b wait for it
        view = from_dlpack(x, name="x", stream=b.ptr)
    assert not b.done  # b holds only the event wait, blocked behind the spinning kernel
    got = Tensor._from_view(view, stream=b.ptr).to_numpy()  # copies on b
    assert (got == 42.0).all()


# ----------------------------------------------------------------------------- export
@pytest.mark.parametrize("dt", dtypes.all_dtypes(), ids=lambda d: d.name)
def test_tensor_to_cupy(device, dt):
    if not _cupy_supports(dt):
        pytest.skip(f"CuPy has no {dt.name}")
    stream = device.create_stream()
    host = _random((4, 6), dt)
    t = Tensor.empty((4, 6), dt, device_id=0, stream=stream)
    t.copy_from_numpy(host)  # on `stream`; CuPy reads on the legacy stream, ordered by us
    x = cp.from_dlpack(t)
    assert x.data.ptr == t.ptr
    assert x.shape == (4, 6) and x.dtype == dt.numpy
    assert np.array_equal(_bits(cp.asnumpy(x)), _bits(host))
    if dt.is_floating or dt.code == dtypes.kDLBool:
        x[...] = x[0:1]  # a CuPy write on its stream
        expected = np.broadcast_to(host[0:1], host.shape)
    else:
        x += 1
        expected = host + 1
    got = t.to_numpy(stream=1)  # read on the legacy stream, after CuPy's write
    assert np.array_equal(_bits(got), _bits(expected))
    stream.sync()


def test_bf16_export_recognised_by_cupy(device):
    if not _cupy_supports(dtypes.bfloat16):
        pytest.skip("CuPy has no bfloat16")
    host = _random((8,), dtypes.bfloat16)
    t = Tensor.empty((8,), "bfloat16", device_id=0, stream=1)
    t.copy_from_numpy(host)
    x = cp.from_dlpack(t)
    assert x.dtype == dtypes.bfloat16.numpy and x.data.ptr == t.ptr
    assert np.array_equal(_bits(cp.asnumpy(x)), _bits(host))


def test_export_keeps_tensor_alive(device):
    base = dlpack_export._live_exports()
    t = Tensor.empty((16,), "float32", device_id=0, stream=1)
    t.fill_bytes(0)
    ref = weakref.ref(t)
    x = cp.from_dlpack(t)
    del t
    gc.collect()
    assert ref() is not None
    x += 1
    cp.cuda.Device(0).synchronize()
    del x
    gc.collect()
    assert ref() is None and dlpack_export._live_exports() == base


class _NoSync:
    """Forwards to a Tensor but exports with stream=-1 (no synchronisation)."""

    def __init__(self, t):
        self.t = t

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    def __dlpack__(self, **kw):
        kw["stream"] = -1
        return self.t.__dlpack__(**kw)


def test_tensor_stream_ordering(device, streams, spin):
    a, b = streams
    n = 1 << 20

    def produce():
        t = Tensor.empty((n,), "float32", device_id=0, stream=a.ptr)  # producer stream a
        t.fill_bytes(0)  # on a
        a.synchronize()  # zeros are in place before the race below
        with a:
            w = cp.from_dlpack(t)  # same stream as the producer: nothing to order
        spin(w, 42.0, a)  # a long kernel on a writes the final values
        return t

    # Control: without synchronisation, b reads before a's kernel has written.
    t0 = produce()
    with b:
        stale = cp.from_dlpack(_NoSync(t0)).copy()
    b.synchronize()
    stale = cp.asnumpy(stale)
    a.synchronize()
    assert (stale == 0).all(), "the unsynchronised read was not early: the test proves nothing"

    # Our export makes b wait on an event recorded on a (cuEventRecord + cuStreamWaitEvent).
    t = produce()
    with b:
        y = cp.from_dlpack(t)
        assert not b.done  # b is blocked behind a's spinning kernel
        copied = y.copy()
    b.synchronize()
    assert (cp.asnumpy(copied) == 42.0).all()
    a.synchronize()


def test_own_consumer_orders_stream(device, streams, spin):
    a, b = streams
    t = Tensor.empty((1 << 16,), "float32", device_id=0, stream=a.ptr)
    with a:
        w = cp.from_dlpack(t)
    spin(w, 7.0, a)
    view = from_dlpack(t, name="x", stream=b.ptr)  # Tensor.__dlpack__(stream=b)
    assert not b.done
    assert view.ptr == t.ptr and view.dtype is dtypes.float32
    got = Tensor._from_view(view, stream=b.ptr).to_numpy()
    assert (got == 7.0).all()
    a.synchronize()


# ----------------------------------------------------------------------------- Tensor helpers
@pytest.mark.parametrize("dt", [d for d in dtypes.all_dtypes() if d.is_floating],
                         ids=lambda d: d.name)
def test_device_fill_nan_and_round_trip(device, dt):
    stream = device.create_stream()
    t = Tensor.empty((5, 7), dt, device_id=0, stream=stream)
    assert t.device == ("cuda", 0) and t.ptr % 16 == 0 and t.nbytes == 35 * dt.itemsize
    t.fill_nan()
    assert np.isnan(t.to_numpy().astype(np.float32)).all()
    host = _random((5, 7), dt)
    t.copy_from_numpy(host)
    assert np.array_equal(_bits(t.to_numpy()), _bits(host))
    view = from_dlpack(t, name="t", stream=-1)
    assert view.dtype is dt and view.ptr == t.ptr  # exported with its real DLPack code
    stream.sync()


def test_device_copy_export_and_empty(device):
    t = Tensor.empty((3,), "int32", device_id=0, stream=1)
    t.copy_from_numpy(np.array([1, 2, 3], np.int32))
    cap = t.__dlpack__(stream=1, max_version=(1, 1), copy=True)
    copied = dlpack._consume_capsule(cap, "t")
    assert copied.ptr != t.ptr and copied.device == ("cuda", 0)
    assert Tensor._from_view(copied, stream=1).to_numpy().tolist() == [1, 2, 3]
    e = Tensor.empty((0, 4), "bfloat16", device_id=0, stream=1)
    assert e.nbytes == 0 and e.to_numpy().shape == (0, 4)
    assert from_dlpack(e, name="e", stream=1).shape == (0, 4)
