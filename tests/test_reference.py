"""The NumPy reference of the MoE layer: forward semantics, finite-difference gradients, EP simulation."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mok_rt import reference as ref
from mok_rt.errors import ArgumentError

H, I, E, K, T, I_S = 8, 6, 4, 2, 5, 4


def _problem(rng, *, tokens=T, hidden=H, inter=I, experts=E, k=K, inter_s=I_S, dup=True):
    x = rng.standard_normal((tokens, hidden))
    ids = rng.integers(0, experts, size=(tokens, k))
    if dup and tokens >= 2 and k >= 2:
        ids[1, :] = ids[1, 0]          # one token routed twice to the same expert
    p = {
        "x": x, "topk_ids": ids, "topk_weights": rng.uniform(0.1, 1.0, size=(tokens, k)),
        "w_gate": rng.standard_normal((experts, inter, hidden)) / np.sqrt(hidden),
        "w_up": rng.standard_normal((experts, inter, hidden)) / np.sqrt(hidden),
        "w_down": rng.standard_normal((experts, hidden, inter)) / np.sqrt(inter),
    }
    if inter_s:
        p["ws_gate"] = rng.standard_normal((inter_s, hidden)) / np.sqrt(hidden)
        p["ws_up"] = rng.standard_normal((inter_s, hidden)) / np.sqrt(hidden)
        p["ws_down"] = rng.standard_normal((hidden, inter_s)) / np.sqrt(inter_s)
    return p


def _call(p, limit=None):
    return ref.forward(p["x"], p["topk_ids"], p["topk_weights"], p["w_gate"], p["w_up"], p["w_down"],
                       ws_gate=p.get("ws_gate"), ws_up=p.get("ws_up"), ws_down=p.get("ws_down"),
                       swiglu_limit=limit)


def _naive_forward(p, limit=None):
    """Per-token loop straight from the formula (independent of the vectorised code)."""
    def act(g, u):
        if limit is not None:
            g, u = min(g, limit), min(max(u, -limit), limit)
        return g / (1.0 + np.exp(-g)) * u

    out = np.zeros_like(p["x"])
    for t in range(p["x"].shape[0]):
        v = p["x"][t]
        if "ws_gate" in p:
            a = np.array([act(gi, ui) for gi, ui in zip(p["ws_gate"] @ v, p["ws_up"] @ v)])
            out[t] += p["ws_down"] @ a
        for j in range(p["topk_ids"].shape[1]):
            e = p["topk_ids"][t, j]
            a = np.array([act(gi, ui) for gi, ui in zip(p["w_gate"][e] @ v, p["w_up"][e] @ v)])
            out[t] += p["topk_weights"][t, j] * (p["w_down"][e] @ a)
    return out


def _pick_limit(p, rng):
    """A limit in a wide gap of the pre-activation values: some clamp, none within reach of FD steps."""
    _, ctx = _call(p)
    parts = [ctx.g, np.abs(ctx.u)]
    if ctx.shared_g is not None:
        parts += [ctx.shared_g, np.abs(ctx.shared_u)]
    vals = np.sort(np.concatenate([v.ravel() for v in parts]))
    lo, hi = int(0.5 * vals.size), int(0.85 * vals.size)
    gaps = vals[lo + 1:hi + 1] - vals[lo:hi]
    i = lo + int(np.argmax(gaps))
    limit = 0.5 * (vals[i] + vals[i + 1])
    margin = 0.5 * (vals[i + 1] - vals[i])
    assert margin > 1e-4
    assert (ctx.g > limit).any() and (np.abs(ctx.u) > limit).any()
    return limit


def _loss(p, d_out, limit):
    out, _ = _call(p, limit)
    return float(np.sum(out * d_out))


@pytest.mark.parametrize("use_limit", [False, True])
def test_forward_matches_naive_loop(use_limit):
    rng = np.random.default_rng(1)
    p = _problem(rng)
    limit = _pick_limit(p, rng) if use_limit else None
    out, _ = _call(p, limit)
    np.testing.assert_allclose(out, _naive_forward(p, limit), rtol=1e-12, atol=1e-13)
    if use_limit:
        assert not np.allclose(out, _call(p)[0])   # the clamp changed something


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("use_limit", [False, True])
def test_gradients_finite_differences(use_limit, shared):
    rng = np.random.default_rng(10 + use_limit + 2 * shared)
    p = _problem(rng, inter_s=I_S if shared else 0)
    limit = _pick_limit(p, rng) if use_limit else None
    assert len(set(p["topk_ids"][1])) == 1     # duplicated id present
    d_out = rng.standard_normal((T, H))
    out, ctx = _call(p, limit)
    grads = ref.backward(ctx, d_out)
    names = {"x": "dx", "topk_weights": "d_topk_weights", "w_gate": "dw_gate", "w_up": "dw_up",
             "w_down": "dw_down", "ws_gate": "dws_gate", "ws_up": "dws_up", "ws_down": "dws_down"}
    eps = 1e-6
    for name, gname in names.items():
        analytic = getattr(grads, gname)
        if name not in p:
            assert analytic is None
            continue
        numeric = np.zeros_like(p[name])
        for idx in np.ndindex(p[name].shape):
            orig = p[name][idx]
            p[name][idx] = orig + eps
            lp = _loss(p, d_out, limit)
            p[name][idx] = orig - eps
            lm = _loss(p, d_out, limit)
            p[name][idx] = orig
            numeric[idx] = (lp - lm) / (2 * eps)
        assert analytic.shape == p[name].shape and analytic.dtype == np.float64
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8, err_msg=gname)


def test_duplicate_ids_sum():
    rng = np.random.default_rng(3)
    p = _problem(rng, k=2, inter_s=0)
    p["topk_ids"][:] = p["topk_ids"][:, :1]
    single = dict(p, topk_ids=p["topk_ids"][:, :1].copy(),
                  topk_weights=p["topk_weights"].sum(axis=1, keepdims=True))
    out2, ctx2 = _call(p)
    out1, ctx1 = _call(single)
    np.testing.assert_allclose(out2, out1, rtol=1e-13, atol=1e-14)
    d_out = rng.standard_normal(out1.shape)
    g2, g1 = ref.backward(ctx2, d_out), ref.backward(ctx1, d_out)
    for f in ("dx", "dw_gate", "dw_up", "dw_down"):
        np.testing.assert_allclose(getattr(g2, f), getattr(g1, f), rtol=1e-12, atol=1e-13)
    # both slots of a token see the same expert output, so the same weight gradient
    np.testing.assert_allclose(g2.d_topk_weights[:, 0], g2.d_topk_weights[:, 1], rtol=1e-13)


def test_empty_tokens_and_empty_experts():
    rng = np.random.default_rng(4)
    p = _problem(rng, tokens=0)
    out, ctx = _call(p, 0.5)
    assert out.shape == (0, H)
    g = ref.backward(ctx, np.zeros((0, H)))
    assert g.dx.shape == (0, H) and g.d_topk_weights.shape == (0, K)
    for f in ("dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down"):
        assert not getattr(g, f).any()
    # experts 0 and 3 get no tokens -> exactly zero weight gradients
    p = _problem(rng, dup=False)
    p["topk_ids"] = rng.integers(1, 3, size=(T, K))
    out, ctx = _call(p)
    g = ref.backward(ctx, rng.standard_normal((T, H)))
    for f in ("dw_gate", "dw_up", "dw_down"):
        arr = getattr(g, f)
        assert not arr[[0, 3]].any() and arr[[1, 2]].any()


def test_low_precision_inputs_are_cast_first():
    rng = np.random.default_rng(5)
    p = _problem(rng)
    for dt in (np.float32, ml_dtypes.bfloat16):
        low = {n: (v.astype(dt) if v.dtype.kind == "f" else v) for n, v in p.items()}
        as64 = {n: (v.astype(np.float64) if n != "topk_ids" else v) for n, v in low.items()}
        out_low, _ = _call(low, 0.7)
        out_64, _ = _call(as64, 0.7)
        assert out_low.dtype == np.float64
        np.testing.assert_array_equal(out_low, out_64)
    ids32 = dict(p, topk_ids=p["topk_ids"].astype(np.int32))
    np.testing.assert_array_equal(_call(ids32)[0], _call(p)[0])


def test_bitwise_deterministic():
    rng = np.random.default_rng(6)
    p = _problem(rng, tokens=40)
    d_out = rng.standard_normal((40, H))
    a = [ref.backward(_call(p, 0.8)[1], d_out) for _ in range(2)]
    for f in ("dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "dws_gate"):
        np.testing.assert_array_equal(getattr(a[0], f), getattr(a[1], f))


# ---------------------------------------------------------------------------------------------
# Expert parallelism
# ---------------------------------------------------------------------------------------------

def _split(arr, num_ranks):
    return [np.ascontiguousarray(a) for a in np.split(arr, num_ranks)]


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8])
@pytest.mark.parametrize("use_limit", [False, True])
def test_ep_equals_global(num_ranks, use_limit):
    rng = np.random.default_rng(100 + num_ranks)
    e_local, hidden, inter, k = 2, 16, 12, 3
    experts = e_local * num_ranks
    counts = rng.integers(0, 9, size=num_ranks)
    counts[0] = 0 if num_ranks > 1 else 7          # a rank with no tokens
    total = int(counts.sum())
    p = _problem(rng, tokens=total, hidden=hidden, inter=inter, experts=experts, k=k, inter_s=5)
    empty = {experts - 1} | ({1} if experts > 2 else set())   # experts nobody routes to
    allowed = np.array([e for e in range(experts) if e not in empty])
    p["topk_ids"] = rng.choice(allowed, size=(total, k))
    if total:
        p["topk_ids"][-1, :] = p["topk_ids"][-1, 0]   # duplicate
    limit = 0.6 if use_limit else None

    out_g, ctx_g = _call(p, limit)
    d_out = rng.standard_normal(out_g.shape)
    grads_g = ref.backward(ctx_g, d_out)

    cuts = np.cumsum(counts)[:-1]
    xs = np.split(p["x"], cuts)
    ids = np.split(p["topk_ids"], cuts)
    tws = np.split(p["topk_weights"], cuts)
    d_outs = np.split(d_out, cuts)
    outs, ctx = ref.ep_forward(xs, ids, tws, _split(p["w_gate"], num_ranks), _split(p["w_up"], num_ranks),
                               _split(p["w_down"], num_ranks), num_ranks=num_ranks,
                               ws_gate=p["ws_gate"], ws_up=p["ws_up"], ws_down=p["ws_down"],
                               swiglu_limit=limit)
    grads = ref.ep_backward(ctx, d_outs)
    tol = dict(rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.concatenate(outs), out_g, **tol)
    np.testing.assert_allclose(np.concatenate([g.dx for g in grads]), grads_g.dx, **tol)
    np.testing.assert_allclose(np.concatenate([g.d_topk_weights for g in grads]), grads_g.d_topk_weights, **tol)
    for f in ("dw_gate", "dw_up", "dw_down"):
        np.testing.assert_allclose(np.concatenate([getattr(g, f) for g in grads]), getattr(grads_g, f), **tol)
        for e in empty:
            assert not getattr(grads[e // e_local], f)[e % e_local].any()
    # shared expert: each rank's gradient comes from its own tokens only; they sum to the global one
    for f in ("dws_gate", "dws_up", "dws_down"):
        np.testing.assert_allclose(sum(getattr(g, f) for g in grads), getattr(grads_g, f), **tol)
    for r in range(num_ranks):
        sub = dict(p, x=xs[r], topk_ids=ids[r], topk_weights=tws[r])
        g_r = ref.backward(_call(sub, limit)[1], d_outs[r])
        for f in ("dws_gate", "dws_up", "dws_down"):
            np.testing.assert_allclose(getattr(grads[r], f), getattr(g_r, f), **tol)
        assert outs[r].shape == (counts[r], hidden) and grads[r].dx.shape == (counts[r], hidden)


def test_ep_without_shared_and_all_empty():
    rng = np.random.default_rng(7)
    w = [rng.standard_normal((2, 4, 8)) for _ in range(2)]
    wd = [rng.standard_normal((2, 8, 4)) for _ in range(2)]
    xs = [np.zeros((0, 8)), np.zeros((0, 8))]
    ids = [np.zeros((0, 2), np.int64)] * 2
    outs, ctx = ref.ep_forward(xs, ids, [np.zeros((0, 2))] * 2, w, w, wd, num_ranks=2)
    grads = ref.ep_backward(ctx, [np.zeros((0, 8))] * 2)
    assert [o.shape for o in outs] == [(0, 8), (0, 8)]
    assert all(g.dws_gate is None and not g.dw_down.any() for g in grads)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def _raises(argument, fn, *args, **kwargs):
    with pytest.raises(ArgumentError) as info:
        fn(*args, **kwargs)
    assert info.value.argument == argument, str(info.value)
    return info.value


def test_validation_errors():
    rng = np.random.default_rng(8)
    p = _problem(rng)

    def fwd(**changes):
        q = dict(p, **changes)
        limit = q.pop("swiglu_limit", None)
        return _call(q, limit)

    bad_ids = p["topk_ids"].copy()
    bad_ids[2, 1] = E
    err = _raises("topk_ids", fwd, topk_ids=bad_ids)
    assert "token 2" in str(err) and str(E) in str(err)
    bad_ids[2, 1] = -1
    _raises("topk_ids", fwd, topk_ids=bad_ids)
    _raises("topk_ids", fwd, topk_ids=p["topk_ids"].astype(np.float32))
    _raises("topk_ids", fwd, topk_ids=p["topk_ids"][:, :0])
    _raises("topk_ids", fwd, topk_ids=p["topk_ids"][:-1])
    _raises("topk_weights", fwd, topk_weights=p["topk_weights"][:, :1])
    _raises("x", fwd, x=p["x"][:, :-1])
    _raises("x", fwd, x=p["x"].astype(np.int32))
    _raises("x", fwd, x=p["x"][None])
    _raises("w_up", fwd, w_up=p["w_up"][:, :-1])
    _raises("w_down", fwd, w_down=p["w_down"].transpose(0, 2, 1))
    _raises("w_gate", fwd, w_gate=p["w_gate"][0])
    _raises("ws_down", fwd, ws_down=None)
    _raises("ws_up", fwd, ws_up=p["ws_up"][:-1])
    _raises("swiglu_limit", fwd, swiglu_limit=-1.0)
    _raises("swiglu_limit", fwd, swiglu_limit=float("nan"))
    _raises("swiglu_limit", fwd, swiglu_limit="7")
    _, ctx = _call(p)
    _raises("d_out", ref.backward, ctx, np.zeros((T, H + 1)))
    _raises("ctx", ref.backward, object(), np.zeros((T, H)))


def test_ep_validation_errors():
    rng = np.random.default_rng(9)
    w = [rng.standard_normal((2, 4, 8)) for _ in range(2)]
    wd = [rng.standard_normal((2, 8, 4)) for _ in range(2)]
    xs = [rng.standard_normal((3, 8)), rng.standard_normal((1, 8))]
    ids = [np.array([[0, 3], [1, 1], [2, 0]]), np.array([[3, 2]])]
    tws = [np.ones((3, 2)), np.ones((1, 2))]
    ok = dict(xs=xs, topk_ids=ids, topk_weights=tws, w_gate=w, w_up=w, w_down=wd, num_ranks=2)
    ref.ep_forward(**ok)
    err = _raises("topk_ids[1]", ref.ep_forward, **dict(ok, topk_ids=[ids[0], np.array([[4, 0]])]))
    assert "outside [0, 4)" in str(err)
    _raises("topk_ids[1]", ref.ep_forward, **dict(ok, topk_ids=[ids[0], np.array([[3]])],
                                                  topk_weights=[tws[0], np.ones((1, 1))]))
    _raises("xs", ref.ep_forward, **dict(ok, xs=xs[:1]))
    _raises("xs[1]", ref.ep_forward, **dict(ok, xs=[xs[0], xs[1][:, :4]]))
    _raises("w_gate", ref.ep_forward, **dict(ok, w_gate=w[0]))
    _raises("w_gate[1]", ref.ep_forward, **dict(ok, w_gate=[w[0], w[1][:1]], w_up=[w[0], w[1][:1]],
                                                w_down=[wd[0], wd[1][:1]]))
    _raises("num_ranks", ref.ep_forward, **dict(ok, num_ranks=0))
    _, ctx = ref.ep_forward(**ok)
    _raises("d_outs[0]", ref.ep_backward, ctx, [np.zeros((2, 8)), np.zeros((1, 8))])
    _raises("d_outs", ref.ep_backward, ctx, [np.zeros((3, 8))])
