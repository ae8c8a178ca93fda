"""GPU test of the megakernel's GEMM tile engine alone (cuda_src/moe/gemm_tile.cuh) through its
probe kernel (cuda_src/moe/tile_probe.cu).

Every case is one 128 x 128 fp32 tile C = A * B through the engine's public interface: the four
layout combinations, partial M / N / K (K tails inside a 64-wide slice, K = 0, K longer than the
ring), two-segment (split) operands and padded row strides.  The global storage around the valid
region (rows or columns past `valid`, k past K, stride padding) holds bf16 NaN, so an element the
engine should have zero-filled instead of reading turns C into NaN.  C is poisoned with NaN before
each launch; the oracle is NumPy float64 (relative Frobenius error <= 1e-2), and C must be exactly
0 outside the valid rows/columns.  All cases run in one launch on 3 CTAs (each CTA runs several
tiles of different layouts back to back) and again on one CTA per case: the bits must agree.

Needs the cubin: `python -m mok_rt.build` (builds mok_rt/cubins/tile_probe.sm_90a.cubin).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from _gpu import cp  # noqa: E402  (CuPy is imported when a test first uses it)

from mok_rt.kernels import moe_params as P  # noqa: E402
from mok_rt.runtime.cubins import get_kernel  # noqa: E402
from mok_rt.runtime.launch import launch  # noqa: E402

BF16 = ml_dtypes.bfloat16
BF16_NAN = 0x7FC0
TILE = 128
TOL = 1e-2
INT_MAX = 2**31 - 1
K_MAJOR, MN_MAJOR = 0, 1


class TileProbeCase(ctypes.Structure):
    """Mirror of mok::TileProbeCase (tile_probe.cu)."""

    _fields_ = [
        ("a0", ctypes.c_uint64), ("a1", ctypes.c_uint64), ("b0", ctypes.c_uint64), ("b1", ctypes.c_uint64),
        ("c", ctypes.c_uint64),
        ("a_split", ctypes.c_int32), ("a_ld", ctypes.c_int32), ("a_valid", ctypes.c_int32),
        ("b_split", ctypes.c_int32), ("b_ld", ctypes.c_int32), ("b_valid", ctypes.c_int32),
        ("k", ctypes.c_int32), ("layout", ctypes.c_int32),
    ]


class TileProbeParams(ctypes.Structure):
    """Mirror of mok::TileProbeParams (tile_probe.cu)."""

    _fields_ = [("cases", ctypes.c_uint64), ("status", ctypes.c_uint64),
                ("num_cases", ctypes.c_int32), ("pad_", ctypes.c_int32)]


assert ctypes.sizeof(TileProbeCase) == 72 and ctypes.sizeof(TileProbeParams) == 24


@dataclass(frozen=True)
class Spec:
    """One tile: layouts, valid M (A) / N (B) extents, K, split rows (None: one segment), stride padding."""

    a_layout: int
    b_layout: int
    a_valid: int
    b_valid: int
    k: int
    a_split: int | None = None
    b_split: int | None = None
    a_pad: int = 0
    b_pad: int = 0


SPECS = {
    # forward gate|up / down: both K-major
    "kk_full": Spec(K_MAJOR, K_MAJOR, 128, 128, 512),
    "kk_gate_up_tail": Spec(K_MAJOR, K_MAJOR, 128, 128, 200, b_split=64, a_pad=8),   # fused [gate; up] B
    "kk_partial_long": Spec(K_MAJOR, K_MAJOR, 77, 40, 1096, a_split=50, b_pad=24),   # 18 slices: 3 ring laps
    "kk_k8": Spec(K_MAJOR, K_MAJOR, 128, 3, 8),
    # A MN-major, B K-major
    "mk": Spec(MN_MAJOR, K_MAJOR, 96, 128, 136, a_split=72, a_pad=16),
    # backward dgrad: B MN-major (dx: the B rows switch from w_gate to w_up at k = I)
    "km_dx": Spec(K_MAJOR, MN_MAJOR, 128, 120, 264, b_split=136),
    "km_dact": Spec(K_MAJOR, MN_MAJOR, 100, 128, 768, b_pad=8),
    # backward wgrad: both MN-major, K = an expert's row count (any value, 0 included)
    "mm_full": Spec(MN_MAJOR, MN_MAJOR, 128, 128, 384),
    "mm_partial_odd_k": Spec(MN_MAJOR, MN_MAJOR, 56, 104, 77, a_pad=8, b_pad=40),
    "mm_long_split": Spec(MN_MAJOR, MN_MAJOR, 128, 64, 1000, a_split=500, b_split=333),
    "mm_k0": Spec(MN_MAJOR, MN_MAJOR, 128, 128, 0),
    "kk_k0": Spec(K_MAJOR, K_MAJOR, 128, 128, 0),
}


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype(BF16)).view(np.uint16)


class _Operand:
    """Device storage of one operand (logical [128, K], zero past `valid`) in `layout`, NaN around it.

    K-major: storage row o (tile index) holds k = 0..K-1, stride K + pad; rows past valid are NaN.
    MN-major: storage row k holds tile indices 0..valid-1, stride valid + 8 + pad; 64 NaN rows past K.
    The split row (tile index for K-major, k for MN-major) starts the second allocation.
    """

    def __init__(self, rng, *, layout, valid, k, split, pad):
        vals = (rng.standard_normal((valid, k)) / np.sqrt(max(k, 1)) ** 0.5).astype(BF16)
        self.logical = np.zeros((TILE, k))
        self.logical[:valid] = vals.astype(np.float64)
        if layout == K_MAJOR:
            ld = k + pad if k + pad > 0 else 8
            store = np.full((TILE, ld), BF16_NAN, dtype=np.uint16)
            store[:valid, :k] = _bits(vals)
        else:
            ld = valid + 8 + pad
            store = np.full((k + 64, ld), BF16_NAN, dtype=np.uint16)
            store[:k, :valid] = _bits(vals.T)
        if split is None:
            self.segs = [cp.asarray(store)]
            self.split = INT_MAX
        else:
            assert 0 < split < store.shape[0]
            self.segs = [cp.asarray(store[:split]), cp.asarray(store[split:])]
            self.split = split
        self.ld, self.valid = ld, valid

    @property
    def ptrs(self) -> tuple[int, int]:
        p = [int(s.data.ptr) for s in self.segs]
        return p[0], p[-1]


class _Problem:
    def __init__(self, specs: dict[str, Spec], seed: int):
        rng = np.random.default_rng(seed)
        self.names = list(specs)
        self.ops, self.want, self.valid = [], [], []
        self.c = cp.empty((len(specs), TILE, TILE), dtype=cp.float32)
        cases = (TileProbeCase * len(specs))()
        for i, (name, s) in enumerate(specs.items()):
            a = _Operand(rng, layout=s.a_layout, valid=s.a_valid, k=s.k, split=s.a_split, pad=s.a_pad)
            b = _Operand(rng, layout=s.b_layout, valid=s.b_valid, k=s.k, split=s.b_split, pad=s.b_pad)
            self.ops.append((a, b))  # keeps the device buffers alive
            self.want.append(a.logical @ b.logical.T)
            self.valid.append((s.a_valid, s.b_valid))
            t = cases[i]
            t.a0, t.a1 = a.ptrs
            t.b0, t.b1 = b.ptrs
            t.c = int(self.c.data.ptr) + i * TILE * TILE * 4
            t.a_split, t.a_ld, t.a_valid = a.split, a.ld, a.valid
            t.b_split, t.b_ld, t.b_valid = b.split, b.ld, b.valid
            t.k, t.layout = s.k, s.a_layout | (s.b_layout << 1)
        self.d_cases = cp.asarray(np.frombuffer(bytes(cases), dtype=np.uint8))
        self.status = cp.zeros(3, dtype=cp.int32)
        self.device_id = cp.cuda.Device().id
        self.kernel = get_kernel("tile_probe", "tile_probe", self.device_id)

    def launch(self, stream, *, grid: int, shared_mem: int, num_cases: int | None = None):
        p = TileProbeParams()
        p.cases, p.status = int(self.d_cases.data.ptr), int(self.status.data.ptr)
        p.num_cases = len(self.names) if num_cases is None else num_cases
        launch(self.kernel, grid=grid, block=P.THREADS, params=p, stream=stream.ptr, device_id=self.device_id,
               shared_mem=shared_mem)

    def run(self, stream, *, grid: int, shared_mem: int) -> np.ndarray:
        self.c.fill(np.nan)
        self.status.fill(0)
        cp.cuda.Device().synchronize()
        self.launch(stream, grid=grid, shared_mem=shared_mem)
        stream.synchronize()
        st = cp.asnumpy(self.status)
        assert st[2] == 0, f"kernel refused: needs {st[0]} bytes of dynamic shared memory, got {shared_mem}"
        return cp.asnumpy(self.c)


@pytest.fixture(scope="module")
def stream():
    cp.cuda.Device(0).use()
    cp.zeros(1).sum()  # make the device's primary context current on this thread
    return cp.cuda.Stream(non_blocking=True)


def _engine_smem(stream) -> tuple[int, int]:
    """(gemm::kSmemBytes, 1 if the wgmma engine is compiled in) from a query launch with no shared memory."""
    pr = _Problem({"kk_k8": SPECS["kk_k8"]}, seed=0)
    pr.launch(stream, grid=1, shared_mem=0, num_cases=0)
    stream.synchronize()
    st = cp.asnumpy(pr.status)
    assert st[2] == 1 and st[0] > 0
    return int(st[0]), int(st[1])


def test_smem_size_matches_launcher(stream):
    need, wgmma = _engine_smem(stream)
    assert P.SMEM_BYTES >= need, f"_moe_params.SMEM_BYTES = {P.SMEM_BYTES}, the GEMM engine needs {need}"
    if wgmma:
        assert P.SMEM_BYTES == need, f"_moe_params.SMEM_BYTES = {P.SMEM_BYTES}, gemm::kSmemBytes = {need}"


def test_too_little_shared_memory_computes_nothing(stream):
    need, _ = _engine_smem(stream)
    pr = _Problem({"kk_k8": SPECS["kk_k8"]}, seed=1)
    pr.c.fill(np.nan)
    pr.launch(stream, grid=1, shared_mem=need - 1024)
    stream.synchronize()
    assert int(cp.asnumpy(pr.status)[2]) == 1
    assert np.isnan(cp.asnumpy(pr.c)).all()


def _check(name: str, got: np.ndarray, want: np.ndarray, valid: tuple[int, int], seed: int):
    m, n = valid
    assert not np.isnan(got).any(), f"{name} (seed {seed}): NaN in C (unwritten, or a masked element was read)"
    outside = got.copy()
    outside[:m, :n] = 0.0
    assert not outside.any(), f"{name} (seed {seed}): nonzero C outside the valid {m} x {n} block"
    diff = np.linalg.norm(got[:m, :n] - want[:m, :n])
    ref = np.linalg.norm(want[:m, :n])
    if ref == 0:
        assert diff == 0, f"{name} (seed {seed}): expected zeros"
    else:
        assert diff / ref <= TOL, f"{name} (seed {seed}): relative error {diff / ref:.3e}"


def test_tile_cases(stream):
    need, _ = _engine_smem(stream)
    seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh inputs; the seed is in every message
    pr = _Problem(SPECS, seed)
    few = pr.run(stream, grid=3, shared_mem=need)
    for i, name in enumerate(pr.names):
        _check(name, few[i], pr.want[i], pr.valid[i], seed)
    one_each = pr.run(stream, grid=len(pr.names), shared_mem=need)
    again = pr.run(stream, grid=3, shared_mem=need)
    for i, name in enumerate(pr.names):
        assert np.array_equal(few[i].view(np.uint32), one_each[i].view(np.uint32)), f"{name}: bits differ by grid"
        assert np.array_equal(few[i].view(np.uint32), again[i].view(np.uint32)), f"{name}: bits differ by run"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_tile_case_alone(stream, name):
    """Each case alone on one CTA (a failure here names the layout/shape directly)."""
    need, _ = _engine_smem(stream)
    seed = int(np.random.SeedSequence().entropy % 2**31)
    pr = _Problem({name: SPECS[name]}, seed)
    got = pr.run(stream, grid=1, shared_mem=need)
    _check(name, got[0], pr.want[0], pr.valid[0], seed)


TIMING_LAYOUTS = {"kk": (K_MAJOR, K_MAJOR), "km": (K_MAJOR, MN_MAJOR), "mm": (MN_MAJOR, MN_MAJOR),
                  "mk": (MN_MAJOR, K_MAJOR)}


@pytest.mark.parametrize("combo", sorted(TIMING_LAYOUTS))
def test_tile_timing(stream, combo):
    """Prints "TILE <layouts> <ms> <TFLOP/s>": 8 full tiles (K = 2048) per SM, all reading the same
    L2-resident operands (the engine's own ceiling, not a memory-bound figure)."""
    layouts = TIMING_LAYOUTS[combo]
    need, _ = _engine_smem(stream)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    k, n_tiles = 2048, 8 * sms
    spec = Spec(layouts[0], layouts[1], TILE, TILE, k)
    pr = _Problem({"t": spec}, seed=7)
    a, b = pr.ops[0]
    c = cp.empty((n_tiles, TILE, TILE), dtype=cp.float32)
    cases = (TileProbeCase * n_tiles)()
    for i in range(n_tiles):
        t = cases[i]
        t.a0, t.a1 = a.ptrs
        t.b0, t.b1 = b.ptrs
        t.c = int(c.data.ptr) + i * TILE * TILE * 4
        t.a_split, t.a_ld, t.a_valid = a.split, a.ld, a.valid
        t.b_split, t.b_ld, t.b_valid = b.split, b.ld, b.valid
        t.k, t.layout = k, layouts[0] | (layouts[1] << 1)
    pr.d_cases = cp.asarray(np.frombuffer(bytes(cases), dtype=np.uint8))
    run = lambda: pr.launch(stream, grid=sms, shared_mem=need, num_cases=n_tiles)  # noqa: E731
    run()
    stream.synchronize()
    got = cp.asnumpy(c[-1])
    _check("timing", got, pr.want[0], (TILE, TILE), 7)
    times = []
    for _ in range(10):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        run()
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1))
    ms = float(np.median(times))
    tflops = 2.0 * TILE * TILE * k * n_tiles / (ms * 1e-3) / 1e12
    print(f"TILE {combo} {ms:.4f} {tflops:.1f}")
