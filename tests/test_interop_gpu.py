"""Framework interop on the GPU: CuPy, PyTorch and JAX tensors in and out through DLPack.

For each framework: forward/backward with its tensors, zero copies (the pointers mok_rt sees are
the framework's, and the framework's views of our results are our memory), on the framework's
current stream and on a non-default one, with the same bits as a run on mok_rt's own tensors
(the CuPy run included).  Stream ordering in both directions is tested with a long producer on
another stream, with a control run that drops the ordering and reads stale data.  The autograd
wrappers of samples/ are checked bitwise against direct API calls, and the samples run.

Each framework's tests skip when it is missing (or has no GPU backend); with MOK_RT_REQUIRE_GPU=1
they fail instead (tests/_gpu.skip_or_fail).
"""
from __future__ import annotations

import importlib.util
import math
import os
import pathlib

import ml_dtypes
import numpy as np
import pytest

# Leave GPU memory to mok_rt's pool and the other frameworks (JAX takes 75% by default).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import mok_rt as mok  # noqa: E402
from mok_rt import reference  # noqa: E402
from mok_rt.interop.dlpack import from_dlpack  # noqa: E402

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
BF16 = ml_dtypes.bfloat16
CFG = dict(hidden=512, intermediate=256, num_experts=8, top_k=2, shared_intermediate=256)
T = 333                       # not a multiple of the row block
WEIGHTS = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")
RESULTS = ("out", "dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")
PRODUCER_N = 8192             # the long producer: a chain of N x N bf16 matmuls (~1.5 ms each on H200)
PRODUCER_STEPS = 40


# --------------------------------------------------------------------------- fixtures and helpers
@pytest.fixture(scope="module")
def torch():
    from _gpu import skip_or_fail   # on a GPU machine with MOK_RT_REQUIRE_GPU=1: fail, not skip
    try:
        import torch as t
    except ImportError:
        skip_or_fail("torch is not installed (pip install -e '.[torch]')")
    if not t.cuda.is_available():
        skip_or_fail("torch has no CUDA")
    return t


@pytest.fixture(scope="module")
def cp():
    from _gpu import need_cupy
    return need_cupy()


@pytest.fixture(scope="module")
def jax():
    from _gpu import skip_or_fail
    try:
        import jax as j
    except ImportError:
        skip_or_fail("jax is not installed (pip install -e '.[jax]' and jax[cuda13])")
    try:
        j.devices("gpu")
    except RuntimeError:
        skip_or_fail("jax has no GPU backend (jax[cuda13])")
    return j


def _load_sample(name: str):
    spec = importlib.util.spec_from_file_location(f"_mok_sample_{name}", ROOT / "samples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _problem(seed: int) -> dict:
    """Fresh random host inputs in the cuda backend's dtypes (bf16, f32 weights, int32 ids)."""
    rng = np.random.default_rng(seed)
    H, I, E, k, Is = (CFG[n] for n in ("hidden", "intermediate", "num_experts", "top_k", "shared_intermediate"))
    return {"x": rng.standard_normal((T, H)).astype(BF16),
            "ids": np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32),
            "tw": rng.random((T, k)).astype(np.float32),
            "w_gate": (rng.standard_normal((E, I, H)) * H ** -0.5).astype(BF16),
            "w_up": (rng.standard_normal((E, I, H)) * H ** -0.5).astype(BF16),
            "w_down": (rng.standard_normal((E, H, I)) * I ** -0.5).astype(BF16),
            "ws_gate": (rng.standard_normal((Is, H)) * H ** -0.5).astype(BF16),
            "ws_up": (rng.standard_normal((Is, H)) * H ** -0.5).astype(BF16),
            "ws_down": (rng.standard_normal((H, Is)) * Is ** -0.5).astype(BF16),
            "d_out": rng.standard_normal((T, H)).astype(BF16)}


def _workspace():
    return mok.Workspace(mok.MoEConfig(**CFG), mok.SingleProcessGroup(devices=[0]), max_tokens=T,
                         poison_outputs=True)


