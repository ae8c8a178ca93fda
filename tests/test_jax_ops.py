"""mok_rt.frameworks.jax_ops on the CPU: the layer as a jax.custom_vjp through XLA FFI custom calls
(ctypes handlers registered for the "cpu" platform, running the reference backend), eager and
under jax.jit, bitwise against each other and against the float64 oracle; the call frame's
attributes, the registration metadata, errors (device-class ones at ws.check(), host ones as the
XLA call's error); and ``samples/jax_custom_vjp.py --jit``.

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

from mok_rt.frameworks import jax_ops, xla_ffi  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMES = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


from test_interop import _jax_cpu as _host_jax, _problem  # noqa: E402  (the same host arrays and problems)


def _jax_cpu(*, x64: bool):
    return _host_jax(jax, x64=x64)


def _ws(*, Is=64, T=64, precision="bf16"):
    cfg = mok.MoEConfig(hidden=64, intermediate=64, num_experts=4, top_k=2, shared_intermediate=Is,
                        precision=precision)
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


@pytest.mark.parametrize("precision", ["fp8_block", "mxfp8"])
def test_fp8_workspace_under_jit_matches_eager_and_the_api(precision):
    """An FP8 workspace through the custom calls: the bf16 weights are quantised inside each call
    (here by the reference backend's emulation), so eager, jit and the API called directly give the
    same bits, and the result is FP8's, a few per cent from the bf16 layer's."""
    p = _problem(71, Is=64)
    names = ("x", "tw") + NAMES
    with _jax_cpu(x64=False):
        outs = {}
        for prec in ("bf16", precision):
            with _ws(precision=prec) as ws:
                a = _arrays(p, jnp.float32, names)
                ids = jnp.asarray(p["ids"], jnp.int32)
                fwd = lambda a: jax_ops.moe_layer(ws, a["x"], ids, a["tw"], a["w_gate"], a["w_up"],  # noqa: E731
                                                  a["w_down"], shared=(a["ws_gate"], a["ws_up"], a["ws_down"]))
                out_e, out_j = np.asarray(fwd(a)), np.asarray(jax.jit(fwd)(a))
                np.testing.assert_array_equal(out_e, out_j)
                f32 = {n: np.asarray(a[n]) for n in names}
                sched = mok.schedule(ws, np.asarray(ids))
                out_api, _ = mok.forward(ws, sched, f32["x"], f32["tw"],
                                         mok.ExpertWeights(f32["w_gate"], f32["w_up"], f32["w_down"]),
                                         shared=mok.ExpertWeights(f32["ws_gate"], f32["ws_up"], f32["ws_down"]))
                np.testing.assert_array_equal(out_j, np.asarray(out_api))
                outs[prec] = out_j.astype(np.float64)
    rel = np.linalg.norm(outs[precision] - outs["bf16"]) / np.linalg.norm(outs["bf16"])
    assert 5e-3 < rel < 0.2, rel


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
        # XLA's CPU runtime runs the program asynchronously: wait before the workspace closes.
        out, g = jax.block_until_ready((out, g))
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


def test_the_layer_is_two_typed_ffi_custom_calls():
    """No host callback: the jitted step's HLO holds the two FFI targets and the workspace handle."""
    p = _problem(83, Is=0)
    with _jax_cpu(x64=False), _ws(Is=0) as ws:
        a = [jnp.asarray(p[n], jnp.float32) for n in ("x", "tw", "w_gate", "w_up", "w_down")]
        ids = jnp.asarray(p["ids"], jnp.int32)
        loss = lambda x: jnp.sum(jax_ops.moe_layer(ws, x, ids, *a[1:]))  # noqa: E731
        hlo = jax.jit(jax.value_and_grad(loss)).lower(a[0]).as_text()
    assert jax_ops.FORWARD_TARGET in hlo and jax_ops.BACKWARD_TARGET in hlo
    assert "callback" not in hlo.lower()
    assert f"handle = {ws._handle}" in hlo


def test_registration_reports_the_header_version_and_no_command_buffers():
    from test_xla_ffi import _metadata_frame

    version = jax_ops.register_targets()
    assert jax_ops.register_targets() == version                      # once per process
    assert version == xla_ffi.header_api_version(jax.ffi.include_dir())
    keep = []
    for target in (jax_ops.FORWARD_TARGET, jax_ops.BACKWARD_TARGET):
        for platform in ("cpu", "CUDA"):
            frame, md = _metadata_frame(keep)
            assert jax_ops._HANDLERS[target, platform](frame) is None
            assert (md.api_version.major_version, md.api_version.minor_version) == version
            assert md.traits == 0, "the handlers run Python per execution: never command-buffer compatible"


def test_device_errors_surface_at_check_after_a_jitted_step():
    """An expert id out of range: the step completes (NaN), ws.check() raises ExpertIdError, as
    after any asynchronous mok_rt call; the next good step is clean."""
    p = _problem(84, Is=0)
    with _jax_cpu(x64=False), _ws(Is=0) as ws:
        a = [jnp.asarray(p[n], jnp.float32) for n in ("x", "tw", "w_gate", "w_up", "w_down")]
        step = jax.jit(jax.value_and_grad(lambda x, ids: jnp.sum(jax_ops.moe_layer(ws, x, ids, *a[1:]))))
        bad = jnp.asarray(p["ids"], jnp.int32).at[3, 1].set(9)
        v, g = jax.block_until_ready(step(a[0], bad))
        assert np.isnan(np.asarray(v))
        with pytest.raises(mok.ExpertIdError, match=r"topk_ids\[3, 1\] = 9"):
            ws.check()
        v, g = jax.block_until_ready(step(a[0], jnp.asarray(p["ids"], jnp.int32)))
        ws.check()
        assert np.isfinite(np.asarray(v)) and np.all(np.isfinite(np.asarray(g)))
        # Eager too (the same custom call).
        jax.block_until_ready(jax_ops.moe_layer(ws, a[0], bad, *a[1:]))
        with pytest.raises(mok.ExpertIdError):
            ws.synchronize()


def test_host_errors_fail_the_xla_call_and_the_process_lives(monkeypatch):
    p = _problem(85, Is=0)
    with _jax_cpu(x64=False), _ws(Is=0) as ws:
        a = [jnp.asarray(p[n], jnp.float32) for n in ("x", "tw", "w_gate", "w_up", "w_down")]
        ids = jnp.asarray(p["ids"], jnp.int32)
        f = jax.jit(lambda x, tw, g, u, d: jax_ops.moe_layer(ws, x, ids, tw, g, u, d))
        jax.block_until_ready(f(*a))
        with monkeypatch.context() as m:   # undone before the workspace closes
            m.setattr(ws, "backend", "cuda")
            # A CUDA workspace's call placed on the CPU platform: the handler refuses it.
            with pytest.raises(jax.errors.JaxRuntimeError,
                               match=r"mok_rt_moe_forward: ArgumentError: ws: .*cpu platform.*backend='cuda'"):
                jax.block_until_ready(jax.jit(lambda x: jax_ops.moe_layer(ws, x, ids, *a[1:]))(a[0]))
            with pytest.raises(jax.errors.JaxRuntimeError, match="mok_rt_moe_(forward|backward): ArgumentError"):
                jax.block_until_ready(jax.jit(jax.grad(lambda x: jnp.sum(jax_ops.moe_layer(ws, x, ids, *a[1:]))))(a[0]))
    # The compiled program outlives the workspace: running it now fails cleanly.  (JAX's C++
    # dispatch raises the failed execution's status as ValueError when it sees it synchronously.)
    with _jax_cpu(x64=False):
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="mok_rt_moe_forward: ArgumentError: ws: "
                                                                           "the workspace is closed"):
            jax.block_until_ready(f(*a))


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
