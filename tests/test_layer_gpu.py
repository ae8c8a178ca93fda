"""The fused layer on one GPU against the float64 NumPy reference (issue: fused MoE layer on one GPU).

Every output is poisoned with NaN before each run (Workspace(poison_outputs=True)), so an element
the kernels fail to write cannot pass; inputs are fresh random bf16 values; errors are relative
Frobenius norms against mok_rt.reference computed in float64 on the same bf16-rounded inputs.
"""
from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from _gpu import cp  # noqa: E402  (CuPy is imported when a test first uses it)

import mok_rt as mok  # noqa: E402
from mok_rt import reference  # noqa: E402

BF16 = ml_dtypes.bfloat16
TOL = 1e-2
GRADS = ("dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")
REPORT: list[str] = []


def _bf16(a):
    return a.astype(BF16)


def make_problem(seed, *, T, H, I, E, k, Is=0, ids=None):
    rng = np.random.default_rng(seed)
    h = {
        "x": _bf16(rng.standard_normal((T, H))),
        "tw": rng.random((T, k)).astype(np.float32),
        "w_gate": _bf16(rng.standard_normal((E, I, H)) * H ** -0.5),
        "w_up": _bf16(rng.standard_normal((E, I, H)) * H ** -0.5),
        "w_down": _bf16(rng.standard_normal((E, H, I)) * I ** -0.5),
        "d_out": _bf16(rng.standard_normal((T, H))),
    }
    if ids is None:
        ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]) if T else np.zeros((0, k))
    h["ids"] = np.asarray(ids, dtype=np.int32)
    h["shared"] = (None, None, None)
    if Is:
        h["shared"] = (_bf16(rng.standard_normal((Is, H)) * H ** -0.5),
                       _bf16(rng.standard_normal((Is, H)) * H ** -0.5),
                       _bf16(rng.standard_normal((H, Is)) * Is ** -0.5))
    return h


def _to_dev(h):
    d = {n: cp.asarray(v) for n, v in h.items() if n != "shared"}
    d["shared"] = tuple(None if s is None else cp.asarray(s) for s in h["shared"])
    return d


def _experts(d):
    return mok.ExpertWeights(gate=d["w_gate"], up=d["w_up"], down=d["w_down"])


def _shared(d):
    return None if d["shared"][0] is None else mok.ExpertWeights(*d["shared"])


def _flat(g) -> dict:
    """mok.Gradients by the names of GRADS (the shared expert's None without one)."""
    shared = tuple(g.dw_shared) if g.dw_shared is not None else (None, None, None)
    return dict(zip(GRADS, (g.dx, g.d_topk_weights, *g.dw, *shared)))


def run_gpu(cfg, h, *, T_max=None):
    d = _to_dev(h)
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=T_max or max(1, len(h["x"])),
                       poison_outputs=True) as ws:
        sched = mok.schedule(ws, d["ids"])
        out, ctx = mok.forward(ws, sched, d["x"], d["tw"], _experts(d), shared=_shared(d))
        g = mok.backward(ws, ctx, d["d_out"])
        ctx2 = mok.recompute_context(ws, sched, d["x"], d["tw"], _experts(d), shared=_shared(d))
        g2 = mok.backward(ws, ctx2, d["d_out"])
        ws.synchronize()
        res = {"out": out.to_numpy()}
        res.update({n: t.to_numpy() for n, t in _flat(g).items() if t is not None})
        res2 = {n: t.to_numpy() for n, t in _flat(g2).items() if t is not None}
    return res, res2


def run_reference(cfg, h):
    f = lambda a: None if a is None else a.astype(np.float64)  # noqa: E731
    out, ctx = reference.forward(f(h["x"]), h["ids"], h["tw"].astype(np.float64), f(h["w_gate"]), f(h["w_up"]),
                                 f(h["w_down"]), ws_gate=f(h["shared"][0]), ws_up=f(h["shared"][1]),
                                 ws_down=f(h["shared"][2]), swiglu_limit=cfg.swiglu_limit)
    g = reference.backward(ctx, f(h["d_out"]))
    res = {"out": out}
    res.update({n: getattr(g, n) for n in GRADS if getattr(g, n) is not None})
    return res