def _experts(d: dict):
    """(routed, shared) mok.ExpertWeights of ``d``'s weights."""
    return (mok.ExpertWeights(gate=d["w_gate"], up=d["w_up"], down=d["w_down"]),
            mok.ExpertWeights(gate=d["ws_gate"], up=d["ws_up"], down=d["ws_down"]))


def _run(ws, d: dict, *, stream=None, grad_bufs=None):
    """schedule + forward + backward on ``d``'s tensors; the results as a dict by RESULTS' names
    (mok_rt tensors, or the caller's buffers for the weight gradients: ``grad_bufs`` by name, all six)."""
    experts, shared = _experts(d)
    sched = mok.schedule(ws, d["ids"], stream=stream)
    out, ctx = mok.forward(ws, sched, d["x"], d["tw"], experts, shared=shared, stream=stream)
    bufs = {}
    if grad_bufs is not None:
        b = [grad_bufs[n] for n in RESULTS[3:]]
        bufs = dict(dw=mok.ExpertWeights(*b[:3]), dw_shared=mok.ExpertWeights(*b[3:]))
    g = mok.backward(ws, ctx, d["d_out"], stream=stream, **bufs)
    return dict(zip(RESULTS, (out, g.dx, g.d_topk_weights, *g.dw, *g.dw_shared)))


def _bits(a) -> np.ndarray:
    """The bytes of any framework's array (or a mok_rt tensor), copied to the host."""
    if isinstance(a, mok.Tensor):
        host = a.to_numpy()
    elif type(a).__module__.startswith("torch"):
        t = a.detach().contiguous().cpu()
        host = (t.view(__import__("torch").int16) if t.element_size() == 2 else t).numpy()
    elif type(a).__module__.startswith("cupy"):
        import cupy
        host = cupy.asnumpy(a.view(cupy.uint16) if a.dtype.itemsize == 2 and a.dtype.kind not in "iuf" else a)
    else:
        host = np.asarray(a)
    return np.ascontiguousarray(host).view(np.uint8)


def _assert_same_bits(got: dict, want: dict, what: str):
    for n in want:
        np.testing.assert_array_equal(_bits(got[n]), want[n], err_msg=f"{what}: {n} differs from the baseline")


@pytest.fixture(scope="module")
def baseline():
    """The problem and its results' bytes computed on mok_rt's own device tensors (no framework)."""
    h = _problem(1)
    with _workspace() as ws:
        d = {}
        for n, v in h.items():
            d[n] = mok.Tensor.empty(v.shape, v.dtype, device_id=0, stream=ws.stream)
            d[n].copy_from_numpy(v, stream=ws.stream)
        res = _run(ws, d)
        ws.synchronize()
        bits = {n: _bits(v) for n, v in res.items()}
    # Sanity: the baseline is the layer (loose bf16 tolerance; test_layer_gpu checks accuracy).
    f = lambda a: a.astype(np.float64)  # noqa: E731
    ref_out, _ = reference.forward(f(h["x"]), h["ids"], f(h["tw"]), f(h["w_gate"]), f(h["w_up"]), f(h["w_down"]),
                                   ws_gate=f(h["ws_gate"]), ws_up=f(h["ws_up"]), ws_down=f(h["ws_down"]))
    out = bits["out"].view(BF16).reshape(ref_out.shape).astype(np.float64)
    assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) < 1e-2
    return h, bits


def _long_matmul_chain(torch, stream):
    """Enqueue ~60 ms of tensor-core work on torch ``stream``; returns its (unused) result."""
    with torch.cuda.stream(stream):
        a = torch.full((PRODUCER_N, PRODUCER_N), 1.0 / PRODUCER_N, device="cuda", dtype=torch.bfloat16)
        y = a
        for _ in range(PRODUCER_STEPS):
            y = y @ a
    return y


