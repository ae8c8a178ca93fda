"""GPU test and timing of the wide FP8 probe: one m64nNk32 batch per K block (tests/cuda/fp8_wide_probe.cuh).

Kernels fp8_gemm_probe_n192 and fp8_gemm_probe_n160 (compiled into the fp8_gemm_probe.cu cubin):
fp8_gemm_probe's engine and scales (1D-2D: s_b per (group, 128-column block, K block)) with
128 x N tiles, N = 192 / 160, and per K block ONE batch of four m64nNk32 into one partial set, one
wait, one promotion.  A tile may span two 128-column scale blocks (chunk-wise scale choice).  The
promotion does the same fp32 operations per element as fp8_gemm_probe, so:

* test_wide_exact_bitwise: operands on which no step rounds (fp8_probe_host.exact_problem), uneven
  groups with an empty one, rows off the 128 grid, N off the tile grid (200, 328: partial last
  tile, the second scale block clamped or real), K not a multiple of 128: bitwise against float64
  AND against fp8_gemm_probe on the same inputs; rows past the groups stay NaN; the same bits from
  every launch and from 1 / 3 / all CTAs.
* test_wide_random: Gaussian-coded and uniformly random E4M3 bytes, random positive block scales
  (2^-4 .. 2^4 apart): bitwise against fp8_gemm_probe (this is where a dependence of the tensor
  cores' partial sums on the instruction's N would show), within TOL_GEMM of float64, two
  launches the same bits.
* test_fp8_wide_timing prints "FP8WIDE <kernel> <shape> <ms> <TFLOP/s>" for fp8_gemm_probe,
  fp8_gemm_probe_overlap and both wide kernels in one process (median of 20 launches after 3
  warm-ups, bf16 C), over test_fp8_gemm_probe_gpu.TIMING plus deepseek-v3 forward shapes; every
  kernel's C must equal fp8_gemm_probe's bit for bit (checked after all lines are printed).

Every test runs in a child process (tests/_gpu.run_isolated) with the parent's cubin.
"""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from _gpu import cp, median_launch_ms, run_isolated  # noqa: E402
import fp8_probe_host as H  # noqa: E402
import test_fp8_gemm_probe_gpu as F  # noqa: E402  (the FP8 probe's helpers: params, tensor maps, Gemm)

from mok_rt.reference.quantize import FP8_BLOCK  # noqa: E402
from mok_rt.runtime.launch import multiprocessor_count  # noqa: E402
from mok_rt.runtime.tensormap import TensorMapBytes  # noqa: E402

WIDE = {"fp8_gemm_probe_n192": 192, "fp8_gemm_probe_n160": 160}
REF = "fp8_gemm_probe"


def _smem(bn: int, stages: int) -> int:
    """fp8probe::WideCfg<N>::kSmemBytes: ring (A 16 KB + B N x 128 B per stage), A-scale slots
    (640 bytes apart), full / empty barriers, alignment slack."""
    return stages * (128 * 128 + bn * 128) + stages * 640 + 2 * stages * 8 + 1024


SMEM_WIDE = {192: _smem(192, 5), 160: _smem(160, 6)}
assert SMEM_WIDE == {192: 209104, 160: 226144}


class Fp8WideParams(ctypes.Structure):
    """Mirror of mok::Fp8WideParams (fp8_wide_probe.cuh)."""

    _fields_ = [("g", F.Fp8GemmParams), ("bw", TensorMapBytes)]


assert ctypes.sizeof(Fp8WideParams) == 640 and Fp8WideParams.bw.offset == 512


def _child_env() -> dict:
    return {F._CUBIN_ENV: str(F._probe_cubin())}