def rel_err(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if b.size == 0:
        return 0.0
    denom = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (denom if denom > 0 else 1.0))


def check_case(name, cfg, h):
    got, got_recomputed = run_gpu(cfg, h)
    ref = run_reference(cfg, h)
    errs = {}
    for n, r in ref.items():
        assert n in got, f"{name}: {n} missing"
        assert got[n].shape == r.shape, f"{name}: {n} shape {got[n].shape} != {r.shape}"
        assert np.isfinite(got[n].astype(np.float64)).all(), f"{name}: {n} has NaN/inf (unwritten?)"
        errs[n] = rel_err(got[n], r)
    REPORT.append(f"{name}: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    print(REPORT[-1])
    bad = {n: e for n, e in errs.items() if e > TOL}
    assert not bad, f"{name}: relative errors above {TOL}: {bad}"
    for n in got_recomputed:   # recompute_context rebuilds the same context: identical bits
        np.testing.assert_array_equal(got_recomputed[n].view(np.uint8), got[n].view(np.uint8),
                                      err_msg=f"{name}: {n} differs with the recomputed context")
    return got


CASES = {
    "tiny_T1": (dict(hidden=256, intermediate=128, num_experts=8, top_k=2), dict(T=1)),
    "shared_T1000": (dict(hidden=1024, intermediate=512, num_experts=16, top_k=4, shared_intermediate=768),
                     dict(T=1000)),
    "qwen3_T4096": (dict(hidden=2048, intermediate=768, num_experts=128, top_k=8), dict(T=4096)),
    "limit7": (dict(hidden=512, intermediate=256, num_experts=8, top_k=3, swiglu_limit=7.0,
                    shared_intermediate=256), dict(T=333, scale=4.0)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    c, p = CASES[name]
    cfg = mok.MoEConfig(**c)
    seed = zlib.crc32(name.encode()) % 1000   # str hash() is salted per process: irreproducible
    h = make_problem(seed, T=p["T"], H=c["hidden"], I=c["intermediate"], E=c["num_experts"],
                     k=c["top_k"], Is=c.get("shared_intermediate", 0))
    if "scale" in p:  # large activations so that the clamp is active
        h["x"] = _bf16(h["x"].astype(np.float32) * p["scale"])
    check_case(name, cfg, h)


@pytest.mark.parametrize("k", range(1, 9))
def test_every_top_k_skewed_routing(k):
    cfg = mok.MoEConfig(hidden=256, intermediate=128, num_experts=12, top_k=k, shared_intermediate=128)
    rng = np.random.default_rng(100 + k)
    T = 517
    probs = np.r_[np.full(3, 0.25), np.zeros(3), np.full(6, 0.25 / 6)]    # experts 3..5 stay empty
    ids = np.stack([rng.choice(12, size=k, replace=False, p=probs) for _ in range(T)])   # k <= 9 nonzero probs
    h = make_problem(200 + k, T=T, H=256, I=128, E=12, k=k, Is=128, ids=ids)
    check_case(f"k{k}_skewed", cfg, h)


def test_every_token_on_expert_zero():
    cfg = mok.MoEConfig(hidden=256, intermediate=128, num_experts=8, top_k=1)
    h = make_problem(7, T=300, H=256, I=128, E=8, k=1, ids=np.zeros((300, 1)))
    check_case("all_on_expert0", cfg, h)


def test_duplicate_expert_in_a_token_sums():
    cfg = mok.MoEConfig(hidden=256, intermediate=128, num_experts=4, top_k=2)
    rng = np.random.default_rng(9)
    h = make_problem(9, T=200, H=256, I=128, E=4, k=2, ids=rng.integers(0, 2, size=(200, 2)))
    check_case("duplicates", cfg, h)


def test_zero_tokens():
    cfg = mok.MoEConfig(hidden=256, intermediate=128, num_experts=8, top_k=2, shared_intermediate=128)
    h = make_problem(10, T=0, H=256, I=128, E=8, k=2, Is=128)
    got, got_recomputed = run_gpu(cfg, h, T_max=64)
    assert got["out"].shape == (0, 256)
    for res in (got, got_recomputed):
        assert set(res) >= set(GRADS), sorted(res)
        assert res["dx"].shape == (0, 256) and res["d_topk_weights"].shape == (0, 2)
        for n, shape in (("dw_gate", (8, 128, 256)), ("dw_up", (8, 128, 256)), ("dw_down", (8, 256, 128)),
                         ("dws_gate", (128, 256)), ("dws_up", (128, 256)), ("dws_down", (256, 128))):
            # poisoned first (run_gpu): no token, so the kernels must write the zeros themselves
            assert res[n].shape == shape, (n, res[n].shape)
            assert np.array_equal(res[n], np.zeros_like(res[n])), n


def test_recompute_context_alone_into_caller_buffers():
    """Activation checkpointing: the forward's context is dropped, recompute_context (same
    arguments as forward) rebuilds it, and the backward writes caller-owned (poisoned) gradient
    buffers: the same bits as the forward's context into mok_rt's buffers; accumulate=True adds."""
    cfg = mok.MoEConfig(hidden=512, intermediate=256, num_experts=8, top_k=2, shared_intermediate=256)
    h = make_problem(14, T=300, H=512, I=256, E=8, k=2, Is=256)
    d = _to_dev(h)
    dw = mok.ExpertWeights(*(cp.full(d[n].shape, cp.nan, dtype=cp.float32) for n in ("w_gate", "w_up", "w_down")))
    dws = mok.ExpertWeights(*(cp.full(a.shape, cp.nan, dtype=cp.float32) for a in d["shared"]))
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=300, poison_outputs=True) as ws:
        sched = mok.schedule(ws, d["ids"])
        _, ctx = mok.forward(ws, sched, d["x"], d["tw"], _experts(d), shared=_shared(d))
        a = _flat(mok.backward(ws, ctx, d["d_out"]))
        a = {n: t.to_numpy() for n, t in a.items()}
        del ctx
        ctx2 = mok.recompute_context(ws, mok.schedule(ws, d["ids"]), d["x"], d["tw"], _experts(d),
                                     shared=_shared(d))
        g = mok.backward(ws, ctx2, d["d_out"], dw=dw, dw_shared=dws)
        assert g.dw is dw and g.dw_shared is dws
        ws.synchronize()
        b = {n: cp.asnumpy(t) if isinstance(t, cp.ndarray) else t.to_numpy() for n, t in _flat(g).items()}
        for n in GRADS:
            np.testing.assert_array_equal(a[n].view(np.uint8), b[n].view(np.uint8), err_msg=n)
        g = mok.backward(ws, ctx2, d["d_out"], dw=dw, dw_shared=dws, accumulate=True)
        ws.synchronize()
        for n, buf in zip(GRADS[2:], (*dw, *dws)):
            np.testing.assert_allclose(cp.asnumpy(buf), 2 * a[n], rtol=1e-5, atol=1e-6, err_msg=n)


@pytest.mark.parametrize("T,Is", [(300, 256), (1, 0), (1000, 0)])
def test_bf16_weight_gradients_are_the_fp32_ones_rounded(T, Is):
    """bf16 gradient buffers (poisoned) get the fp32 kernel's sums rounded once to nearest even:
    bitwise round_bf16(fp32 result), overwrite and accumulate (from the same start values), on
    ragged experts with empty ones (T=1) and with a shared expert."""
    cfg = mok.MoEConfig(hidden=512, intermediate=256, num_experts=8, top_k=2, shared_intermediate=Is)
    h = make_problem(21 + T, T=T, H=512, I=256, E=8, k=2, Is=Is)
    d = _to_dev(h)
    shapes = [d[n].shape for n in ("w_gate", "w_up", "w_down")] + ([a.shape for a in d["shared"]] if Is else [])
    rng = np.random.default_rng(T)
    start = [_bf16(rng.standard_normal(s)) for s in shapes]   # accumulate from bf16-exact values
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=T, poison_outputs=True) as ws:
        _, ctx = mok.forward(ws, mok.schedule(ws, d["ids"]), d["x"], d["tw"], _experts(d), shared=_shared(d))
        for accumulate in (False, True):
            f32 = [cp.asarray(a.astype(np.float32)) if accumulate else cp.full(a.shape, cp.nan, cp.float32)
                   for a in start]
            b16 = [cp.asarray(a if accumulate else np.full(a.shape, np.nan, BF16)) for a in start]
            parts = lambda bufs: dict(dw=mok.ExpertWeights(*bufs[:3]),  # noqa: E731
                                      dw_shared=mok.ExpertWeights(*bufs[3:]) if Is else None)
            g32 = mok.backward(ws, ctx, d["d_out"], accumulate=accumulate, **parts(f32))
            g16 = mok.backward(ws, ctx, d["d_out"], accumulate=accumulate, **parts(b16))
            ws.synchronize()
            np.testing.assert_array_equal(g16.dx.to_numpy().view(np.uint16), g32.dx.to_numpy().view(np.uint16))
            for i, (a, b) in enumerate(zip(f32, b16)):
                want = cp.asnumpy(a).astype(BF16)
                assert np.isfinite(want.astype(np.float32)).all()
                np.testing.assert_array_equal(cp.asnumpy(b).view(np.uint16), want.view(np.uint16),
                                              err_msg=f"gradient {i} accumulate={accumulate}")
        with pytest.raises(mok.ArgumentError, match="dw.down"):
            mok.backward(ws, ctx, d["d_out"], dw=mok.ExpertWeights(*b16[:2], f32[2]))


def run_steps(cfg, hs, *, T_max, poison=True) -> list[dict]:
    """Schedule, forward and backward of each problem of ``hs`` in turn on one workspace: the host
    results of each step.  Each step's tensors are dropped before the next, so its result blocks
    (and the scratch) are what the next step gets back, holding the previous step's values."""
    ds = [_to_dev(h) for h in hs]
    res = []
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=T_max, poison_outputs=poison) as ws:
        for d in ds:
            sched = mok.schedule(ws, d["ids"])
            out, ctx = mok.forward(ws, sched, d["x"], d["tw"], _experts(d), shared=_shared(d))
            g = mok.backward(ws, ctx, d["d_out"])
            ws.synchronize()
            res.append({"out": out.to_numpy(), **{n: t.to_numpy() for n, t in _flat(g).items() if t is not None}})
            del sched, out, ctx, g
    return res