def _torch_inputs(torch, h, *, stream=None):
    dev = torch.device("cuda", 0)

    def conv(v):
        if v.dtype == BF16:  # torch has no ml_dtypes: move the bits, then reinterpret
            return torch.from_numpy(v.view(np.uint16).view(np.int16)).to(dev).view(torch.bfloat16)
        return torch.from_numpy(v).to(dev)

    if stream is None:
        return {n: conv(v) for n, v in h.items()}
    with torch.cuda.stream(stream):
        return {n: conv(v) for n, v in h.items()}


def _torch_stream_arg(torch, s):
    """What a caller hands mok_rt for torch stream ``s``: the stream object (CUDA stream protocol)
    when torch has it, else its handle.  Handle 0 (the default stream) goes as the int 1
    (CU_STREAM_LEGACY, the same stream): see test_torch_stream_object_with_handle_zero."""
    if hasattr(s, "__cuda_stream__") and s.cuda_stream:
        return s
    return s.cuda_stream or 1


def _cupy_stream_arg(s):
    return s if hasattr(s, "__cuda_stream__") and s.ptr else (s.ptr or 1)


# --------------------------------------------------------------------------- a run on mok_rt tensors
def test_results_export_to_every_framework_without_copies(baseline, torch, cp, jax):
    h, want = baseline
    with _workspace() as ws:
        d = {n: mok.Tensor.empty(v.shape, v.dtype, device_id=0, stream=ws.stream) for n, v in h.items()}
        for n, v in h.items():
            d[n].copy_from_numpy(v, stream=ws.stream)
        res = _run(ws, d)
        # Consumers take the results while our kernels may still run: their streams wait on ours.
        as_torch = {n: torch.from_dlpack(v) for n, v in res.items()}
        as_cupy = {n: cp.from_dlpack(v) for n, v in res.items()}
        as_jax = {n: jax.dlpack.from_dlpack(v) for n, v in res.items()}
        for n, v in res.items():
            assert as_torch[n].data_ptr() == v.ptr, n
            assert as_cupy[n].data.ptr == v.ptr, n
            assert as_jax[n].unsafe_buffer_pointer() == v.ptr, n
        assert as_torch["out"].dtype == torch.bfloat16 and as_torch["dw_gate"].dtype == torch.float32
        _assert_same_bits(as_torch, want, "torch views")
        _assert_same_bits(as_cupy, want, "cupy views")
        _assert_same_bits(as_jax, want, "jax views")
        ws.synchronize()


# --------------------------------------------------------------------------- CuPy
@pytest.mark.parametrize("which", ["current", "non_default"])
def test_cupy_inputs(baseline, cp, which):
    h, want = baseline
    s = cp.cuda.get_current_stream() if which == "current" else cp.cuda.Stream(non_blocking=True)
    with s, _workspace() as ws:
        d = {n: cp.asarray(v) for n, v in h.items()}
        for n in ("x", "ids", "tw", "w_down", "d_out"):
            assert from_dlpack(d[n], name=n).ptr == d[n].data.ptr, n
        res = _run(ws, d, stream=_cupy_stream_arg(s))
        views = {n: cp.from_dlpack(v) for n, v in res.items()}   # on cupy's current stream (s)
        assert all(views[n].data.ptr == res[n].ptr for n in res)
        s.synchronize()
        ws.check()
    _assert_same_bits(views, want, f"cupy ({which} stream)")


# --------------------------------------------------------------------------- PyTorch
@pytest.mark.parametrize("which", ["current", "non_default"])
def test_torch_inputs(baseline, torch, which):
    h, want = baseline
    s = torch.cuda.current_stream() if which == "current" else torch.cuda.Stream()
    with torch.cuda.stream(s), _workspace() as ws:
        d = _torch_inputs(torch, h)
        for n in ("x", "ids", "tw", "w_gate", "d_out"):
            assert from_dlpack(d[n], name=n).ptr == d[n].data_ptr(), n
        # Weight gradients written straight into torch-owned fp32 buffers (poisoned first).
        bufs = {"d" + n: torch.full(d[n].shape, float("nan"), device="cuda", dtype=torch.float32) for n in WEIGHTS}
        res = _run(ws, d, stream=_torch_stream_arg(torch, s), grad_bufs=bufs)
        for n, b in bufs.items():
            assert res[n] is b, n
        views = {n: (v if n in bufs else torch.from_dlpack(v)) for n, v in res.items()}
        for n in ("out", "dx", "d_topk_weights"):
            assert views[n].data_ptr() == res[n].ptr, n
        s.synchronize()
        ws.check()
    _assert_same_bits(views, want, f"torch ({which} stream)")


