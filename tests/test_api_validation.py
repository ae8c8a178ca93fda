"""Host-side validation of the public API on the reference backend (any machine): arguments that
used to be coerced, truncated or silently accepted raise ArgumentError naming the argument, and
mok_rt's exceptions survive pickling (a worker process's error reaching its pool)."""
from __future__ import annotations

import copy
import enum
import pickle
from types import SimpleNamespace

import numpy as np
import pytest

import mok_rt as mok
from mok_rt import errors
from mok_rt.api.workspace import from_handle, handle_of

T, H, I, E, K, IS = 8, 64, 64, 4, 2, 64
SHAPES = {"gate": (E, I, H), "up": (E, I, H), "down": (E, H, I)}
SHARED_SHAPES = {"gate": (IS, H), "up": (IS, H), "down": (H, IS)}


def _cfg(**kw) -> mok.MoEConfig:
    base = dict(hidden=H, intermediate=I, num_experts=E, top_k=K)
    base.update(kw)
    return mok.MoEConfig(**base)


def _ws(**kw) -> mok.Workspace:
    opts = {n: kw.pop(n) for n in ("strict", "poison_outputs", "trace", "stream") if n in kw}
    return mok.Workspace(_cfg(**kw), max_tokens=16, backend="reference", **opts)


def _weights(rng, shapes) -> mok.ExpertWeights:
    return mok.ExpertWeights(*(rng.standard_normal(shapes[p]) * 0.1 for p in ("gate", "up", "down")))


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    return SimpleNamespace(x=rng.standard_normal((T, H)), ids=ids, tw=rng.random((T, K)),
                           experts=_weights(rng, SHAPES), shared=_weights(rng, SHARED_SHAPES),
                           d_out=rng.standard_normal((T, H)))


def _raises(argument: str, fn, *args, **kw) -> mok.ArgumentError:
    """Call ``fn``; assert it raises ArgumentError for ``argument``, named in the message too."""
    with pytest.raises(mok.ArgumentError) as info:
        fn(*args, **kw)
    assert info.value.argument == argument, str(info.value)
    assert str(info.value).startswith(f"{argument}: "), str(info.value)
    return info.value


# --------------------------------------------------------------------------- 1: exceptions pickle
class _Result(enum.IntEnum):   # stands in for a cuda.bindings CUresult (module level: picklable)
    CUDA_ERROR_OUT_OF_MEMORY = 2


_ERRORS = [
    mok.MokError("plain"),
    mok.ArgumentError("x", "bad"),
    mok.CudaDriverError("cuMemAlloc", _Result.CUDA_ERROR_OUT_OF_MEMORY, "asked for 1 TiB"),
    mok.CudaDriverError("cuInit", None),
    mok.NoCubinError("no cubin for sm_70"),
    mok.DeviceError("device said no", code=9, info=(1, 2)),
    mok.ExpertIdError("expert 7 of 4", code=1, info=(3, 7)),
    mok.CapacityError("rank 0 got 900 rows", code=2, info=(0, 900, 640)),
    mok.TokenCountError("rank 1 sent 99 tokens", code=3, info=(1, 99)),
    mok.PeerTimeoutError("rank 1 timed out waiting for rank 0", code=4, info=(1, 0, 2), rank=0),
]


def test_every_exception_class_is_covered():
    assert {type(e).__name__ for e in _ERRORS} == set(errors.__all__)


@pytest.mark.parametrize("err", _ERRORS, ids=lambda e: type(e).__name__ + ":" + str(e)[:12])
@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
def test_exceptions_round_trip(err, how):
    back = {"pickle": lambda e: pickle.loads(pickle.dumps(e)), "copy": copy.copy, "deepcopy": copy.deepcopy}[how](err)
    assert type(back) is type(err) and back is not err
    assert str(back) == str(err) and back.args == err.args
    assert vars(back) == vars(err)   # every attribute (argument, call, result, code, info, rank)


def test_argument_error_from_a_worker_keeps_its_argument():
    back = pickle.loads(pickle.dumps(mok.ArgumentError("topk_ids", "out of range"), protocol=2))
    assert isinstance(back, ValueError) and back.argument == "topk_ids" and str(back) == "topk_ids: out of range"


# --------------------------------------------------------------------------- 2, 3: MoEConfig
@pytest.mark.parametrize("cf", [float("inf"), float("-inf"), float("nan"), 0.0, -1.0, True, "2"])
def test_capacity_factor_must_be_finite_and_positive(cf):
    _raises("capacity_factor", _cfg, capacity_factor=cf)


