"""The "fp8_block" forward on the CUDA backend (moe_forward_fp8, mok.quantize_weights) against the
oracle's FP8 emulation (mok_rt.reference.forward(..., precision="fp8_block"), docs/SEMANTICS.md §10).

* the quantised weights: bitwise the oracle's quantize_experts (values and scales);
* the dispatch's quantisation of x (routed rows and, with a shared expert, token order): bitwise;
* ``out`` and the context's y: relative Frobenius error <= 5e-3 against the oracle's down GEMMs and
  combine fed with the kernel's own E4M3 a (aq, and saq with a shared expert), and <= 1e-2 end to
  end (check_case says why; FP8ERR lines print both);
* the context's g, u (bf16) within 5e-3 and aq within 2e-2 of the oracle's; recompute_context
  rebuilds the context bit for bit;
* every run repeats bit for bit (the backward: tests/test_fp8_backward_gpu.py).

Every buffer the kernels write is poisoned with NaN first (poison_outputs=True); results are
compared as bits wherever they are compared exactly.  Each test runs in a child process of its own
(tests/_gpu.run_isolated: a kernel fault then fails that test only; MOK_RT_GPU_ISOLATE=0 runs them
here).  Run: ``python -m pytest -q tests/test_fp8_forward_gpu.py -s`` (prints the measured errors,
FP8ERR).
"""
from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from _gpu import cp, run_isolated  # noqa: E402  (CuPy is imported when a test first uses it)

import mok_rt as mok  # noqa: E402
from mok_rt import reference  # noqa: E402
from mok_rt.reference import fp8 as _F  # noqa: E402
from mok_rt.reference.quantize import FP8_BLOCK, quantize_experts, quantize_fp8_block  # noqa: E402

BF16 = ml_dtypes.bfloat16
TOL_OUT = 5e-3    # out, y given the kernel's Q(a); g, u
TOL_E2E = 1e-2    # out, y end to end (see _downstream_reference)
REPORT: list[str] = []


def _bf16(a):
    return np.asarray(a).astype(BF16)


def make_problem(seed, *, T, H, I, E, k, Is=0, ids=None, x_scale=1.0):
    rng = np.random.default_rng(seed)
    h = {
        "x": _bf16(rng.standard_normal((T, H)) * x_scale),
        "tw": rng.random((T, k)).astype(np.float32),
        "w_gate": _bf16(rng.standard_normal((E, I, H)) * H ** -0.5),
        "w_up": _bf16(rng.standard_normal((E, I, H)) * H ** -0.5),
        "w_down": _bf16(rng.standard_normal((E, H, I)) * I ** -0.5),
    }
    if ids is None:
        ids = np.stack([rng.choice(E, size=k, replace=k > E) for _ in range(T)]) if T else np.zeros((0, k))
    h["ids"] = np.asarray(ids, dtype=np.int32)
    h["shared"] = (None, None, None)
    if Is:
        h["shared"] = (_bf16(rng.standard_normal((Is, H)) * H ** -0.5), _bf16(rng.standard_normal((Is, H)) * H ** -0.5),
                       _bf16(rng.standard_normal((H, Is)) * Is ** -0.5))
    return h


def _cfg(h, k, limit=None, **kw):
    E, I, H = h["w_gate"].shape
    Is = 0 if h["shared"][0] is None else h["shared"][0].shape[0]
    return mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k, shared_intermediate=Is,
                         swiglu_limit=limit, precision="fp8_block", **kw)


def _reference(cfg, h):
    f = lambda a: None if a is None else a.astype(np.float64)  # noqa: E731
    return reference.forward(f(h["x"]), h["ids"], h["tw"].astype(np.float64), f(h["w_gate"]), f(h["w_up"]),
                             f(h["w_down"]), ws_gate=f(h["shared"][0]), ws_up=f(h["shared"][1]),
                             ws_down=f(h["shared"][2]), swiglu_limit=cfg.swiglu_limit, precision="fp8_block")