@pytest.mark.parametrize("which", ["current", "non_default"])
def test_torch_stream_given_as_an_int_handle(baseline, torch, which):
    """Older torch streams lack ``__cuda_stream__``: the raw handle works too (default: 1)."""
    h, want = baseline
    s = torch.cuda.current_stream() if which == "current" else torch.cuda.Stream()
    with torch.cuda.stream(s), _workspace() as ws:
        d = _torch_inputs(torch, h)
        res = _run(ws, d, stream=s.cuda_stream or 1)
        views = {n: torch.from_dlpack(v) for n, v in res.items()}
        s.synchronize()
        ws.check()
    _assert_same_bits(views, want, f"torch int handle ({which} stream)")


@pytest.mark.parametrize("last", ["x", "w_down"])
def test_torch_producer_on_another_stream_is_ordered_before_us(baseline, torch, last):
    """An input (``last``) is written at the end of ~60 ms of work on stream A (torch's current
    stream); mok_rt runs on stream B.  Importing x with stream=B (torch's __dlpack__) must make B
    wait for A; w_down, imported later in the same call, is exported with stream=-1 (the order
    is per call: interop/producers.py) and must be covered by that wait too.  Control: the same
    run with every input imported without synchronisation (stream=-1) reads stale NaNs."""
    h, want = baseline
    A, B = torch.cuda.Stream(), torch.cuda.Stream()
    sb = _torch_stream_arg(torch, B)
    with _workspace() as ws:
        d = _torch_inputs(torch, h)
        final = d[last]
        names = ("tw", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")
        sched = mok.schedule(ws, d["ids"], stream=sb)
        experts = lambda imp: (mok.ExpertWeights(*(imp(d[n], n) for n in names[1:4])),  # noqa: E731
                               mok.ExpertWeights(*(imp(d[n], n) for n in names[4:])))
        ex, sh = experts(lambda t, n: t)
        mok.forward(ws, sched, d["x"], d["tw"], ex, shared=sh, stream=sb)   # warm-up
        torch.cuda.synchronize()
        ws.check()

        def race(*, ordered: bool):
            target = torch.full_like(final, float("nan"))
            torch.cuda.synchronize()
            imp = (lambda t, n: t) if ordered else (lambda t, n: from_dlpack(t, name=n, stream=-1))  # noqa: E731
            inputs = dict(d, **{last: target})
            with torch.cuda.stream(A):
                _long_matmul_chain(torch, A)
                target.copy_(final)                  # the producer's last write, still far away
                ex = mok.ExpertWeights(*(imp(inputs[n], n) for n in names[1:4]))
                sh = mok.ExpertWeights(*(imp(inputs[n], n) for n in names[4:]))
                out, _ = mok.forward(ws, sched, imp(inputs["x"], "x"), imp(inputs["tw"], "tw"), ex, shared=sh,
                                     stream=sb)
                producer_busy = not A.query()
            with torch.cuda.stream(B):
                got = torch.from_dlpack(out).clone()
            torch.cuda.synchronize()
            assert producer_busy, "the producer finished before mok_rt was called: the test proves nothing"
            return got

        got = race(ordered=True)
        np.testing.assert_array_equal(_bits(got), want["out"], err_msg="ordered run differs")
        stale = race(ordered=False)
        assert torch.isnan(stale.float()).any(), "control run did not read stale data: the race did not happen"
        ws.check()


def test_torch_consumer_waits_for_our_kernels(torch):
    """mok_rt runs on stream B behind ~60 ms of other work; torch takes the output on stream C
    right away.  Our __dlpack__(stream=C) must make C wait.  Control: a capsule exported with
    stream=-1 lets C read the buffer before our kernels wrote it."""
    B, C = torch.cuda.Stream(), torch.cuda.Stream()
    sb = _torch_stream_arg(torch, B)
    with _workspace() as ws:
        def race(seed, *, ordered: bool):
            # A fresh problem per run: stale memory can never hold this run's result.
            d = _torch_inputs(torch, _problem(seed))
            experts, shared = _experts(d)
            sched = mok.schedule(ws, d["ids"], stream=sb)
            torch.cuda.synchronize()
            _long_matmul_chain(torch, B)
            out, _ = mok.forward(ws, sched, d["x"], d["tw"], experts, shared=shared, stream=sb)
            with torch.cuda.stream(C):
                y = torch.from_dlpack(out) if ordered else torch.utils.dlpack.from_dlpack(out.__dlpack__(stream=-1))
                got = y.clone()
                busy = not B.query()
            torch.cuda.synchronize()
            assert busy, "our kernels finished before the consumer was enqueued: the test proves nothing"
            return got, out

        for seed, ordered in ((2, True), (3, False)):
            got, out = race(seed, ordered=ordered)
            same = np.array_equal(_bits(got), _bits(out))   # _bits(out) waits for our stream
            assert same == ordered, ("ordered consumer read wrong data" if ordered else
                                     "control consumer read the final data: the race did not happen")
        ws.check()


def test_torch_stream_object_with_handle_zero(baseline, torch):
    """torch's default stream has handle 0 (DLPack's 'ambiguous' value): passing the stream object
    itself must work (mok_rt spells it as the legacy default stream, 1, towards DLPack)."""
    h, want = baseline
    s = torch.cuda.default_stream()
    assert s.cuda_stream == 0
    if not hasattr(s, "__cuda_stream__"):
        pytest.skip("this torch has no CUDA stream protocol")
    with torch.cuda.stream(s), _workspace() as ws:
        res = _run(ws, _torch_inputs(torch, h), stream=s)
        views = {n: torch.from_dlpack(v) for n, v in res.items()}
        s.synchronize()
        ws.check()
    _assert_same_bits(views, want, "torch default stream object")


# --------------------------------------------------------------------------- JAX
@pytest.mark.parametrize("which", ["workspace", "non_default"])
def test_jax_inputs(baseline, jax, which):
    """JAX exposes no streams: mok_rt runs on the workspace's stream or one the caller made; DLPack
    orders JAX's work before ours and ours before JAX's."""
    from cuda.core import Device
    h, want = baseline
    gpu = jax.devices("gpu")[0]
    stream = None if which == "workspace" else Device(0).create_stream()
    with _workspace() as ws:
        d = {n: jax.device_put(v, gpu) for n, v in h.items()}
        for n in ("x", "ids", "tw", "w_up", "d_out"):
            assert from_dlpack(d[n], name=n).ptr == d[n].unsafe_buffer_pointer(), n
        res = _run(ws, d, stream=stream)
        views = {n: jax.dlpack.from_dlpack(v) for n, v in res.items()}
        for n in res:
            assert views[n].unsafe_buffer_pointer() == res[n].ptr, n
        _assert_same_bits(views, want, f"jax ({which} stream)")
        ws.synchronize()
        if stream is not None:
            stream.sync()


def test_jax_pending_producer_and_consumer(baseline, jax):
    """x comes out of a ~60 ms jitted computation that has not finished when mok_rt is called (JAX
    dispatches asynchronously); our stream must wait for it, and JAX consuming our output right
    away must wait for our kernels."""
    import jax.numpy as jnp
    h, want = baseline
    gpu = jax.devices("gpu")[0]
    with _workspace() as ws:
        d = {n: jax.device_put(v, gpu) for n, v in h.items()}
        experts, shared = _experts(d)
        sched = mok.schedule(ws, d["ids"])
        a = jax.device_put(np.full((PRODUCER_N, PRODUCER_N), 1.0 / PRODUCER_N, BF16), gpu)

        @jax.jit
        def late_x(a, x):
            y = jax.lax.fori_loop(0, PRODUCER_STEPS, lambda i, y: jnp.tanh(y @ a), a)
            return jnp.where(y[0, 0] > 2.0, jnp.zeros_like(x), x)   # tanh <= 1: always x, after the chain

        late_x(a, d["x"]).block_until_ready()   # compile outside the race
        ws.synchronize()
        x = late_x(a, d["x"])
        assert not x.is_ready(), "the producer finished before mok_rt was called: the test proves nothing"
        out, _ = mok.forward(ws, sched, x, d["tw"], experts, shared=shared)
        y = jax.dlpack.from_dlpack(out)
        z = (y.astype(jnp.float32) * 1.0).astype(jnp.bfloat16)   # JAX work on our output
        np.testing.assert_array_equal(_bits(z), want["out"])
        ws.synchronize()


# --------------------------------------------------------------------------- the autograd wrappers
@pytest.mark.parametrize("checkpoint", [False, True])
def test_torch_function_matches_the_direct_calls(baseline, torch, checkpoint):
    """fp32 master weights holding bf16 values: the wrapper's cast is exact, so every gradient must
    carry the direct calls' bits (weight gradients fp32, dx bf16, d_topk_weights fp32)."""
    ta = _load_sample("torch_autograd")
    h, want = baseline
    d = _torch_inputs(torch, h)
    leaves = {n: (d[n].float() if n in WEIGHTS else d[n]).clone().requires_grad_(True)
              for n in ("x", "tw") + WEIGHTS}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())   # the inputs were made on the default stream
    with torch.cuda.stream(s), _workspace() as ws:
        out = ta.moe(ws, leaves["x"], d["ids"], leaves["tw"], *(leaves[n] for n in WEIGHTS), checkpoint=checkpoint)
        out.backward(d["d_out"])
        s.synchronize()
        ws.check()
    got = {"out": out, "dx": leaves["x"].grad, "d_topk_weights": leaves["tw"].grad,
           **{"d" + n: leaves[n].grad for n in WEIGHTS}}
    assert got["dw_gate"].dtype == torch.float32 and got["dx"].dtype == torch.bfloat16
    _assert_same_bits(got, want, f"torch.autograd.Function (checkpoint={checkpoint})")


