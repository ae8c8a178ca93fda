"""The TMA + wgmma megakernels (cuda_src/moe/moe_layer.cu) against the float64 reference, through
the same harness as tests/test_moe_kernel_gpu.py (NaN-poisoned outputs, fresh random inputs,
bitwise determinism): gate|up tiles of 128 columns with a half-empty last one, 256-wide N tiles
past H and I, the dX map switch at k = I, MN-major wgrads with K not a multiple of 64, one and
three CTAs.  Prints a TIMING line (ms per launch) at a mid-size shape.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from _gpu import cp  # noqa: E402  (CuPy is imported when a test first uses it)

from mok_rt.kernels.moe_launch import KernelKnobs  # noqa: E402
from test_moe_kernel_gpu import (CASES, TOL, Problem, _assert_bitwise_equal, _check_backward,  # noqa: E402
                                 _check_forward, _host_bf16, _rel_err)

TMA = KernelKnobs()
FWD_NAMES = ["out", "x_routed", "gu", "act", "y_slot"]
BWD_NAMES = ["dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down"]
SHARED_FWD = ["sgu", "sact"]
SHARED_BWD = ["dws_gate", "dws_up", "dws_down"]

TMA_CASES = dict(CASES)
TMA_CASES.update({
    # I = 192: gate|up tiles of 128 + 64 columns, dA tile 192 of 256; H = 320: N tiles 256 + 64;
    # shared I_s = 320 (gate|up 128, 128, 64; dX switch at k = 320).
    "ragged": dict(seed=11, tokens=389, hidden=320, inter=192, experts=7, top_k=4, shared_inter=320, limit=None),
    # Many row blocks per expert (wgrad K of several hundred rows), clamp on.
    "deep_k": dict(seed=12, tokens=1024, hidden=512, inter=384, experts=4, top_k=2, shared_inter=128, limit=1.0),
    # Token blocks for every split of the combines (combine_parts: 32 up to 8 blocks — the cases
    # above —, 16 from 16, 4 from 64, 2 from 128, 1 from 256).
    "blocks_20": dict(seed=16, tokens=2500, hidden=256, inter=128, experts=6, top_k=3, shared_inter=128, limit=None),
    "blocks_64": dict(seed=13, tokens=8100, hidden=128, inter=64, experts=3, top_k=1, shared_inter=64, limit=None),
    "blocks_128": dict(seed=14, tokens=16384, hidden=128, inter=64, experts=5, top_k=2, shared_inter=0, limit=None),
    "blocks_257": dict(seed=17, tokens=32773, hidden=128, inter=64, experts=3, top_k=1, shared_inter=0, limit=None),
    # Wide rows for the ring-staged copies (staged_rows.cuh): the dispatch moves 5 rows of 8320 B per
    # stage (26 stages a block, the last of 3 rows) and d_topk_weights reads each token in two column
    # pieces (2560 + 1600: the k + 1 = 9 rows of a piece fill one 48 KB stage).
    "wide_h": dict(seed=15, tokens=300, hidden=4160, inter=128, experts=4, top_k=8, shared_inter=0, limit=None),
})


@pytest.fixture(scope="module")
def stream():
    cp.cuda.Device(0).use()
    cp.zeros(1).sum()
    return cp.cuda.Stream(non_blocking=True)


def _names(pb, base, shared):
    return base + (shared if pb.Is else [])


@pytest.mark.parametrize("case", sorted(TMA_CASES))
def test_tma_matches_reference_and_is_deterministic(stream, case):
    pb = Problem(**TMA_CASES[case])
    fwd = pb.forward(stream, knobs=TMA)
    _check_forward(pb, fwd)
    bwd = pb.backward(stream, fwd, knobs=TMA)
    _check_backward(pb, bwd)
    fwd2 = pb.forward(stream, knobs=TMA)
    _assert_bitwise_equal(fwd, fwd2, _names(pb, FWD_NAMES, SHARED_FWD))
    bwd2 = pb.backward(stream, fwd2, knobs=TMA)
    _assert_bitwise_equal(bwd, bwd2, _names(pb, BWD_NAMES, SHARED_BWD))


def test_tma_few_ctas_context_only_and_accumulate(stream):
    pb = Problem(**TMA_CASES["ragged"])
    full = pb.forward(stream, knobs=TMA)
    for n_ctas in (1, 3):
        other = pb.forward(stream, knobs=KernelKnobs(max_ctas=n_ctas))
        _assert_bitwise_equal(full, other, _names(pb, FWD_NAMES, SHARED_FWD))
    bwd = pb.backward(stream, full, knobs=TMA)
    one = pb.backward(stream, full, knobs=KernelKnobs(max_ctas=1))
    _assert_bitwise_equal(bwd, one, _names(pb, BWD_NAMES, SHARED_BWD))

    ctx_only = pb.forward(stream, context_only=True, knobs=TMA)
    _assert_bitwise_equal(full, ctx_only, ["x_routed", "gu", "act", "y_slot", "sgu", "sact"])
    assert np.isnan(_host_bf16(ctx_only["out"])).all(), "context_only must not write out"

    rng = np.random.default_rng(7)
    names = ["dw_gate", "dw_up", "dw_down"] + SHARED_BWD
    prefill = {n: rng.standard_normal(bwd[n].shape).astype(np.float32) for n in names}
    acc = pb.backward(stream, full, accumulate=True, prefill=prefill, knobs=TMA)
    for n in names:
        assert np.array_equal(cp.asnumpy(acc[n]), prefill[n] + cp.asnumpy(bwd[n])), n


def test_tma_zero_tokens_and_capacity_error(stream):
    pb = Problem(seed=5, tokens=0, hidden=128, inter=64, experts=2, top_k=2, shared_inter=64, limit=None)
    bwd = pb.backward(stream, pb.forward(stream, knobs=TMA), knobs=TMA)
    for n in ["dw_gate", "dw_up", "dw_down"] + SHARED_BWD:
        assert not cp.asnumpy(bwd[n]).any(), n
    pb = Problem(**CASES["wide_k"])
    pb.dsched["num_blocks"][...] = pb.dims.max_blocks + 1
    with pytest.raises(AssertionError, match="device error word"):
        pb.forward(stream, knobs=TMA)
    assert int(cp.asnumpy(pb.err)[0]) == 2   # kErrCapacity


def test_timing(stream):
    """TIMING fwd <ms> bwd <ms>: a mid-size shape (qwen3-like widths, fewer tokens)."""
    pb = Problem(seed=21, tokens=2048, hidden=2048, inter=768, experts=16, top_k=8, shared_inter=0, limit=None)
    for knobs in (TMA,):
        fwd = pb.forward(stream, knobs=knobs)
        bwd = pb.backward(stream, fwd, knobs=knobs)
        _check_backward(pb, bwd)
        t_f, t_b = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            fwd = pb.forward(stream, knobs=knobs)
            t1 = time.perf_counter()
            pb.backward(stream, fwd, knobs=knobs)
            t2 = time.perf_counter()
            t_f.append(t1 - t0)
            t_b.append(t2 - t1)
        # Includes buffer allocation and NaN poisoning (the harness's), so an upper bound.
        print(f"TIMING fwd {1e3 * min(t_f):.2f} ms bwd {1e3 * min(t_b):.2f} ms (upper bounds)")
