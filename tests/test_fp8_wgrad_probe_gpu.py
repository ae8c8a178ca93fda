"""GPU test and timing of the FP8 weight-gradient GEMM probe (1D-1D scales; issue 18's speed half).

Kernels fp8_gemm_probe_1d1d and fp8_gemm_probe_1d1d_overlap (tests/cuda/fp8_wgrad_probe.cuh,
compiled into the fp8_gemm_probe.cu cubin): the fp8_gemm_probe engine with a B scale per
(group, K block, column), s_b [G, KB, N], next to the A scale per (row, K block):

    C[r, n] = sum_kb fp32(s_a[kb, r] * s_b[g, kb, n]) * (A[r, kb-block] . B[g][n, kb-block])

* test_wgrad_exact_bitwise: operands on which no step rounds (integers |q| <= 4, power-of-two
  scales -- fp8_probe_host.exact_problem's recipe, with per-column B scales), uneven groups with an
  empty one, rows, N and K off the tile grid: bitwise against float64, rows past the groups stay
  NaN (poison), the same bits from every launch, from 1 / 3 / all CTAs and from both schedules.
* test_wgrad_column_scale: one column's B scale 1024x in every K block, another's 64x in one K
  block only: those columns (exactly) and every other column (unchanged) against the oracle.
* test_wgrad_random: Gaussian E4M3 operands and random positive scales, fp32 C, relative Frobenius
  error <= TOL_GEMM (2e-4; measured 1.25e-4, and 2.1e-4 on uniformly random bytes).  Not 1e-5: Hopper's FP8 MMA does not keep a full fp32 sum inside a K
  block (see test_fp8_gemm_probe_gpu.py's docstring), so that is not a property of the hardware on
  general data; the exact tests above are the bit-level check of the scale handling.
* test_fp8_wgrad_timing prints "FP8WGRAD <kernel> <shape> <ms> <TFLOP/s>" for both 1D-1D kernels
  and for the existing 1D-2D fp8_gemm_probe at the same shape (B scales per 128 x 128 block), so
  the cost of the per-column promotion shows; test_bf16_wgrad_timing prints
  "BF16WGRAD <kernel>_<shape> <ms> <TFLOP/s>" through the bf16 probe (tests/cuda/gemm_probe.cu,
  K-major A and B).  Median of 20 launches after 3 warm-ups, bf16 C, a sampled float64 check.

Wgrad shapes: groups = experts; per group M output rows, N output columns, K = the expert's routed
rows (tokens).  dW[e] = X_e^T . dY_e is C = A . B^T with A = X_e^T (M x K, K-major) and B = dY_e^T.

Every test runs in a child process (tests/_gpu.run_isolated) with the parent's cubins.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from _gpu import cp, median_launch_ms, run_isolated  # noqa: E402
import fp8_probe_host as H  # noqa: E402
import test_fp8_gemm_probe_gpu as F  # noqa: E402  (the FP8 probe's helpers: params, tensor maps, Gemm)
import test_gemm_probe_gpu as B  # noqa: E402  (the bf16 probe's helpers: Probe)

from mok_rt.reference.quantize import FP8_BLOCK  # noqa: E402
from mok_rt.runtime import tensormap as tm  # noqa: E402
from mok_rt.runtime.launch import multiprocessor_count  # noqa: E402
from mok_rt.runtime.tensormap import TensorMapBytes  # noqa: E402

KERNELS_1D1D = ("fp8_gemm_probe_1d1d", "fp8_gemm_probe_1d1d_overlap")
# fp8probe::kWgradSmemBytes: fp8_gemm_probe's ring and A-scale slots, the barriers in a 128-byte
# slot, six 512-byte B-scale slots (128 fp32 each), alignment slack.
SMEM_1D1D = 6 * (128 * 128 + 128 * 128) + 6 * 640 + 128 + 6 * 128 * 4 + 1024
assert SMEM_1D1D == 204672 == F.SMEM_BYTES - 2 * 6 * 8 + 128 + 6 * 512
SB_BOX = 128


class Fp8WgradParams(ctypes.Structure):
    """Mirror of mok::Fp8WgradParams (fp8_wgrad_probe.cuh)."""

    _fields_ = [("g", F.Fp8GemmParams), ("sbm", TensorMapBytes)]


assert ctypes.sizeof(Fp8WgradParams) == 640 and Fp8WgradParams.sbm.offset == 512

_BF16_CUBIN_ENV = "MOK_BF16_PROBE_CUBIN"   # the bf16 probe's cubin, compiled once in the parent


def _child_env() -> dict:
    return {F._CUBIN_ENV: str(F._probe_cubin())}


def _bf16_cubin() -> Path:
    if os.environ.get(_BF16_CUBIN_ENV):
        B._probe_path = Path(os.environ[_BF16_CUBIN_ENV])
    return B._probe_cubin()


@pytest.fixture(scope="module")
def stream():
    cp.cuda.Device(0).use()
    cp.zeros(1).sum()
    return cp.cuda.Stream(non_blocking=True)


class Wgrad(F.Gemm):
    """F.Gemm (A, B, A scales, offsets, C, poison/run) with per-column B scales sb_cols [G, KB, N]
    f32 through the 1D-1D kernels.  F.Gemm's own 1D-2D scale pointer is unused by these kernels;
    it gets a zero placeholder of its shape."""

    def __init__(self, *, rows, n, k, qa, sa_kmajor, qb, sb_cols, c_bf16=False, kernel=KERNELS_1D1D[0]):
        g, kb, nb = len(list(rows)), H.cdiv(k, FP8_BLOCK), H.cdiv(n, H.BLOCK_N)
        assert sb_cols.shape == (g, kb, n) and sb_cols.dtype == cp.float32 and n % 4 == 0
        super().__init__(rows=rows, n=n, k=k, qa=qa, sa_kmajor=sa_kmajor, qb=qb,
                         sb=cp.zeros((g, nb, kb), dtype=cp.float32), c_bf16=c_bf16, kernel=kernel)
        self.sb_cols = sb_cols
        wp = Fp8WgradParams()
        wp.g = self.params
        # dims {N, KB, G}; row pitch N * 4 bytes (a multiple of 16: N % 4 == 0); box 128 columns of
        # one K block of one group, starting at n0 = 128 * tile (512-byte aligned).
        wp.sbm = F._tmap(F._ptr(sb_cols), "f32", (n, kb, g), (n * 4, kb * n * 4), (SB_BOX, 1, 1), False)
        self.wparams = wp

    def launch(self, stream, max_ctas=None):
        grid = min(multiprocessor_count(cp.cuda.Device().id), max(self.num_tiles, 1))
        F._run(self.kernel, min(grid, max_ctas) if max_ctas else grid, F.THREADS, self.wparams, stream, SMEM_1D1D)


def _oracle(qa_u8, sa_kmajor, qb_u8, sb_cols, off, k) -> np.ndarray:
    """float64 C [off[-1], N] of the dequantised operands (host arrays): A[r, k] * s_a[kb, r] times
    B[g][n, k] * s_b[g, kb, n], summed over k."""
    return H.grouped_oracle(qa_u8, sa_kmajor, lambda g: H.dequant_weight_cols(qb_u8[g], sb_cols[g], k), off,
                            qb_u8.shape[1], k)


def _exact_operands(rng, rows, n, k, cap):
    """exact_problem's recipe with per-column B scales: |q| <= 4 integers (a K block's partial sum is
    an integer below 2^11, exact whatever the MMA's internal precision), scales in {1/2, 1, 2}."""
    g, kb = len(rows), H.cdiv(k, FP8_BLOCK)
    qa = rng.integers(-4, 5, size=(cap, k)).astype(np.float32).astype(H.E4M3)
    qb = rng.integers(-4, 5, size=(g, n, k)).astype(np.float32).astype(H.E4M3)
    ld = H.cdiv(cap, 4) * 4
    sa = np.zeros((kb, ld), dtype=np.float32)
    sa[:, :cap] = np.exp2(rng.integers(-1, 2, size=(kb, cap)))
    sb = np.exp2(rng.integers(-1, 2, size=(g, kb, n))).astype(np.float32)
    return H.bits_u8(qa), sa, H.bits_u8(qb), sb