@pytest.mark.parametrize("checkpoint", [False, True])
def test_jax_custom_vjp_matches_the_direct_calls(baseline, jax, checkpoint):
    import jax.numpy as jnp
    jv = _load_sample("jax_custom_vjp")
    h, want = baseline
    gpu = jax.devices("gpu")[0]
    d = {n: jax.device_put(v, gpu) for n, v in h.items()}
    with _workspace() as ws:
        moe = jv.make_moe(ws, checkpoint=checkpoint)
        params = {"x": d["x"], "tw": d["tw"], **{n: d[n].astype(jnp.float32) for n in WEIGHTS}}

        def f(p):
            return moe(p["x"], d["ids"], p["tw"], *(p[n] for n in WEIGHTS))

        out, vjp = jax.vjp(f, params)
        (g,) = vjp(d["d_out"])
        got = {"out": out, "dx": g["x"], "d_topk_weights": g["tw"], **{"d" + n: g[n] for n in WEIGHTS}}
        _assert_same_bits(got, want, f"jax.custom_vjp (checkpoint={checkpoint})")
        ws.synchronize()


# --------------------------------------------------------------------------- the samples
@pytest.mark.parametrize("checkpoint", [False, True])
def test_torch_sample_trains_on_the_gpu(torch, checkpoint):
    losses = _load_sample("torch_autograd").main(["--backend", "cuda", "--steps", "6"] +
                                                 (["--checkpoint"] if checkpoint else []))
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("checkpoint", [False, True])
def test_jax_sample_trains_on_the_gpu(jax, checkpoint):
    losses = _load_sample("jax_custom_vjp").main(["--backend", "cuda", "--steps", "6"] +
                                                 (["--checkpoint"] if checkpoint else []))
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