class Wide(F.Gemm):
    """F.Gemm (operands, A / A-scale maps, 1D-2D B scales, offsets, C, poison/run) through a wide
    kernel: a second B map with an N-row box {128, N, 1}; the 128-row map g.b is not read."""

    def __init__(self, *, kernel, **kw):
        assert kernel in WIDE and not kw.get("quantize_out")
        super().__init__(kernel=kernel, **kw)
        self.bn = WIDE[kernel]
        wp = Fp8WideParams()
        wp.g = self.params
        wp.bw = F._tmap(F._ptr(self.qb), "u8", (self.k, self.n, self.groups), (self.k, self.n * self.k),
                        (128, self.bn, 1), True)
        self.wparams = wp
        self.num_tiles = int(self.tiles[-1]) * H.cdiv(self.n, self.bn)

    def launch(self, stream, max_ctas=None):
        grid = min(multiprocessor_count(cp.cuda.Device().id), max(self.num_tiles, 1))
        F._run(self.kernel, min(grid, max_ctas) if max_ctas else grid, F.THREADS, self.wparams, stream,
               SMEM_WIDE[self.bn])


def _make(kernel: str, **kw):
    return Wide(kernel=kernel, **kw) if kernel in WIDE else F.Gemm(kernel=kernel, **kw)


@pytest.fixture(scope="module")
def stream():
    cp.cuda.Device(0).use()
    cp.zeros(1).sum()
    return cp.cuda.Stream(non_blocking=True)


def _assert_same(c, c_ref, what: str):
    if F._same_bits(c, c_ref):
        return
    a, b = cp.asnumpy(F._bits(c)), cp.asnumpy(F._bits(c_ref))
    bad = np.argwhere(a != b)
    fa, fb = cp.asnumpy(c).astype(np.float64), cp.asnumpy(c_ref).astype(np.float64)
    i = tuple(bad[0])
    raise AssertionError(f"{what}: {len(bad)} of {a.size} outputs differ in bits, first {bad[:4].tolist()}: "
                         f"got {fa[i]!r} want {fb[i]!r}")


EXACT = {
    # uneven groups with an empty one; N = 328: at N = 192 tile 1 (columns 192..) switches from
    # scale block 1 to 2 at its column 64; at N = 160 tile 1 (160..) switches at its column 96 and
    # tile 2 (320..) has its second block clamped (past N); K = 3 blocks + 16
    "uneven": dict(rows=[200, 0, 77, 300, 128], n=328, k=400, extra=50),
    # N = 200: both widths' last tile has its second block past N (clamped); K = 2 blocks + 16
    "n200": dict(rows=[129, 0, 300], n=200, k=272, extra=7),
    # N = 3 x 192 = 3.6 x 160, 8 K blocks
    "long_k": dict(rows=[256, 129], n=576, k=1024, extra=0),
    "tiny": dict(rows=[5], n=8, k=16, extra=3),
}


@pytest.mark.parametrize("kernel", list(WIDE))
@pytest.mark.parametrize("case", sorted(EXACT))
def test_wide_exact_bitwise(request, stream, case, kernel):
    if run_isolated(request, env=_child_env()) is not None:
        return
    cfg = EXACT[case]
    rows, n, k = cfg["rows"], cfg["n"], cfg["k"]
    rng = np.random.default_rng(len(case) + 100)
    cap = sum(rows) + cfg["extra"]
    a, b = H.exact_problem(rng, rows, n, k, cap)
    ld = H.cdiv(cap, 4) * 4
    kw = dict(rows=rows, n=n, k=k, qa=cp.asarray(H.bits_u8(a.values)),
              sa_kmajor=cp.asarray(H.act_scales_kmajor(a.scales, ld)), qb=cp.asarray(H.bits_u8(b.values)),
              sb=cp.asarray(np.ascontiguousarray(b.scales)))
    gm = _make(kernel, **kw)
    want = H.emulate_gemm(a, b, gm.off)
    assert np.array_equal(want.astype(np.float32).astype(np.float64), want)   # fp32-exact by construction
    c = gm.run(stream)   # C poisoned with NaN first
    got = gm.c_f64(c)
    bad = np.argwhere(got[: gm.total] != want)
    assert len(bad) == 0, f"{kernel} {case}: {len(bad)} of {want.size} outputs differ, first {bad[:4].tolist()}: " \
                          f"got {got[tuple(bad[0])]} want {want[tuple(bad[0])]}"
    assert np.isnan(got[gm.total:]).all(), "rows past the groups were written"
    _assert_same(c, _make(REF, **kw).run(stream), f"{kernel} vs {REF} ({case})")
    F._check_repeatable(stream, gm, c)   # another launch, 1 CTA, 3 CTAs: the same bits