@pytest.mark.parametrize("poison", [True, False], ids=["poisoned", "not_poisoned"])
def test_a_step_after_another_routing_and_token_count(poison):
    """Stale scratch / results: a workspace first runs a larger step (T = 900, every expert full,
    other weights, activations 8x larger), then a smaller ragged one with empty experts; the second
    step must match the float64 reference and be bitwise the same step on a fresh workspace.
    Without poisoning (as in training) anything the second step reads but did not write holds the
    first step's values; with it, NaN where the buffers are poisoned."""
    H, I, E, k, Is = 256, 192, 8, 3, 128
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k, shared_intermediate=Is)
    first = make_problem(31, T=900, H=H, I=I, E=E, k=k, Is=Is)
    first["x"] = _bf16(first["x"].astype(np.float32) * 8)
    rng = np.random.default_rng(32)
    probs = [0.4, 0.3, 0.0, 0.2, 0.0, 0.05, 0.05, 0.0]          # experts 2, 4 and 7 get no rows
    ids = np.stack([rng.choice(E, size=k, replace=False, p=probs) for _ in range(211)])
    h = make_problem(33, T=211, H=H, I=I, E=E, k=k, Is=Is, ids=ids)
    got = run_steps(cfg, [first, h], T_max=900, poison=poison)[1]
    ref = run_reference(cfg, h)
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    errs = {}
    for n, r in ref.items():
        assert got[n].shape == r.shape, n
        assert np.isfinite(got[n].astype(np.float64)).all(), f"{n} has NaN/inf (unwritten?)"
        errs[n] = rel_err(got[n], r)
    REPORT.append(f"second_step_poison={poison}: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    print(REPORT[-1])
    assert all(e <= TOL for e in errs.values()), errs
    for n in ("dw_gate", "dw_up", "dw_down"):   # the empty experts' gradients: zero, not stale
        assert not got[n][[2, 4, 7]].any(), n
    fresh = run_steps(cfg, [h], T_max=900, poison=poison)[0]
    for n in got:
        np.testing.assert_array_equal(got[n].view(np.uint8), fresh[n].view(np.uint8),
                                      err_msg=f"{n}: the second step differs from the same step on a fresh workspace")


def test_bitwise_deterministic():
    cfg = mok.MoEConfig(hidden=1024, intermediate=512, num_experts=16, top_k=4, shared_intermediate=512)
    h = make_problem(11, T=1500, H=1024, I=512, E=16, k=4, Is=512)
    a, _ = run_gpu(cfg, h)
    b, _ = run_gpu(cfg, h)
    for n in a:
        np.testing.assert_array_equal(a[n].view(np.uint8), b[n].view(np.uint8), err_msg=n)


# ---- bad input on the device path ---------------------------------------------------------------

@pytest.fixture
def small():
    cfg = mok.MoEConfig(hidden=256, intermediate=128, num_experts=8, top_k=2)
    h = make_problem(12, T=50, H=256, I=128, E=8, k=2)
    ws = mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=64, poison_outputs=True)
    yield ws, _to_dev(h), h
    ws.close()


