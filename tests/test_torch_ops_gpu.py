"""The torch custom ops of mok_rt.frameworks.torch_ops on the GPU (CUDA backend): the eager op
against the API called directly, torch.compile(fullgraph=True) against eager, and capture under
torch.cuda.graph (eager op and compiled function), all bitwise.

Needs torch with CUDA: each test skips (or fails, with MOK_RT_REQUIRE_GPU=1) without it.
"""
from __future__ import annotations

import pytest

import mok_rt as mok
from _gpu import skip_or_fail

pytestmark = pytest.mark.gpu

CFG = dict(hidden=256, intermediate=192, num_experts=8, top_k=4, shared_intermediate=128)
T = 333                      # not a multiple of the row block
WEIGHTS = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


@pytest.fixture(scope="module")
def torch():
    try:
        import torch
    except ImportError:
        skip_or_fail("torch is not installed (pip install -e '.[torch]')")
    if not torch.cuda.is_available():
        skip_or_fail("torch has no CUDA")
    return torch


@pytest.fixture(scope="module")
def ops(torch):
    from mok_rt.frameworks import torch_ops
    return torch_ops


def _ws(precision="bf16", **kw):
    return mok.Workspace(mok.MoEConfig(**CFG, precision=precision), mok.SingleProcessGroup(devices=[0]),
                         max_tokens=T, **kw)


def _problem(torch, seed):
    """bf16 x and d_out, fp32 routing weights, fp32 master weights (the ops cast them), int64 ids."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    H, I, E, k, Is = (CFG[n] for n in ("hidden", "intermediate", "num_experts", "top_k", "shared_intermediate"))
    rnd = lambda *s, scale=1.0: torch.randn(*s, generator=g, device="cuda") * scale  # noqa: E731
    logits = rnd(T, E)
    return {"x": rnd(T, H).to(torch.bfloat16), "ids": torch.topk(logits, k, dim=-1).indices,
            "tw": torch.rand(T, k, generator=g, device="cuda"),
            "w_gate": rnd(E, I, H, scale=H ** -0.5), "w_up": rnd(E, I, H, scale=H ** -0.5),
            "w_down": rnd(E, H, I, scale=I ** -0.5), "ws_gate": rnd(Is, H, scale=H ** -0.5),
            "ws_up": rnd(Is, H, scale=H ** -0.5), "ws_down": rnd(H, Is, scale=Is ** -0.5),
            "d_out": rnd(T, H).to(torch.bfloat16)}


def _layer(ops, ws, a, p):
    """moe_layer on leaves ``a`` (x, tw, weights) with the ids of ``p``."""
    return ops.moe_layer(ws, a["x"], p["ids"], a["tw"], a["w_gate"], a["w_up"], a["w_down"],
                         shared=(a["ws_gate"], a["ws_up"], a["ws_down"]))


def _leaves(p):
    return {n: p[n].clone().requires_grad_(True) for n in ("x", "tw") + WEIGHTS}


def _grads(a):
    return {n: t.grad for n, t in a.items()}


def _same(torch, got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
    assert torch.equal(got.contiguous().view(bits), want.contiguous().view(bits)), what


# fp8_block: the ops pass bf16 weights, which each call quantises (forward copies in the forward,
# the transposed copies in the backward, after recompute_context): the API on the same bf16
# weights gives the same bits.
@pytest.mark.parametrize("precision", ["bf16", "fp8_block"])
def test_eager_op_matches_the_api_bitwise(torch, ops, precision):
    p = _problem(torch, 1)
    s = torch.cuda.current_stream()
    with _ws(precision, poison_outputs=True) as ws:
        bf = {n: p[n].to(torch.bfloat16) for n in WEIGHTS}
        sched = mok.schedule(ws, p["ids"], stream=s)
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], mok.ExpertWeights(*(bf[n] for n in WEIGHTS[:3])),
                               shared=mok.ExpertWeights(*(bf[n] for n in WEIGHTS[3:])), stream=s)
        g = mok.backward(ws, ctx, p["d_out"], stream=s)
        want = {"out": torch.from_dlpack(out).clone(), "x": torch.from_dlpack(g.dx).clone(),
                "tw": torch.from_dlpack(g.d_topk_weights).clone(),
                **{n: torch.from_dlpack(t).clone() for n, t in zip(WEIGHTS, (*g.dw, *g.dw_shared))}}
        a = _leaves(p)
        y = _layer(ops, ws, a, p)
        y.backward(p["d_out"])
        torch.cuda.synchronize()
        ws.synchronize()
    _same(torch, y.detach(), want["out"], "out")
    assert y.dtype == torch.bfloat16
    for n, grad in _grads(a).items():
        _same(torch, grad, want[n], n)     # fp32 masters get the layer's fp32 gradients as they are


@pytest.mark.parametrize("precision", ["bf16", "fp8_block"])
def test_compiled_matches_eager_bitwise(torch, ops, precision):
    """The op is opaque to inductor: with the routing given, the compiled function's output and
    every gradient are the eager bits."""
    import torch._dynamo
    torch._dynamo.reset()
    p = _problem(torch, 2)
    with _ws(precision) as ws:
        a = _leaves(p)
        y = _layer(ops, ws, a, p)
        y.backward(p["d_out"])
        want_y, want_g = y.detach().clone(), _grads(a)

        def f(x, tw, *w):
            return ops.moe_layer(ws, x, p["ids"], tw, *w[:3], shared=w[3:])

        compiled = torch.compile(f, fullgraph=True)
        for _ in range(2):
            b = _leaves(p)
            y2 = compiled(b["x"], b["tw"], *(b[n] for n in WEIGHTS))
            y2.backward(p["d_out"])
            torch.cuda.synchronize()
            _same(torch, y2.detach(), want_y, "out")
            for n, grad in _grads(b).items():
                _same(torch, grad, want_g[n], n)
        ws.synchronize()


def test_compiled_block_with_router_trains(torch, ops):
    """Router -> softmax -> top-k -> the layer under torch.compile(fullgraph=True): close to
    eager (inductor's router kernels round differently), every parameter gets a gradient."""
    import torch._dynamo
    torch._dynamo.reset()
    p = _problem(torch, 3)
    router = (torch.randn(CFG["num_experts"], CFG["hidden"], device="cuda") * CFG["hidden"] ** -0.5)
    with _ws() as ws:
        def block(x, r, *w):
            probs = torch.softmax(x.float() @ r.T, dim=-1)
            top, ids = torch.topk(probs, CFG["top_k"], dim=-1)
            y = ops.moe_layer(ws, x, ids, top / top.sum(-1, keepdim=True), *w[:3], shared=w[3:])
            return y.float().square().mean()

        def run(fn):
            a = {n: p[n].clone().requires_grad_(True) for n in WEIGHTS}
            r = router.clone().requires_grad_(True)
            x = p["x"].clone().requires_grad_(True)
            loss = fn(x, r, *(a[n] for n in WEIGHTS))
            loss.backward()
            return loss.detach(), {"x": x.grad, "router": r.grad, **_grads(a)}

        want = run(block)
        got = run(torch.compile(block, fullgraph=True))
        torch.cuda.synchronize()
        ws.synchronize()
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=1e-4)
    for n, grad in got[1].items():
        assert grad is not None and torch.isfinite(grad.float()).all() and grad.abs().sum() > 0, n


