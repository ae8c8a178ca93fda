"""Framework interop on the CPU: torch CPU tensors and JAX CPU arrays through the reference backend,
the autograd wrappers of samples/ against plain-framework autodiff (float64), and the samples' mains.

torch and jax are optional: each test skips cleanly when its framework is not installed.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import pathlib

import numpy as np
import pytest

import mok_rt as mok
from mok_rt import reference
from mok_rt.interop.dlpack import from_dlpack

# On a GPU machine JAX would otherwise take 75% of the GPU's memory for itself when it starts.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMES = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


def _load_sample(name: str):
    """Import samples/<name>.py (not a package) as a module."""
    spec = importlib.util.spec_from_file_location(f"_mok_sample_{name}", ROOT / "samples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def jax():
    return pytest.importorskip("jax")


@contextlib.contextmanager
def _jax_cpu(jax, *, x64: bool = True):
    """JAX arrays on the host (the reference backend reads host memory; a GPU machine would
    otherwise place them on the GPU), in float64 when ``x64`` (the spelling moved across versions)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.default_device(jax.devices("cpu")[0]))
        if x64:
            ctx = getattr(jax, "enable_x64", None)
            if ctx is not None:
                stack.enter_context(ctx(True))
            else:
                old = jax.config.jax_enable_x64
                jax.config.update("jax_enable_x64", True)
                stack.callback(jax.config.update, "jax_enable_x64", old)
        yield


def _problem(seed, *, T=29, H=64, I=64, E=4, k=2, Is=64):
    """A fresh random float64 problem as NumPy arrays (ids int64, distinct experts per token)."""
    rng = np.random.default_rng(seed)
    p = {"x": rng.standard_normal((T, H)),
         "ids": np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64),
         "tw": rng.random((T, k)),
         "w_gate": rng.standard_normal((E, I, H)) * H ** -0.5,
         "w_up": rng.standard_normal((E, I, H)) * H ** -0.5,
         "w_down": rng.standard_normal((E, H, I)) * I ** -0.5,
         "d_out": rng.standard_normal((T, H))}
    if Is:
        p.update(ws_gate=rng.standard_normal((Is, H)) * H ** -0.5, ws_up=rng.standard_normal((Is, H)) * H ** -0.5,
                 ws_down=rng.standard_normal((H, Is)) * Is ** -0.5)
    return p


def _ws(*, Is=64, limit=None, T=64):
    cfg = mok.MoEConfig(hidden=64, intermediate=64, num_experts=4, top_k=2, shared_intermediate=Is,
                        swiglu_limit=limit)
    return mok.Workspace(cfg, max_tokens=T, backend="reference")


def _oracle(p, limit=None):
    out, rctx = reference.forward(p["x"], p["ids"], p["tw"], p["w_gate"], p["w_up"], p["w_down"],
                                  ws_gate=p.get("ws_gate"), ws_up=p.get("ws_up"), ws_down=p.get("ws_down"),
                                  swiglu_limit=limit)
    return out, reference.backward(rctx, p["d_out"])


# --------------------------------------------------------------------------- plain-framework layers
def _torch_layer(torch, x, ids, tw, wg, wu, wd, sg=None, su=None, sd=None, limit=None):
    """docs/SEMANTICS.md written with torch ops (autograd differentiates it)."""
    def swiglu(g, u):
        if limit is not None:
            g, u = torch.clamp(g, max=limit), torch.clamp(u, -limit, limit)
        return torch.nn.functional.silu(g) * u

    out = torch.zeros_like(x)
    for j in range(ids.shape[1]):
        e = ids[:, j]
        a = swiglu(torch.einsum("th,tih->ti", x, wg[e]), torch.einsum("th,tih->ti", x, wu[e]))
        out = out + tw[:, j:j + 1] * torch.einsum("ti,thi->th", a, wd[e])
    if sg is not None:
        out = out + swiglu(x @ sg.T, x @ su.T) @ sd.T
    return out


def _jax_layer(jnp, x, ids, tw, wg, wu, wd, sg=None, su=None, sd=None):
    import jax

    def swiglu(g, u):
        return jax.nn.silu(g) * u

    out = jnp.zeros_like(x)
    for j in range(ids.shape[1]):
        e = ids[:, j]
        a = swiglu(jnp.einsum("th,tih->ti", x, wg[e]), jnp.einsum("th,tih->ti", x, wu[e]))
        out = out + tw[:, j:j + 1] * jnp.einsum("ti,thi->th", a, wd[e])
    if sg is not None:
        out = out + swiglu(x @ sg.T, x @ su.T) @ sd.T
    return out


