"""The reference backend as the device's stand-in, where it used to differ: the CapacityError's
code, info and wording; gradient buffers accumulated into surviving a failed step; bf16 weight
gradients rounded from fp32; the oracle's sigmoid for very negative inputs; the framework adapters
on a ``strict=True`` reference workspace; the samples' one-line answer to ``--backend cuda``
without a GPU.

jax and torch are optional: their tests skip when the framework is not installed.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import warnings

import ml_dtypes
import numpy as np
import pytest

import mok_rt as mok
from mok_rt.reference import layer as ref_layer
from mok_rt.reference.schedule import CapacityOverflow, schedule_reference
from mok_rt.runtime.errorword import ERR_CAPACITY, ERR_EXPERT_ID, device_error

ROOT = pathlib.Path(__file__).resolve().parents[1]
BF16 = ml_dtypes.bfloat16


def _cfg(**kw):
    return mok.MoEConfig(**{"hidden": 64, "intermediate": 64, "num_experts": 4, "top_k": 2, **kw})


def _problem(rng, *, T, H=64, I=64, E=4, k=2, Is=0, dtype=np.float32):
    p = {"x": rng.standard_normal((T, H)).astype(dtype),
         "ids": np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32),
         "tw": rng.random((T, k)).astype(np.float32),
         "w": [(rng.standard_normal(s) / np.sqrt(s[-1])).astype(dtype) for s in ((E, I, H), (E, I, H), (E, H, I))],
         "d_out": rng.standard_normal((T, H)).astype(dtype)}
    p["shared"] = [(rng.standard_normal(s) / np.sqrt(s[-1])).astype(dtype) for s in ((Is, H), (Is, H), (H, Is))] \
        if Is else None
    return p


def _experts(p):
    return mok.ExpertWeights(*p["w"]), (mok.ExpertWeights(*p["shared"]) if p["shared"] else None)


# ----------------------------------------------------------------------------- 1. CapacityError
def test_capacity_error_carries_the_device_code_info_and_wording():
    with mok.Workspace(_cfg(capacity_factor=0.01), max_tokens=4096, backend="reference") as ws:
        cap = ws.capacity_rows
        mok.schedule(ws, np.zeros((4096, 2), np.int32))   # 8192 rows for expert 0 of rank 0
        with pytest.raises(mok.CapacityError) as info:
            ws.synchronize()
        ws.synchronize()   # read and cleared, like the device's error word
    e = info.value
    assert e.code == ERR_CAPACITY and e.info == (0, 8192, cap)
    # The device path's message, with the reference in place of "device N".
    assert str(e) == str(device_error(ERR_CAPACITY, (0, 8192, cap), "mok_rt (reference)"))
    assert "rank 0 received 8192 rows, more than its capacity of" in str(e)


def test_expert_id_error_carries_the_device_code():
    ids = np.zeros((8, 2), np.int32)
    ids[5, 1] = 9
    with mok.Workspace(_cfg(), max_tokens=8, backend="reference") as ws:
        mok.schedule(ws, ids)
        with pytest.raises(mok.ExpertIdError) as info:
            ws.check()
    assert info.value.code == ERR_EXPERT_ID and info.value.info == (0, 5, 9)


def test_schedule_reference_capacity_overflow_is_still_an_argument_error():
    with pytest.raises(mok.ArgumentError) as info:
        schedule_reference([np.zeros((4, 2), np.int64)], num_experts=2, num_ranks=1, block_m=4, rank=0,
                           capacity_rows=7)
    e = info.value
    assert isinstance(e, CapacityOverflow) and e.argument == "capacity_rows"
    assert (e.rank, e.rows, e.capacity) == (0, 8, 7)


# ----------------------------------------------------------------------------- 2. accumulate survives
@pytest.mark.parametrize("failure", ["expert_id", "capacity"])
@pytest.mark.parametrize("grad_dtype", [np.float32, BF16])
def test_failed_micro_batch_leaves_accumulated_gradients(failure, grad_dtype):
    """As on CUDA, where the kernels exit without work: buffers added into keep the earlier
    micro-batches' sums; what the failed call itself returns is NaN."""
    rng = np.random.default_rng(3)
    cfg = _cfg(shared_intermediate=64, capacity_factor=0.01 if failure == "capacity" else None)
    good = _problem(rng, T=64, Is=64)
    bad = _problem(rng, T=64, Is=64)
    if failure == "expert_id":
        bad["ids"][7, 0] = 4
        err = mok.ExpertIdError
    else:   # every route to expert 0: more rows than the 640 the workspace holds
        bad = _problem(rng, T=4096, Is=64)
        bad["ids"][:] = 0
        err = mok.CapacityError
    w = _experts(good)
    dw = mok.ExpertWeights(*(np.zeros(a.shape, grad_dtype) for a in good["w"]))
    dws = mok.ExpertWeights(*(np.zeros(a.shape, grad_dtype) for a in good["shared"]))
    with mok.Workspace(cfg, max_tokens=4096, backend="reference") as ws:
        sched = mok.schedule(ws, good["ids"])
        _, ctx = mok.forward(ws, sched, good["x"], good["tw"], w[0], shared=w[1])
        mok.backward(ws, ctx, good["d_out"], dw=dw, dw_shared=dws, accumulate=True)
        ws.synchronize()
        first = [np.array(a, copy=True) for a in (*dw, *dws)]
        assert all(np.isfinite(a.astype(np.float32)).all() and a.any() for a in first)

        sched = mok.schedule(ws, bad["ids"])
        out, ctx = mok.forward(ws, sched, bad["x"], bad["tw"], w[0], shared=w[1])
        g = mok.backward(ws, ctx, bad["d_out"], dw=dw, dw_shared=dws, accumulate=True)
        assert g.dw is dw and g.dw_shared is dws
        for t in (out, g.dx, g.d_topk_weights):
            assert np.isnan(t.to_numpy().astype(np.float32)).all()
        with pytest.raises(err):
            ws.synchronize()
    for a, b in zip((*dw, *dws), first):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_failed_step_still_poisons_buffers_it_would_overwrite():
    rng = np.random.default_rng(4)
    p = _problem(rng, T=16)
    p["ids"][2, 1] = -1
    dw = mok.ExpertWeights(*(np.zeros(a.shape, np.float32) for a in p["w"]))
    with mok.Workspace(_cfg(), max_tokens=16, backend="reference") as ws:
        sched = mok.schedule(ws, p["ids"])
        _, ctx = mok.forward(ws, sched, p["x"], p["tw"], _experts(p)[0])
        mok.backward(ws, ctx, p["d_out"], dw=dw)   # accumulate=False: this step owns them
        with pytest.raises(mok.ExpertIdError):
            ws.synchronize()
    assert all(np.isnan(a).all() for a in dw)