def rel_err(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if b.size == 0:
        return 0.0
    n = np.linalg.norm(b)
    d = np.linalg.norm(a - b)
    return float(d / n) if n > 0 else float(d)


def _host(t):
    return t.to_numpy()


def _ctx_arrays(ctx, dims) -> dict:
    """The FP8 context's buffers (flat bytes) by name, as host arrays of their dtypes and shapes."""
    from mok_rt.kernels.moe_params_fp8 import FP8_FORWARD_BUFFERS
    table = {b.name: b for b in FP8_FORWARD_BUFFERS}
    dt = {"u8": np.uint8, "f32": np.float32, "bf16": BF16}
    out = {}
    for name, t in ctx.saved.bufs.items():
        b = table[name]
        raw = _host(t)
        out[name] = raw.view(dt[b.dtype]).reshape(b.shape(dims)) if raw.size else np.zeros(b.shape(dims), dt[b.dtype])
    return out


def _warm_up(ws, h, d_out=None) -> None:
    """A step of another problem ``h`` (same shapes) on ``ws`` first: schedule, quantize_weights,
    forward (and, given ``d_out``, backward); its results dropped, so that the next step gets its
    result blocks and scratch back holding this step's values (stale-scratch checks)."""
    d = {n: cp.asarray(v) for n, v in h.items() if n != "shared"}
    sh = None if h["shared"][0] is None else mok.ExpertWeights(*(cp.asarray(s) for s in h["shared"]))
    qw = mok.quantize_weights(ws, mok.ExpertWeights(d["w_gate"], d["w_up"], d["w_down"]), sh)
    out, ctx = mok.forward(ws, mok.schedule(ws, d["ids"]), d["x"], d["tw"], qw)
    g = None if d_out is None else mok.backward(ws, ctx, cp.asarray(d_out))
    ws.synchronize()
    assert np.isfinite(out.to_numpy().astype(np.float32)).all(), "the warm-up step's out"
    del out, ctx, g, qw


def stale_pair():
    """(first, second) problems for the stale-scratch tests: first T = 700 on every expert
    (uniform routing), activations 8x larger, other weights; second T = 211, ragged, experts 2, 4
    and 7 empty.  H = 320 and I = 192: partial K blocks, I an odd multiple of 64; a shared expert."""
    p = dict(H=320, I=192, E=8, k=3, Is=128)
    first = make_problem(41, T=700, x_scale=8.0, **p)
    rng = np.random.default_rng(42)
    probs = [0.4, 0.3, 0.0, 0.2, 0.0, 0.05, 0.05, 0.0]
    ids = np.stack([rng.choice(8, size=3, replace=False, p=probs) for _ in range(211)])
    return first, make_problem(43, T=211, ids=ids, **p)


def run_gpu(cfg, h, *, max_tokens=None, repeat=2, warm=None):
    """Runs of the CUDA FP8 forward: outs (repeat runs), the quantised weights, the context arrays of
    the first run and of a recompute, the schedule's row slots.  ``warm``: a problem whose forward
    runs on the workspace first (_warm_up)."""
    d = {n: cp.asarray(v) for n, v in h.items() if n != "shared"}
    sh = None if h["shared"][0] is None else mok.ExpertWeights(*(cp.asarray(s) for s in h["shared"]))
    ew = mok.ExpertWeights(d["w_gate"], d["w_up"], d["w_down"])
    T = len(h["x"])
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=max_tokens or max(1, T),
                       poison_outputs=True) as ws:
        if warm is not None:
            _warm_up(ws, warm)
        sched = mok.schedule(ws, d["ids"])
        qw = mok.quantize_weights(ws, ew, sh)
        runs = [mok.forward(ws, sched, d["x"], d["tw"], qw) for _ in range(repeat)]
        out_bf16_weights, _ = mok.forward(ws, sched, d["x"], d["tw"], ew, shared=sh)
        ctx_r = mok.recompute_context(ws, sched, d["x"], d["tw"], qw)
        ws.synchronize()
        dims = runs[0][1].saved.dims
        res = {
            "outs": [_host(o) for o, _ in runs],
            "out_bf16_weights": _host(out_bf16_weights),
            "qw": (qw.experts.to_numpy(), None if qw.shared is None else qw.shared.to_numpy()),
            "ctx": _ctx_arrays(runs[0][1], dims),
            "ctx_r": _ctx_arrays(ctx_r, dims),
            "row_slot": sched.to_numpy()["row_slot"],   # the used rows (their blocks' padding: -1)
            "dims": dims,
        }
    return res