def test_huge_capacity_factor_does_not_overflow():
    cfg = _cfg(capacity_factor=1e308)
    worst = _cfg().capacity_rows(max_tokens=2**40, num_ranks=2)
    assert cfg.capacity_rows(max_tokens=2**40, num_ranks=2) == worst   # no OverflowError: the worst case
    with mok.Workspace(cfg, max_tokens=16, backend="reference") as ws, _ws() as plain:
        assert ws.capacity_rows == plain.capacity_rows
    # A small factor still limits the rows.
    assert _cfg(capacity_factor=0.5).capacity_rows(max_tokens=1024, num_ranks=4) < worst


@pytest.mark.parametrize("field, value", [
    ("block_m", 128.0), ("block_m", np.float64(128.0)), ("ctas_per_sm", True), ("ctas_per_sm", 1.0),
    ("ctas_per_sm", np.bool_(True)), ("comm_sms", 32.0), ("comm_sms", True), ("hidden", 64.0), ("hidden", True),
    ("intermediate", "64"), ("num_experts", 4.0), ("top_k", 2.0), ("shared_intermediate", 64.0),
    ("shared_intermediate", False),
])
def test_config_int_fields_reject_bools_and_floats(field, value):
    _raises(field, _cfg, **{field: value})


def test_config_takes_numpy_ints_as_plain_ints():
    cfg = _cfg(hidden=np.int64(H), num_experts=np.int32(E), top_k=np.int16(K), shared_intermediate=np.int64(IS),
               block_m=np.int64(128), ctas_per_sm=np.int32(2), comm_sms=np.uint8(16))
    assert cfg == _cfg(shared_intermediate=IS, ctas_per_sm=2, comm_sms=16)
    assert all(type(getattr(cfg, f)) is int for f in ("hidden", "num_experts", "top_k", "shared_intermediate",
                                                       "block_m", "ctas_per_sm", "comm_sms"))


# --------------------------------------------------------------------------- 4: groups and ranks
@pytest.mark.parametrize("group", [
    SimpleNamespace(devices=[]),
    SimpleNamespace(devices=[0], local_ranks=[1]),
    SimpleNamespace(devices=[0, 0], local_ranks=[-1]),
    SimpleNamespace(devices=[0, 0], local_ranks=[0, 0]),
    SimpleNamespace(devices=[0], local_ranks=[]),
    SimpleNamespace(devices=[0], local_ranks=[0.0]),
    SimpleNamespace(devices=["a"]),
    SimpleNamespace(devices=[0.5]),
    SimpleNamespace(devices=[True]),
    SimpleNamespace(devices=[-1]),
    SimpleNamespace(devices=0),
    SimpleNamespace(devices="0"),
    SimpleNamespace(device_id="0"),
    SimpleNamespace(device_id=1.5),
    SimpleNamespace(device_id=-1),
], ids=repr)
def test_duck_typed_group_is_checked(group):
    _raises("group", mok.Workspace, _cfg(), group, max_tokens=8, backend="reference")


def test_duck_typed_group_of_one_rank_works():
    for group in (SimpleNamespace(devices=[np.int64(0)]), SimpleNamespace(devices=(0,), local_ranks=(0,)),
                  SimpleNamespace(device_id=0)):
        with mok.Workspace(_cfg(), group, max_tokens=8, backend="reference") as ws:
            assert ws.num_ranks == 1 and ws.local_ranks == (0,) and ws.device_id == 0


@pytest.mark.parametrize("n", [0, -2, 1.0, True, None])
def test_experts_per_rank_needs_a_positive_int(n):
    _raises("num_ranks", _cfg().experts_per_rank, n)


def test_experts_per_rank_of_numpy_int():
    assert _cfg().experts_per_rank(np.int64(2)) == 2 and type(_cfg().experts_per_rank(np.int64(2))) is int
    _raises("num_experts", _cfg().experts_per_rank, 3)


# --------------------------------------------------------------------------- 5: QuantizedWeights.shared
def _fp8_call(qw_of, call="forward"):
    """Run ``call`` with ``qw_of(qw, ws)`` in place of correctly quantised weights."""
    p = _inputs()
    cfg_kw = dict(shared_intermediate=IS, precision="fp8_block")
    with _ws(**cfg_kw) as ws:
        qw = mok.quantize_weights(ws, p.experts, p.shared)
        sched = mok.schedule(ws, p.ids)
        fn = mok.forward if call == "forward" else mok.recompute_context
        return fn(ws, sched, p.x, p.tw, qw_of(qw, ws))