# ----------------------------------------------------------------------------- 3. bf16 gradients
def test_bf16_weight_gradients_are_the_fp32_ones_rounded():
    """SEMANTICS §4: a bf16 gradient is bitwise the fp32 gradient rounded to bf16, for caller
    buffers and for the ones the backward allocates.  At this size a direct float64 -> bf16
    rounding differs in a few elements (checked, so that the test keeps its teeth)."""
    H = I = Is = 256
    rng = np.random.default_rng(0)
    p = _problem(rng, T=1024, H=H, I=I, E=8, Is=Is, dtype=BF16)
    routed, shared = _experts(p)
    with mok.Workspace(_cfg(hidden=H, intermediate=I, num_experts=8, shared_intermediate=Is), max_tokens=1024,
                       backend="reference") as ws:
        sched = mok.schedule(ws, p["ids"])
        _, ctx = mok.forward(ws, sched, p["x"], p["tw"], routed, shared=shared)
        f32 = mok.backward(ws, ctx, p["d_out"])
        f64 = mok.backward(ws, ctx, p["d_out"], dw=mok.ExpertWeights(*(np.empty(a.shape) for a in p["w"])),
                           dw_shared=mok.ExpertWeights(*(np.empty(a.shape) for a in p["shared"])))
        bufs = [np.full(a.shape, np.nan, BF16) for a in p["w"]]
        g = mok.backward(ws, ctx, p["d_out"], dw=mok.ExpertWeights(*bufs))   # shared ones allocated in bf16
    got = [*bufs, *(a.to_numpy() for a in g.dw_shared)]
    want = [a.to_numpy().astype(BF16) for a in (*f32.dw, *f32.dw_shared)]
    for a, b in zip(got, want):
        assert a.dtype == BF16
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    direct = [np.asarray(a).astype(BF16) for a in (*f64.dw, *f64.dw_shared)]
    assert sum(int((a.view(np.uint16) != b.view(np.uint16)).sum()) for a, b in zip(direct, want)) > 0


