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
    strict = kw.pop("strict", False)
    cfg = dict(hidden=64, intermediate=64, num_experts=4, top_k=2)
    cfg.update(kw)
    return mok.Workspace(mok.MoEConfig(**cfg), max_tokens=64, backend="reference", strict=strict)


def _experts(p) -> mok.ExpertWeights:
    return mok.ExpertWeights(gate=p["w_gate"], up=p["w_up"], down=p["w_down"])


def _shared(p):
    return None if p["shared"][0] is None else mok.ExpertWeights(*p["shared"])


def test_forward_backward_match_the_reference_functions():
    rng = np.random.default_rng(0)
    p = _problem(rng, Is=64)
    with _ws(shared_intermediate=64) as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], _experts(p), shared=_shared(p))
        d_out = rng.standard_normal(out.shape)
        g = mok.backward(ws, ctx, d_out)
    ref_out, rctx = reference.forward(p["x"], p["ids"], p["tw"], p["w_gate"], p["w_up"], p["w_down"],
                                      ws_gate=p["shared"][0], ws_up=p["shared"][1], ws_down=p["shared"][2])
    rg = reference.backward(rctx, d_out)
    np.testing.assert_allclose(out.to_numpy(), ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(g.dx.to_numpy(), rg.dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(g.dw_shared.down.to_numpy(), rg.dws_down.astype(np.float32), rtol=1e-6)
    assert isinstance(g, mok.Gradients) and isinstance(g.dw, mok.ExpertWeights)
    for part, ref in zip(("gate", "up", "down"), (rg.dw_gate, rg.dw_up, rg.dw_down)):
        np.testing.assert_allclose(getattr(g.dw, part).to_numpy(), ref.astype(np.float32), rtol=1e-6)


def test_accumulate_into_caller_buffers():
    rng = np.random.default_rng(1)
    p = _problem(rng)
    bufs = {n: np.full(p[n].shape, 1.0, np.float32) for n in ("w_gate", "w_up", "w_down")}
    dw = mok.ExpertWeights(gate=bufs["w_gate"], up=bufs["w_up"], down=bufs["w_down"])
    with _ws() as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], _experts(p))
        d_out = rng.standard_normal(out.shape)
        g1 = mok.backward(ws, ctx, d_out)
        g2 = mok.backward(ws, ctx, d_out, dw=dw, accumulate=True)
    assert g2.dw is dw and g2.dw.gate is bufs["w_gate"]
    assert g2.dw_shared is None
    np.testing.assert_allclose(bufs["w_down"], 1.0 + g1.dw.down.to_numpy(), rtol=1e-6)


def test_dw_buffers_are_returned_as_the_same_objects():
    rng = np.random.default_rng(11)
    p = _problem(rng, Is=64)
    dw = mok.ExpertWeights(*(np.full(p[n].shape, np.nan, np.float32) for n in ("w_gate", "w_up", "w_down")))
    dws = mok.ExpertWeights(*(np.full(a.shape, np.nan, np.float32) for a in p["shared"]))
    with _ws(shared_intermediate=64) as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], _experts(p), shared=_shared(p))
        d_out = rng.standard_normal(out.shape)
        fresh = mok.backward(ws, ctx, d_out)
        g = mok.backward(ws, ctx, d_out, dw=dw, dw_shared=dws)   # accumulate=False overwrites the NaNs
    assert g.dw is dw and g.dw_shared is dws
    for a, b in zip(tuple(dw) + tuple(dws), tuple(fresh.dw) + tuple(fresh.dw_shared)):
        np.testing.assert_array_equal(a, b.to_numpy())