@pytest.mark.parametrize("call", ["forward", "recompute_context"])
def test_quantized_weights_without_the_shared_expert_are_refused(call):
    err = _raises("experts", _fp8_call, lambda qw, ws: mok.QuantizedWeights(qw.precision, qw.shapes, qw.experts, None),
                  call)
    assert "shared" in str(err)


def test_quantized_shared_expert_type_is_checked():
    junk = lambda qw, ws: mok.QuantizedWeights(qw.precision, qw.shapes, qw.experts, "junk")  # noqa: E731
    err = _raises("experts", _fp8_call, junk)
    assert "shared" in str(err) and "str" in str(err)
    _fp8_call(lambda qw, ws: qw)   # the real thing passes


def test_quantized_weights_with_a_shared_expert_the_config_lacks_are_refused():
    p = _inputs()
    with _ws(shared_intermediate=IS, precision="fp8_block") as ws_s, _ws(precision="fp8_block") as ws:
        with_shared = mok.quantize_weights(ws_s, p.experts, p.shared)
        qw = mok.QuantizedWeights("fp8_block", (with_shared.shapes[0], None), with_shared.experts, with_shared.shared)
        sched = mok.schedule(ws, p.ids)
        err = _raises("experts", mok.forward, ws, sched, p.x, p.tw, qw)
        assert "shared" in str(err)


# --------------------------------------------------------------------------- 6: bool options
_NOT_BOOLS = ["False", 0, 1, 0.0, None, np.array(True)]


@pytest.mark.parametrize("value", _NOT_BOOLS, ids=repr)
def test_backward_accumulate_must_be_a_bool(value):
    p = _inputs()
    bufs = [np.ones(SHAPES[n], np.float32) for n in ("gate", "up", "down")]
    with _ws() as ws:
        _, ctx = mok.forward(ws, mok.schedule(ws, p.ids), p.x, p.tw, p.experts)
        _raises("accumulate", mok.backward, ws, ctx, p.d_out, dw=mok.ExpertWeights(*bufs), accumulate=value)
    assert all((b == 1).all() for b in bufs)   # refused before anything was written


def test_backward_accumulate_takes_a_numpy_bool():
    p = _inputs()
    bufs = [np.ones(SHAPES[n], np.float32) for n in ("gate", "up", "down")]
    with _ws() as ws:
        _, ctx = mok.forward(ws, mok.schedule(ws, p.ids), p.x, p.tw, p.experts)
        g = mok.backward(ws, ctx, p.d_out)
        mok.backward(ws, ctx, p.d_out, dw=mok.ExpertWeights(*bufs), accumulate=np.bool_(True))
    np.testing.assert_allclose(bufs[2], 1 + g.dw.down.to_numpy(), rtol=1e-6)


@pytest.mark.parametrize("option", ["strict", "poison_outputs", "trace"])
@pytest.mark.parametrize("value", ["no", 1, None], ids=repr)
def test_workspace_flags_must_be_bools(option, value):
    _raises(option, _ws, **{option: value})


def test_workspace_flags_take_numpy_bools():
    with _ws(strict=np.bool_(True), poison_outputs=np.bool_(False), trace=False) as ws:
        assert ws.strict is True and ws.poison_outputs is False and ws.trace is False


@pytest.mark.parametrize("value", ["no", 0, None], ids=repr)
def test_quantize_for_backward_must_be_a_bool(value):
    p = _inputs()
    with _ws(precision="fp8_block") as ws:
        _raises("for_backward", mok.quantize_weights, ws, p.experts, for_backward=value)


# --------------------------------------------------------------------------- 7: stream on the reference
class _ForeignStream:
    def __cuda_stream__(self):
        return (0, 1234)


@pytest.mark.parametrize("stream", ["garbage", True, 1.5, object()], ids=repr)
def test_reference_backend_checks_the_stream(stream):
    p = _inputs()
    _raises("stream", _ws, stream=stream)
    with _ws() as ws:
        _raises("stream", mok.schedule, ws, p.ids, stream=stream)
        sched = mok.schedule(ws, p.ids)
        _raises("stream", mok.forward, ws, sched, p.x, p.tw, p.experts, stream=stream)
        _raises("stream", mok.recompute_context, ws, sched, p.x, p.tw, p.experts, stream=stream)
        _, ctx = mok.forward(ws, sched, p.x, p.tw, p.experts)
        _raises("stream", mok.backward, ws, ctx, p.d_out, stream=stream)
    with _ws(precision="fp8_block") as ws:
        _raises("stream", mok.quantize_weights, ws, p.experts, stream=stream)