# ----------------------------------------------------------------------------- 4. sigmoid
def test_sigmoid_keeps_relative_accuracy_for_very_negative_inputs():
    z = np.concatenate([np.linspace(-700.0, -38.0, 5001), [-40.0, -100.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no overflow (or other) warnings anywhere
        s = ref_layer._sigmoid(z)
        every = ref_layer._sigmoid(np.linspace(-800.0, 800.0, 16001))
    # sigmoid(z) = exp(z) / (1 + exp(z)) = exp(z) (1 - O(exp(z))): exp(z) to 1e-16 relative here.
    np.testing.assert_allclose(s, np.exp(z), rtol=2e-16, atol=0)
    assert np.all(np.diff(every) >= 0) and every[0] == 0.0 and every[-1] == 1.0
    zz = np.linspace(-30.0, 30.0, 6001)
    np.testing.assert_allclose(ref_layer._sigmoid(zz) + ref_layer._sigmoid(-zz), 1.0, rtol=0, atol=2.3e-16)
    assert ref_layer.silu(np.array([-40.0]))[0] < 0   # was exactly -0.0
    assert np.isnan(ref_layer._sigmoid(np.array([np.nan]))).all()
    assert ref_layer._sigmoid(np.array([-50.0], np.float32)).dtype == np.float32


# ----------------------------------------------------------------------------- 5. adapters, strict
def _jax():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return pytest.importorskip("jax", reason="jax is not installed (pip install -e '.[jax]')")


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("w_dtype", ["bfloat16", "float32"])
def test_jax_adapter_on_a_strict_reference_workspace(jit, w_dtype):
    """A strict workspace takes the CUDA dtypes, so the adapter casts as on CUDA: bf16 in, bf16
    weight gradients for bf16 weights, fp32 for fp32 masters (cast to bf16 for the layer, as on
    CUDA).  With bf16 weights the values are those of the default (lenient) workspace, which
    computes in float32: the weight gradients bitwise."""
    jax = _jax()
    import jax.numpy as jnp
    from mok_rt.frameworks import jax_ops

    p = _problem(np.random.default_rng(7), T=24, Is=64)
    results = {}
    with jax.default_device(jax.devices("cpu")[0]):
        names = ("x", "tw", "wg", "wu", "wd", "sg", "su", "sd")
        arrs = [jnp.asarray(p["x"], jnp.bfloat16), jnp.asarray(p["tw"], jnp.float32),
                *(jnp.asarray(a, w_dtype) for a in (*p["w"], *p["shared"]))]
        ids = jnp.asarray(p["ids"])
        d_out = jnp.asarray(p["d_out"], jnp.float32)
        for strict in (True, False):
            with mok.Workspace(_cfg(shared_intermediate=64), max_tokens=24, backend="reference", strict=strict) as ws:
                def loss(x, tw, wg, wu, wd, sg, su, sd):
                    out = jax_ops.moe_layer(ws, x, ids, tw, wg, wu, wd, shared=(sg, su, sd))
                    return jnp.sum(out.astype(jnp.float32) * d_out)
                f = jax.value_and_grad(loss, argnums=tuple(range(8)))
                v, g = (jax.jit(f) if jit else f)(*arrs)
                jax.block_until_ready(g)
                ws.synchronize()
                results[strict] = (float(v), dict(zip(names, (np.asarray(a) for a in g))))
    (v_s, g_s), (v_l, g_l) = results[True], results[False]
    for n, a in zip(names, arrs):
        assert g_s[n].dtype == a.dtype, n
    if w_dtype == "float32":   # strict: the masters rounded to bf16 for the layer; lenient: as given
        for n in names:
            a, b = g_s[n].astype(np.float64), g_l[n].astype(np.float64)
            assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b), n
        return
    for n in names[2:]:   # weight gradients: the fp32 sums, rounded once to the weights' dtype
        np.testing.assert_array_equal(g_s[n], g_l[n], err_msg=n)
    np.testing.assert_array_equal(g_s["tw"], g_l["tw"])
    # out and dx: bf16 rounded from float64 (strict) or through float32 (lenient): equal but for ties.
    np.testing.assert_allclose(g_s["x"].astype(np.float32), g_l["x"].astype(np.float32), rtol=1e-2, atol=1e-2)
    assert v_s == pytest.approx(v_l, rel=1e-3)


def test_torch_adapter_on_a_strict_reference_workspace():
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
    from mok_rt.frameworks import torch_ops

    p = _problem(np.random.default_rng(8), T=24, Is=64)
    results = {}
    for strict in (True, False):
        x = torch.from_numpy(p["x"]).to(torch.bfloat16).requires_grad_()
        tw = torch.from_numpy(p["tw"]).requires_grad_()
        ws_ = [torch.from_numpy(a).to(torch.bfloat16).requires_grad_() for a in (*p["w"], *p["shared"])]
        with mok.Workspace(_cfg(shared_intermediate=64), max_tokens=24, backend="reference", strict=strict) as ws:
            out = torch_ops.moe_layer(ws, x, torch.from_numpy(p["ids"]).long(), tw, *ws_[:3], shared=ws_[3:])
            (out.float() * torch.from_numpy(p["d_out"])).sum().backward()
            ws.synchronize()
        assert out.dtype == torch.bfloat16
        results[strict] = [t.grad for t in (x, tw, *ws_)]
    for i, (a, b) in enumerate(zip(results[True], results[False])):
        assert a.dtype == b.dtype
        if i == 0:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
        else:
            assert torch.equal(a, b), i


# ----------------------------------------------------------------------------- 6. samples
@pytest.mark.skipif(mok.device_count() > 0, reason="the machine has a GPU")
@pytest.mark.parametrize("sample,needs", [("train_moe.py", None), ("jax_custom_vjp.py", "jax"),
                                          ("torch_autograd.py", "torch")])
def test_samples_say_in_one_line_that_cuda_needs_a_gpu(sample, needs):
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    r = subprocess.run([sys.executable, str(ROOT / "samples" / sample), "--backend", "cuda"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert "needs a CUDA GPU (none found)" in r.stderr