def test_backward_takes_its_inputs_from_the_context():
    # backward(ws, ctx, d_out) reads x, topk_weights and the weights through ctx: the gradients
    # equal those of the reference at the forward's inputs, and two contexts of different inputs
    # on one schedule each give their own.
    rng = np.random.default_rng(12)
    p = _problem(rng, Is=64)
    q = _problem(np.random.default_rng(13), Is=64)
    q["ids"] = p["ids"]
    with _ws(shared_intermediate=64) as ws:
        sched = mok.schedule(ws, p["ids"])
        out_p, ctx_p = mok.forward(ws, sched, p["x"], p["tw"], _experts(p), shared=_shared(p))
        _, ctx_q = mok.forward(ws, sched, q["x"], q["tw"], _experts(q), shared=_shared(q))
        d_out = rng.standard_normal(out_p.shape)
        gp = mok.backward(ws, ctx_p, d_out)
        gq = mok.backward(ws, ctx_q, d_out)
        again = mok.backward(ws, ctx_p, d_out)   # changing nothing else: the same gradients as before
    for prob, g in ((p, gp), (q, gq)):
        _, rctx = reference.forward(prob["x"], prob["ids"], prob["tw"], prob["w_gate"], prob["w_up"],
                                    prob["w_down"], ws_gate=prob["shared"][0], ws_up=prob["shared"][1],
                                    ws_down=prob["shared"][2])
        rg = reference.backward(rctx, d_out)
        np.testing.assert_allclose(g.dx.to_numpy(), rg.dx, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(g.d_topk_weights.to_numpy(), rg.d_topk_weights, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(g.dw.up.to_numpy(), rg.dw_up.astype(np.float32), rtol=1e-6)
        np.testing.assert_allclose(g.dw_shared.gate.to_numpy(), rg.dws_gate.astype(np.float32), rtol=1e-6)
    for a, b in zip((gp.dx, gp.d_topk_weights, *gp.dw, *gp.dw_shared),
                    (again.dx, again.d_topk_weights, *again.dw, *again.dw_shared)):
        np.testing.assert_array_equal(a.to_numpy(), b.to_numpy())


@pytest.mark.parametrize("Is", [0, 64])
def test_recompute_context_gives_the_same_gradients(Is):
    rng = np.random.default_rng(2)
    p = _problem(rng, Is=Is)
    with _ws(shared_intermediate=Is) as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], _experts(p), shared=_shared(p))
        ctx2 = mok.recompute_context(ws, sched, p["x"], p["tw"], _experts(p), shared=_shared(p))
        assert isinstance(ctx2, mok.Context) and ctx2.recomputed and not ctx.recomputed
        d_out = rng.standard_normal(out.shape)
        a = mok.backward(ws, ctx, d_out)
        b = mok.backward(ws, ctx2, d_out)
    pairs = [(a.dx, b.dx), (a.d_topk_weights, b.d_topk_weights), *zip(a.dw, b.dw)]
    if Is:
        pairs += list(zip(a.dw_shared, b.dw_shared))
    else:
        assert a.dw_shared is None and b.dw_shared is None
    for u, v in pairs:
        np.testing.assert_array_equal(u.to_numpy(), v.to_numpy())


def test_duplicate_expert_in_one_token_sums():
    rng = np.random.default_rng(3)
    p = _problem(rng, T=3, k=2)
    p["ids"][:] = [[1, 1], [0, 1], [2, 2]]
    with _ws() as ws:
        sched = mok.schedule(ws, p["ids"])
        out, _ = mok.forward(ws, sched, p["x"], p["tw"], _experts(p))
    single = np.stack([reference.forward(p["x"][t:t + 1], p["ids"][t:t + 1, :1], p["tw"][t:t + 1, :1] +
                                         p["tw"][t:t + 1, 1:], p["w_gate"], p["w_up"], p["w_down"])[0][0]
                       for t in (0, 2)])
    np.testing.assert_allclose(out.to_numpy()[[0, 2]], single, rtol=1e-12)


def test_zero_tokens():
    rng = np.random.default_rng(4)
    p = _problem(rng, T=0)
    with _ws() as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], _experts(p))
        assert out.shape == (0, 64)
        g = mok.backward(ws, ctx, np.zeros((0, 64)))
        assert not g.dw.gate.to_numpy().any()


# ---- bad input: each a clear error naming the argument ------------------------------------------

def _call_forward(ws, p, **over):
    q = dict(p)
    q.update(over)
    sched = mok.schedule(ws, q["ids"])
    return mok.forward(ws, sched, q["x"], q["tw"], _experts(q), shared=_shared(q))