def _e4m3_gauss(rng, shape) -> np.ndarray:
    """E4M3 bytes of N(0, 1) * 112 (|v| <= 448 saturates; no NaN encodings)."""
    v = np.clip(rng.standard_normal(shape) * 112.0, -448.0, 448.0)
    return v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _e4m3_uniform(rng, shape) -> np.ndarray:
    """Uniformly random E4M3 bytes without the NaN codes: products 2^30 apart inside one MMA, the
    case where the tensor cores' internal (non-fp32) sum rounds the most."""
    return H.no_nan_bytes(rng.integers(0, 256, size=shape, dtype=np.uint8))


def _oracle(qa, sa_kmajor, qb, sb, off, k) -> np.ndarray:
    """float64 C [off[-1], N] of the dequantised operands (host arrays, 1D-2D scales)."""
    n = qb.shape[1]
    return H.grouped_oracle(qa, sa_kmajor, lambda g: H.dequant_weight_blocks(qb[g], sb[g], n, k), off, n, k)


RANDOM = {
    "uneven": dict(rows=[256, 130, 0, 77], n=384, k=592),
    "partial_n": dict(rows=[300, 128], n=328, k=256),
}


@pytest.mark.parametrize("kernel", list(WIDE))
@pytest.mark.parametrize("case", sorted(RANDOM))
def test_wide_random(request, stream, capsys, case, kernel):
    if run_isolated(request, env=_child_env()) is not None:
        return
    cfg = RANDOM[case]
    rows, n, k = cfg["rows"], cfg["n"], cfg["k"]
    rng = np.random.default_rng(n + k)
    cap, kb, nb, g = sum(rows) + 5, H.cdiv(k, FP8_BLOCK), H.cdiv(n, H.BLOCK_N), len(rows)
    ld = H.cdiv(cap, 4) * 4
    for codes, make in (("gauss", _e4m3_gauss), ("uniform", _e4m3_uniform)):
        qa, qb = make(rng, (cap, k)), make(rng, (g, n, k))
        sa = np.zeros((kb, ld), dtype=np.float32)
        sa[:, :cap] = rng.uniform(0.5, 1.5, size=(kb, cap)) / 448
        sb = (rng.uniform(0.5, 1.5, size=(g, nb, kb)) * np.exp2(rng.integers(-4, 5, size=(g, nb, kb))) / 448)
        sb = sb.astype(np.float32)
        kw = dict(rows=rows, n=n, k=k, qa=cp.asarray(qa), sa_kmajor=cp.asarray(sa), qb=cp.asarray(qb),
                  sb=cp.asarray(sb))
        gm = _make(kernel, **kw)
        c = gm.run(stream)
        got = gm.c_f64(c)
        assert np.isnan(got[gm.total:]).all(), "rows past the groups were written"
        c_ref = _make(REF, **kw).run(stream)
        err = H.rel_err(got[: gm.total], _oracle(qa, sa, qb, sb, gm.off, k))
        with capsys.disabled():
            print(f"\nFP8ERR {kernel} wide_{case}_{codes} frobenius {err:.3g} "
                  f"bitwise_vs_{REF} {'yes' if F._same_bits(c, c_ref) else 'NO'}")
        if codes == "gauss":   # uniform bytes: TOL_GEMM is not a bound there (F's docstring); bits are
            assert err <= F.TOL_GEMM, f"{kernel}: relative error {err:.3g}"
        _assert_same(c, c_ref, f"{kernel} vs {REF} ({case}, {codes})")
        assert F._same_bits(gm.run(stream), c), "two launches gave other bits"


@pytest.mark.parametrize("kernel", list(WIDE))
def test_wide_no_rows(request, stream, kernel):
    if run_isolated(request, env=_child_env()) is not None:
        return
    a, b = H.exact_problem(np.random.default_rng(3), [0, 0], 192, 128, 128)
    ld = 128
    gm = Wide(kernel=kernel, rows=[0, 0], n=192, k=128, qa=cp.asarray(H.bits_u8(a.values)),
              sa_kmajor=cp.asarray(H.act_scales_kmajor(a.scales, ld)), qb=cp.asarray(H.bits_u8(b.values)),
              sb=cp.asarray(np.ascontiguousarray(b.scales)))
    assert np.isnan(gm.c_f64(gm.run(stream))).all()