def test_reference_backend_accepts_and_ignores_stream_likes():
    p = _inputs()
    with _ws(stream=_ForeignStream()) as ws:
        for stream in (None, 0, 7, _ForeignStream()):
            sched = mok.schedule(ws, p.ids, stream=stream)
            out, ctx = mok.forward(ws, sched, p.x, p.tw, p.experts, stream=stream)
            mok.backward(ws, ctx, p.d_out, stream=stream)


# --------------------------------------------------------------------------- 8: handles
@pytest.mark.parametrize("bad", [lambda h: h + 0.9, lambda h: float(h), lambda h: str(h), lambda h: "abc",
                                 lambda h: None, lambda h: True, lambda h: [h]],
                         ids=["plus_0.9", "float", "str", "abc", "None", "True", "list"])
def test_from_handle_takes_only_ints(bad):
    with _ws() as ws:
        _raises("handle", from_handle, bad(ws._handle))


def test_from_handle_of_int_and_numpy_int():
    with _ws() as ws:
        h = ws._handle
        assert from_handle(h) is ws and from_handle(np.int64(h)) is ws
        assert handle_of(np.int64(h)) == h and type(handle_of(np.int64(h))) is int
        _raises("handle", from_handle, 10**12)   # an int naming no workspace


# --------------------------------------------------------------------------- 9: aliased gradient buffers
def _backward_into(dw=None, dw_shared=None, *, shared=False, accumulate=False):
    p = _inputs()
    with _ws(shared_intermediate=IS if shared else 0) as ws:
        sched = mok.schedule(ws, p.ids)
        _, ctx = mok.forward(ws, sched, p.x, p.tw, p.experts, shared=p.shared if shared else None)
        return mok.backward(ws, ctx, p.d_out, dw=dw, dw_shared=dw_shared, accumulate=accumulate)


def _zeros(shapes, part):
    return np.zeros(shapes[part], np.float32)


@pytest.mark.parametrize("accumulate", [False, True])
def test_the_same_buffer_twice_is_refused(accumulate):
    buf = _zeros(SHAPES, "gate")
    err = _raises("dw.up", _backward_into, mok.ExpertWeights(buf, buf, _zeros(SHAPES, "down")), accumulate=accumulate)
    assert "dw.gate" in str(err)
    assert not buf.any()


def test_partially_overlapping_buffers_are_refused():
    n = E * I * H
    flat = np.zeros(2 * n + n // 2, np.float32)
    gate = flat[:n].reshape(SHAPES["gate"])
    up = flat[n // 2:n // 2 + n].reshape(SHAPES["up"])          # its first half is gate's second half
    down = flat[n // 2 + n:].reshape(SHAPES["down"])
    err = _raises("dw.up", _backward_into, mok.ExpertWeights(gate, up, down))
    assert "dw.gate" in str(err)


def test_overlap_across_routed_and_shared_buffers_is_refused():
    dw = mok.ExpertWeights(*(_zeros(SHAPES, n) for n in ("gate", "up", "down")))
    flat = dw.down.reshape(-1)
    shared_gate = flat[:IS * H].reshape(SHARED_SHAPES["gate"])   # inside dw.down
    dws = mok.ExpertWeights(shared_gate, _zeros(SHARED_SHAPES, "up"), _zeros(SHARED_SHAPES, "down"))
    err = _raises("dw_shared.gate", _backward_into, dw, dws, shared=True)
    assert "dw.down" in str(err)


def test_adjacent_buffers_of_one_allocation_are_fine():
    n = E * I * H
    flat = np.zeros(3 * n, np.float32)
    dw = mok.ExpertWeights(*(flat[i * n:(i + 1) * n].reshape(SHAPES[p]) for i, p in enumerate(("gate", "up", "down"))))
    g = _backward_into(dw)
    ref = _backward_into()
    for part in ("gate", "up", "down"):
        np.testing.assert_allclose(getattr(g.dw, part), getattr(ref.dw, part).to_numpy(), rtol=1e-6)