def _capture_step(torch, fn, static, p):
    """Warm up ``fn`` on a side stream, then capture forward + backward under torch.cuda.graph;
    returns (graph, captured output, captured gradients by name)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for t in static.values():
                t.grad = None
            fn(static).backward(p["d_out"])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for t in static.values():
        t.grad = None          # the captured backward allocates .grad in the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn(static)
        y.backward(p["d_out"])
    return graph, y, _grads(static)


@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_capture_replays_match_eager(torch, ops, compiled):
    """Forward and backward through the op captured in one torch.cuda.graph; replays with new
    input contents (same addresses) give the eager bits of those inputs."""
    import torch._dynamo
    torch._dynamo.reset()
    probs = [_problem(torch, s) for s in (11, 12, 13)]
    with _ws() as ws:
        eager = []
        for p in probs:
            a = _leaves(p)
            y = _layer(ops, ws, a, p)
            y.backward(p["d_out"])
            eager.append((y.detach().clone(), {n: g.clone() for n, g in _grads(a).items()}))
        torch.cuda.synchronize()
        ws.synchronize()

        p0 = probs[0]
        static = _leaves(p0)
        static_p = {"ids": p0["ids"].clone(), "d_out": p0["d_out"].clone()}

        def step(a):
            return _layer(ops, ws, a, static_p)

        fn = torch.compile(step, fullgraph=True) if compiled else step
        graph, y, grads = _capture_step(torch, fn, static, static_p)
        for p, (want_y, want_g) in zip(probs, eager):
            with torch.no_grad():
                for n in static:
                    static[n].copy_(p[n])
                static_p["ids"].copy_(p["ids"])
                static_p["d_out"].copy_(p["d_out"])
            graph.replay()
            torch.cuda.synchronize()
            ws.synchronize()
            _same(torch, y.detach(), want_y, "out")
            for n in want_g:
                _same(torch, grads[n], want_g[n], n)
        assert ws.memory_bytes()["graph_arena"] > 0
        del graph
