"""The torch custom ops of mok_rt.frameworks.torch_ops on the CPU (reference backend): the eager op
against the API called directly (bitwise), torch.compile(fullgraph=True) against eager, opcheck,
gradcheck against float64 finite differences and the float64 oracle, the --compile sample.

torch is optional: every test here skips, with a reason, when it is not installed.
"""
from __future__ import annotations

import importlib.util
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import mok_rt as mok
from mok_rt import reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
H = I = Is_ = 64
E, K = 4, 2


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")


@pytest.fixture(scope="module")
def ops(torch):
    from mok_rt.frameworks import torch_ops
    return torch_ops


def _ws(*, Is=Is_, limit=None, T=64, precision="bf16"):
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K, shared_intermediate=Is,
                        swiglu_limit=limit, precision=precision)
    return mok.Workspace(cfg, max_tokens=T, backend="reference")


def _problem(torch, seed, *, T=29, Is=Is_, dtype=None):
    """float32 (or ``dtype``) torch tensors; ids int64 with distinct experts per token."""
    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype)  # noqa: E731
    p = {"x": rnd(T, H), "ids": torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]),
         "tw": torch.rand(T, K, generator=g, dtype=torch.float64).to(dtype),
         "w_gate": rnd(E, I, H, scale=H ** -0.5), "w_up": rnd(E, I, H, scale=H ** -0.5),
         "w_down": rnd(E, H, I, scale=I ** -0.5), "d_out": rnd(T, H)}
    if Is:
        p.update(ws_gate=rnd(Is, H, scale=H ** -0.5), ws_up=rnd(Is, H, scale=H ** -0.5),
                 ws_down=rnd(H, Is, scale=Is ** -0.5))
    return p


def _shared(p):
    return (p["ws_gate"], p["ws_up"], p["ws_down"]) if "ws_gate" in p else None


WEIGHTS = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


def test_importing_mok_rt_does_not_import_torch():
    code = "import sys, mok_rt, mok_rt.interop; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- eager op == the API
# FP8 workspaces too: the ops pass the bf16 weights, which each call quantises (the reference
# backend's emulation here; the CUDA kernels on a GPU).
@pytest.mark.parametrize("Is,precision", [(Is_, "bf16"), (0, "bf16"), (Is_, "fp8_block"), (0, "mxfp8")])
def test_eager_op_matches_the_api_bitwise(torch, ops, Is, precision):
    p = _problem(torch, 1 + Is, Is=Is)
    with _ws(Is=Is, precision=precision) as ws:
        # The API called directly with the same float32 tensors.
        sched = mok.schedule(ws, p["ids"])
        experts = mok.ExpertWeights(p["w_gate"], p["w_up"], p["w_down"])
        shared = None if not Is else mok.ExpertWeights(*_shared(p))
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], experts, shared=shared)
        g = mok.backward(ws, ctx, p["d_out"])
        want = {"out": torch.from_dlpack(out), "dx": torch.from_dlpack(g.dx),
                "tw": torch.from_dlpack(g.d_topk_weights),
                **{n: torch.from_dlpack(t) for n, t in zip(WEIGHTS, (*g.dw, *(g.dw_shared or ())))}}

        # The raw ops.
        sh = list(_shared(p) or (None, None, None))
        got_out = torch.ops.mok_rt.moe_forward(p["x"], p["ids"], p["tw"], p["w_gate"], p["w_up"], p["w_down"], *sh,
                                               ws._handle)
        grads = torch.ops.mok_rt.moe_backward(p["d_out"], p["x"], p["ids"], p["tw"], p["w_gate"], p["w_up"],
                                              p["w_down"], *sh, ws._handle)
        assert len(grads) == (8 if Is else 5)
        assert torch.equal(got_out, want["out"]) and got_out.dtype == torch.float32
        for got, n in zip(grads, ("dx", "tw") + WEIGHTS):
            assert got.dtype == torch.float32 and got.shape == want[n].shape, n
            assert torch.equal(got, want[n]), n

        # Through autograd (moe_layer).
        leaves = {n: p[n].clone().requires_grad_(True) for n in ("x", "tw") + WEIGHTS if n in p}
        y = ops.moe_layer(ws, leaves["x"], p["ids"], leaves["tw"], leaves["w_gate"], leaves["w_up"],
                          leaves["w_down"], shared=_shared(leaves))
        y.backward(p["d_out"])
        ws.synchronize()
    assert torch.equal(y.detach(), want["out"])
    assert torch.equal(leaves["x"].grad, want["dx"]) and torch.equal(leaves["tw"].grad, want["tw"])
    for n in WEIGHTS:
        if n in leaves:
            assert torch.equal(leaves[n].grad, want[n]), n