# ---- timing ---------------------------------------------------------------------------------------------

TIMING = {
    **F.TIMING,
    # deepseek-v3 forward (H 7168, I 2048, gate|up N = 2 I): the EP = 8 slice (32 experts x 2048
    # routed rows) and the full model (256 experts, 8192 tokens x top-8 = 256 rows per expert)
    "dsv3slice_gate_up_g32x2048": dict(groups=32, rows=2048, n=4096, k=7168),
    "dsv3slice_down_g32x2048": dict(groups=32, rows=2048, n=7168, k=2048),
    "dsv3_gate_up_g256x256": dict(groups=256, rows=256, n=4096, k=7168),
    "dsv3_down_g256x256": dict(groups=256, rows=256, n=7168, k=2048),
}
TIMED = (REF, "fp8_gemm_probe_overlap", *WIDE)


def _random_bytes(shape):
    """Random E4M3 bytes (no NaN codes), filled in slabs: an int32 temporary of a 7.5 GB B would be 30 GB."""
    out = cp.empty(shape, dtype=cp.uint8)
    flat = out.reshape(shape[0], -1)
    step = max(1, (1 << 28) // flat.shape[1])
    for i in range(0, flat.shape[0], step):
        part = cp.random.randint(0, 256, size=flat[i:i + step].shape, dtype=cp.int32).astype(cp.uint8)
        flat[i:i + step] = H.no_nan_bytes(part)
    return out


@pytest.mark.parametrize("shape", list(TIMING))
def test_fp8_wide_timing(request, stream, capsys, shape):
    if run_isolated(request, env=_child_env()) is not None:
        return
    t = TIMING[shape]
    g, rows, n, k = t["groups"], t["rows"], t["n"], t["k"]
    m = g * rows
    kb, nb = H.cdiv(k, FP8_BLOCK), H.cdiv(n, H.BLOCK_N)
    flops = 2.0 * m * n * k
    cp.random.seed(5)
    qa, qb = _random_bytes((m, k)), _random_bytes((g, n, k))
    sa = cp.random.uniform(0.5, 1.5, size=(kb, m)).astype(cp.float32) * np.float32(1 / 448)
    sb = cp.random.uniform(0.5, 1.5, size=(g, nb, kb)).astype(cp.float32) * np.float32(1 / 448)
    kw = dict(rows=[rows] * g, n=n, k=k, qa=qa, sa_kmajor=sa, qb=qb, sb=sb, c_bf16=True)
    c_ref, mismatches = None, []
    for kernel in TIMED:
        gm = _make(kernel, **kw)
        c = gm.run(stream)
        if c_ref is None:
            c_ref = c
            # float64 check of the reference kernel on 2 groups x 32 rows (bf16 C)
            rng = np.random.default_rng(1)
            got, want = [], []
            for gi in np.sort(rng.choice(g, size=min(2, g), replace=False)):
                r = cp.asarray(int(gi) * rows + np.sort(rng.choice(rows, size=min(32, rows), replace=False)))
                a_deq = H.dequant_rows(cp.asnumpy(qa[r]), cp.asnumpy(sa[:, r]), k)
                b_deq = H.dequant_weight_blocks(cp.asnumpy(qb[int(gi)]), cp.asnumpy(sb[int(gi)]), n, k)
                want.append(a_deq @ b_deq.T)
                got.append(gm.c_f64(c[r]))
            err = H.rel_err(np.concatenate(got), np.concatenate(want))
            assert err <= F.TOL_BF16_OUT, f"{REF}: relative error {err:.3g}"
        elif not F._same_bits(c, c_ref):
            mismatches.append(kernel)
        ms = median_launch_ms(gm.launch, stream)
        assert not cp.asnumpy(gm.err).any()
        with capsys.disabled():
            print(f"\nFP8WIDE {kernel} {shape} {ms:.3f} {flops / (ms * 1e-3) / 1e12:.1f}")
        if c is not c_ref:
            del c
        del gm
        cp.get_default_memory_pool().free_all_blocks()
    assert not mismatches, f"C differs in bits from {REF}'s: {mismatches}"
