"""The reference backend behaves like the CUDA backend where it matters to callers: errors the
device reports surface at synchronize()/check(), and strict=True takes the CUDA dtypes only.
Also the argument checks both backends share."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import mok_rt as mok

BF16 = ml_dtypes.bfloat16
E, H, I, K, T = 4, 64, 64, 2, 16


def _ws(**kw):
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K)
    return mok.Workspace(cfg, max_tokens=64, backend="reference", **kw)


_API_NAMES = {"w_gate": "experts.gate", "w_up": "experts.up", "w_down": "experts.down", "dw_gate": "dw.gate"}


def _dw(gate):
    """Gradient buffers with the given gate buffer (the other two fresh fp32 zeros)."""
    return mok.ExpertWeights(gate, np.zeros((E, I, H), np.float32), np.zeros((E, H, I), np.float32))


def _inputs(dtype=BF16, tw_dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        x=rng.standard_normal((T, H)).astype(dtype),
        ids=np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32),
        tw=rng.random((T, K)).astype(tw_dtype),
        w=[(rng.standard_normal(s) * 0.1).astype(dtype) for s in ((E, I, H), (E, I, H), (E, H, I))],
    )


# ----------------------------------------------------------------------------- deferred errors
@pytest.mark.parametrize("wait", ["synchronize", "check"])
def test_expert_id_error_surfaces_at_synchronize(wait):
    p = _inputs()
    p["ids"][3, 1] = E + 2
    with _ws() as ws:
        sched = mok.schedule(ws, p["ids"])   # does not raise, as on the device
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], mok.ExpertWeights(*p["w"]))
        g = mok.backward(ws, ctx, out)
        assert out.shape == (T, H) and np.isnan(out.to_numpy().astype(np.float32)).all()
        assert g.dx.shape == (T, H) and g.dw.gate.shape == (E, I, H)
        with pytest.raises(mok.ExpertIdError, match="token 3") as info:
            getattr(ws, wait)()
        assert info.value.info == (0, 3, E + 2)
        ws.synchronize()   # read and cleared, like the device's error word
        # The workspace stays usable.
        sched = mok.schedule(ws, _inputs()["ids"])
        out, _ = mok.forward(ws, sched, p["x"], p["tw"], mok.ExpertWeights(*p["w"]))
        ws.synchronize()
        assert np.isfinite(out.to_numpy().astype(np.float32)).all()


def test_first_error_wins_until_synchronize():
    with _ws() as ws:
        a = _inputs()["ids"]
        a[1, 0] = -1
        b = _inputs()["ids"]
        b[7, 1] = E
        mok.schedule(ws, a)
        mok.schedule(ws, b)
        with pytest.raises(mok.ExpertIdError, match="token 1"):
            ws.synchronize()
        ws.check()


def test_backward_into_caller_buffers_on_a_failed_schedule():
    p = _inputs()
    p["ids"][0, 0] = 99
    buf = np.zeros((E, I, H), np.float32)
    with _ws() as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], mok.ExpertWeights(*p["w"]))
        g = mok.backward(ws, ctx, out, dw=_dw(buf))
        assert g.dw.gate is buf and np.isnan(buf).all()
        with pytest.raises(mok.ExpertIdError):
            ws.synchronize()


# ----------------------------------------------------------------------------- strict
def test_default_reference_accepts_float32_and_float64():
    for dtype in (np.float32, np.float64):
        p = _inputs(dtype=dtype, tw_dtype=np.float64)
        with _ws() as ws:
            sched = mok.schedule(ws, p["ids"])
            out, _ = mok.forward(ws, sched, p["x"], p["tw"], mok.ExpertWeights(*p["w"]))
            ws.synchronize()
            assert out.dtype == dtype


def test_strict_reference_runs_what_cuda_runs():
    p = _inputs()
    buf = np.zeros((E, I, H), np.float32)
    with _ws(strict=True) as ws:
        assert ws.strict
        for ids in (p["ids"], p["ids"].astype(np.int64)):
            sched = mok.schedule(ws, ids)
            out, ctx = mok.forward(ws, sched, p["x"], p["tw"], mok.ExpertWeights(*p["w"]))
            g = mok.backward(ws, ctx, out, dw=_dw(buf))
            ws.synchronize()
            assert out.dtype == BF16 and g.dw.gate is buf


@pytest.mark.parametrize("arg", ["x", "w_gate", "w_up", "w_down", "topk_weights", "d_out",
                                 "dw_gate"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_strict_reference_rejects_what_cuda_rejects(arg, dtype):
    p = _inputs()
    if arg == "topk_weights" and dtype == np.float32:
        pytest.skip("fp32 topk_weights are the CUDA contract")
    x, tw, (wg, wu, wd) = p["x"], p["tw"], p["w"]
    wide = {"x": lambda: x.astype(dtype), "w_gate": lambda: wg.astype(dtype),
            "w_up": lambda: wu.astype(dtype), "w_down": lambda: wd.astype(dtype),
            "topk_weights": lambda: tw.astype(dtype)}
    with _ws(strict=True) as ws:
        sched = mok.schedule(ws, p["ids"])
        args = dict(x=x, topk_weights=tw, w_gate=wg, w_up=wu, w_down=wd)
        if arg in wide:
            args[arg] = wide[arg]()
            with pytest.raises(mok.ArgumentError) as info:
                mok.forward(ws, sched, args["x"], args["topk_weights"],
                            mok.ExpertWeights(args["w_gate"], args["w_up"], args["w_down"]))
        else:
            out, ctx = mok.forward(ws, sched, x, tw, mok.ExpertWeights(wg, wu, wd))
            d_out = out.to_numpy()
            kw = {}
            if arg == "d_out":
                d_out = d_out.astype(dtype)
            elif dtype == np.float32:
                pytest.skip("fp32 gradient buffers are the CUDA contract")
            else:
                kw["dw"] = _dw(np.zeros((E, I, H), dtype))
            with pytest.raises(mok.ArgumentError) as info:
                mok.backward(ws, ctx, d_out, **kw)
    assert info.value.argument == _API_NAMES.get(arg, arg), str(info.value)


def test_strict_is_keyword_only_and_off_by_default():
    with _ws() as ws:
        assert ws.strict is False
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K)
    with pytest.raises(TypeError):
        mok.Workspace(cfg, None, 64, "reference", None, False, False, True)  # noqa


# ----------------------------------------------------------------------------- validation
def test_read_only_gradient_buffer_is_an_argument_error():
    p = _inputs()
    buf = np.zeros((E, I, H), np.float32)
    buf.flags.writeable = False
    with _ws() as ws:
        sched = mok.schedule(ws, p["ids"])
        out, ctx = mok.forward(ws, sched, p["x"], p["tw"], mok.ExpertWeights(*p["w"]))
        with pytest.raises(mok.ArgumentError, match="read-only") as info:
            mok.backward(ws, ctx, out, dw=_dw(buf))
    assert info.value.argument == "dw.gate"


@pytest.mark.parametrize("dtype", [np.uint32, np.float32, np.complex64])
def test_ids_dtype_error_lists_only_int32_int64(dtype):
    ids = _inputs()["ids"].astype(dtype)
    with _ws() as ws, pytest.raises(mok.ArgumentError) as info:
        mok.schedule(ws, ids)
    msg = str(info.value)
    assert info.value.argument == "topk_ids"
    assert "int32" in msg and "int64" in msg
    assert "float" not in msg.replace(np.dtype(dtype).name, "") and "bfloat16" not in msg


@pytest.mark.parametrize("E_, k", [(8, 9), (16, 9), (4, 0)])
def test_top_k_range(E_, k):
    with pytest.raises(mok.ArgumentError, match=r"top_k must be 1\.\.8|positive") as info:
        mok.MoEConfig(hidden=64, intermediate=64, num_experts=E_, top_k=k)
    assert info.value.argument == "top_k"
    assert mok.MoEConfig(hidden=64, intermediate=64, num_experts=8, top_k=8).top_k == 8
    # A token may name one expert twice: top_k above the expert count is a valid layer.
    assert mok.MoEConfig(hidden=64, intermediate=64, num_experts=4, top_k=8).top_k == 8


def test_reference_workspace_repr_says_cpu():
    with _ws() as ws:
        r = repr(ws)
    assert "backend='reference'" in r and "0:cpu" in r and "cuda" not in r