def _wgrad_from_host(qa, sa, qb, sb, rows, n, k, **kw) -> Wgrad:
    return Wgrad(rows=rows, n=n, k=k, qa=cp.asarray(qa), sa_kmajor=cp.asarray(sa), qb=cp.asarray(qb),
                 sb_cols=cp.asarray(sb), **kw)


def _assert_bitwise(got: np.ndarray, want: np.ndarray, what: str):
    bad = np.argwhere(got != want)
    assert len(bad) == 0, f"{what}: {len(bad)} of {want.size} outputs differ, first {bad[:4].tolist()}: " \
                          f"got {got[tuple(bad[0])]} want {want[tuple(bad[0])]}"


EXACT = {
    # uneven groups with an empty one and a group of 77 rows, N = 1.5 tiles (partial last column
    # tile: its scale box reads past N as zeros), K = 3 blocks + 16
    "uneven": dict(rows=[200, 0, 77, 300, 128], n=200, k=400, extra=50),
    "long_k": dict(rows=[256, 129], n=256, k=1024, extra=3),
}


@pytest.mark.parametrize("case", sorted(EXACT))
@pytest.mark.parametrize("kernel", KERNELS_1D1D)
def test_wgrad_exact_bitwise(request, stream, kernel, case):
    if run_isolated(request, env=_child_env()) is not None:
        return
    cfg = EXACT[case]
    rows, n, k = cfg["rows"], cfg["n"], cfg["k"]
    cap = sum(rows) + cfg["extra"]
    qa, sa, qb, sb = _exact_operands(np.random.default_rng(len(case)), rows, n, k, cap)
    gm = _wgrad_from_host(qa, sa, qb, sb, rows, n, k, kernel=kernel)
    want = _oracle(qa, sa, qb, sb, gm.off, k)
    assert np.array_equal(want.astype(np.float32).astype(np.float64), want)   # fp32-exact by construction
    c = gm.run(stream)   # C poisoned with NaN first
    got = gm.c_f64(c)
    _assert_bitwise(got[: gm.total], want, f"{kernel} {case}")
    assert np.isnan(got[gm.total:]).all(), "rows past the groups were written"
    F._check_repeatable(stream, gm, c)   # another launch, 1 CTA, 3 CTAs: the same bits
    other = [kn for kn in KERNELS_1D1D if kn != kernel][0]
    assert F._same_bits(_wgrad_from_host(qa, sa, qb, sb, rows, n, k, kernel=other).run(stream), c), \
        f"{kernel} and {other} disagree"