def test_fp8_workspace_really_quantises(torch, ops):
    """The op on an fp8_block workspace is not the bf16 layer: its out differs from bf16's by about
    FP8's error (a few per cent), not by bf16 roundings."""
    p = _problem(torch, 7)
    outs = {}
    for precision in ("bf16", "fp8_block"):
        with _ws(precision=precision) as ws:
            outs[precision] = ops.moe_layer(ws, p["x"], p["ids"], p["tw"], p["w_gate"], p["w_up"], p["w_down"],
                                            shared=_shared(p)).detach().double()
    rel = float((outs["fp8_block"] - outs["bf16"]).norm() / outs["bf16"].norm())
    assert 5e-3 < rel < 0.2, rel   # measured ~6e-2


def test_moe_layer_takes_a_handle_and_expert_weights(torch, ops):
    p = _problem(torch, 3)
    with _ws() as ws:
        a = ops.moe_layer(ws, p["x"], p["ids"], p["tw"], p["w_gate"], p["w_up"], p["w_down"], shared=_shared(p))
        h = ops.register_workspace(ws)
        assert h == ws._handle and ops.register_workspace(h) == h and ops.lookup_workspace(h) is ws
        b = ops.moe_layer(h, p["x"], p["ids"], p["tw"], p["w_gate"], p["w_up"], p["w_down"],
                          shared=mok.ExpertWeights(*_shared(p)))
        assert torch.equal(a, b)
        assert ops.register_workspace(ws.rank(0)) != h   # a rank is a workspace of its own name
    with pytest.raises(mok.ArgumentError, match="handle"):
        ops.lookup_workspace(10 ** 9)


def test_bad_shared_and_closed_workspace_raise_argument_errors(torch, ops):
    p = _problem(torch, 4)
    with _ws() as ws:
        with pytest.raises(mok.ArgumentError, match="shared"):
            torch.ops.mok_rt.moe_forward(p["x"], p["ids"], p["tw"], p["w_gate"], p["w_up"], p["w_down"],
                                         p["ws_gate"], None, p["ws_down"], ws._handle)
    with pytest.raises(mok.ArgumentError, match="closed"):
        ops.moe_layer(ws, p["x"], p["ids"], p["tw"], p["w_gate"], p["w_up"], p["w_down"], shared=_shared(p))


def test_bf16_parameters_get_bf16_gradients(torch, ops):
    """The reference backend computes bf16 inputs in float32; autograd casts the gradients back."""
    p = _problem(torch, 5, dtype=torch.bfloat16)
    leaves = {n: p[n].clone().requires_grad_(True) for n in ("x", "tw") + WEIGHTS}
    with _ws() as ws:
        y = ops.moe_layer(ws, leaves["x"], p["ids"], leaves["tw"], leaves["w_gate"], leaves["w_up"],
                          leaves["w_down"], shared=_shared(leaves))
        y.float().square().sum().backward()
        ws.synchronize()
    assert y.dtype == torch.bfloat16
    for n, t in leaves.items():
        assert t.grad is not None and t.grad.dtype == torch.bfloat16 and torch.isfinite(t.grad.float()).all(), n


