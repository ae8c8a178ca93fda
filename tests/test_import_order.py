"""Which stream each DLPack producer is handed when a layer call imports its inputs
(mok_rt/interop/producers.py, from_dlpack's ``ordered``), on the CPU: producers that order on
their framework's current stream (CuPy, torch) get the call's stream once per call and
framework and -1 afterwards; every other producer gets it on every import; nothing carries
over from one call to the next."""
from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from null_driver import FakeDeviceArray, null_driver  # noqa: E402

import mok_rt as mok  # noqa: E402
from mok_rt.interop import dlpack, dtypes, producers  # noqa: E402

T, H, I, E, K = 256, 128, 128, 8, 2
BF = ml_dtypes.bfloat16


class _Recording(FakeDeviceArray):
    """A fake device array that records the stream of every export (in ``log``, shared)."""

    log: list = []

    def __dlpack__(self, *, stream=None, **kw):
        self.log.append((self.name, stream))
        return super().__dlpack__(stream=stream, **kw)


class _CupyLike(_Recording):
    pass


class _TorchLike(_Recording):
    is_cuda = True


@pytest.fixture
def frameworks(monkeypatch):
    """_CupyLike and _TorchLike stand for cupy.ndarray and torch.Tensor; _Recording for a
    producer that orders per array (JAX, a mok_rt Tensor)."""
    monkeypatch.setitem(producers._by_type, _CupyLike, "cupy")
    monkeypatch.setitem(producers._by_type, _TorchLike, "torch")
    _Recording.log = []
    return _Recording.log


def _array(cls, name, shape, dtype, ptr):
    a = cls(shape, dtype, ptr=ptr)
    a.name = name
    return a


def test_the_exact_framework_classes_are_known():
    assert producers._classify(dict) is None
    torch = pytest.importorskip("torch")
    assert producers._classify(torch.Tensor) == "torch"
    assert producers._classify(torch.nn.Parameter) == "torch"
    assert producers._classify(type("Sub", (torch.Tensor,), {})) is None   # a subclass may export otherwise
    assert producers.current_stream_framework(torch.zeros(2)) is None     # host tensors take no stream
    try:
        import cupy
    except Exception:   # no CuPy (or no CUDA runtime for it) here
        return
    assert producers._classify(cupy.ndarray) == "cupy"


def test_first_array_of_a_framework_gets_the_stream_the_rest_minus_one(frameworks):
    ptr = iter(range(1 << 40, 1 << 41, 1 << 20))
    a, b, c = (_array(_CupyLike, n, (4, 8), np.float32, next(ptr)) for n in "abc")
    t, u = (_array(_TorchLike, n, (4, 8), np.float32, next(ptr)) for n in "tu")
    j = _array(_Recording, "j", (4, 8), np.float32, next(ptr))
    ordered = set()
    for x in (a, t, b, j, u, c, j):
        dlpack.from_dlpack(x, name=x.name, stream=77, ordered=ordered)
    assert frameworks == [("a", 77), ("t", 77), ("b", -1), ("j", 77), ("u", -1), ("c", -1), ("j", 77)]
    assert ordered == {"cupy", "torch"}
    frameworks.clear()
    dlpack.from_dlpack(b, name="b", stream=77, ordered=set())   # another call: ordered again
    dlpack.from_dlpack(b, name="b", stream=77)                  # an import on its own: always
    dlpack.from_dlpack(b, name="b", stream=-1, ordered=set())   # asked for no order: none
    assert frameworks == [("b", 77), ("b", 77), ("b", -1)]


def test_a_failed_export_orders_nothing(frameworks):
    class _Failing(_CupyLike):
        def __dlpack__(self, **kw):
            raise BufferError("nope")

    producers._by_type[_Failing] = "cupy"
    try:
        ordered = set()
        bad = _array(_Failing, "bad", (4,), np.float32, 1 << 40)
        with pytest.raises(mok.ArgumentError, match="^bad: __dlpack__ failed"):
            dlpack.from_dlpack(bad, name="bad", stream=5, ordered=ordered)
        assert ordered == set()
    finally:
        del producers._by_type[_Failing]


def _inputs(cls):
    ptr = iter(range(1 << 44, 1 << 45, 1 << 30))
    return dict(ids=_array(cls, "ids", (T, K), np.int32, next(ptr)),
                x=_array(cls, "x", (T, H), BF, next(ptr)), tw=_array(cls, "tw", (T, K), np.float32, next(ptr)),
                experts=mok.ExpertWeights(*(_array(cls, n, s, BF, next(ptr)) for n, s in
                                            (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I))))),
                d_out=_array(cls, "d_out", (T, H), BF, next(ptr)),
                dw=mok.ExpertWeights(*(_array(cls, n, s, np.float32, next(ptr)) for n, s in
                                       (("dw.gate", (E, I, H)), ("dw.up", (E, I, H)), ("dw.down", (E, H, I))))))


@pytest.mark.parametrize("cls, ordered", [(_CupyLike, True), (_TorchLike, True), (_Recording, False)])
def test_each_layer_call_orders_once_per_framework(frameworks, cls, ordered):
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K)
    with null_driver(), mok.Workspace(cfg, max_tokens=T) as ws:
        s = int(ws.stream.handle)
        a = _inputs(cls)
        for _ in range(2):   # the second step (cached launches) orders exactly as the first
            frameworks.clear()
            sched = mok.schedule(ws, a["ids"])
            _, ctx = mok.forward(ws, sched, a["x"], a["tw"], a["experts"])
            mok.backward(ws, ctx, a["d_out"], dw=a["dw"])
            rest = -1 if ordered else s
            assert frameworks == [("ids", s), ("x", s), ("tw", rest), ("gate", rest), ("up", rest),
                                  ("down", rest), ("d_out", s), ("dw.gate", rest), ("dw.up", rest),
                                  ("dw.down", rest)]


def test_bad_input_after_an_ordered_import_still_names_the_argument(frameworks):
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K)
    with null_driver(), mok.Workspace(cfg, max_tokens=T) as ws:
        a = _inputs(_CupyLike)
        sched = mok.schedule(ws, a["ids"])
        mok.forward(ws, sched, a["x"], a["tw"], a["experts"])
        bad_tw = _array(_CupyLike, "tw", (T, K), dtypes.bfloat16, 1 << 46)
        with pytest.raises(mok.ArgumentError) as ei:
            mok.forward(ws, sched, a["x"], bad_tw, a["experts"])
        assert ei.value.argument == "topk_weights"
        frameworks.clear()
        mok.forward(ws, sched, a["x"], a["tw"], a["experts"])   # a new call orders again
        assert frameworks[0] == ("x", int(ws.stream.handle))