@pytest.mark.parametrize("field,value,arg", [
    ("x", lambda p: p["x"].astype(np.int32), "x"),
    ("x", lambda p: p["x"][:, :32].copy(), "x"),
    ("x", lambda p: np.asfortranarray(p["x"]), "x"),
    ("tw", lambda p: p["tw"][:, :1].copy(), "topk_weights"),
    ("w_gate", lambda p: p["w_gate"][:3].copy(), "experts.gate"),
    ("w_down", lambda p: np.swapaxes(p["w_down"], 1, 2), "experts.down"),
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


@pytest.mark.parametrize("experts", [
    lambda p: (p["w_gate"], p["w_up"], p["w_down"]),              # the old positional triple
    lambda p: {"gate": p["w_gate"], "up": p["w_up"], "down": p["w_down"]},
    lambda p: p["w_gate"],
])
def test_experts_must_be_expert_weights(experts):
    p = _problem(np.random.default_rng(14))
    with _ws() as ws:
        sched = mok.schedule(ws, p["ids"])
        with pytest.raises(mok.ArgumentError) as info:
            mok.forward(ws, sched, p["x"], p["tw"], experts(p))
        assert info.value.argument == "experts", str(info.value)
        with pytest.raises(mok.ArgumentError) as info:
            mok.recompute_context(ws, sched, p["x"], p["tw"], experts(p))
        assert info.value.argument == "experts", str(info.value)


def _forwarded(ws, p):
    """(schedule, out, ctx) of one forward of problem ``p``."""
    sched = mok.schedule(ws, p["ids"])
    return (sched, *mok.forward(ws, sched, p["x"], p["tw"], _experts(p)))


def test_accumulate_without_buffers_names_dw():
    p = _problem(np.random.default_rng(15))
    with _ws() as ws:
        _, out, ctx = _forwarded(ws, p)
        with pytest.raises(mok.ArgumentError) as info:
            mok.backward(ws, ctx, np.zeros(out.shape), accumulate=True)
    assert info.value.argument == "dw", str(info.value)


def test_accumulate_without_shared_buffers_names_dw_shared():
    p = _problem(np.random.default_rng(16), Is=64)
    dw = mok.ExpertWeights(*(np.zeros(p[n].shape, np.float32) for n in ("w_gate", "w_up", "w_down")))
    with _ws(shared_intermediate=64) as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], _experts(p), shared=_shared(p))
        with pytest.raises(mok.ArgumentError) as info:
            mok.backward(ws, ctx, np.zeros(out.shape), dw=dw, accumulate=True)
    assert info.value.argument == "dw_shared", str(info.value)


def test_shared_without_a_shared_expert_names_shared():
    p = _problem(np.random.default_rng(17), Is=64)   # shared weights, but the config has none
    with _ws() as ws:
        sched = mok.schedule(ws, p["ids"])
        with pytest.raises(mok.ArgumentError) as info:
            mok.forward(ws, sched, p["x"], p["tw"], _experts(p), shared=_shared(p))
        assert info.value.argument == "shared", str(info.value)
        with pytest.raises(mok.ArgumentError) as info:
            mok.recompute_context(ws, sched, p["x"], p["tw"], _experts(p), shared=_shared(p))
        assert info.value.argument == "shared", str(info.value)
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], _experts(p))
        with pytest.raises(mok.ArgumentError) as info:
            mok.backward(ws, ctx, np.zeros(out.shape), dw_shared=mok.ExpertWeights(
                *(np.zeros(a.shape, np.float32) for a in p["shared"])))
        assert info.value.argument == "dw_shared", str(info.value)


def test_read_only_dw_buffer_names_it():
    p = _problem(np.random.default_rng(18))
    bufs = [np.zeros(p[n].shape, np.float32) for n in ("w_gate", "w_up", "w_down")]
    bufs[0].flags.writeable = False
    with _ws() as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], _experts(p))
        with pytest.raises(mok.ArgumentError) as info:
            mok.backward(ws, ctx, np.zeros(out.shape), dw=mok.ExpertWeights(*bufs))
    assert info.value.argument == "dw.gate", str(info.value)


@pytest.mark.parametrize("part,bad,arg", [
    (0, lambda a: a.astype(np.float16), "dw.gate"),           # gradients are fp32 or bf16 (f64 on the oracle)
    (1, lambda a: a[:, :, :32].copy(), "dw.up"),
    (2, lambda a: np.swapaxes(a, 1, 2), "dw.down"),                # not contiguous
])
def test_bad_dw_buffers_are_named(part, bad, arg):
    p = _problem(np.random.default_rng(19))
    bufs = [np.zeros(p[n].shape, np.float32) for n in ("w_gate", "w_up", "w_down")]
    bufs[part] = bad(bufs[part])
    with _ws() as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], _experts(p))
        with pytest.raises(mok.ArgumentError) as info:
            mok.backward(ws, ctx, np.zeros(out.shape), dw=mok.ExpertWeights(*bufs))
    assert info.value.argument == arg, str(info.value)


