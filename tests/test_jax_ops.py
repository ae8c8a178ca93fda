"""mok_rt.frameworks.jax_ops on the CPU: the layer as a jax.custom_vjp on the reference backend,
eager and under jax.jit (through jax.pure_callback), against the float64 oracle; the clear
TypeError on the CUDA backend under jit; and ``samples/jax_custom_vjp.py --jit``.

jax is optional: the whole module skips when it is not installed.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import mok_rt as mok
from mok_rt import reference

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax", reason="jax is not installed (pip install -e '.[jax]')")
import jax.numpy as jnp  # noqa: E402

from mok_rt.frameworks import jax_ops  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMES = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


from test_interop import _jax_cpu as _host_jax, _problem  # noqa: E402  (the same host arrays and problems)


def _jax_cpu(*, x64: bool):
    return _host_jax(jax, x64=x64)


def _ws(*, Is=64, T=64):
    cfg = mok.MoEConfig(hidden=64, intermediate=64, num_experts=4, top_k=2, shared_intermediate=Is)
    return mok.Workspace(cfg, max_tokens=T, backend="reference")


def _arrays(p, dtype, names):
    return {n: jnp.asarray(p[n], dtype) for n in names if n in p}


def _loss_fn(ws, ids, d_out, shared: bool):
    def loss(a):
        sh = (a["ws_gate"], a["ws_up"], a["ws_down"]) if shared else None
        out = jax_ops.moe_layer(ws, a["x"], ids, a["tw"], a["w_gate"], a["w_up"], a["w_down"], shared=sh)
        return jnp.sum(out * d_out)
    return loss


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("x64", [False, True])
def test_jit_matches_eager_bitwise(shared, x64):
    p = _problem(60 + shared, Is=64 if shared else 0)
    dtype = jnp.float64 if x64 else jnp.float32
    names = ("x", "tw") + NAMES
    with _jax_cpu(x64=x64), _ws(Is=64 if shared else 0) as ws:
        a = _arrays(p, dtype, names)
        ids = jnp.asarray(p["ids"], jnp.int32)
        d_out = jnp.asarray(p["d_out"], dtype)
        loss = _loss_fn(ws, ids, d_out, shared)
        fwd = lambda a: jax_ops.moe_layer(ws, a["x"], ids, a["tw"], a["w_gate"], a["w_up"], a["w_down"],  # noqa: E731
                                          shared=(a["ws_gate"], a["ws_up"], a["ws_down"]) if shared else None)
        out_e, out_j = fwd(a), jax.jit(fwd)(a)
        assert out_j.dtype == dtype and out_j.shape == a["x"].shape
        np.testing.assert_array_equal(np.asarray(out_e), np.asarray(out_j))
        v_e, g_e = jax.value_and_grad(loss)(a)
        v_j, g_j = jax.jit(jax.value_and_grad(loss))(a)
        assert np.asarray(v_e).tobytes() == np.asarray(v_j).tobytes()
        assert set(g_e) == set(g_j) == set(a)
        for n in a:
            assert g_j[n].dtype == a[n].dtype and g_j[n].shape == a[n].shape, n
            np.testing.assert_array_equal(np.asarray(g_e[n]), np.asarray(g_j[n]), err_msg=n)
            assert np.all(np.isfinite(np.asarray(g_j[n]))) and np.any(np.asarray(g_j[n]) != 0), n


@pytest.mark.parametrize("shared", [True, False])
def test_gradients_match_the_float64_reference(shared):
    Is = 64 if shared else 0
    p = _problem(70 + shared, T=13, Is=Is)
    names = ("x", "tw") + NAMES
    ref_out, rctx = reference.forward(p["x"], p["ids"], p["tw"], p["w_gate"], p["w_up"], p["w_down"],
                                      ws_gate=p.get("ws_gate"), ws_up=p.get("ws_up"), ws_down=p.get("ws_down"))
    ref = reference.backward(rctx, p["d_out"])
    with _jax_cpu(x64=True), _ws(Is=Is) as ws:
        a = _arrays(p, jnp.float64, names)
        ids, d_out = jnp.asarray(p["ids"]), jnp.asarray(p["d_out"])
        out = jax.jit(lambda a: jax_ops.moe_layer(
            ws, a["x"], ids, a["tw"], a["w_gate"], a["w_up"], a["w_down"],
            shared=mok.ExpertWeights(a["ws_gate"], a["ws_up"], a["ws_down"]) if shared else None))(a)
        _, g = jax.jit(jax.value_and_grad(_loss_fn(ws, ids, d_out, shared)))(a)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-12, atol=1e-12)
    pairs = {"x": "dx", "tw": "d_topk_weights", "w_gate": "dw_gate", "w_up": "dw_up", "w_down": "dw_down",
             "ws_gate": "dws_gate", "ws_up": "dws_up", "ws_down": "dws_down"}
    for n, r in pairs.items():
        if n in g:
            np.testing.assert_allclose(np.asarray(g[n]), getattr(ref, r), rtol=1e-10, atol=1e-12, err_msg=n)


def test_ids_get_no_gradient_and_dtypes_follow_the_inputs():
    """bf16 weights on the reference backend: computed in float32, gradients cast back to bf16;
    the ids' cotangent is float0 (JAX's zero for integer inputs)."""
    p = _problem(80, Is=0)
    with _jax_cpu(x64=False), _ws(Is=0) as ws:
        x = jnp.asarray(p["x"], jnp.float32)
        tw = jnp.asarray(p["tw"], jnp.float32)
        w = [jnp.asarray(p[n], jnp.bfloat16) for n in NAMES[:3]]
        ids = jnp.asarray(p["ids"], jnp.int32)

        def loss(x, ids, tw, *w):
            return jnp.sum(jax_ops.moe_layer(ws, x, ids, tw, *w))

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5), allow_int=True))(x, ids, tw, *w)
    assert grads[1].dtype == jax.dtypes.float0
    assert grads[0].dtype == jnp.float32 and grads[2].dtype == jnp.float32
    assert all(g.dtype == jnp.bfloat16 for g in grads[3:])


def test_workspace_handle_is_static_and_accepted():
    p = _problem(81, Is=0)
    with _jax_cpu(x64=False), _ws(Is=0) as ws:
        h = jax_ops.workspace_handle(ws)
        assert h == ws._handle and jax_ops.lookup_workspace(h) is ws
        a = [jnp.asarray(p[n], jnp.float32) for n in ("x", "tw", "w_gate", "w_up", "w_down")]
        ids = jnp.asarray(p["ids"], jnp.int32)
        f = jax.jit(lambda x, tw, g, u, d: jax_ops.moe_layer(h, x, ids, tw, g, u, d))
        np.testing.assert_array_equal(np.asarray(f(*a)),
                                      np.asarray(jax_ops.moe_layer(ws, a[0], ids, *a[1:])))
    with pytest.raises(mok.ArgumentError):
        jax_ops.workspace_handle("not a workspace")
    with pytest.raises(mok.ArgumentError, match="shared"):
        jax_ops.moe_layer(h, *a[:1], ids, *a[1:], shared=(a[2], None, a[4]))


def test_cuda_backend_under_jit_raises_a_clear_type_error(monkeypatch):
    # No GPU here: the check itself, then the layer with the workspace's backend patched to "cuda".
    x = jnp.ones((2, 3))
    jax_ops.check_traceable("cuda", x, None)           # concrete arrays: the eager DLPack path
    jax_ops.check_traceable("reference", x)

    def traced(x):
        with pytest.raises(TypeError, match="XLA FFI"):
            jax_ops.check_traceable("cuda", x)
        jax_ops.check_traceable("reference", x)        # pure_callback: fine
        return x

    jax.jit(traced)(x)

    p = _problem(82, Is=0)
    with _jax_cpu(x64=False), _ws(Is=0) as ws:
        a = [jnp.asarray(p[n], jnp.float32) for n in ("x", "tw", "w_gate", "w_up", "w_down")]
        ids = jnp.asarray(p["ids"], jnp.int32)
        with monkeypatch.context() as m:   # undone before the workspace closes
            m.setattr(ws, "backend", "cuda")
            assert jax_ops.lookup_workspace(ws._handle).backend == "cuda"
            with pytest.raises(TypeError, match="jax.jit.*XLA FFI custom calls.*not ship") as e:
                jax.jit(lambda x, tw, g, u, d: jax_ops.moe_layer(ws, x, ids, tw, g, u, d))(*a)
            # Under jax.value_and_grad too (the fwd rule checks before anything runs).
            with pytest.raises(TypeError, match="XLA FFI"):
                jax.jit(jax.grad(lambda x: jnp.sum(jax_ops.moe_layer(ws, x, ids, *a[1:]))))(a[0])
        assert "eagerly" in str(e.value) and "reference" in str(e.value)


def test_import_mok_rt_does_not_import_jax():
    code = "import sys, mok_rt, mok_rt.frameworks; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_jit_sample_runs():
    r = subprocess.run([sys.executable, str(ROOT / "samples" / "jax_custom_vjp.py"), "--jit", "--backend",
                        "reference", "--steps", "2"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "jit=True" in r.stdout and "step   1  loss" in r.stdout


def test_jit_sample_matches_eager_sample():
    def run(*extra):
        r = subprocess.run([sys.executable, str(ROOT / "samples" / "jax_custom_vjp.py"), "--backend", "reference",
                            "--steps", "2", *extra], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, JAX_PLATFORMS="cpu"))
        assert r.returncode == 0, r.stdout + r.stderr
        return [float(line.split()[3]) for line in r.stdout.splitlines() if line.startswith("step")]

    eager, jitted = run("--checkpoint"), run("--jit")
    assert len(eager) == len(jitted) == 2
    np.testing.assert_allclose(jitted, eager, rtol=1e-5)