def _fwd(ws, d, **over):
    q = dict(d)
    q.update(over)
    sched = mok.schedule(ws, q["ids"])
    return mok.forward(ws, sched, q["x"], q["tw"], _experts(q))


@pytest.mark.parametrize("field,make,arg", [
    ("x", lambda d, h: d["x"].astype(cp.float32), "x"),
    ("x", lambda d, h: cp.asarray(h["x"])[:, :128].copy(), "x"),
    ("x", lambda d, h: cp.asfortranarray(d["x"]), "x"),
    ("x", lambda d, h: h["x"], "x"),                                  # host memory, not the device
    ("tw", lambda d, h: d["tw"].astype(cp.float64), "topk_weights"),
    ("w_up", lambda d, h: d["w_up"][:, :, ::2], "experts.up"),       # strided view
    ("ids", lambda d, h: d["ids"].astype(cp.float32), "topk_ids"),
])
def test_bad_arguments_are_named(small, field, make, arg):
    ws, d, h = small
    with pytest.raises(mok.ArgumentError) as info:
        _fwd(ws, d, **{field: make(d, h)})
    assert info.value.argument == arg, str(info.value)


def test_ids_out_of_range_raise_after_sync(small):
    ws, d, h = small
    ids = d["ids"].copy()
    ids[17, 1] = 8
    _fwd(ws, d, ids=ids)
    with pytest.raises(mok.ExpertIdError, match="token 17"):
        ws.synchronize()
    # The workspace works again after the error was reported: a forward and backward (outputs
    # poisoned first, the fixture's poison_outputs) against the float64 reference.
    out, ctx = _fwd(ws, d)
    g = mok.backward(ws, ctx, d["d_out"])
    ws.synchronize()
    got = {"out": out.to_numpy(), **{n: t.to_numpy() for n, t in _flat(g).items() if t is not None}}
    ref = run_reference(ws.config, h)
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    for n, r in ref.items():
        assert got[n].shape == r.shape, n
        assert np.isfinite(got[n].astype(np.float64)).all(), f"{n} has NaN/inf (unwritten?)"
        assert rel_err(got[n], r) <= TOL, (n, rel_err(got[n], r))


def test_too_many_tokens(small):
    ws, d, _ = small
    with pytest.raises(mok.ArgumentError, match="max_tokens"):
        mok.schedule(ws, cp.zeros((65, 2), dtype=cp.int32))


def test_capacity_error_raises():
    cfg = mok.MoEConfig(hidden=256, intermediate=128, num_experts=8, top_k=2, capacity_factor=0.25)
    h = make_problem(13, T=4096, H=256, I=128, E=8, k=2, ids=np.zeros((4096, 2)))   # 8192 rows on expert 0
    d = _to_dev(h)
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=4096) as ws:
        assert ws.capacity_rows < 8192
        _fwd(ws, d)
        with pytest.raises(mok.CapacityError):
            ws.synchronize()


def teardown_module(module):
    print("\n".join(["", "relative Frobenius errors vs float64 reference:"] + REPORT))