# --------------------------------------------------------------------------- DLPack in and out
def test_torch_cpu_tensors_in_and_out_without_copies(torch):
    p = _problem(10)
    t = {n: torch.from_numpy(v) for n, v in p.items()}
    shared = [t[n] for n in ("ws_gate", "ws_up", "ws_down")]
    # Zero copy on the way in: mok_rt sees torch's own memory.
    for n in ("x", "ids", "tw", "w_gate", "ws_down"):
        assert from_dlpack(t[n], name=n).ptr == t[n].data_ptr()
    # Caller-owned, poisoned: routed buffers in torch's memory (mok_rt allocates the shared ones).
    dw = mok.ExpertWeights(*(torch.full(t[n].shape, float("nan"), dtype=torch.float64) for n in NAMES[:3]))
    with _ws() as ws:
        sched = mok.schedule(ws, t["ids"])
        out, ctx = mok.forward(ws, sched, t["x"], t["tw"], mok.ExpertWeights(t["w_gate"], t["w_up"], t["w_down"]),
                               shared=mok.ExpertWeights(*shared))
        g = mok.backward(ws, ctx, t["d_out"], dw=dw)
        ws.synchronize()
    ref_out, ref_g = _oracle(p)
    out_t = torch.from_dlpack(out)
    assert out_t.data_ptr() == out.ptr and out_t.dtype == torch.float64   # zero copy on the way out
    np.testing.assert_allclose(out_t.numpy(), ref_out, rtol=1e-12, atol=1e-12)
    dx = torch.from_dlpack(g.dx)
    assert dx.data_ptr() == g.dx.ptr
    np.testing.assert_allclose(dx.numpy(), ref_g.dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(torch.from_dlpack(g.d_topk_weights).numpy(), ref_g.d_topk_weights, rtol=1e-12)
    assert g.dw is dw and g.dw.gate is dw.gate    # written in place into torch's buffers
    for buf, n in zip(dw, ("dw_gate", "dw_up", "dw_down")):
        np.testing.assert_allclose(buf.numpy(), getattr(ref_g, n), rtol=1e-12, atol=1e-14)
    for got, n in zip(g.dw_shared, ("dws_gate", "dws_up", "dws_down")):
        np.testing.assert_allclose(torch.from_dlpack(got).numpy(), getattr(ref_g, n), rtol=2e-6, atol=1e-7)


def test_jax_cpu_arrays_in_and_out(jax):
    import jax.numpy as jnp
    p = _problem(11)
    with _jax_cpu(jax):
        a = {n: jnp.asarray(v) for n, v in p.items()}
        assert a["x"].dtype == jnp.float64 and a["ids"].dtype == jnp.int64
        for n in ("x", "ids", "w_down"):
            assert from_dlpack(a[n], name=n).ptr == a[n].unsafe_buffer_pointer()
        shared = [a[n] for n in ("ws_gate", "ws_up", "ws_down")]
        with _ws() as ws:
            sched = mok.schedule(ws, a["ids"])
            out, ctx = mok.forward(ws, sched, a["x"], a["tw"], mok.ExpertWeights(a["w_gate"], a["w_up"], a["w_down"]),
                                   shared=mok.ExpertWeights(*shared))
            g = mok.backward(ws, ctx, a["d_out"])
            ws.synchronize()
        out_j = jax.dlpack.from_dlpack(out)
        dx_j = jax.dlpack.from_dlpack(g.dx)
        assert out_j.dtype == jnp.float64
        ref_out, ref_g = _oracle(p)
        np.testing.assert_allclose(np.asarray(out_j), ref_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(dx_j), ref_g.dx, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(jax.dlpack.from_dlpack(g.dw_shared.down)), ref_g.dws_down, rtol=2e-6,
                                   atol=1e-7)


# --------------------------------------------------------------------------- torch.autograd.Function
@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("Is,limit", [(64, None), (0, None), (64, 0.7)])
def test_torch_function_matches_torch_autograd(torch, checkpoint, Is, limit):
    ta = _load_sample("torch_autograd")
    p = _problem(20 + Is + int(checkpoint), Is=Is)
    names = ("x", "tw", "w_gate", "w_up", "w_down") + (NAMES[3:] if Is else ())

    def leaves():
        return {n: torch.from_numpy(p[n].copy()).requires_grad_(True) for n in names}

    ids = torch.from_numpy(p["ids"])
    d_out = torch.from_numpy(p["d_out"])
    mine, plain = leaves(), leaves()
    shared = [mine.get(n) for n in NAMES[3:]]
    with _ws(Is=Is, limit=limit) as ws:
        out = ta.moe(ws, mine["x"], ids, mine["tw"], mine["w_gate"], mine["w_up"], mine["w_down"], *shared,
                     checkpoint=checkpoint)
        out.backward(d_out)
        ws.synchronize()
    want = _torch_layer(torch, plain["x"], ids, plain["tw"], plain["w_gate"], plain["w_up"], plain["w_down"],
                        *[plain.get(n) for n in NAMES[3:]], limit=limit)
    want.backward(d_out)
    assert out.dtype == torch.float64
    np.testing.assert_allclose(out.detach().numpy(), want.detach().numpy(), rtol=1e-10, atol=1e-12)
    for n in names:
        assert mine[n].grad is not None and mine[n].grad.dtype == torch.float64, n
        np.testing.assert_allclose(mine[n].grad.numpy(), plain[n].grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=n)


def test_torch_function_gradcheck(torch):
    ta = _load_sample("torch_autograd")
    p = _problem(30, T=3, Is=0)
    x = torch.from_numpy(p["x"]).requires_grad_(True)
    tw = torch.from_numpy(p["tw"]).requires_grad_(True)
    w = [torch.from_numpy(p[n]) for n in NAMES[:3]]
    ids = torch.from_numpy(p["ids"])
    with _ws(Is=0) as ws:
        assert torch.autograd.gradcheck(lambda x_, tw_: ta.moe(ws, x_, ids, tw_, *w), (x, tw), eps=1e-6, atol=1e-7)


def test_torch_block_trains_router_and_experts(torch):
    ta = _load_sample("torch_autograd")
    cfg = mok.MoEConfig(hidden=64, intermediate=64, num_experts=4, top_k=2, shared_intermediate=64)
    with mok.Workspace(cfg, max_tokens=32, backend="reference") as ws:
        block = ta.MoEBlock(ws, device=torch.device("cpu"), generator=torch.Generator().manual_seed(0))
        x = torch.randn(32, 64)
        block(x).square().mean().backward()
        ws.synchronize()
    for name, prm in block.named_parameters():
        assert prm.grad is not None and prm.grad.dtype == torch.float32, name
        assert torch.isfinite(prm.grad).all() and prm.grad.abs().sum() > 0, name


# --------------------------------------------------------------------------- jax.custom_vjp
@pytest.mark.parametrize("checkpoint", [False, True])
def test_jax_custom_vjp_matches_jax_grad(jax, checkpoint):
    import jax.numpy as jnp
    jv = _load_sample("jax_custom_vjp")
    p = _problem(40 + int(checkpoint))
    names = ("x", "tw") + NAMES
    with _jax_cpu(jax), _ws() as ws:
        moe = jv.make_moe(ws, checkpoint=checkpoint)
        a = {n: jnp.asarray(p[n]) for n in names}
        ids, d_out = jnp.asarray(p["ids"]), jnp.asarray(p["d_out"])

        def loss_mine(args):
            return jnp.sum(moe(args["x"], ids, args["tw"], *(args[n] for n in NAMES)) * d_out)

        def loss_plain(args):
            return jnp.sum(_jax_layer(jnp, args["x"], ids, args["tw"], *(args[n] for n in NAMES)) * d_out)

        v_mine, g_mine = jax.value_and_grad(loss_mine)(a)   # eager: concrete arrays reach fwd/bwd
        v_plain, g_plain = jax.value_and_grad(loss_plain)(a)
        ws.synchronize()
        assert math.isclose(float(v_mine), float(v_plain), rel_tol=1e-10)
        for n in names:
            assert g_mine[n].dtype == jnp.float64, n
            # Weight gradients pass through fp32 (what the layer returns); the rest is float64.
            tol = dict(rtol=2e-6, atol=1e-7) if n.startswith("w") else dict(rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(np.asarray(g_mine[n]), np.asarray(g_plain[n]), err_msg=n, **tol)
        np.testing.assert_allclose(np.asarray(moe(a["x"], ids, a["tw"], *(a[n] for n in NAMES))),
                                   np.asarray(_jax_layer(jnp, a["x"], ids, a["tw"], *(a[n] for n in NAMES))),
                                   rtol=1e-10, atol=1e-12)


def test_jax_custom_vjp_refuses_jit_with_a_clear_error(jax):
    import jax.numpy as jnp
    jv = _load_sample("jax_custom_vjp")
    p = _problem(50, Is=0)
    with _jax_cpu(jax, x64=False), _ws(Is=0) as ws:
        moe = jv.make_moe(ws)
        args = [jnp.asarray(p[n], jnp.float32) for n in ("x", "tw", "w_gate", "w_up", "w_down")]
        ids = jnp.asarray(p["ids"], jnp.int32)
        with pytest.raises(TypeError, match="jax.jit"):
            jax.jit(lambda x, tw, g, u, d: moe(x, ids, tw, g, u, d))(*args)


# --------------------------------------------------------------------------- the samples
@pytest.mark.parametrize("checkpoint", [False, True])
def test_torch_sample_runs(torch, capsys, checkpoint):
    ta = _load_sample("torch_autograd")
    losses = ta.main(["--backend", "reference", "--steps", "2"] + (["--checkpoint"] if checkpoint else []))
    assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses)
    assert "step   1  loss" in capsys.readouterr().out


@pytest.mark.parametrize("checkpoint", [False, True])
def test_jax_sample_runs(jax, capsys, checkpoint):
    jv = _load_sample("jax_custom_vjp")
    losses = jv.main(["--backend", "reference", "--steps", "2"] + (["--checkpoint"] if checkpoint else []))
    assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses)
    assert "step   1  loss" in capsys.readouterr().out


def test_checkpointed_and_stored_training_agree(torch):
    ta = _load_sample("torch_autograd")
    a = ta.main(["--backend", "reference", "--steps", "2"])
    b = ta.main(["--backend", "reference", "--steps", "2", "--checkpoint"])
    assert a == b
