"""Engine "tma2" (experimental): the forward on clusters of two CTAs that take tasks in pairs and
share multicast weight tiles (cuda_src/moe/moe_layer_tma2.cu).  The arithmetic is "tma"'s -- the
same tiles, the same k order -- so every forward output and context buffer must be bitwise equal
to "tma"'s, at every case of the TMA tests, with few CTAs, context-only, T = 0, and it must report
the capacity error.  Timing lines: ENGINE tma|tma2 fwd <ms> (harness included, upper bounds)."""
from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

from mok_rt._moe_launch import KernelKnobs  # noqa: E402
from test_moe_kernel_gpu import CASES, Problem, _assert_bitwise_equal, _check_forward, _host_bf16  # noqa: E402
from test_moe_tma_gpu import FWD_NAMES, SHARED_FWD, TMA, TMA_CASES, _names  # noqa: E402

TMA2 = KernelKnobs(engine="tma2")


@pytest.fixture(scope="module")
def stream():
    cp.cuda.Device(0).use()
    cp.zeros(1).sum()
    return cp.cuda.Stream(non_blocking=True)


@pytest.mark.parametrize("case", sorted(TMA_CASES))
def test_tma2_forward_is_bitwise_tma(stream, case):
    pb = Problem(**TMA_CASES[case])
    want = pb.forward(stream, knobs=TMA)
    got = pb.forward(stream, knobs=TMA2)
    _check_forward(pb, got)
    _assert_bitwise_equal(want, got, _names(pb, FWD_NAMES, SHARED_FWD))
    again = pb.forward(stream, knobs=TMA2)
    _assert_bitwise_equal(got, again, _names(pb, FWD_NAMES, SHARED_FWD))


def test_tma2_few_ctas_and_context_only(stream):
    pb = Problem(**TMA_CASES["ragged"])
    full = pb.forward(stream, knobs=TMA)
    for n_ctas in (2, 3, 6):   # 3: rounded down to a whole cluster
        other = pb.forward(stream, knobs=KernelKnobs(engine="tma2", max_ctas=n_ctas))
        _assert_bitwise_equal(full, other, _names(pb, FWD_NAMES, SHARED_FWD))
    ctx_only = pb.forward(stream, context_only=True, knobs=TMA2)
    _assert_bitwise_equal(full, ctx_only, ["x_routed", "gu", "act", "y_slot", "sgu", "sact"])
    assert np.isnan(_host_bf16(ctx_only["out"])).all(), "context_only must not write out"


def test_tma2_zero_tokens_and_capacity_error(stream):
    pb = Problem(seed=5, tokens=0, hidden=128, inter=64, experts=2, top_k=2, shared_inter=64, limit=None)
    pb.forward(stream, knobs=TMA2)
    pb = Problem(**CASES["wide_k"])
    pb.dsched["num_blocks"][...] = pb.dims.max_blocks + 1
    with pytest.raises(AssertionError, match="device error word"):
        pb.forward(stream, knobs=TMA2)
    assert int(cp.asnumpy(pb.err)[0]) == 2   # kErrCapacity


def test_tma2_timing(stream):
    """ENGINE lines at a shape with several row blocks per expert (where pairs share B)."""
    pb = Problem(seed=21, tokens=4096, hidden=2048, inter=768, experts=16, top_k=8, shared_inter=0, limit=None)
    for name, knobs in (("tma", TMA), ("tma2", TMA2)):
        pb.forward(stream, knobs=knobs)
        t = []
        for _ in range(3):
            t0 = time.perf_counter()
            pb.forward(stream, knobs=knobs)
            t.append(time.perf_counter() - t0)
        print(f"ENGINE {name} fwd {1e3 * min(t):.2f} ms (upper bound)")