# --------------------------------------------------------------------------- opcheck
@pytest.mark.parametrize("Is", [Is_, 0])
def test_opcheck(torch, ops, Is):
    p = _problem(torch, 6 + Is, T=8, Is=Is)
    sh = list(_shared(p) or (None, None, None))
    with _ws(Is=Is) as ws:
        leaf = lambda t: None if t is None else t.clone().requires_grad_(True)  # noqa: E731
        fwd = (leaf(p["x"]), p["ids"], leaf(p["tw"]), *(leaf(p[n]) for n in WEIGHTS[:3]), *map(leaf, sh), ws._handle)
        torch.library.opcheck(torch.ops.mok_rt.moe_forward.default, fwd)
        bwd = (p["d_out"][:8], p["x"], p["ids"], p["tw"], p["w_gate"], p["w_up"], p["w_down"], *sh, ws._handle)
        torch.library.opcheck(torch.ops.mok_rt.moe_backward.default, bwd)


# --------------------------------------------------------------------------- float64: gradcheck, the oracle
def test_gradcheck_float64(torch, ops):
    p = _problem(torch, 7, T=3, Is=Is_, dtype=torch.float64)
    ids = p["ids"]
    with _ws() as ws:
        def f(x, tw, *w):
            return ops.moe_layer(ws, x, ids, tw, *w[:3], shared=w[3:])

        # x and topk_weights in full; the weights through a random projection of their gradient
        # (gradcheck's fast mode), every input differentiable at once.
        args = [p[n].clone().requires_grad_(True) for n in ("x", "tw") + WEIGHTS]
        assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, fast_mode=True)
        assert torch.autograd.gradcheck(lambda x, tw: f(x, tw, *(p[n] for n in WEIGHTS)), args[:2], eps=1e-6,
                                        atol=1e-7)