def _check_weights(got, want, *, for_backward=True):
    """Bitwise: the forward copies, and (for_backward) the transposed input-gradient copies."""
    names = ("gate", "up", "down") + (("gate_t", "up_t", "down_t") if for_backward else ())
    assert ("gate_t" in got) == for_backward, sorted(got)
    for name in names:
        q = getattr(want, name)
        np.testing.assert_array_equal(got[name].view(np.uint8), q.values.view(np.uint8), err_msg=f"{name} values")
        np.testing.assert_array_equal(got[f"{name}_scale"].view(np.uint32), q.scales.astype(np.float32).view(np.uint32),
                                      err_msg=f"{name} scales")


def _check_xq(got, h, dims):
    """The dispatch's E4M3 rows and scales, bitwise: routed rows (padding zero) and token order."""
    k, T = dims.top_k, dims.tokens
    q = quantize_fp8_block(h["x"].astype(np.float32), (1, FP8_BLOCK))
    qv, qs = q.values.view(np.uint8), q.scales.astype(np.float32)
    slots = got["row_slot"]
    ctx = got["ctx"]
    rows = np.nonzero(slots >= 0)[0]
    tok = slots[rows] // k
    np.testing.assert_array_equal(ctx["xrq"][rows], qv[tok], err_msg="routed xq rows")
    np.testing.assert_array_equal(ctx["xrq_s"][:, rows].T.view(np.uint32), qs[tok].view(np.uint32),
                                  err_msg="routed xq scales")
    pad = np.nonzero(slots < 0)[0]   # padding rows of the used blocks
    assert not ctx["xrq"][pad].any() and not ctx["xrq_s"][:, pad].any(), "padding rows must be zero"
    if dims.shared_intermediate and T:
        np.testing.assert_array_equal(ctx["xq"][:T], qv, err_msg="token-order xq")
        np.testing.assert_array_equal(ctx["xq_s"][:, :T].T.view(np.uint32), qs.view(np.uint32), err_msg="xq scales")


def _deq_rows(q, s, rows):
    """float64 values of e4m3 rows `rows` of q [R, K] with their scales s [K/128, ld]."""
    v = q[rows].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    sc = np.repeat(s[:, rows].T.astype(np.float64), FP8_BLOCK, axis=1)[:, : v.shape[1]]
    return v * sc


def _downstream_reference(got, rctx, aq_rows):
    """The oracle's y [T, k, H] and out (reference.fp8's down GEMMs and combine, float64) fed with
    the kernel's own E4M3 a: aq_rows (the used rows' dequantised aq) and, with a shared expert, saq.
    Why: a is quantised from the fp32 result of an FP8 GEMM (whose tensor cores round inside each
    128-deep K block), the oracle's from a float64 one; where the two land on different sides of an
    E4M3 rounding midpoint (a fraction of a per cent of the elements, each then one E4M3 step = 6-12 %
    apart) the end-to-end difference reaches ~5e-3 with nothing wrong.  Given the same decisions,
    what follows must agree tightly: what is left is the bf16 stores of y and out and the down GEMMs'
    own rounding (~2e-3)."""
    d, ctx = got["dims"], got["ctx"]
    T, k = rctx.topk_ids.shape
    slots = got["row_slot"]
    rows = np.nonzero(slots >= 0)[0]
    aq = np.zeros((T * k, d.intermediate))
    aq[slots[rows]] = aq_rows
    saq = None
    if rctx._ws is not None and T:
        saq = _deq_rows(ctx["saq"], ctx["saq_s"], np.arange(T))
    return _F._down_and_combine(aq, rctx.topk_ids, rctx.topk_weights, rctx._w, saq, rctx._ws)


