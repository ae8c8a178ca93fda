"""mok_rt.frameworks.jax_ops on the GPU: the layer's XLA FFI custom calls (ctypes handlers on the
"CUDA" platform, mok_rt launching on XLA's stream) eager and under jax.jit, bitwise against the
mok_rt API called directly on the same device arrays; two layers in one jitted program; repeated
steps; an expert id out of range raised by ws.synchronize() after a jitted step; and
``samples/jax_custom_vjp.py --jit`` on the GPU.

Needs jax with a GPU backend (jax[cuda13]): each test skips (or fails, with MOK_RT_REQUIRE_GPU=1)
without it.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import mok_rt as mok
from _gpu import skip_or_fail

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
BF16 = ml_dtypes.bfloat16
CFG = dict(hidden=256, intermediate=192, num_experts=8, top_k=4, shared_intermediate=128)
T = 333                      # not a multiple of the row block
WEIGHTS = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


@pytest.fixture(scope="module")
def jax():
    try:
        import jax
    except ImportError:
        skip_or_fail("jax is not installed (pip install -e '.[jax]' and jax[cuda13])")
    try:
        jax.devices("gpu")
    except RuntimeError:
        skip_or_fail("jax has no GPU backend (jax[cuda13])")
    return jax


@pytest.fixture(scope="module")
def ops(jax):
    from mok_rt.frameworks import jax_ops
    return jax_ops


def _ws(precision="bf16"):
    return mok.Workspace(mok.MoEConfig(**CFG, precision=precision), mok.SingleProcessGroup(devices=[0]),
                         max_tokens=2 * T, poison_outputs=True)


def _problem(jax, seed):
    """On the GPU: bf16 x, fp32 routing weights, fp32 master weights holding bf16 values (so the
    layer's cast to bf16 is exact and the API can be fed the bf16 copies), int32 ids, and a d_out
    whose fp32 values are bf16 values (the loss's cotangent reaching the layer is exactly it)."""
    rng = np.random.default_rng(seed)
    H, I, E, k, Is = (CFG[n] for n in ("hidden", "intermediate", "num_experts", "top_k", "shared_intermediate"))
    shapes = {"w_gate": (E, I, H), "w_up": (E, I, H), "w_down": (E, H, I), "ws_gate": (Is, H), "ws_up": (Is, H),
              "ws_down": (H, Is)}
    h = {n: (rng.standard_normal(s) * s[-1] ** -0.5).astype(BF16).astype(np.float32) for n, s in shapes.items()}
    h.update(x=rng.standard_normal((T, H)).astype(BF16), tw=rng.random((T, k)).astype(np.float32),
             ids=np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32),
             d_out=rng.standard_normal((T, H)).astype(BF16).astype(np.float32))
    gpu = jax.devices("gpu")[0]
    return {n: jax.device_put(v, gpu) for n, v in h.items()}


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


def _same(got, want, what):
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=what)


def _loss(ops, ws, ids, d_out):
    def loss(a):
        out = ops.moe_layer(ws, a["x"], ids, a["tw"], *(a[n] for n in WEIGHTS[:3]),
                            shared=tuple(a[n] for n in WEIGHTS[3:]))
        return (out.astype(np.float32) * d_out).sum(), out
    return loss


def _direct(jax, ws, p):
    """The same step through the mok_rt API on the same device arrays (DLPack, the workspace's
    stream): out and every gradient, as JAX arrays."""
    jnp = jax.numpy
    w = {n: p[n].astype(jnp.bfloat16) for n in WEIGHTS}
    sched = mok.schedule(ws, p["ids"])
    out, ctx = mok.forward(ws, sched, p["x"], p["tw"], mok.ExpertWeights(*(w[n] for n in WEIGHTS[:3])),
                           shared=mok.ExpertWeights(*(w[n] for n in WEIGHTS[3:])))
    g = mok.backward(ws, ctx, p["d_out"].astype(jnp.bfloat16))
    res = dict(zip(("out", "x", "tw") + WEIGHTS, (out, g.dx, g.d_topk_weights, *g.dw, *g.dw_shared)))
    res = {n: jnp.array(jax.dlpack.from_dlpack(v)) for n, v in res.items()}   # copies: free mok's blocks
    ws.synchronize()
    return res