def test_wgrad_column_scale(request, stream):
    """A column's scale reaches exactly that column: column 130 (second tile, partial) 1024x in every
    K block, column 7 64x in K block 1 only.  Powers of two keep every step exact, so the check is
    bitwise; the other columns must not move."""
    if run_isolated(request, env=_child_env()) is not None:
        return
    rows, n, k = [200, 77], 200, 400
    cap = sum(rows) + 8
    qa, sa, qb, sb = _exact_operands(np.random.default_rng(11), rows, n, k, cap)
    sb2 = sb.copy()
    sb2[:, :, 130] *= np.float32(1024.0)
    sb2[:, 1, 7] *= np.float32(64.0)
    for kernel in KERNELS_1D1D:
        base = _wgrad_from_host(qa, sa, qb, sb, rows, n, k, kernel=kernel)
        c0 = base.c_f64(base.run(stream))[: base.total]
        gm = _wgrad_from_host(qa, sa, qb, sb2, rows, n, k, kernel=kernel)
        c1 = gm.c_f64(gm.run(stream))[: gm.total]
        want = _oracle(qa, sa, qb, sb2, gm.off, k)
        assert np.array_equal(want.astype(np.float32).astype(np.float64), want)
        _assert_bitwise(c1, want, f"{kernel} with scaled columns")
        assert np.array_equal(c1[:, 130], 1024.0 * c0[:, 130]), "column 130's scale was not applied exactly"
        assert not np.array_equal(c1[:, 7], c0[:, 7]), "column 7's K-block-1 scale had no effect"
        others = np.setdiff1d(np.arange(n), [7, 130])
        assert np.array_equal(c1[:, others], c0[:, others]), "a column's scale leaked into other columns"


def _e4m3_gauss(rng, shape) -> np.ndarray:
    """E4M3 bytes of N(0, 1) * 112 (|v| <= 448 saturates; no NaN encodings)."""
    v = np.clip(rng.standard_normal(shape) * 112.0, -448.0, 448.0)
    return v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


