"""The FP8 forward's staged gate|up kernel (moe_forward_fp8_staged: g, u stored through shared
memory by the signaler's TMA stores, cuda_src/moe/pipeline/staged_tile.cuh) on the shapes that
reach its edges, though the host chooses it only where H has >= 32 K blocks
(kernels/moe_fp8.STAGED_MIN_K_BLOCKS, lowered here for the test):

* against the FP8 oracle with the tolerances of tests/test_fp8_forward_gpu.py (check_case: out, the
  context's g, u, aq, y; determinism; recompute_context bit for bit);
* bitwise equal to the direct kernel on every output and context array (gu above all: its rows past
  T in the shared expert's tile, the padding rows of routed tiles, a tile with one sub-tile);
* EP = 2 (ranks sharing one GPU) bitwise equal to EP = 1 with it.

Every buffer is poisoned first (poison_outputs=True).  Each oracle test runs in a child process of
its own (tests/_gpu.run_isolated).  Run: ``python -m pytest -q tests/test_fp8_staged_gpu.py -s``.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from test_fp8_forward_gpu import CASES, _cfg, _isolated, check_case, make_problem  # noqa: E402

from mok_rt.kernels import moe_fp8 as M8  # noqa: E402

pytestmark = pytest.mark.gpu

ALWAYS, NEVER = 1, 10**9   # STAGED_MIN_K_BLOCKS: every shape staged / none


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


# T = 1; a ragged shared tile (T = 300: rows past T in the last token block); partial K / N blocks
# and a skipped sub-tile (I = 192); the SwiGLU clamp; a partial last K block of the staged gate|up
# tiles (H = 448); qwen3's H, I on 32 ragged experts.
@pytest.mark.parametrize("name", ["T1", "ragged_T300_shared", "odd64_blocks", "limit7", "h448_shared",
                                  "qwen3_dims_e32_T512"])
def test_staged_matches_the_oracle_and_the_direct_kernel_bitwise(request, monkeypatch, name):
    if _isolated(request):
        return
    p, c = CASES[name]
    h = make_problem(zlib.crc32(name.encode()) % 1000, **p)
    got = {}
    for label, m in (("direct", NEVER), ("staged", ALWAYS)):
        monkeypatch.setattr(M8, "STAGED_MIN_K_BLOCKS", m)
        got[label] = check_case(f"{name}_{label}", _cfg(h, p["k"], **c), h)
    a, b = got["direct"], got["staged"]
    np.testing.assert_array_equal(_bits(b["outs"][0]), _bits(a["outs"][0]), err_msg=f"{name}: out differs")
    assert a["ctx"].keys() == b["ctx"].keys()
    for n in a["ctx"]:
        np.testing.assert_array_equal(_bits(b["ctx"][n]), _bits(a["ctx"][n]), err_msg=f"{name}: context {n} differs")


def test_staged_with_skewed_and_empty_experts(request, monkeypatch):
    """Experts 3-5 empty, most rows on three experts (idle upper halves, whole padding tiles)."""
    if _isolated(request):
        return
    rng = np.random.default_rng(305)
    T, E, k = 389, 12, 5
    probs = np.r_[np.full(3, 0.25), np.zeros(3), np.full(6, 0.25 / 6)]
    ids = np.stack([rng.choice(E, size=k, replace=False, p=probs) for _ in range(T)])
    h = make_problem(405, T=T, H=256, I=192, E=E, k=k, Is=128, ids=ids)
    monkeypatch.setattr(M8, "STAGED_MIN_K_BLOCKS", ALWAYS)
    check_case("k5_skewed_staged", _cfg(h, k), h)


def test_staged_ep2_against_ep1(monkeypatch):
    from test_ep_gpu import check_ep_against_one_rank
    monkeypatch.setattr(M8, "STAGED_MIN_K_BLOCKS", ALWAYS)
    check_ep_against_one_rank("e6_shared_limit", [0, 0], precision="fp8_block")   # shared expert, clamp, T = 1000 / 37