def check_case(name, cfg, h, **kw):
    got = run_gpu(cfg, h, **kw)
    ref_out, rctx = _reference(cfg, h)
    dims, k = got["dims"], cfg.top_k
    # quantize_weights: bitwise the oracle's quantize_experts.
    f = lambda a: a.astype(np.float32)  # noqa: E731
    _check_weights(got["qw"][0], quantize_experts(f(h["w_gate"]), f(h["w_up"]), f(h["w_down"]), "fp8_block"))
    if got["qw"][1] is not None:
        _check_weights(got["qw"][1], quantize_experts(*(f(s) for s in h["shared"]), "fp8_block"))
    _check_xq(got, h, dims)
    out = got["outs"][0]
    assert np.isfinite(out.astype(np.float64)).all(), f"{name}: out has NaN/inf (unwritten?)"
    err = rel_err(out, ref_out)
    # The context: y (bf16, per route), g / u (bf16) and aq of the routed rows.
    slots = got["row_slot"]
    rows = np.nonzero(slots >= 0)[0]
    r = slots[rows]
    I = dims.intermediate
    errs = {"out": err}
    if rows.size:
        gu = got["ctx"]["gu"][rows].astype(np.float64)
        errs["g"] = rel_err(gu[:, :I], rctx.g[r])
        errs["u"] = rel_err(gu[:, I:], rctx.u[r])
    aq_rows = _deq_rows(got["ctx"]["aq"], got["ctx"]["aq_s"], rows)
    y_gpu = got["ctx"]["y_slot"][: dims.tokens * k]
    y_d, out_d = _downstream_reference(got, rctx, aq_rows)
    stage = {"out": rel_err(out, out_d)}
    if rows.size:
        errs["aq"] = rel_err(aq_rows, rctx.aq[r])
        errs["y"] = rel_err(y_gpu, rctx.y.reshape(-1, dims.hidden))
        stage["y"] = rel_err(y_gpu, y_d.reshape(-1, dims.hidden))
    REPORT.append(f"FP8ERR {name}: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items())
                  + " | given the kernel's Q(a): " + " ".join(f"{n}={e:.2e}" for n, e in stage.items()))
    print(REPORT[-1])
    for n, e in stage.items():
        assert e <= TOL_OUT, f"{name}: {n} relative error {e:.3e} > {TOL_OUT} given the same Q(a)"
        assert errs[n] <= TOL_E2E, f"{name}: {n} relative error {errs[n]:.3e} > {TOL_E2E} end to end"
    for n in ("g", "u"):
        assert errs.get(n, 0.0) <= TOL_OUT, f"{name}: {n} relative error {errs[n]:.3e}"
    assert errs.get("aq", 0.0) <= 2e-2, f"{name}: aq relative error {errs['aq']:.3e}"   # E4M3 ties may flip
    # Determinism: every run, and the forward on bf16 weights (quantised inside), bit for bit;
    # recompute_context rebuilds the context bit for bit.
    for o in got["outs"][1:] + [got["out_bf16_weights"]]:
        np.testing.assert_array_equal(o.view(np.uint16), out.view(np.uint16), err_msg=f"{name}: runs differ")
    for n, a in got["ctx"].items():
        np.testing.assert_array_equal(got["ctx_r"][n].view(np.uint8), a.view(np.uint8),
                                      err_msg=f"{name}: recomputed context {n} differs")
    return got


CASES = {
    "T1": (dict(T=1, H=256, I=128, E=8, k=2), {}),
    "ragged_T300_shared": (dict(T=300, H=256, I=128, E=8, k=4, Is=128), {}),
    "odd64_blocks": (dict(T=517, H=320, I=192, E=6, k=3, Is=192), {}),   # partial K / N blocks, a skipped sub-tile
    "wide_T1000": (dict(T=1000, H=1024, I=512, E=16, k=4, Is=768), {}),
    "limit7": (dict(T=333, H=512, I=256, E=8, k=3, Is=256, x_scale=4.0), {"limit": 7.0}),
    # H = 3.5 K blocks (the last down tile 192 columns wide) and a shared expert larger in out than
    # the routed ones: where the end-to-end out error came nearest its bound (_downstream_reference).
    "h448_shared": (dict(T=250, H=448, I=192, E=6, k=3, Is=128), {}),
    # The model dimensions (K blocks, N tiles, I blocks as at full size), with fewer experts so that
    # the float64 oracle stays within seconds: qwen3-30b-a3b's H, I and top-8 on 32 experts (ragged:
    # ~128 rows an expert), deepseek-v3's H, I, top-8 and shared expert on 8 experts (every token on
    # every expert: 256 full rows each; the ragged and empty experts are the small cases' job).
    "qwen3_dims_e32_T512": (dict(T=512, H=2048, I=768, E=32, k=8), {}),
    "dsv3_dims_e8_T256_shared": (dict(T=256, H=7168, I=2048, E=8, k=8, Is=2048), {}),
}


