"""GPU test of fp8_gemm_probe_mc and fp8_gemm_probe_lean_mc: the overlap and the lean schedule on
2-CTA clusters sharing B by TMA multicast (tests/cuda/fp8_mc_probe.cuh, compiled into the
fp8_gemm_probe.cu cubin).

* test_mc_exact_bitwise: operands on which no step rounds (fp8_probe_host.exact_problem), groups
  with an even number of row blocks (one empty, rows off the 128 grid), N off the tile grid, K not
  a multiple of 128: bitwise against float64 and against fp8_gemm_probe_overlap; rows past the
  groups stay NaN; the same bits from 1, 3 or all clusters.
* test_mc_random: device-quantised operands, bitwise against fp8_gemm_probe_overlap, two launches
  the same bits.
* test_mc_odd_group_refused: a group with an odd number of row blocks (a pair would span two
  groups' B) sets the error word (kErrInternal) and writes nothing; no hang.
Timings: bench/fp8_calibrate.py (engine "mok_probe_mc", next to cuBLAS's block-scaled GEMM).
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from _gpu import cp, run_isolated  # noqa: E402
import fp8_probe_host as H  # noqa: E402
import test_fp8_gemm_probe_gpu as F  # noqa: E402
import test_fp8_wide_probe_gpu as W  # noqa: E402  (Fp8WideParams)

from mok_rt.runtime.launch import launch, max_active_clusters  # noqa: E402

KERNEL, REF = "fp8_gemm_probe_mc", "fp8_gemm_probe_overlap"
CONTROL = "fp8_gemm_probe_mc_own"   # same clusters and release protocol, B loaded by each CTA itself
LEAN = "fp8_gemm_probe_lean_mc"     # the same clusters with the lean consumers
MC_KERNELS = (KERNEL, LEAN)
ERR_INTERNAL = 5


class Mc(F.Gemm):
    """F.Gemm through fp8_gemm_probe_mc: the B map's box is the 64-row half a CTA multicasts;
    clusters of 2 CTAs, an even grid."""

    def __init__(self, *, kernel=KERNEL, **kw):
        super().__init__(kernel=kernel, **kw)
        wp = W.Fp8WideParams()
        wp.g = self.params
        wp.bw = F._tmap(F._ptr(self.qb), "u8", (self.k, self.n, self.groups), (self.k, self.n * self.k),
                        (128, 64, 1), True)
        self.wparams = wp

    _resident = None

    def resident_clusters(self) -> int:
        """The clusters that run at once (a persistent grid larger than this runs in two waves)."""
        if Mc._resident is None:
            Mc._resident = max_active_clusters(self.kernel, block=F.THREADS, cluster=(2, 1, 1),
                                               shared_mem=F.SMEM_BYTES, device_id=cp.cuda.Device().id)
        return Mc._resident

    def launch(self, stream, max_ctas=None):
        ctas = max_ctas or 2 * self.resident_clusters()
        grid = 2 * max(1, min(ctas // 2, self.num_tiles // 2))
        launch(self.kernel, grid=grid, block=F.THREADS, params=self.wparams, stream=stream.ptr,
               device_id=cp.cuda.Device().id, shared_mem=F.SMEM_BYTES, cluster=(2, 1, 1))


def _child_env() -> dict:
    return {F._CUBIN_ENV: str(F._probe_cubin())}


@pytest.fixture(scope="module")
def stream():
    cp.cuda.Device(0).use()
    cp.zeros(1).sum()
    return cp.cuda.Stream(non_blocking=True)


EXACT = {
    # row blocks per group: 2, 0, 2, 4; N = 320 (last tile 64 wide), K = 3 blocks + 16
    "uneven": dict(rows=[200, 0, 256, 500], n=320, k=400, extra=40),
    "long_k": dict(rows=[256, 129], n=256, k=1024, extra=0),
    "tiny": dict(rows=[130], n=8, k=16, extra=3),
}


@pytest.mark.parametrize("kernel", MC_KERNELS)
@pytest.mark.parametrize("case", sorted(EXACT))
def test_mc_exact_bitwise(request, stream, case, kernel):
    if run_isolated(request, env=_child_env()) is not None:
        return
    cfg = EXACT[case]
    rng = np.random.default_rng(len(case) + 200)
    cap = sum(cfg["rows"]) + cfg["extra"]
    a, b = H.exact_problem(rng, cfg["rows"], cfg["n"], cfg["k"], cap)
    gm = F._gemm_from_host(a, b, cfg["rows"], cls=Mc, kernel=kernel)
    want = H.emulate_gemm(a, b, gm.off)
    c = gm.run(stream)
    got = gm.c_f64(c)
    bad = np.argwhere(got[: gm.total] != want)
    assert len(bad) == 0, f"{len(bad)} of {want.size} outputs differ, first {bad[:4].tolist()}"
    assert np.isnan(got[gm.total:]).all(), "rows past the groups were written"
    assert F._same_bits(F._gemm_from_host(a, b, cfg["rows"], kernel=REF).run(stream), c), f"{kernel} and {REF} disagree"
    for ctas in (2, 6, None):
        assert F._same_bits(gm.run(stream, max_ctas=ctas), c), f"a run on {ctas or 'all'} CTAs gave other bits"


@pytest.mark.parametrize("kernel", MC_KERNELS)
def test_mc_random(request, stream, kernel):
    if run_isolated(request, env=_child_env()) is not None:
        return
    rows, n, k = [256, 130, 0, 1024], 384, 2048
    rng = np.random.default_rng(11)
    x = H.activation_rows(rng, sum(rows) + 8, k)
    w = H.weights(rng, len(rows), n, k)
    ld = H.cdiv(x.shape[0], 4) * 4
    qa, sa = F.quantize_rows_dev(stream, F._dev_bf16(x), k, scale_ld=ld)
    qb, sb, _, _ = F.quantize_weights_dev(stream, F._dev_bf16(w), len(rows), n, k)
    kw = dict(rows=rows, n=n, k=k, qa=qa, sa_kmajor=sa, qb=qb, sb=sb)
    c = Mc(kernel=kernel, **kw).run(stream)
    assert F._same_bits(F.Gemm(kernel=REF, **kw).run(stream), c), f"{kernel} and {REF} disagree"
    assert F._same_bits(Mc(kernel=kernel, **kw).run(stream), c), "two launches gave other bits"
    assert F._same_bits(Mc(kernel=CONTROL, **kw).run(stream), c), f"{CONTROL} and {kernel} disagree"
    got = cp.asnumpy(c)[: sum(rows)].astype(np.float64)
    want = H.emulate_gemm(H.quantize_rows_ref(x), H.quantize_weights_ref(w)[0], H.group_offsets(rows)[0])
    err = H.rel_err(got, want)
    print(f"\nFP8ERR {kernel} random frobenius {err:.3g}")
    assert err <= F.TOL_GEMM


@pytest.mark.parametrize("kernel", MC_KERNELS)
def test_mc_odd_group_refused(request, stream, kernel):
    if run_isolated(request, env=_child_env()) is not None:
        return
    rng = np.random.default_rng(5)
    rows = [128, 300]   # 1 and 3 row blocks
    a, b = H.exact_problem(rng, rows, 128, 256, sum(rows))
    gm = F._gemm_from_host(a, b, rows, cls=Mc, kernel=kernel)
    gm.c.view(cp.uint32).fill(F.F32_NAN)
    stream.synchronize()
    gm.launch(stream)
    stream.synchronize()
    err = cp.asnumpy(gm.err)
    assert err[0] == ERR_INTERNAL, f"error word {err.tolist()}"
    assert np.isnan(gm.c_f64(gm.c)).all()
