"""GPU test of the TMA + wgmma engine through its standalone probe (tests/cuda/gemm_probe.cu).

The probe computes a grouped GEMM C[rows of g] = A[rows of g] * B[g]^T with device-side row offsets
(multiples of 128, like the MoE experts), B either K-major ([G, N, K], the weights) or MN-major
([G, K, N]).  Buffers are CuPy arrays (bf16 held as raw uint16 bits), C is poisoned with NaN before
each launch, the oracle is NumPy float64 (relative Frobenius error <= 1e-2), and two launches must
give the same bits.  test_probe_timing prints the qwen3-30b-a3b expert shapes as
"PROBE <name> <ms> <TFLOP/s>" (median of 20 launches, CUDA events) for both tile widths
(kernels gemm_probe: 128 x 256 tiles, gemm_probe_bn128: 128 x 128 tiles).

The probe is not part of the package: it is compiled here with nvcc into a temporary directory
(once per session; skipped when nvcc is absent).
"""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from _gpu import cp, median_launch_ms, skip_or_fail  # noqa: E402  (CuPy is imported when a test first uses it)

from mok_rt.runtime import tensormap as tm  # noqa: E402
from pathlib import Path  # noqa: E402

from mok_rt import build  # noqa: E402
from mok_rt.runtime.cubins import get_kernel_at  # noqa: E402
from mok_rt.runtime.launch import launch, multiprocessor_count  # noqa: E402

BF16 = ml_dtypes.bfloat16
BF16_NAN = 0x7FC0
TOL = 1e-2
BLOCK_M = 128
THREADS = 384
# kernel name -> (tile width BN, ring stages), as instantiated in gemm_probe.cu.
KERNELS = {"gemm_probe": (256, 4), "gemm_probe_bn128": (128, 6)}


def _smem_bytes(bn: int, stages: int) -> int:
    """gemm_wgmma.cuh Engine::kSmemBytes: ring + full/empty barriers + 1024 bytes of alignment slack."""
    return stages * (BLOCK_M * 64 * 2 + bn * 64 * 2) + 2 * stages * 8 + 1024


assert _smem_bytes(256, 4) == 197696 and _smem_bytes(128, 6) == 197728
TIMEOUT_NS = 2_000_000_000
ERR_CAPACITY = 2


class ProbeParams(ctypes.Structure):
    """Mirror of mok::ProbeParams (gemm_probe.cu); the two tensor maps sit at offsets 0 and 128."""

    _fields_ = [
        ("a", tm.TensorMapBytes),
        ("b", tm.TensorMapBytes),
        ("group_offset", ctypes.c_uint64),
        ("c", ctypes.c_uint64),
        ("err", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_int64),
        ("groups", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("max_rows", ctypes.c_int32),
        ("b_mn_major", ctypes.c_int32),
        ("pad_", ctypes.c_int32 * 3),
    ]


assert ctypes.sizeof(ProbeParams) == 320
assert ProbeParams.b.offset == 128 and ProbeParams.group_offset.offset == 256


_PROBE_SOURCE = Path(__file__).resolve().parent / "cuda" / "gemm_probe.cu"
_probe_path = None


def _probe_cubin() -> Path:
    """tests/cuda/gemm_probe.cu compiled with the package's flags (once per session)."""
    global _probe_path
    if _probe_path is None:
        import tempfile
        try:
            build.find_nvcc()
        except build.BuildError as ex:
            skip_or_fail(f"the GEMM probe is compiled on the fly and needs nvcc: {ex}")
        _probe_path = build.compile_cubin(_PROBE_SOURCE, Path(tempfile.mkdtemp(prefix="mok_probe_")))
    return _probe_path


# ---- helpers ----------------------------------------------------------------------------------

def _ptr(a) -> int:
    return int(a.data.ptr)


def _dev_bf16(a: np.ndarray):
    return cp.asarray(np.ascontiguousarray(a.astype(BF16)).view(np.uint16))


def _bf16_bits_from_f32(x):
    """Round-to-nearest-even float32 -> bf16 bits, on the device (inputs are finite)."""
    u = x.view(cp.uint32)
    return ((u + cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1))) >> 16).astype(cp.uint16)