def _isolated(request) -> bool:
    """True when the test ran in a child process (its FP8ERR lines are kept for test_report)."""
    lines = run_isolated(request)
    if lines is None:
        return False
    REPORT.extend(lines)
    return True


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_fp8_oracle(request, name):
    if _isolated(request):
        return
    p, c = CASES[name]
    h = make_problem(zlib.crc32(name.encode()) % 1000, **p)   # str hash() is salted per process
    check_case(name, _cfg(h, p["k"], **c), h)


@pytest.mark.parametrize("k", range(1, 9))
def test_every_top_k_skewed_and_empty_experts(request, k):
    if _isolated(request):
        return
    rng = np.random.default_rng(300 + k)
    T, E = 389, 12
    probs = np.r_[np.full(3, 0.25), np.zeros(3), np.full(6, 0.25 / 6)]    # experts 3..5 stay empty
    ids = np.stack([rng.choice(E, size=k, replace=False, p=probs) for _ in range(T)])
    h = make_problem(400 + k, T=T, H=256, I=192, E=E, k=k, Is=128 if k % 2 else 0, ids=ids)
    check_case(f"k{k}_skewed", _cfg(h, k), h)


def test_every_token_on_one_expert_and_duplicate_routes(request):
    if _isolated(request):
        return
    ids = np.zeros((300, 2), dtype=np.int32)      # both routes of every token on expert 0
    h = make_problem(7, T=300, H=256, I=128, E=4, k=2, ids=ids)
    check_case("all_on_expert0_dup", _cfg(h, 2), h)


@pytest.mark.parametrize("Is", [128, 0])
def test_zero_tokens(request, Is):
    if _isolated(request):
        return
    # T = 0, with and without a shared expert: a zero-size out (forward and recompute_context run);
    # then, on the same workspace and quantised weights, a T = 16 forward against the FP8 oracle.
    h = make_problem(8, T=0, H=256, I=128, E=4, k=2, Is=Is)
    cfg = _cfg(h, 2)
    d = {n: cp.asarray(v) for n, v in h.items() if n != "shared"}
    sh = mok.ExpertWeights(*(cp.asarray(s) for s in h["shared"])) if Is else None
    h16 = make_problem(18, T=16, H=256, I=128, E=4, k=2, Is=Is)
    d16 = {n: cp.asarray(h16[n]) for n in ("x", "ids", "tw")}
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=16, poison_outputs=True) as ws:
        sched = mok.schedule(ws, d["ids"])
        qw = mok.quantize_weights(ws, mok.ExpertWeights(d["w_gate"], d["w_up"], d["w_down"]), sh)
        out, ctx = mok.forward(ws, sched, d["x"], d["tw"], qw)
        ctx_r = mok.recompute_context(ws, sched, d["x"], d["tw"], qw)
        ws.synchronize()
        assert out.to_numpy().shape == (0, 256)
        assert ctx.saved.dims.tokens == 0 and ctx_r.saved.dims.tokens == 0
        del ctx, ctx_r
        # The same workspace and weights (h's) on T = 16 tokens: the FP8 oracle on h16's tokens.
        out16, _ = mok.forward(ws, mok.schedule(ws, d16["ids"]), d16["x"], d16["tw"], qw)
        ws.synchronize()
        got16 = out16.to_numpy()
    h16.update({n: h[n] for n in ("w_gate", "w_up", "w_down", "shared")})
    want16, _ = _reference(cfg, h16)
    assert got16.shape == (16, 256) and np.isfinite(got16.astype(np.float64)).all()
    assert rel_err(got16, want16) <= TOL_E2E, rel_err(got16, want16)


def test_a_step_after_another_routing_and_token_count(request):
    if _isolated(request):
        return
    # Stale scratch: a T = 700 forward with other routing, weights and larger activations runs on
    # the workspace first; check_case then holds the T = 211 step to the oracle, its padding rows
    # to zero (_check_xq) and its context bitwise to a recompute.
    first, h = stale_pair()
    check_case("after_T700", _cfg(h, 3), h, warm=first, max_tokens=700)


def test_fewer_tokens_than_the_workspace_holds(request):
    if _isolated(request):
        return
    h = make_problem(9, T=77, H=256, I=128, E=8, k=4, Is=128)
    check_case("T77_of_512", _cfg(h, 4), h, max_tokens=512)