def test_bf16_gradient_buffers_get_the_rounded_gradients():
    """bf16 dw / dw_shared buffers: the fp32 gradients rounded to bf16 (SEMANTICS §4; accumulate: added
    in fp32 to what is there, as the kernel does, then rounded); mixed dtypes name the first buffer
    that differs."""
    bf = ml_dtypes.bfloat16
    p = _problem(np.random.default_rng(23), Is=64)
    with _ws(shared_intermediate=64) as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], _experts(p), shared=_shared(p))
        d_out = np.random.default_rng(5).standard_normal(out.shape)
        ref = mok.backward(ws, ctx, d_out)     # float64 gradients: the oracle's own precision
        want = [a.to_numpy() for a in (*ref.dw, *ref.dw_shared)]
        bufs = [np.full(a.shape, np.nan, bf) for a in want]
        g = mok.backward(ws, ctx, d_out, dw=mok.ExpertWeights(*bufs[:3]), dw_shared=mok.ExpertWeights(*bufs[3:]))
        for a, w in zip(bufs, want):
            np.testing.assert_array_equal(a.view(np.uint16), w.astype(np.float32).astype(bf).view(np.uint16))
        start = [np.ones(a.shape, bf) for a in want]
        g = mok.backward(ws, ctx, d_out, dw=mok.ExpertWeights(*start[:3]), dw_shared=mok.ExpertWeights(*start[3:]),
                         accumulate=True)
        assert g.dw.gate is start[0]
        for a, w in zip(start, want):
            np.testing.assert_array_equal(a.view(np.uint16), (1 + w.astype(np.float32)).astype(bf).view(np.uint16))
        only = mok.backward(ws, ctx, d_out, dw=mok.ExpertWeights(*bufs[:3]))   # shared ones allocated alike
        assert only.dw_shared.gate.to_numpy().dtype == bf
        with pytest.raises(mok.ArgumentError) as info:
            mok.backward(ws, ctx, d_out, dw=mok.ExpertWeights(*bufs[:3]),
                         dw_shared=mok.ExpertWeights(*(np.zeros(a.shape, np.float32) for a in want[3:])))
        assert info.value.argument == "dw_shared.gate", str(info.value)


def test_backward_rejects_what_is_not_a_context():
    p = _problem(np.random.default_rng(20))
    with _ws() as ws:
        sched, out, _ = _forwarded(ws, p)
        with pytest.raises(mok.ArgumentError) as info:
            mok.backward(ws, sched, np.zeros(out.shape))   # the old call passed the schedule here
    assert info.value.argument == "ctx", str(info.value)


def test_strict_reference_accepts_what_cuda_accepts():
    p = _problem(np.random.default_rng(21), dtype=np.float64)
    with _ws(strict=True) as ws:
        with pytest.raises(mok.ArgumentError) as info:
            _call_forward(ws, p)
        assert info.value.argument == "x", str(info.value)
        b = _problem(np.random.default_rng(21), dtype=BF16)
        out, ctx = _call_forward(ws, b)
        assert out.to_numpy().dtype == BF16
        g = mok.backward(ws, ctx, np.zeros(out.shape, BF16))
        assert g.dw.gate.to_numpy().dtype == np.float32
    with _ws() as ws:   # the oracle also takes float64
        _call_forward(ws, p)


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
    with _ws() as ws, pytest.raises(mok.ArgumentError, match="shared") as info:
        _call_forward(ws, p)
    assert info.value.argument == "shared", str(info.value)
    q = _problem(np.random.default_rng(8))
    with _ws(shared_intermediate=64) as ws, pytest.raises(mok.ArgumentError, match="shared expert") as info:
        _call_forward(ws, q)
    assert info.value.argument == "shared", str(info.value)
    with _ws(shared_intermediate=64) as ws, pytest.raises(mok.ArgumentError) as info:
        _call_forward(ws, dict(p, shared=(p["shared"][0][:32].copy(),) + p["shared"][1:]))
    assert info.value.argument == "shared.gate", str(info.value)


def test_closed_workspace_and_foreign_schedule():
    p = _problem(np.random.default_rng(9))
    ws = _ws()
    sched = mok.schedule(ws, p["ids"])
    with _ws() as other, pytest.raises(mok.ArgumentError, match="sched"):
        mok.forward(other, sched, p["x"], p["tw"], _experts(p))
    _, ctx = mok.forward(ws, sched, p["x"], p["tw"], _experts(p))
    with _ws() as other, pytest.raises(mok.ArgumentError) as info:   # the caller passed ctx, not sched
        mok.backward(other, ctx, np.ones_like(p["x"]))
    assert info.value.argument == "ctx", str(info.value)
    ws.close()
    ws.close()
    with pytest.raises(mok.ArgumentError, match="closed"):
        mok.schedule(ws, p["ids"])


@pytest.mark.parametrize("kw", [dict(hidden=100), dict(intermediate=0), dict(top_k=0), dict(swiglu_limit=-1.0),
                                dict(shared_intermediate=30), dict(block_m=96), dict(block_m=64),
                                dict(num_experts=2.5)])
def test_config_validation(kw):
    base = dict(hidden=64, intermediate=64, num_experts=4, top_k=2)
    base.update(kw)
    with pytest.raises(mok.ArgumentError) as info:
        mok.MoEConfig(**base)
    assert info.value.argument in kw