def _f64_from_bf16_bits(bits) -> np.ndarray:
    return np.asarray(cp.asnumpy(bits)).view(BF16).astype(np.float64)


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    diff = np.linalg.norm(got - want)
    if not np.isfinite(diff):
        return float("inf")
    ref = np.linalg.norm(want)
    return float(diff / ref) if ref > 0 else float(diff)


def _bf16_nan_count(bits) -> int:
    return int(cp.count_nonzero(((bits & 0x7F80) == 0x7F80) & ((bits & 0x7F) != 0)))


class Probe:
    """One grouped GEMM problem on the device: A [cap, K], B [G, N, K] or [G, K, N], C [cap, N]."""

    def __init__(self, *, rows, n, k, b_major, a_bits, b_bits, capacity=None, kernel="gemm_probe"):
        self.rows = list(rows)
        assert all(r % BLOCK_M == 0 for r in self.rows)
        self.groups = len(self.rows)
        self.off = np.concatenate([[0], np.cumsum(self.rows)]).astype(np.int32)
        self.total = int(self.off[-1])
        self.cap = capacity if capacity is not None else max(self.total, BLOCK_M)
        self.n, self.k, self.b_major = n, k, tm.Major(b_major)
        self.a, self.b = a_bits, b_bits
        self.bn, stages = KERNELS[kernel]
        self.smem = _smem_bytes(self.bn, stages)
        assert self.a.shape == (self.cap, k)
        want_b = (self.groups, n, k) if self.b_major == tm.Major.K else (self.groups, k, n)
        assert self.b.shape == want_b, (self.b.shape, want_b)
        self.d_off = cp.asarray(self.off)
        self.c = cp.empty((self.cap, n), dtype=cp.uint16)
        self.err = cp.zeros(4, dtype=cp.int32)
        a_spec = tm.gemm_operand(_ptr(self.a), major=tm.Major.K, rows=self.cap, k=k, box_rows=BLOCK_M)
        b_spec = tm.gemm_operand(_ptr(self.b), major=self.b_major, rows=n, k=k, box_rows=self.bn,
                                 groups=self.groups)
        p = ProbeParams()
        p.a = tm.TensorMapBytes(*tm.encode(a_spec))
        p.b = tm.TensorMapBytes(*tm.encode(b_spec))
        p.group_offset, p.c, p.err = _ptr(self.d_off), _ptr(self.c), _ptr(self.err)
        p.timeout_ns = TIMEOUT_NS
        p.groups, p.n, p.k, p.max_rows = self.groups, n, k, self.cap
        p.b_mn_major = int(self.b_major == tm.Major.MN)
        self.params = p
        self.device_id = cp.cuda.Device().id
        self.kernel = get_kernel_at(_probe_cubin(), kernel, self.device_id)

    def grid(self, max_ctas=None) -> int:
        tiles = (self.cap // BLOCK_M) * -(-self.n // self.bn)
        g = min(multiprocessor_count(self.device_id), max(tiles, 1))
        return min(g, max_ctas) if max_ctas else g

    def launch(self, stream, *, max_ctas=None):
        launch(self.kernel, grid=self.grid(max_ctas), block=THREADS, params=self.params, stream=stream.ptr,
               device_id=self.device_id, shared_mem=self.smem)

    def run(self, stream, *, max_ctas=None):
        """Poison C, launch once, wait; the error word must stay clear."""
        self.c.fill(BF16_NAN)
        stream.synchronize()
        cp.cuda.Device().synchronize()
        self.launch(stream, max_ctas=max_ctas)
        stream.synchronize()
        err = cp.asnumpy(self.err)
        assert not err.any(), f"device error word set: {err.tolist()}"
        return self.c.copy()


def _reference(a: np.ndarray, b: np.ndarray, off: np.ndarray, b_major: tm.Major, rows=None) -> np.ndarray:
    """float64 C for rows [0, off[-1]) (or only `rows`, sorted), from float64 A and B."""
    out_rows = np.arange(off[-1]) if rows is None else np.asarray(rows)
    n = b.shape[1] if b_major == tm.Major.K else b.shape[2]
    out = np.zeros((len(out_rows), n))
    for g in range(len(off) - 1):
        sel = np.nonzero((out_rows >= off[g]) & (out_rows < off[g + 1]))[0]
        if len(sel) == 0:
            continue
        bg = b[g].T if b_major == tm.Major.K else b[g]
        out[sel] = a[out_rows[sel]] @ bg
    return out


def _small_problem(seed, *, rows, n, k, b_major, extra_rows=BLOCK_M, kernel="gemm_probe"):
    rng = np.random.default_rng(seed)
    total = sum(rows)
    cap = total + extra_rows
    a = rng.standard_normal((cap, k)).astype(BF16)
    g = len(rows)
    shape = (g, n, k) if tm.Major(b_major) == tm.Major.K else (g, k, n)
    b = (rng.standard_normal(shape) / np.sqrt(k)).astype(BF16)
    pr = Probe(rows=rows, n=n, k=k, b_major=b_major, a_bits=_dev_bf16(a), b_bits=_dev_bf16(b), capacity=cap,
               kernel=kernel)
    want = _reference(a.astype(np.float64), b.astype(np.float64), pr.off, pr.b_major)
    return pr, want


@pytest.fixture(scope="module")
def stream():
    cp.cuda.Device(0).use()
    cp.zeros(1).sum()  # make the device's primary context current on this thread
    return cp.cuda.Stream(non_blocking=True)


# ---- correctness ------------------------------------------------------------------------------

CASES = {
    # Uneven groups (one empty), a partial last column tile (320 = 256 + 64), K with a 8-wide tail.
    "k_major": dict(seed=1, rows=[256, 0, 128, 384, 128], n=320, k=200, b_major=tm.Major.K),
    # Same for the MN-major B, N = 1.5 tiles, the empty group first.
    "mn_major": dict(seed=2, rows=[0, 128, 512, 128], n=384, k=136, b_major=tm.Major.MN),
    # Long K (many ring laps per tile) and a full-width tile.
    "k_major_long_k": dict(seed=3, rows=[384, 256], n=256, k=1024, b_major=tm.Major.K),
    "mn_major_long_k": dict(seed=4, rows=[128, 384], n=512, k=1088, b_major=tm.Major.MN),
    # The narrowest problem: one row block, N = 8, K = 8 (one k-tile, almost all zero fill).
    "tiny": dict(seed=5, rows=[128], n=8, k=8, b_major=tm.Major.K),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_probe_matches_reference(stream, case, kernel):
    pr, want = _small_problem(**CASES[case], kernel=kernel)
    c = pr.run(stream)
    got = _f64_from_bf16_bits(c)
    err = _rel_err(got[: pr.total], want)
    assert err <= TOL, f"relative error {err:.3g}"
    # Rows past the device row count are never written.
    assert np.isnan(got[pr.total:]).all()
    # Bitwise determinism, and the same bits from 1 and 3 CTAs (tiles and ring phases carried
    # across many tiles per CTA).
    assert cp.array_equal(pr.run(stream), c)
    assert cp.array_equal(pr.run(stream, max_ctas=1), c)
    assert cp.array_equal(pr.run(stream, max_ctas=3), c)


def test_probe_no_rows(stream):
    """All groups empty: nothing is written, no error."""
    pr, _ = _small_problem(6, rows=[0, 0, 0], n=256, k=64, b_major=tm.Major.K)
    c = pr.run(stream)
    assert np.isnan(_f64_from_bf16_bits(c)).all()


def test_probe_row_count_over_capacity_sets_error_word(stream):
    """Device offsets beyond the capacity are reported (kErrCapacity), not used."""
    pr, _ = _small_problem(7, rows=[128, 256], n=64, k=64, b_major=tm.Major.K, extra_rows=0)
    bad = pr.off.copy()
    bad[-1] = pr.cap + BLOCK_M
    pr.d_off[...] = cp.asarray(bad)
    pr.c.fill(BF16_NAN)
    stream.synchronize()
    pr.launch(stream)
    stream.synchronize()
    assert int(cp.asnumpy(pr.err)[0]) == ERR_CAPACITY
    assert np.isnan(_f64_from_bf16_bits(pr.c)).all()


# ---- qwen3-30b-a3b expert shapes: sampled correctness + timing --------------------------------

QWEN3 = {
    # M = 131072 routed rows over 128 experts (16384 tokens x top-8), H = 2048, I = 768.
    "qwen3_gate_up": dict(n=2 * 768, k=2048),
    "qwen3_down": dict(n=2048, k=768),
}
QWEN3_ROWS, QWEN3_EXPERTS = 131072, 128


def _big_problem(n, k, b_major, seed, kernel):
    cp.random.seed(seed)
    rows = [QWEN3_ROWS // QWEN3_EXPERTS] * QWEN3_EXPERTS
    a = _bf16_bits_from_f32(cp.random.standard_normal((QWEN3_ROWS, k), dtype=cp.float32))
    shape = (QWEN3_EXPERTS, n, k) if b_major == tm.Major.K else (QWEN3_EXPERTS, k, n)
    b = _bf16_bits_from_f32(cp.random.standard_normal(shape, dtype=cp.float32) * np.float32(1 / np.sqrt(k)))
    return Probe(rows=rows, n=n, k=k, b_major=b_major, a_bits=a, b_bits=b, kernel=kernel)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("b_major", [tm.Major.K, tm.Major.MN], ids=["bK", "bMN"])
@pytest.mark.parametrize("shape", sorted(QWEN3))
def test_probe_timing(stream, capsys, shape, b_major, kernel):
    dims = QWEN3[shape]
    pr = _big_problem(dims["n"], dims["k"], b_major, seed=11, kernel=kernel)
    c = pr.run(stream)
    assert _bf16_nan_count(c) == 0, "some outputs were not written"
    # float64 check on 4 groups x 128 random rows.
    rng = np.random.default_rng(12)
    groups = np.sort(rng.choice(pr.groups, size=4, replace=False))
    rows = np.concatenate([pr.off[g] + np.sort(rng.choice(pr.rows[g], size=128, replace=False)) for g in groups])
    a_rows = _f64_from_bf16_bits(pr.a[cp.asarray(rows)])
    want = np.zeros((len(rows), dims["n"]))
    for i, g in enumerate(groups):
        bg = _f64_from_bf16_bits(pr.b[int(g)])
        bg = bg.T if b_major == tm.Major.K else bg
        want[128 * i: 128 * (i + 1)] = a_rows[128 * i: 128 * (i + 1)] @ bg
    got = _f64_from_bf16_bits(c[cp.asarray(rows)])
    err = _rel_err(got, want)
    assert err <= TOL, f"relative error {err:.3g}"

    ms = median_launch_ms(pr.launch, stream)   # 3 warm-ups, median of 20 back-to-back launches
    assert not cp.asnumpy(pr.err).any()
    flops = 2.0 * pr.total * dims["n"] * dims["k"]
    name = f"{shape}_{'bK' if b_major == tm.Major.K else 'bMN'}_bn{pr.bn}"
    with capsys.disabled():
        print(f"\nPROBE {name} {ms:.3f} {flops / (ms * 1e-3) / 1e12:.1f}")
