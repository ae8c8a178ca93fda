"""The public API on the reference backend (any machine): semantics, validation, errors."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import mok_rt as mok
from mok_rt import reference

BF16 = ml_dtypes.bfloat16


def _problem(rng, *, T=37, H=64, I=64, E=4, k=2, Is=0, dtype=np.float64):
    p = {
        "x": rng.standard_normal((T, H)).astype(dtype),
        "ids": np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32) if T else
        np.zeros((0, k), np.int32),
        "tw": rng.random((T, k)).astype(np.float32 if dtype != np.float64 else np.float64),
        "w_gate": (rng.standard_normal((E, I, H)) * H ** -0.5).astype(dtype),
        "w_up": (rng.standard_normal((E, I, H)) * H ** -0.5).astype(dtype),
        "w_down": (rng.standard_normal((E, H, I)) * I ** -0.5).astype(dtype),
        "shared": (None, None, None),
    }
    if Is:
        p["shared"] = ((rng.standard_normal((Is, H)) * H ** -0.5).astype(dtype),
                       (rng.standard_normal((Is, H)) * H ** -0.5).astype(dtype),
                       (rng.standard_normal((H, Is)) * Is ** -0.5).astype(dtype))
    return p


def _ws(**kw):
    cfg = dict(hidden=64, intermediate=64, num_experts=4, top_k=2)
    cfg.update(kw)
    return mok.Workspace(mok.MoEConfig(**cfg), max_tokens=64, backend="reference")


def test_forward_backward_match_the_reference_functions():
    rng = np.random.default_rng(0)
    p = _problem(rng, Is=64)
    with _ws(shared_intermediate=64) as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], p["w_gate"], p["w_up"], p["w_down"], *p["shared"])
        d_out = rng.standard_normal(out.shape)
        g = mok.backward(ws, sched, ctx, d_out, p["x"], p["tw"], p["w_gate"], p["w_up"], p["w_down"], *p["shared"])
    ref_out, rctx = reference.forward(p["x"], p["ids"], p["tw"], p["w_gate"], p["w_up"], p["w_down"],
                                      ws_gate=p["shared"][0], ws_up=p["shared"][1], ws_down=p["shared"][2])
    rg = reference.backward(rctx, d_out)
    np.testing.assert_allclose(out.to_numpy(), ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(g.dx.to_numpy(), rg.dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(g.dws_down.to_numpy(), rg.dws_down.astype(np.float32), rtol=1e-6)


def test_accumulate_into_caller_buffers():
    rng = np.random.default_rng(1)
    p = _problem(rng)
    bufs = {n: np.full(p[n].shape, 1.0, np.float32) for n in ("w_gate", "w_up", "w_down")}
    with _ws() as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], p["w_gate"], p["w_up"], p["w_down"])
        d_out = rng.standard_normal(out.shape)
        g1 = mok.backward(ws, sched, ctx, d_out, p["x"], p["tw"], p["w_gate"], p["w_up"], p["w_down"])
        g2 = mok.backward(ws, sched, ctx, d_out, p["x"], p["tw"], p["w_gate"], p["w_up"], p["w_down"],
                          dw_gate=bufs["w_gate"], dw_up=bufs["w_up"], dw_down=bufs["w_down"], accumulate=True)
    assert g2.dw_gate is bufs["w_gate"]
    np.testing.assert_allclose(bufs["w_down"], 1.0 + g1.dw_down.to_numpy(), rtol=1e-6)


def test_recompute_context_gives_the_same_gradients():
    rng = np.random.default_rng(2)
    p = _problem(rng)
    with _ws() as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], p["w_gate"], p["w_up"], p["w_down"])
        ctx2 = mok.recompute_context(ws, sched, p["x"], p["w_gate"], p["w_up"])
        d_out = rng.standard_normal(out.shape)
        a = mok.backward(ws, sched, ctx, d_out, p["x"], p["tw"], p["w_gate"], p["w_up"], p["w_down"])
        b = mok.backward(ws, sched, ctx2, d_out, p["x"], p["tw"], p["w_gate"], p["w_up"], p["w_down"])
    for n in ("dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down"):
        np.testing.assert_array_equal(getattr(a, n).to_numpy(), getattr(b, n).to_numpy())


def test_duplicate_expert_in_one_token_sums():
    rng = np.random.default_rng(3)
    p = _problem(rng, T=3, k=2)
    p["ids"][:] = [[1, 1], [0, 1], [2, 2]]
    with _ws() as ws:
        sched = mok.schedule(ws, p["ids"])
        out, _ = mok.forward(ws, sched, p["x"], p["tw"], p["w_gate"], p["w_up"], p["w_down"])
    single = np.stack([reference.forward(p["x"][t:t + 1], p["ids"][t:t + 1, :1], p["tw"][t:t + 1, :1] +
                                         p["tw"][t:t + 1, 1:], p["w_gate"], p["w_up"], p["w_down"])[0][0]
                       for t in (0, 2)])
    np.testing.assert_allclose(out.to_numpy()[[0, 2]], single, rtol=1e-12)


def test_zero_tokens():
    rng = np.random.default_rng(4)
    p = _problem(rng, T=0)
    with _ws() as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], p["w_gate"], p["w_up"], p["w_down"])
        assert out.shape == (0, 64)
        g = mok.backward(ws, sched, ctx, np.zeros((0, 64)), p["x"], p["tw"], p["w_gate"], p["w_up"], p["w_down"])
        assert not g.dw_gate.to_numpy().any()


# ---- bad input: each a clear error naming the argument ------------------------------------------

def _call_forward(ws, p, **over):
    q = dict(p)
    q.update(over)
    sched = mok.schedule(ws, q["ids"])
    return mok.forward(ws, sched, q["x"], q["tw"], q["w_gate"], q["w_up"], q["w_down"], *q["shared"])


@pytest.mark.parametrize("field,value,arg", [
    ("x", lambda p: p["x"].astype(np.int32), "x"),
    ("x", lambda p: p["x"][:, :32].copy(), "x"),
    ("x", lambda p: np.asfortranarray(p["x"]), "x"),
    ("tw", lambda p: p["tw"][:, :1].copy(), "topk_weights"),
    ("w_gate", lambda p: p["w_gate"][:3].copy(), "w_gate"),
    ("w_down", lambda p: np.swapaxes(p["w_down"], 1, 2), "w_down"),
    ("ids", lambda p: p["ids"].astype(np.float32), "topk_ids"),
    ("ids", lambda p: p["ids"][:, :1].copy(), "topk_ids"),
    ("x", lambda p: [[1.0]], "x"),
])
def test_bad_arguments_are_named(field, value, arg):
    p = _problem(np.random.default_rng(5))
    with _ws() as ws:
        with pytest.raises(mok.ArgumentError) as info:
            _call_forward(ws, p, **{field: value(p)})
    assert info.value.argument == arg, str(info.value)


def test_ids_out_of_range_raise_expert_id_error():
    # As on the device: schedule() returns, synchronize() raises (and clears) the error.
    p = _problem(np.random.default_rng(6))
    p["ids"][5, 1] = 4
    with _ws() as ws:
        mok.schedule(ws, p["ids"])
        with pytest.raises(mok.ExpertIdError, match="token 5"):
            ws.synchronize()
        ws.synchronize()


def test_more_tokens_than_the_workspace_holds():
    p = _problem(np.random.default_rng(7), T=65)
    with _ws() as ws, pytest.raises(mok.ArgumentError, match="max_tokens"):
        mok.schedule(ws, p["ids"])


def test_shared_expert_arguments_must_match_the_config():
    p = _problem(np.random.default_rng(8), Is=64)
    with _ws() as ws, pytest.raises(mok.ArgumentError, match="shared"):
        _call_forward(ws, p)
    q = _problem(np.random.default_rng(8))
    with _ws(shared_intermediate=64) as ws, pytest.raises(mok.ArgumentError, match="shared expert"):
        _call_forward(ws, q)


def test_closed_workspace_and_foreign_schedule():
    p = _problem(np.random.default_rng(9))
    ws = _ws()
    sched = mok.schedule(ws, p["ids"])
    with _ws() as other, pytest.raises(mok.ArgumentError, match="sched"):
        mok.forward(other, sched, p["x"], p["tw"], p["w_gate"], p["w_up"], p["w_down"])
    ws.close()
    ws.close()
    with pytest.raises(mok.ArgumentError, match="closed"):
        mok.schedule(ws, p["ids"])


@pytest.mark.parametrize("kw", [dict(hidden=100), dict(intermediate=0), dict(top_k=0), dict(swiglu_limit=-1.0),
                                dict(shared_intermediate=30), dict(block_m=96), dict(num_experts=2.5)])
def test_config_validation(kw):
    base = dict(hidden=64, intermediate=64, num_experts=4, top_k=2)
    base.update(kw)
    with pytest.raises(mok.ArgumentError) as info:
        mok.MoEConfig(**base)
    assert info.value.argument in kw