# fp8_block: the custom calls pass bf16 weights, which each call quantises; the API on the same
# weights gives the same bits.
@pytest.mark.parametrize("precision", ["bf16", "fp8_block"])
def test_jit_and_eager_match_the_api_bitwise(jax, ops, precision):
    p = _problem(jax, 1)
    with _ws(precision) as ws:
        want = _direct(jax, ws, p)
        a = {n: p[n] for n in ("x", "tw") + WEIGHTS}
        vg = jax.value_and_grad(_loss(ops, ws, p["ids"], p["d_out"]), has_aux=True)
        (_, out_e), g_e = vg(a)                                # eager: the same custom calls, one by one
        step = jax.jit(vg)
        (_, out_j), g_j = step(a)
        (_, out_j2), g_j2 = step(a)                            # again: the per-call memory was recycled
        jax.block_until_ready((out_e, g_e, out_j, g_j, out_j2, g_j2))
        ws.synchronize()                                       # no device error, XLA's stream included
    assert out_j.dtype == jax.numpy.bfloat16 and g_j["w_gate"].dtype == jax.numpy.float32
    for name, got in (("eager", (out_e, g_e)), ("jit", (out_j, g_j)), ("jit again", (out_j2, g_j2))):
        _same(got[0], want["out"], f"{name}: out")
        for n in a:
            assert got[1][n].shape == a[n].shape and got[1][n].dtype == a[n].dtype, (name, n)
            _same(got[1][n], want[n], f"{name}: d{n}")
    assert np.all(np.isfinite(np.asarray(g_j["w_down"]))) and np.any(np.asarray(g_j["w_down"]) != 0)


def test_two_layers_in_one_program(jax, ops):
    """Two layer calls (and their two backwards) in one XLA program on one workspace: its scratch
    is shared by calls ordered on XLA's stream.  Jitted gradients equal eager ones bitwise."""
    jnp = jax.numpy
    p = _problem(jax, 2)
    with _ws() as ws:
        def loss(a):
            w = [a[n] for n in WEIGHTS]
            h = ops.moe_layer(ws, a["x"], p["ids"], a["tw"], *w[:3], shared=w[3:])
            h = ops.moe_layer(ws, (h * 0.5).astype(jnp.bfloat16), p["ids"][::-1], a["tw"], *w[:3], shared=w[3:])
            return (h.astype(jnp.float32) * p["d_out"]).sum()

        a = {n: p[n] for n in ("x", "tw") + WEIGHTS}
        v_e, g_e = jax.value_and_grad(loss)(a)
        v_j, g_j = jax.jit(jax.value_and_grad(loss))(a)
        jax.block_until_ready((v_e, g_e, v_j, g_j))
        ws.synchronize()
    # The loss is XLA's own fp32 sum, which jit fuses and orders differently from eager op-by-op
    # execution (measured: 3 ulp apart); the layers' gradients are mok_rt's and stay bitwise.
    np.testing.assert_allclose(np.asarray(v_j), np.asarray(v_e), rtol=1e-5)
    for n in a:
        _same(g_j[n], g_e[n], f"d{n}")


def test_expert_id_error_is_raised_after_a_jitted_step(jax, ops):
    p = _problem(jax, 3)
    with _ws() as ws:
        a = {n: p[n] for n in ("x", "tw") + WEIGHTS}
        step = jax.jit(jax.value_and_grad(lambda a, ids: _loss(ops, ws, ids, p["d_out"])(a), has_aux=True))
        bad = p["ids"].at[7, 2].set(CFG["num_experts"] + 3)
        jax.block_until_ready(step(a, bad))
        with pytest.raises(mok.ExpertIdError):
            ws.synchronize()
        (_, out), g = step(a, p["ids"])                         # the next step is clean
        jax.block_until_ready((out, g))
        ws.synchronize()
    assert np.all(np.isfinite(np.asarray(out.astype(np.float32))))


def test_a_reference_workspace_on_the_gpu_platform_is_refused(jax, ops):
    p = _problem(jax, 4)
    cfg = mok.MoEConfig(**CFG)
    with mok.Workspace(cfg, max_tokens=T, backend="reference") as ws:
        x = p["x"].astype(np.float32)
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError),
                           match=r"mok_rt_moe_forward: ArgumentError: ws: .*CUDA platform.*on the CPU"):
            jax.block_until_ready(jax.jit(lambda x: ops.moe_layer(ws, x, p["ids"], p["tw"],
                                                                  *(p[n] for n in WEIGHTS[:3]),
                                                                  shared=tuple(p[n] for n in WEIGHTS[3:])))(x))


def _sample(*extra):
    r = subprocess.run([sys.executable, str(ROOT / "samples" / "jax_custom_vjp.py"), "--backend", "cuda",
                        "--steps", "4", *extra], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, [float(line.split()[3]) for line in r.stdout.splitlines() if line.startswith("step")]


def test_jit_sample_trains_on_the_gpu(jax):
    out, jitted = _sample("--jit")
    assert "backend=cuda" in out and "jit=True" in out
    _, eager = _sample("--checkpoint")
    assert len(jitted) == len(eager) == 4 and all(np.isfinite(jitted))
    assert jitted[-1] < jitted[0]
    # The same kernels; XLA may fuse the router's arithmetic around them differently.
    np.testing.assert_allclose(jitted, eager, rtol=2e-2)