def test_float64_matches_the_oracle(torch, ops):
    p = _problem(torch, 8, dtype=torch.float64)
    leaves = {n: p[n].clone().requires_grad_(True) for n in ("x", "tw") + WEIGHTS}
    with _ws(limit=0.7) as ws:
        y = ops.moe_layer(ws, leaves["x"], p["ids"], leaves["tw"], leaves["w_gate"], leaves["w_up"],
                          leaves["w_down"], shared=_shared(leaves))
        y.backward(p["d_out"])
        ws.synchronize()
    npy = {n: t.numpy() for n, t in p.items()}
    want, rctx = reference.forward(npy["x"], npy["ids"], npy["tw"], npy["w_gate"], npy["w_up"], npy["w_down"],
                                   ws_gate=npy["ws_gate"], ws_up=npy["ws_up"], ws_down=npy["ws_down"],
                                   swiglu_limit=0.7)
    rg = reference.backward(rctx, npy["d_out"])
    assert y.dtype == torch.float64
    np.testing.assert_allclose(y.detach().numpy(), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(leaves["x"].grad.numpy(), rg.dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(leaves["tw"].grad.numpy(), rg.d_topk_weights, rtol=1e-12, atol=1e-12)
    for n, r in zip(WEIGHTS, ("dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")):
        assert leaves[n].grad.dtype == torch.float64, n
        np.testing.assert_allclose(leaves[n].grad.numpy(), getattr(rg, r), rtol=1e-12, atol=1e-13, err_msg=n)


# --------------------------------------------------------------------------- torch.compile
def _block(torch, ops, ws, seed):
    """Router (Linear -> softmax -> top-k, renormalised) then the layer, fp32 parameters."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            rnd = lambda *s, fan_in: torch.nn.Parameter(torch.randn(*s, generator=g) * fan_in ** -0.5)  # noqa: E731
            self.ws = ws
            self.router = rnd(E, H, fan_in=H)
            self.w_gate, self.w_up, self.w_down = rnd(E, I, H, fan_in=H), rnd(E, I, H, fan_in=H), rnd(E, H, I, fan_in=I)
            self.ws_gate, self.ws_up, self.ws_down = rnd(Is_, H, fan_in=H), rnd(Is_, H, fan_in=H), rnd(H, Is_, fan_in=Is_)

        def forward(self, x):
            probs = torch.softmax(x @ self.router.T, dim=-1)
            top, ids = torch.topk(probs, K, dim=-1)
            w = top / top.sum(dim=-1, keepdim=True)
            y = ops.moe_layer(self.ws, x, ids, w, self.w_gate, self.w_up, self.w_down,
                              shared=(self.ws_gate, self.ws_up, self.ws_down))
            return (y * 0.5).square().mean()

    return Block()


def _run(torch, block, fn, x):
    block.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    loss = fn(x)
    loss.backward()
    return loss.detach(), x.grad, {n: q.grad for n, q in block.named_parameters()}


def test_compile_fullgraph_aot_eager_matches_eager_bitwise(torch, ops):
    """aot_eager runs the traced graph's ATen ops as eager would: every bit must agree."""
    import torch._dynamo
    torch._dynamo.reset()
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(9))
    with _ws() as ws:
        block = _block(torch, ops, ws, 10)
        want = _run(torch, block, block, x)
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        for _ in range(2):   # the second call reuses the compiled graph
            got = _run(torch, block, compiled, x)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            for n in want[2]:
                assert got[2][n] is not None and torch.equal(got[2][n], want[2][n]), n
        ws.synchronize()


def test_compile_fullgraph_another_workspace_recompiles(torch, ops):
    """The handle is guarded: the compiled function called with another workspace (another
    swiglu_limit, so other results) runs on that workspace."""
    import torch._dynamo
    torch._dynamo.reset()
    p = _problem(torch, 11, Is=0)

    def f(ws, x, tw):
        return ops.moe_layer(ws, x, p["ids"], tw, p["w_gate"] * 4, p["w_up"] * 4, p["w_down"]) * 2

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    with _ws(Is=0) as a, _ws(Is=0, limit=0.1) as b:
        want_a, want_b = f(a, p["x"], p["tw"]), f(b, p["x"], p["tw"])
        assert not torch.equal(want_a, want_b)
        assert torch.equal(cf(a, p["x"], p["tw"]), want_a)
        assert torch.equal(cf(b, p["x"], p["tw"]), want_b)
        assert torch.equal(cf(a._handle, p["x"], p["tw"]), want_a)


def test_compile_fullgraph_inductor(torch, ops):
    """Inductor generates its own kernels for the router and the loss (other rounding than
    eager's ATen calls): close to eager, and the layer's own outputs bitwise equal to the op's."""
    import torch._dynamo
    torch._dynamo.reset()
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(12))
    with _ws() as ws:
        block = _block(torch, ops, ws, 13)
        want = _run(torch, block, block, x)
        got = _run(torch, block, torch.compile(block, fullgraph=True), x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-6)
        for n in want[2]:
            torch.testing.assert_close(got[2][n], want[2][n], rtol=1e-4, atol=1e-6, msg=n)

        # Routing given: nothing for inductor to fuse around the op but a scale.
        p = _problem(torch, 14)
        sh = _shared(p)
        f = lambda x_: ops.moe_layer(ws, x_, p["ids"], p["tw"], p["w_gate"], p["w_up"], p["w_down"], shared=sh)  # noqa: E731
        assert torch.equal(torch.compile(f, fullgraph=True)(p["x"]), f(p["x"]))
        ws.synchronize()


# --------------------------------------------------------------------------- the sample
def _load_sample(name: str):
    spec = importlib.util.spec_from_file_location(f"_mok_sample_{name}", ROOT / "samples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_torch_sample_compile_matches_eager(torch, capsys):
    import torch._dynamo
    torch._dynamo.reset()
    ta = _load_sample("torch_autograd")
    eager = ta.main(["--backend", "reference", "--steps", "2"])
    compiled = ta.main(["--backend", "reference", "--steps", "2", "--compile", "--compile-backend", "aot_eager"])
    assert len(compiled) == 2 and all(math.isfinite(v) and v > 0 for v in compiled)
    assert compiled == eager
    assert "compile=aot_eager" in capsys.readouterr().out


def test_torch_sample_without_torch_says_so_in_one_line(tmp_path):
    """A stub ``torch`` that fails to import stands in for a machine without PyTorch."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, str(ROOT / "samples" / "torch_autograd.py"), "--backend", "reference"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 1
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "needs PyTorch" in r.stderr