RANDOM = {
    "uneven": dict(rows=[256, 130, 0, 77], n=384, k=592),
    "partial_n": dict(rows=[300, 128], n=200, k=256),
}


@pytest.mark.parametrize("case", sorted(RANDOM))
def test_wgrad_random(request, stream, capsys, case):
    """Gaussian E4M3 operands and random positive scales (per-column B scales 2^-4 .. 2^4 apart), fp32 C, both kernels."""
    if run_isolated(request, env=_child_env()) is not None:
        return
    cfg = RANDOM[case]
    rows, n, k = cfg["rows"], cfg["n"], cfg["k"]
    rng = np.random.default_rng(n + k)
    cap, kb, g = sum(rows) + 5, H.cdiv(k, FP8_BLOCK), len(rows)
    ld = H.cdiv(cap, 4) * 4
    # E4M3 codes of Gaussian values spread over the format's range (as a quantiser makes them);
    # uniformly random bytes put products 2^30 apart inside one MMA, where the tensor cores' short
    # internal sum (see test_fp8_gemm_probe_gpu.TOL_GEMM) shows more than on any quantised data.
    qa = _e4m3_gauss(rng, (cap, k))
    qb = _e4m3_gauss(rng, (g, n, k))
    sa = np.zeros((kb, ld), dtype=np.float32)
    sa[:, :cap] = rng.uniform(0.5, 1.5, size=(kb, cap)) / 448
    sb = (rng.uniform(0.5, 1.5, size=(g, kb, n)) * np.exp2(rng.integers(-4, 5, size=(g, kb, n))) / 448).astype(np.float32)
    want = None
    bits = []
    for kernel in KERNELS_1D1D:
        gm = _wgrad_from_host(qa, sa, qb, sb, rows, n, k, kernel=kernel)
        want = _oracle(qa, sa, qb, sb, gm.off, k) if want is None else want
        c = gm.run(stream)
        got = gm.c_f64(c)
        err = H.rel_err(got[: gm.total], want)
        with capsys.disabled():
            print(f"\nFP8ERR {kernel} wgrad_{case} frobenius {err:.3g}")
        assert err <= F.TOL_GEMM, f"{kernel}: relative error {err:.3g}"
        assert np.isnan(got[gm.total:]).all(), "rows past the groups were written"
        assert F._same_bits(gm.run(stream), c), "two launches gave other bits"
        bits.append(c)
    assert F._same_bits(bits[0], bits[1]), "the two schedules disagree"


# ---- timing ---------------------------------------------------------------------------------------------

WGRAD = {
    "qwen3_wdown": dict(groups=128, m=2048, n=768, k=1024),
    "qwen3_wgu": dict(groups=128, m=1536, n=2048, k=1024),
    "dsv3slice_wdown": dict(groups=32, m=7168, n=2048, k=2048),
    "dsv3slice_wgu": dict(groups=32, m=4096, n=7168, k=2048),
    # deepseek-v3 full: 256 experts, 8192 tokens x top-8 -> 256 rows per expert
    "dsv3_wdown": dict(groups=256, m=7168, n=2048, k=256),
}


