"""CUDA-graph capture of the layer: schedule, forward, backward and recompute captured on a raw
stream (cuda-bindings) and under ``torch.cuda.graph``, in bf16 and in FP8 (weights quantised
before the capture, or bf16 weights quantised inside the captured calls); one layer and two
chained layers in one graph.  Replays with new input contents at the same addresses must give the bits of eager runs on
the same inputs, and a device error during a replay must still raise at ``ws.synchronize()``.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from _gpu import cp, skip_or_fail  # noqa: E402  (CuPy is imported when a test first uses it)

import mok_rt as mok  # noqa: E402
from mok_rt.runtime.driver import call, driver  # noqa: E402
from test_layer_gpu import _experts, _shared, _to_dev, make_problem  # noqa: E402

SHAPE = dict(T=700, H=256, I=192, E=8, k=4, Is=128)
NAMES = ("out", "dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "d_shared_gate", "d_shared_up",
         "d_shared_down")


def _cfg(precision="bf16"):
    s = SHAPE
    return mok.MoEConfig(hidden=s["H"], intermediate=s["I"], num_experts=s["E"], top_k=s["k"],
                         shared_intermediate=s["Is"], precision=precision)


def _step(ws, d, *, stream=None, recompute=False, weights=None):
    """schedule + forward (+ recompute) + backward; the results by name.  `weights`: FP8
    QuantizedWeights (made outside), else the bf16 ExpertWeights (quantised inside under FP8)."""
    sched = mok.schedule(ws, d["ids"], stream=stream)
    w, sh = (weights, None) if weights is not None else (_experts(d), _shared(d))
    out, ctx = mok.forward(ws, sched, d["x"], d["tw"], w, shared=sh, stream=stream)
    if recompute:
        ctx = mok.recompute_context(ws, sched, d["x"], d["tw"], w, shared=sh, stream=stream)
    g = mok.backward(ws, ctx, d["d_out"], stream=stream)
    return dict(out=out, dx=g.dx, d_topk_weights=g.d_topk_weights, dw_gate=g.dw.gate, dw_up=g.dw.up,
                dw_down=g.dw.down, d_shared_gate=g.dw_shared.gate, d_shared_up=g.dw_shared.up,
                d_shared_down=g.dw_shared.down)


def _host(results):
    return {n: cp.asnumpy(cp.from_dlpack(t)).view(np.uint8) for n, t in results.items()}


def _poison(results) -> None:
    """NaN (0xFF bytes) into a captured call's results before a replay, so that a replay that does
    not write an element cannot pass on what the previous replay (or eager run) left there."""
    for t in results.values():
        t.poison()
    cp.cuda.Device(0).synchronize()   # the fills (on the legacy stream) before the replay


def _refill(d, h, *, weights=False):
    """New contents, same addresses: the inputs, and with `weights` the expert weights too (an
    optimizer step between replays)."""
    for n in ("x", "ids", "tw", "d_out") + (("w_gate", "w_up", "w_down") if weights else ()):
        d[n][...] = cp.asarray(h[n])
    if weights:
        for dev, host in zip(d["shared"], h["shared"]):
            if dev is not None:
                dev[...] = cp.asarray(host)


class _RawGraph:
    """Stream capture through cuda-bindings: begin, end, instantiate, launch.  CuPy's current
    stream is the capturing one meanwhile, so that importing its arrays (DLPack, ordered on the
    consumer's stream) adds no wait on a stream outside the capture."""

    def __init__(self, stream_handle: int):
        self.s = driver.CUstream(stream_handle)
        self.cupy_stream = cp.cuda.ExternalStream(stream_handle)
        self.graph = self.exec = None

    def __enter__(self):
        call("cuStreamBeginCapture", self.s, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        self.cupy_stream.__enter__()
        return self

    def __exit__(self, *exc):
        self.cupy_stream.__exit__(*exc)
        self.graph = call("cuStreamEndCapture", self.s)
        if exc[0] is None:
            self.exec = call("cuGraphInstantiate", self.graph, 0)

    def replay(self):
        call("cuGraphLaunch", self.exec, self.s)

    def close(self):
        if self.exec is not None:
            call("cuGraphExecDestroy", self.exec)
        if self.graph is not None:
            call("cuGraphDestroy", self.graph)


# Every replay also gets new weights at the same addresses (an optimizer step between replays), so
# a replay that reused anything computed from the weights at capture time fails.  FP8: with bf16
# weights, whose quantisation then runs inside the captured calls, and with weights quantised once
# before the capture (`qw`, made from the first seed's weights and read by the eager runs and the
# replays alike).
@pytest.mark.parametrize("precision,recompute,fp8_weights", [
    ("bf16", False, None), ("bf16", True, None),
    ("fp8_block", False, "quantized"), ("fp8_block", True, "quantized"), ("fp8_block", False, "bf16")])
def test_raw_capture_replays_match_eager_bitwise(precision, recompute, fp8_weights):
    seeds = (101, 102, 103)
    probs = [make_problem(s, **SHAPE) for s in seeds]
    with mok.Workspace(_cfg(precision), mok.SingleProcessGroup(devices=[0]), max_tokens=SHAPE["T"],
                       poison_outputs=True) as ws:
        d = _to_dev(probs[0])
        qw = mok.quantize_weights(ws, _experts(d), _shared(d)) if fp8_weights == "quantized" else None
        cp.cuda.Device(0).synchronize()
        eager = []
        for h in probs:
            _refill(d, h, weights=True)
            cp.cuda.Device(0).synchronize()
            eager.append(_host(_step(ws, d, recompute=recompute, weights=qw)))
            ws.synchronize()
        _refill(d, probs[0], weights=True)
        cp.cuda.Device(0).synchronize()
        g = _RawGraph(int(ws.stream.handle))
        try:
            with g:
                captured = _step(ws, d, recompute=recompute, weights=qw)
            for h, want in zip(probs, eager):
                _refill(d, h, weights=True)
                _poison(captured)
                g.replay()
                ws.synchronize()
                got = _host(captured)
                for n in NAMES:
                    assert np.array_equal(got[n], want[n]), n
        finally:
            g.close()


def test_two_layers_in_one_graph_and_a_device_error_in_a_replay():
    h1, h2 = make_problem(201, **SHAPE), make_problem(202, **SHAPE)
    with mok.Workspace(_cfg(), mok.SingleProcessGroup(devices=[0]), max_tokens=SHAPE["T"],
                       poison_outputs=True) as ws:
        d1, d2 = _to_dev(h1), _to_dev(h2)
        cp.cuda.Device(0).synchronize()

        def two_layers():
            s1 = mok.schedule(ws, d1["ids"])
            y, c1 = mok.forward(ws, s1, d1["x"], d1["tw"], _experts(d1), shared=_shared(d1))
            s2 = mok.schedule(ws, d2["ids"])
            z, c2 = mok.forward(ws, s2, y, d2["tw"], _experts(d2), shared=_shared(d2))
            g2 = mok.backward(ws, c2, d2["d_out"])
            g1 = mok.backward(ws, c1, g2.dx)
            return dict(z=z, dx=g1.dx, dw1=g1.dw.down, dw2=g2.dw.gate)

        eager = two_layers()
        ws.synchronize()
        want = _host(eager)
        for n, t in eager.items():   # eager results written (poisoned first), so a replay has something to match
            assert np.isfinite(t.to_numpy().astype(np.float32)).all(), n
        del eager
        g = _RawGraph(int(ws.stream.handle))
        try:
            with g:
                captured = two_layers()
            _poison(captured)
            g.replay()
            ws.synchronize()
            got = _host(captured)
            for n in want:
                assert np.array_equal(got[n], want[n]), n
            assert ws.memory_bytes()["graph_arena"] > 0
            # An expert id out of range in a replay: reported at synchronize, as eagerly.
            d2["ids"][5, 1] = 10_000
            cp.cuda.Device(0).synchronize()
            g.replay()
            with pytest.raises(mok.ExpertIdError):
                ws.synchronize()
            d2["ids"][...] = cp.asarray(h2["ids"])
            _poison(captured)   # else the first replay's bits would still be there to compare
            g.replay()
            ws.synchronize()   # the error word was cleared: the next replay is clean
            got = _host(captured)
            for n in want:
                assert np.array_equal(got[n], want[n]), n
        finally:
            g.close()


def test_torch_cuda_graph_capture_matches_eager():
    try:
        import torch
    except ImportError:
        skip_or_fail("torch is not installed (pip install -e '.[torch]')")
    if not torch.cuda.is_available():
        skip_or_fail("torch has no CUDA")
    h = make_problem(301, **SHAPE)
    dev = torch.device("cuda", 0)
    t = {n: torch.from_dlpack(cp.asarray(v)) if n != "shared" else v for n, v in _to_dev(h).items()}
    d = {n: v for n, v in t.items() if n != "shared"}
    d["shared"] = tuple(torch.from_dlpack(v) for v in _to_dev(h)["shared"])
    with mok.Workspace(_cfg(), mok.SingleProcessGroup(devices=[0]), max_tokens=SHAPE["T"],
                       poison_outputs=True) as ws:
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm-up off the default stream, as torch's docs advise
            want = {n: torch.from_dlpack(v).clone() for n, v in _step(ws, d, stream=side).items()}
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _step(ws, d, stream=torch.cuda.current_stream())
        for n, w in want.items():   # the eager results were written (poisoned first)
            assert torch.isfinite(w.float()).all(), n
        _poison(captured)
        graph.replay()
        torch.cuda.synchronize()
        ws.synchronize()
        for n in NAMES:
            got = torch.from_dlpack(captured[n])
            assert torch.equal(got.view(torch.uint8), want[n].view(torch.uint8)), n


def test_expert_parallel_capture_is_refused():
    h = make_problem(401, **SHAPE)
    with mok.Workspace(_cfg(), mok.SingleProcessGroup(devices=[0, 0]), max_tokens=SHAPE["T"]) as ws:
        d = _to_dev(h)
        cp.cuda.Device(0).synchronize()
        rank = ws.rank(0)
        g = _RawGraph(int(rank.stream.handle))
        with pytest.raises(mok.ArgumentError, match="graph"):
            with g:
                mok.schedule(rank, d["ids"])
        g.close()


def test_no_memory_growth_over_1000_steps():
    h = make_problem(501, T=256, H=128, I=64, E=4, k=2)
    cfg = mok.MoEConfig(hidden=128, intermediate=64, num_experts=4, top_k=2)
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=256) as ws:
        d = _to_dev(h)

        def step():
            sched = mok.schedule(ws, d["ids"])
            out, ctx = mok.forward(ws, sched, d["x"], d["tw"], _experts(d))
            mok.backward(ws, ctx, d["d_out"])

        for _ in range(20):
            step()
        ws.synchronize()
        free0, _ = call("cuMemGetInfo")
        held0 = ws.memory_bytes()
        for _ in range(1000):
            step()
        ws.synchronize()
        free1, _ = call("cuMemGetInfo")
        assert ws.memory_bytes() == held0
        assert int(free0) - int(free1) < 64 << 20, (free0, free1)
