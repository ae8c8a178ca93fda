"""Direct GPU test of the fused MoE kernels (cuda_src/moe/moe_layer.cu) through mok_rt.kernels.moe_launch.

Buffers are CuPy arrays (bf16 held as raw uint16 bits), the schedule comes from the NumPy twin
(mok_rt.reference.schedule) and the oracle is the float64 NumPy reference (mok_rt.reference).  Every
output is poisoned with NaN before a launch, so an element the kernels fail to write fails the
comparison; every result must also be bitwise identical over two runs.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from _gpu import cp  # noqa: E402  (CuPy is imported when a test first uses it)

from mok_rt import reference  # noqa: E402
from mok_rt.kernels.moe_launch import (BackwardBuffers, ForwardBuffers, KernelKnobs, LayerDims,  # noqa: E402
                                ScheduleBuffers, backward_buffer_bytes, forward_buffer_bytes, launch_backward,
                                launch_forward)
from mok_rt.kernels.moe_params import BLOCK_M  # noqa: E402
from mok_rt.reference.schedule import schedule_reference  # noqa: E402

BF16 = ml_dtypes.bfloat16
BF16_NAN = 0x7FC0
TOL = 1e-2
# Clamp limits that are bf16 values themselves: the hardest case for the backward, which
# recomputes the clamp masks from the bf16-saved pre-activations (the forward rounds those so
# that they stay on the fp32 value's side of the clamp; plain rounding would flip ~0.1% of the
# masks here and miss the tolerance by several times).
LIMIT = 1.0
LIMIT_SHARED = 0.75


# ---- host <-> device helpers ------------------------------------------------------------------

def _dev_bf16(a: np.ndarray):
    return cp.asarray(np.ascontiguousarray(a.astype(BF16)).view(np.uint16))


def _host_bf16(a) -> np.ndarray:
    return cp.asnumpy(a).view(BF16).astype(np.float64)


def _empty_bf16(shape):
    return cp.full(shape, BF16_NAN, dtype=cp.uint16)  # poisoned: NaN until written


def _empty_f32(shape):
    return cp.full(shape, np.nan, dtype=cp.float32)


def _ptr(a) -> int:
    return int(a.data.ptr) if a is not None and a.size else 0


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    want = np.asarray(want, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape
    ref = np.linalg.norm(want)
    diff = np.linalg.norm(got - want)
    if not np.isfinite(diff):
        return float("inf")
    return float(diff / ref) if ref > 0 else float(diff)


# ---- problem ----------------------------------------------------------------------------------

class Problem:
    """Random inputs (bf16-representable), their reference results and device copies."""

    def __init__(self, *, seed, tokens, hidden, inter, experts, top_k, shared_inter, limit, extra_blocks=2):
        rng = np.random.default_rng(seed)
        T, H, I, E, k, Is = tokens, hidden, inter, experts, top_k, shared_inter
        self.T, self.H, self.I, self.E, self.k, self.Is, self.limit = T, H, I, E, k, Is, limit
        self.x = rng.standard_normal((T, H)).astype(BF16)
        ids = rng.integers(0, E, size=(T, k))
        if E > 2:
            ids[ids == E - 1] = 0      # the last expert receives nothing: zero weight gradients
        if T > 0 and k > 1:
            ids[0, 1] = ids[0, 0]      # a duplicated route: both contributions add up
        self.ids = ids.astype(np.int32)
        self.weights = rng.random((T, k)).astype(np.float32)
        sh, si = 1.0 / np.sqrt(H), 1.0 / np.sqrt(I)
        self.w_gate = (rng.standard_normal((E, I, H)) * sh).astype(BF16)
        self.w_up = (rng.standard_normal((E, I, H)) * sh).astype(BF16)
        self.w_down = (rng.standard_normal((E, H, I)) * si).astype(BF16)
        if Is:
            self.ws_gate = (rng.standard_normal((Is, H)) * sh).astype(BF16)
            self.ws_up = (rng.standard_normal((Is, H)) * sh).astype(BF16)
            self.ws_down = (rng.standard_normal((H, Is)) / np.sqrt(Is)).astype(BF16)
        else:
            self.ws_gate = self.ws_up = self.ws_down = None
        self.d_out = rng.standard_normal((T, H)).astype(BF16)

        self.sched = schedule_reference([self.ids], num_experts=E, num_ranks=1, block_m=BLOCK_M, rank=0)
        assert self.sched.block_m == BLOCK_M
        # Capacity above what the routing needs: the extra row blocks must be skipped on the device.
        self.capacity = int(self.sched.num_rows) + extra_blocks * BLOCK_M
        self.dims = LayerDims(tokens=T, hidden=H, intermediate=I, top_k=k, local_experts=E,
                              capacity_rows=self.capacity, shared_intermediate=Is, swiglu_limit=limit)

        self.out_ref, self.ctx_ref = reference.forward(
            self.x, self.ids, self.weights, self.w_gate, self.w_up, self.w_down,
            ws_gate=self.ws_gate, ws_up=self.ws_up, ws_down=self.ws_down, swiglu_limit=limit)
        self.grads_ref = reference.backward(self.ctx_ref, self.d_out)
        self._upload()

    def _upload(self):
        s, d = self.sched, self.dims
        mb, rows = d.max_blocks, d.capacity_rows
        block_expert = np.zeros(max(mb, 1), np.int32)
        block_expert[: s.num_blocks] = s.block_expert
        row_slot = np.full(max(rows, 1), -1, np.int32)
        row_slot[: s.num_rows] = s.row_slot
        row_src = np.full(max(rows, 1), -1, np.int32)
        row_src[: s.num_rows] = s.row_src_rank
        self.dsched = {
            "expert_count": cp.asarray(np.asarray(s.expert_count, np.int32)),
            "expert_offset": cp.asarray(np.asarray(s.expert_offset, np.int32)),
            "num_blocks": cp.asarray(np.array([s.num_blocks], np.int32)),
            "block_expert": cp.asarray(block_expert),
            "row_src_rank": cp.asarray(row_src),
            "row_slot": cp.asarray(row_slot),
            "route_row": cp.asarray(np.asarray(s.route_row, np.int32).reshape(-1)),
        }
        self.sched_bufs = ScheduleBuffers(**{n: _ptr(a) for n, a in self.dsched.items()})
        self.dx_in = _dev_bf16(self.x)
        self.dweights = cp.asarray(self.weights)
        self.dw = {n: _dev_bf16(getattr(self, n)) for n in ("w_gate", "w_up", "w_down")}
        if self.Is:
            self.dw.update({n: _dev_bf16(getattr(self, n)) for n in ("ws_gate", "ws_up", "ws_down")})
        self.dd_out = _dev_bf16(self.d_out)
        self.err = cp.zeros(4, dtype=cp.int32)

    def check_error_word(self):
        code = cp.asnumpy(self.err)
        assert not code.any(), f"device error word set: {code.tolist()}"

    # ---- forward ----
    def new_forward_buffers(self):
        T, H, I, Is, k, R = self.T, self.H, self.I, self.Is, self.k, self.capacity
        sizes = forward_buffer_bytes(self.dims)
        b = {
            "x_routed": _empty_bf16((R, H)), "gu": _empty_bf16((R, 2 * I)), "act": _empty_bf16((R, I)),
            "y_slot": _empty_bf16((T * k, H)), "out": _empty_bf16((T, H)),
            "counters": cp.full(sizes["counters"] // 4, -7, dtype=cp.int32),  # the launch must zero them
        }
        if Is:
            b.update(sgu=_empty_bf16((T, 2 * Is)), sact=_empty_bf16((T, Is)), shared_y=_empty_f32((T, H)))
        for name, arr in b.items():
            assert arr.nbytes == sizes[name], name
        return b

    def forward(self, stream, *, context_only=False, knobs=KernelKnobs()):
        b = self.new_forward_buffers()
        ptrs = {n: _ptr(a) for n, a in b.items()}
        ptrs.update({_KERNEL_NAMES.get(n, n): _ptr(a) for n, a in self.dw.items()})
        bufs = ForwardBuffers(x=_ptr(self.dx_in), topk_weights=_ptr(self.dweights), **ptrs)
        stream.synchronize()
        cp.cuda.Device().synchronize()
        launch_forward(bufs, self.sched_bufs, self.dims, stream=stream.ptr, err_ptr=_ptr(self.err),
                       device_id=cp.cuda.Device().id, knobs=knobs, context_only=context_only)
        stream.synchronize()
        self.check_error_word()
        return b

    # ---- backward ----
    def new_backward_buffers(self, fwd, *, prefill=None):
        T, H, I, Is, k, R, E = self.T, self.H, self.I, self.Is, self.k, self.capacity, self.E
        sizes = backward_buffer_bytes(self.dims)
        b = {
            "dx": _empty_bf16((T, H)), "d_topk_weights": _empty_f32((T, k)),
            "dw_gate": _empty_f32((E, I, H)), "dw_up": _empty_f32((E, I, H)), "dw_down": _empty_f32((E, H, I)),
            "dy_routed": _empty_bf16((R, H)), "dgu": _empty_bf16((R, 2 * I)), "dx_slot": _empty_bf16((T * k, H)),
            "counters": cp.full(sizes["counters"] // 4, -7, dtype=cp.int32),
        }
        if Is:
            b.update(dws_gate=_empty_f32((Is, H)), dws_up=_empty_f32((Is, H)), dws_down=_empty_f32((H, Is)),
                     dsgu=_empty_bf16((T, 2 * Is)), dx_shared=_empty_f32((T, H)))
        for name, arr in b.items():
            assert arr.nbytes == sizes[_KERNEL_NAMES.get(name, name)], name
        if prefill is not None:
            for name, arr in prefill.items():
                b[name][...] = cp.asarray(arr)
        return b

    def backward(self, stream, fwd, *, accumulate=False, prefill=None, knobs=KernelKnobs()):
        b = self.new_backward_buffers(fwd, prefill=prefill)
        ptrs = {_KERNEL_NAMES.get(n, n): _ptr(a) for n, a in b.items()}
        ptrs.update({_KERNEL_NAMES.get(n, n): _ptr(a) for n, a in self.dw.items()})
        ctx = {n: _ptr(fwd[n]) for n in ("x_routed", "gu", "act", "y_slot")}
        if self.Is:
            ctx.update(sgu=_ptr(fwd["sgu"]), sact=_ptr(fwd["sact"]))
        bufs = BackwardBuffers(d_out=_ptr(self.dd_out), x=_ptr(self.dx_in), topk_weights=_ptr(self.dweights),
                               **ctx, **ptrs)
        stream.synchronize()
        cp.cuda.Device().synchronize()
        launch_backward(bufs, self.sched_bufs, self.dims, stream=stream.ptr, err_ptr=_ptr(self.err),
                        device_id=cp.cuda.Device().id, knobs=knobs, accumulate=accumulate)
        stream.synchronize()
        self.check_error_word()
        return b


# The reference's names (mok_rt.reference) -> the kernels' buffer names (_moe_params.BACKWARD_BUFFERS).
_KERNEL_NAMES = {"ws_gate": "shared_gate", "ws_up": "shared_up", "ws_down": "shared_down",
                 "dws_gate": "d_shared_gate", "dws_up": "d_shared_up", "dws_down": "d_shared_down"}
_GRAD_F32 = ("d_topk_weights", "dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")


def _check_forward(pb: Problem, fwd):
    assert _rel_err(_host_bf16(fwd["out"]), pb.out_ref) <= TOL
    # Context: y_slot holds the unweighted expert output of each route.
    y_ref = pb.ctx_ref.y.reshape(pb.T * pb.k, pb.H)
    assert _rel_err(_host_bf16(fwd["y_slot"]), y_ref) <= TOL
    # Padding rows of x_routed are zero; used rows are the token rows.
    s = pb.sched
    xr = _host_bf16(fwd["x_routed"])[: s.num_rows]
    slot = np.asarray(s.row_slot)
    assert np.array_equal(xr[slot < 0], np.zeros_like(xr[slot < 0]))
    assert np.array_equal(xr[slot >= 0], pb.x.astype(np.float64)[slot[slot >= 0] // pb.k])
    if pb.Is:
        assert _rel_err(_host_bf16(fwd["sact"]), pb.ctx_ref.shared_a) <= TOL


def _check_backward(pb: Problem, bwd):
    g = pb.grads_ref
    assert _rel_err(_host_bf16(bwd["dx"]), g.dx) <= TOL, "dx"
    for name in _GRAD_F32:
        want = getattr(g, name)
        if want is None:
            continue
        err = _rel_err(cp.asnumpy(bwd[name]), want)
        assert err <= TOL, f"{name}: relative error {err:.3g}"


def _assert_bitwise_equal(a: dict, b: dict, names):
    for n in names:
        assert cp.asnumpy(a[n]).tobytes() == cp.asnumpy(b[n]).tobytes(), f"{n} differs between two runs"


# ---- tests ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stream():
    cp.cuda.Device(0).use()
    cp.zeros(1).sum()  # make the device's primary context current on this thread
    return cp.cuda.Stream(non_blocking=True)


CASES = {
    # T not a tile multiple, H with a half-width last N tile, I with a half-width dA tile, shared expert.
    "shared": dict(seed=1, tokens=300, hidden=320, inter=192, experts=5, top_k=3, shared_inter=128, limit=None),
    # swiglu clamp, no shared expert, skewed small experts.
    "limit": dict(seed=2, tokens=257, hidden=192, inter=320, experts=6, top_k=2, shared_inter=0, limit=LIMIT),
    # clamp with a shared expert whose width (64) is half a tile; k = 1.
    "limit_shared": dict(seed=3, tokens=130, hidden=256, inter=64, experts=3, top_k=1, shared_inter=64,
                         limit=LIMIT_SHARED),
    # many routes per token, several row blocks per expert.
    "wide_k": dict(seed=4, tokens=200, hidden=128, inter=128, experts=4, top_k=8, shared_inter=192, limit=None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_backward_match_reference(stream, case):
    pb = Problem(**CASES[case])
    fwd = pb.forward(stream)
    _check_forward(pb, fwd)
    bwd = pb.backward(stream, fwd)
    _check_backward(pb, bwd)

    # Bitwise determinism: the same inputs give the same bits.
    fwd2 = pb.forward(stream)
    fnames = ["out", "x_routed", "gu", "act", "y_slot"] + (["sgu", "sact"] if pb.Is else [])
    _assert_bitwise_equal(fwd, fwd2, fnames)
    bwd2 = pb.backward(stream, fwd2)
    bnames = ["dx", "dw_gate", "dw_up", "dw_down", "d_topk_weights"] + (
        ["dws_gate", "dws_up", "dws_down"] if pb.Is else [])
    _assert_bitwise_equal(bwd, bwd2, bnames)


def test_few_ctas_and_context_only(stream):
    """One and three CTAs give the same bits (no co-residency needed); context_only skips out."""
    pb = Problem(**CASES["shared"])
    full = pb.forward(stream)
    one = pb.forward(stream, knobs=KernelKnobs(max_ctas=1))
    three = pb.forward(stream, knobs=KernelKnobs(max_ctas=3))
    names = ["out", "x_routed", "gu", "act", "y_slot", "sgu", "sact"]
    _assert_bitwise_equal(full, one, names)
    _assert_bitwise_equal(full, three, names)
    bwd_full = pb.backward(stream, full)
    bwd_one = pb.backward(stream, full, knobs=KernelKnobs(max_ctas=1))
    _assert_bitwise_equal(bwd_full, bwd_one, ["dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down",
                                              "dws_gate", "dws_up", "dws_down"])

    ctx_only = pb.forward(stream, context_only=True)
    _assert_bitwise_equal(full, ctx_only, ["x_routed", "gu", "act", "y_slot", "sgu", "sact"])
    assert np.isnan(_host_bf16(ctx_only["out"])).all(), "context_only must not write out"


def test_accumulate_adds_into_weight_gradients(stream):
    pb = Problem(**CASES["shared"])
    fwd = pb.forward(stream)
    fresh = pb.backward(stream, fwd)
    rng = np.random.default_rng(7)
    names = ["dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down"]
    prefill = {n: rng.standard_normal(fresh[n].shape).astype(np.float32) for n in names}
    acc = pb.backward(stream, fwd, accumulate=True, prefill=prefill)
    for n in names:
        want = prefill[n] + cp.asnumpy(fresh[n])   # one fp32 add per element, as on the device
        assert np.array_equal(cp.asnumpy(acc[n]), want), n
    # The untouched expert (no routes) kept the caller's values exactly.
    assert int(pb.sched.expert_count[pb.E - 1]) == 0
    assert np.array_equal(cp.asnumpy(acc["dw_gate"])[pb.E - 1], prefill["dw_gate"][pb.E - 1])
    _assert_bitwise_equal(fresh, acc, ["dx", "d_topk_weights"])


def test_zero_tokens(stream):
    """T = 0: nothing routed; weight gradients are written as zeros."""
    pb = Problem(seed=5, tokens=0, hidden=128, inter=64, experts=2, top_k=2, shared_inter=64, limit=None)
    fwd = pb.forward(stream)
    bwd = pb.backward(stream, fwd)
    for n in ("dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down"):
        assert not cp.asnumpy(bwd[n]).any(), n
        assert np.isfinite(cp.asnumpy(bwd[n])).all(), n


def test_capacity_overflow_sets_error_word(stream):
    """A schedule with more row blocks than the capacity is reported, not used."""
    pb = Problem(**CASES["wide_k"])
    pb.dsched["num_blocks"][...] = pb.dims.max_blocks + 1
    with pytest.raises(AssertionError, match="device error word"):
        pb.forward(stream)
    assert int(cp.asnumpy(pb.err)[0]) == 2   # kErrCapacity