def test_special_weight_blocks_quantise_bitwise(request):
    if _isolated(request):
        return
    # Zero, tiny (flushed), huge and inf blocks in the weights: quantize_weights as the oracle
    # (NaN scales for the inf block); the forward is not compared (inf weights give NaN outputs).
    h = make_problem(10, T=4, H=256, I=256, E=2, k=1)
    w = h["w_gate"].astype(np.float32)
    w[0, :128, :128] = 0.0
    w[0, 128:, :128] *= 1e-38
    w[1, :128, 128:] *= 1e30
    w[1, 128:, 128:] = 1.0
    w[1, 200, 200] = np.inf
    h["w_gate"] = _bf16(w)
    cfg = _cfg(h, 1)
    d = {n: cp.asarray(v) for n, v in h.items() if n != "shared"}
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=4) as ws:
        qw = mok.quantize_weights(ws, mok.ExpertWeights(d["w_gate"], d["w_up"], d["w_down"]))
        ws.synchronize()
        got = qw.experts.to_numpy()
    f = lambda a: a.astype(np.float32)  # noqa: E731
    _check_weights(got, quantize_experts(f(h["w_gate"]), f(h["w_up"]), f(h["w_down"]), "fp8_block"))


def test_quantize_weights_transposed_copies_bitwise(request):
    if _isolated(request):
        return
    # The input-gradient copies ([E, H, I], [E, H, I], [E, I, H] and the shared expert's) against the
    # oracle's gate_t / up_t / down_t, with partial blocks on both axes (H = 320, I = 192) and special
    # blocks; then for_backward=False: the forward copies alone, the same bytes.
    h = make_problem(12, T=4, H=320, I=192, E=3, k=1, Is=192)
    w = h["w_down"].astype(np.float32)                  # [E, H, I]: a partial block on both axes
    w[0, 256:, 128:] = 0.0
    w[1, :128, 128:] *= 1e-38
    w[2, 256:, :128] *= 1e30
    w[2, 300, 150] = np.nan
    h["w_down"] = _bf16(w)
    cfg = _cfg(h, 1)
    d = {n: cp.asarray(v) for n, v in h.items() if n != "shared"}
    sh = mok.ExpertWeights(*(cp.asarray(s) for s in h["shared"]))
    ew = mok.ExpertWeights(d["w_gate"], d["w_up"], d["w_down"])
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=4) as ws:
        qw = mok.quantize_weights(ws, ew, sh)
        qf = mok.quantize_weights(ws, ew, sh, for_backward=False)
        ws.synchronize()
        got = (qw.experts.to_numpy(), qw.shared.to_numpy())
        got_f = (qf.experts.to_numpy(), qf.shared.to_numpy())
        # The transposed copy alone (q == nullptr): what the backward will quantise after a forward
        # that quantised bf16 master weights for itself.
        from mok_rt.kernels import fp8_quantize as Q8
        shape = tuple(d["w_down"].shape)
        qt = cp.full(Q8.transposed_shape(shape), 0xAA, dtype=cp.uint8)
        st = cp.full(Q8.scale_shape(Q8.transposed_shape(shape)), -1.0, dtype=cp.float32)
        s = cp.cuda.Stream(non_blocking=True)
        Q8.launch_quantize([(d["w_down"].data.ptr, shape, 0, 0, qt.data.ptr, st.data.ptr)], stream=s.ptr,
                           device_id=cp.cuda.Device().id)
        s.synchronize()
        only_t = {"down_t": qt.get(), "down_t_scale": st.get()}
    f = lambda a: a.astype(np.float32)  # noqa: E731
    want = (quantize_experts(f(h["w_gate"]), f(h["w_up"]), f(h["w_down"]), "fp8_block"),
            quantize_experts(*(f(s) for s in h["shared"]), "fp8_block"))
    for g, gf, wq in zip(got, got_f, want):
        _check_weights(g, wq)
        _check_weights(gf, wq, for_backward=False)
    np.testing.assert_array_equal(only_t["down_t"], want[0].down_t.values.view(np.uint8))
    np.testing.assert_array_equal(only_t["down_t_scale"].view(np.uint32),
                                  want[0].down_t.scales.astype(np.float32).view(np.uint32))


def test_report():
    print("\n".join(REPORT))