@pytest.mark.parametrize("shape", list(WGRAD))
def test_fp8_wgrad_timing(request, stream, capsys, shape):
    if run_isolated(request, env=_child_env()) is not None:
        return
    t = WGRAD[shape]
    g, m, n, k = t["groups"], t["m"], t["n"], t["k"]
    rows_total, kb, nb = g * m, H.cdiv(k, FP8_BLOCK), H.cdiv(n, H.BLOCK_N)
    flops = 2.0 * rows_total * n * k
    cp.random.seed(5)
    qa = H.no_nan_bytes(cp.random.randint(0, 256, size=(rows_total, k), dtype=cp.int32).astype(cp.uint8))
    qb = H.no_nan_bytes(cp.random.randint(0, 256, size=(g, n, k), dtype=cp.int32).astype(cp.uint8))
    sa = cp.random.uniform(0.5, 1.5, size=(kb, rows_total)).astype(cp.float32) * np.float32(1 / 448)
    sb_cols = cp.random.uniform(0.5, 1.5, size=(g, kb, n)).astype(cp.float32) * np.float32(1 / 448)
    sb_blocks = cp.random.uniform(0.5, 1.5, size=(g, nb, kb)).astype(cp.float32) * np.float32(1 / 448)
    # float64 check on 2 groups x 64 rows (bf16 C).
    rng = np.random.default_rng(1)
    sel = [(int(gi), np.sort(rng.choice(m, size=64, replace=False))) for gi in np.sort(rng.choice(g, 2, replace=False))]
    a_deq = {gi: H.dequant_rows(cp.asnumpy(qa[cp.asarray(gi * m + r)]), cp.asnumpy(sa[:, cp.asarray(gi * m + r)]), k)
             for gi, r in sel}
    for kernel in (*KERNELS_1D1D, "fp8_gemm_probe"):
        kw = dict(rows=[m] * g, n=n, k=k, qa=qa, sa_kmajor=sa, qb=qb, c_bf16=True, kernel=kernel)
        gm = Wgrad(sb_cols=sb_cols, **kw) if kernel in KERNELS_1D1D else F.Gemm(sb=sb_blocks, **kw)
        c = gm.run(stream)
        got, want = [], []
        for gi, r in sel:
            qb_g = cp.asnumpy(qb[gi])
            b_deq = (H.dequant_weight_cols(qb_g, cp.asnumpy(sb_cols[gi]), k) if kernel in KERNELS_1D1D
                     else H.dequant_weight_blocks(qb_g, cp.asnumpy(sb_blocks[gi]), n, k))
            want.append(a_deq[gi] @ b_deq.T)
            got.append(gm.c_f64(c[cp.asarray(gi * m + r)]))
        err = H.rel_err(np.concatenate(got), np.concatenate(want))
        assert err <= F.TOL_BF16_OUT, f"{kernel}: relative error {err:.3g}"
        ms = median_launch_ms(gm.launch, stream)
        assert not cp.asnumpy(gm.err).any()
        with capsys.disabled():
            print(f"\nFP8WGRAD {kernel} {shape} {ms:.3f} {flops / (ms * 1e-3) / 1e12:.1f}")
        del gm, c   # C is up to 7.5 GB (dsv3_wdown, bf16), and run() keeps a copy
        cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.parametrize("shape", list(WGRAD))
def test_bf16_wgrad_timing(request, stream, capsys, shape):
    """The bf16 probe (both tile widths) at the same shapes, K-major A and B."""
    if run_isolated(request, env={_BF16_CUBIN_ENV: str(_bf16_cubin())}) is not None:
        return
    _bf16_cubin()
    t = WGRAD[shape]
    g, m, n, k = t["groups"], t["m"], t["n"], t["k"]
    rows_total = g * m
    assert m % B.BLOCK_M == 0, "the bf16 probe needs group rows in multiples of 128"
    flops = 2.0 * rows_total * n * k
    cp.random.seed(11)
    a = B._bf16_bits_from_f32(cp.random.standard_normal((rows_total, k), dtype=cp.float32))
    b = B._bf16_bits_from_f32(cp.random.standard_normal((g, n, k), dtype=cp.float32) * np.float32(1 / np.sqrt(k)))
    rng = np.random.default_rng(12)
    sel = [(int(gi), np.sort(rng.choice(m, size=64, replace=False))) for gi in np.sort(rng.choice(g, 2, replace=False))]
    for kernel in sorted(B.KERNELS):
        pr = B.Probe(rows=[m] * g, n=n, k=k, b_major=tm.Major.K, a_bits=a, b_bits=b, kernel=kernel)
        c = pr.run(stream)
        got, want = [], []
        for gi, r in sel:
            rr = cp.asarray(gi * m + r)
            want.append(B._f64_from_bf16_bits(a[rr]) @ B._f64_from_bf16_bits(b[gi]).T)
            got.append(B._f64_from_bf16_bits(c[rr]))
        err = B._rel_err(np.concatenate(got), np.concatenate(want))
        assert err <= B.TOL, f"{kernel}: relative error {err:.3g}"
        ms = median_launch_ms(pr.launch, stream)
        assert not cp.asnumpy(pr.err).any()
        with capsys.disabled():
            print(f"\nBF16WGRAD {kernel}_bn{pr.bn}_{shape} {ms:.3f} {flops / (ms * 1e-3) / 1e12:.1f}")
        del pr, c
        cp.get_default_memory_pool().free_all_blocks()
