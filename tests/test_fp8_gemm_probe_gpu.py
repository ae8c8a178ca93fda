"""GPU test of the FP8 "fp8_block" engine through its standalone probe (tests/cuda/fp8_gemm_probe.cu).

* fp8_quantize_rows / fp8_quantize_weights against mok_rt.reference.quantize: every E4M3 byte and
  every fp32 scale bitwise (zero, tiny, huge, inf and NaN blocks, subnormal inputs, ties, a partial
  last block), both scale layouts, and the weights' transposed (dgrad) copy; the same for the
  megakernel's pipelined dispatch quantiser (fp8_quantize_rows_pipelined) and the epilogue's
  (fp8_quantize_frag_rows), also over every bf16 input under amaxes from the flush threshold up.
* fp8_gemm_probe (grouped, uneven groups with an empty one, M and N not tile multiples, K not a
  multiple of 128): bitwise against the float64 emulation on operands where no step rounds
  (tests/fp8_probe_host.exact_problem); within TOL_GEMM (relative Frobenius) on random operands
  quantised by the device quantisers; its epilogue quantiser bitwise against the oracle applied to
  the GEMM's own fp32 output; the same bits from every launch, from 1, 3 or all CTAs, and from
  every consumer schedule (fp8_gemm_probe, _overlap, _lean, _lean_turns).
* test_fp8_timing prints "FP8PROBE <kernel> <shape> <ms> <TFLOP/s>" (median of 20 launches, bf16 output).

TOL_GEMM: the fp32 side of the engine (scale products, one fma per promoted K block) costs about
1e-7 here (tests/test_fp8_probe_host.py).  The rest is the tensor cores': Hopper's FP8 MMA does
not keep a full fp32 sum inside a K block (DeepSeek-V3 measured ~14 bits; that is why the engine
promotes every 128 K).  A bitwise or 1e-5 match against float64 is therefore not a property the
hardware offers on general data; the test prints the measured error ("FP8ERR") and holds it to
TOL_GEMM, which leaves a margin over 2^-14.

The probe is compiled here with nvcc into a temporary directory (once per session; skipped
when nvcc is absent).  Buffers are CuPy arrays; launches go through mok_rt.runtime (cuda-python).

Every GEMM test (timings included) runs in a child process of its own (tests/_gpu.run_isolated;
the child loads this process's cubin): a kernel fault kills its process's CUDA context, and the
first GPU run lost 40 tests to one illegal instruction.  MOK_RT_GPU_ISOLATE=0 runs them here.
Outputs are compared as bits: the rows past the groups are NaN by design (poison), and NaN != NaN.
"""
from __future__ import annotations

import ctypes
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from _gpu import cp, median_launch_ms, run_isolated, skip_or_fail  # noqa: E402
import fp8_probe_host as H  # noqa: E402

from mok_rt import build  # noqa: E402
from mok_rt.reference.quantize import FP8_BLOCK, QTensor, quantize_fp8_block  # noqa: E402
from mok_rt.runtime import driver as _driver  # noqa: E402
from mok_rt.runtime.cubins import get_kernel_at  # noqa: E402
from mok_rt.runtime.launch import launch, multiprocessor_count  # noqa: E402
from mok_rt.runtime.tensormap import TensorMapBytes  # noqa: E402

TOL_GEMM = 2e-4
TOL_BF16_OUT = 1e-2
THREADS = 384
# fp8probe::kGemmSmemBytes: ring, the A-scale slots (132 fp32 each, 640 bytes apart), barriers, slack
SMEM_BYTES = 6 * (128 * 128 + 128 * 128) + 6 * 640 + 2 * 6 * 8 + 1024
assert SMEM_BYTES == 201568
# The A-scale box: 132 fp32 from row (row0 & ~3), so that its innermost coordinate is 16-byte
# aligned (an unaligned one is an illegal instruction: the first GPU run's "uneven" case).
SA_BOX = 132
TIMEOUT_NS = 2_000_000_000
# The two consumer schedules (same promotion order, so the same bits): one K block in flight per
# warpgroup, or two (block kb + 1's MMAs overlap block kb's promotion).
KERNELS = ("fp8_gemm_probe", "fp8_gemm_probe_overlap", "fp8_gemm_probe_lean", "fp8_gemm_probe_lean_turns")
F32_NAN = 0x7FC00000


class Fp8GemmParams(ctypes.Structure):
    """Mirror of mok::Fp8GemmParams (fp8_gemm_probe.cu)."""

    _fields_ = [
        ("a", TensorMapBytes), ("b", TensorMapBytes), ("sa", TensorMapBytes),
        ("sb", ctypes.c_uint64), ("group_offset", ctypes.c_uint64), ("tile_offset", ctypes.c_uint64),
        ("c", ctypes.c_uint64), ("cq", ctypes.c_uint64), ("cq_scale", ctypes.c_uint64),
        ("err", ctypes.c_uint64), ("timeout_ns", ctypes.c_int64),
        ("groups", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("max_rows", ctypes.c_int32),
        ("c_bf16", ctypes.c_int32), ("cq_ld", ctypes.c_int32), ("pad_", ctypes.c_int32 * 10),
    ]


class QuantRowsParams(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint64), ("q", ctypes.c_uint64), ("scale", ctypes.c_uint64),
                ("rows", ctypes.c_int32), ("k", ctypes.c_int32), ("s_row", ctypes.c_int64), ("s_kb", ctypes.c_int64)]


class QuantWeightsParams(ctypes.Structure):
    _fields_ = [("w", ctypes.c_uint64), ("q", ctypes.c_uint64), ("s", ctypes.c_uint64), ("qt", ctypes.c_uint64),
                ("st", ctypes.c_uint64), ("groups", ctypes.c_int32), ("r", ctypes.c_int32), ("c", ctypes.c_int32)]


assert ctypes.sizeof(Fp8GemmParams) == 512 and Fp8GemmParams.sb.offset == 384 and Fp8GemmParams.err.offset == 432
assert Fp8GemmParams.groups.offset == 448 and Fp8GemmParams.cq_ld.offset == 468
assert ctypes.sizeof(QuantRowsParams) == 48 and ctypes.sizeof(QuantWeightsParams) == 56

_SOURCE = Path(__file__).resolve().parent / "cuda" / "fp8_gemm_probe.cu"
_CUBIN_ENV = "MOK_FP8_PROBE_CUBIN"   # a child process (run_isolated) loads the parent's cubin
_cubin = Path(os.environ[_CUBIN_ENV]) if os.environ.get(_CUBIN_ENV) else None


def _probe_cubin() -> Path:
    global _cubin
    if _cubin is None:
        try:
            build.find_nvcc()
        except build.BuildError as ex:
            skip_or_fail(f"the FP8 probe is compiled on the fly and needs nvcc: {ex}")
        _cubin = build.compile_cubin(_SOURCE, Path(tempfile.mkdtemp(prefix="mok_fp8_probe_")))
    return _cubin


def _kernel(name: str):
    return get_kernel_at(_probe_cubin(), name, cp.cuda.Device().id)


def _ptr(a) -> int:
    return int(a.data.ptr) if a is not None else 0


def _tmap(address: int, dtype: str, dims, strides, box, swizzle128: bool) -> TensorMapBytes:
    """cuTensorMapEncodeTiled for a UINT8 (E4M3) or FLOAT32 tensor (mok_rt's tensormap module is
    bf16-only; the megakernel's FP8 maps will get their own encoder)."""
    d = _driver.driver
    _driver.init()
    dt = {"u8": d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
          "f32": d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32}[dtype]
    sw = d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if swizzle128 else d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE
    tmap = _driver.call(
        "cuTensorMapEncodeTiled", dt, len(dims), address, [d.cuuint64_t(x) for x in dims],
        [d.cuuint64_t(x) for x in strides], [d.cuuint32_t(x) for x in box], [d.cuuint32_t(1)] * len(dims),
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, sw,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    return TensorMapBytes(*ctypes.string_at(int(tmap.getPtr()), 128))


@pytest.fixture(scope="module")
def stream():
    cp.cuda.Device(0).use()
    cp.zeros(1).sum()
    return cp.cuda.Stream(non_blocking=True)


def _run(kernel, grid, block, params, stream, smem=0):
    launch(kernel, grid=grid, block=block, params=params, stream=stream.ptr, device_id=cp.cuda.Device().id,
           shared_mem=smem)


# ---- quantisers ---------------------------------------------------------------------------------------

def quantize_rows_dev(stream, x_bits, k: int, *, scale_ld: int | None = None, kernel: str = "fp8_quantize_rows",
                     scale_fill: float = 0.0):
    """Device quantiser of bf16 rows; scales [rows, KB], or [KB, scale_ld] when scale_ld is given
    (filled with scale_fill first: the GEMM reads zeros past the rows).
    kernel "fp8_quantize_rows_pipelined" (the megakernel's dispatch quantiser) needs scale_ld."""
    rows = x_bits.shape[0]
    kb = H.cdiv(k, FP8_BLOCK)
    q = cp.full((rows, k), 0xAA, dtype=cp.uint8)
    if scale_ld is None:
        s = cp.full((rows, kb), -1.0, dtype=cp.float32)
        s_row, s_kb = kb, 1
    else:
        s = cp.full((kb, scale_ld), scale_fill, dtype=cp.float32)
        s_row, s_kb = 1, scale_ld
    p = QuantRowsParams(_ptr(x_bits), _ptr(q), _ptr(s), rows, k, s_row, s_kb)
    if kernel == "fp8_quantize_rows":
        grid = max(1, min(264, H.cdiv(rows * kb, 8)))
    else:  # a CTA per 128 rows, as the dispatch's tasks
        assert scale_ld is not None
        grid = max(1, H.cdiv(rows, 128))
    _run(_kernel(kernel), grid, 256, p, stream)
    stream.synchronize()
    return q, s


def quantize_weights_dev(stream, w_bits, groups: int, r: int, c: int):
    rb, cb = H.cdiv(r, FP8_BLOCK), H.cdiv(c, FP8_BLOCK)
    q = cp.full((groups, r, c), 0xAA, dtype=cp.uint8)
    qt = cp.full((groups, c, r), 0xAA, dtype=cp.uint8)
    s = cp.full((groups, rb, cb), -1.0, dtype=cp.float32)
    st = cp.full((groups, cb, rb), -1.0, dtype=cp.float32)
    p = QuantWeightsParams(_ptr(w_bits), _ptr(q), _ptr(s), _ptr(qt), _ptr(st), groups, r, c)
    _run(_kernel("fp8_quantize_weights"), groups * rb * cb, 256, p, stream)
    stream.synchronize()
    return q, s, qt, st


def quantize_frag_rows_dev(stream, x: np.ndarray):
    """The epilogue quantiser (fp8_quantize_frag_rows) on fp32 rows [M, K], K % 8 == 0; returns
    (e4m3 bytes [M, K], scales [M, KB]), both prefilled so an unwritten element shows."""
    rows, k = x.shape
    kb = H.cdiv(k, FP8_BLOCK)
    xd = cp.asarray(np.ascontiguousarray(x, dtype=np.float32))
    q = cp.full((rows, k), 0xAA, dtype=cp.uint8)
    s = cp.full((rows, kb), -1.0, dtype=cp.float32)
    p = QuantRowsParams(_ptr(xd), _ptr(q), _ptr(s), rows, k, kb, 1)
    _run(_kernel("fp8_quantize_frag_rows"), (H.cdiv(rows, 64), kb), 128, p, stream)
    stream.synchronize()
    return q, s


def _dev_bf16(x: np.ndarray):
    return cp.asarray(np.ascontiguousarray(x.astype(H.BF16)).view(np.uint16))


def _assert_q_equal(q_dev, s_dev, want: QTensor, what: str):
    got_q, got_s = cp.asnumpy(q_dev), cp.asnumpy(s_dev).view(np.uint32)
    want_q, want_s = H.bits_u8(want.values), H.bits_u32(want.scales)
    bad_q = np.argwhere(got_q != want_q)
    assert len(bad_q) == 0, f"{what}: {len(bad_q)} E4M3 bytes differ, first at {bad_q[:4].tolist()}: " \
                            f"got {got_q[tuple(bad_q[0])]:#x} want {want_q[tuple(bad_q[0])]:#x}"
    bad_s = np.argwhere(got_s != want_s)
    assert len(bad_s) == 0, f"{what}: {len(bad_s)} scales differ, first at {bad_s[:4].tolist()}: " \
                            f"got {got_s[tuple(bad_s[0])]:#x} want {want_s[tuple(bad_s[0])]:#x}"


@pytest.mark.parametrize("k", [464, 128, 2048])
def test_quantize_rows_bitwise(stream, k):
    rng = np.random.default_rng(k)
    x = H.activation_rows(rng, 37, k)
    if k > 3 * FP8_BLOCK:
        x = np.concatenate([x, H.special_rows(k)])
    want = H.quantize_rows_ref(x)
    if k > 3 * FP8_BLOCK:  # the special blocks are there
        assert np.isnan(want.scales).any() and (want.scales == 0).sum() >= 2
    xd = _dev_bf16(x)
    q, s = quantize_rows_dev(stream, xd, k)
    _assert_q_equal(q, s, want, "rows, scales [M, KB]")
    ld = H.cdiv(x.shape[0], 4) * 4 + 4
    q2, s2 = quantize_rows_dev(stream, xd, k, scale_ld=ld)
    assert cp.array_equal(q2, q)
    assert np.array_equal(cp.asnumpy(s2).view(np.uint32), H.bits_u32(H.act_scales_kmajor(want.scales, ld)))


@pytest.mark.parametrize("k,rows", [(464, 37), (128, 37), (2048, 37), (2112, 300), (1088, 129)])
def test_quantize_rows_pipelined_bitwise(stream, k, rows):
    """The megakernel's dispatch quantiser (moe/tasks/quantize_rows.cuh: quad layout) against the
    oracle, byte for byte and scale for scale, special_rows' blocks included (NaN, inf, flushed,
    subnormal elements); partial last units (1088, 2112) and several tasks."""
    rng = np.random.default_rng(k + rows)
    x = H.activation_rows(rng, rows, k)
    if k > 3 * FP8_BLOCK:
        x = np.concatenate([x[:9], H.special_rows(k), x[9:]])
    want = H.quantize_rows_ref(x)
    m = x.shape[0]
    ld = H.cdiv(m, 4) * 4 + 4
    q, s = quantize_rows_dev(stream, _dev_bf16(x), k, scale_ld=ld, kernel="fp8_quantize_rows_pipelined")
    _assert_q_equal(q, s[:, :m].T, want, "pipelined rows, scales [KB, ld]")


def test_quantize_rows_every_bf16(stream):
    """The dispatch quantiser (quad layout) and the epilogue's (fragment layout, fp32 in) against the
    oracle for every finite bf16 value v with |v| <= amax, both signs, under amaxes from the flush
    threshold (448 * 2^-126) to bf16's largest: each block holds amax and 127 of those values, so every
    product v * fp32(448 / amax) meets cvt's rounding, saturation and subnormal paths."""
    rng = np.random.default_rng(11)
    # 0x04E0 = 448 * 2^-126 (s = 2^-126 exactly, m = 2^126); 0x04DF flushes; 0x43E0 = 448 (m = 1).
    amax_bits = [0x04DF, 0x04E0, 0x04E1, 0x0500, 0x1F80, 0x2F7F, 0x3F80, 0x3F81, 0x43E0, 0x43E1, 0x5F00, 0x7F7F]
    amax_bits += rng.integers(0x04E0, 0x7F7F, size=5).tolist()
    blocks = []
    for a in amax_bits:
        mags = np.arange(0, a + 1, dtype=np.uint16)
        vals = np.concatenate([mags, mags | 0x8000])
        vals = np.concatenate([vals, np.zeros(-len(vals) % (FP8_BLOCK - 1), dtype=np.uint16)])
        body = vals.reshape(-1, FP8_BLOCK - 1)
        blocks.append(np.concatenate([np.full((body.shape[0], 1), a, dtype=np.uint16), body], axis=1))
    bits = np.concatenate(blocks)
    k = 8 * FP8_BLOCK                     # a unit of the dispatch quantiser per row
    bits = np.concatenate([bits, np.zeros((-len(bits) % 8, FP8_BLOCK), dtype=np.uint16)]).reshape(-1, k)
    x = bits.view(H.BF16)
    want = H.quantize_rows_ref(x)
    m = x.shape[0]
    ld = H.cdiv(m, 4) * 4
    q, s = quantize_rows_dev(stream, cp.asarray(bits), k, scale_ld=ld, kernel="fp8_quantize_rows_pipelined",
                             scale_fill=-1.0)   # an unwritten scale (a flushed block's 0) shows
    _assert_q_equal(q, s[:, :m].T, want, "pipelined rows, every bf16")
    q, s = quantize_frag_rows_dev(stream, x.astype(np.float32))
    _assert_q_equal(q, s, want, "fragment rows, every bf16")


def _fp32_special_rows(rng, k: int) -> np.ndarray:
    """fp32 rows for the epilogue quantiser: random significands (not bf16 values) at magnitudes
    10^-3 .. 10^4, and blocks that take every path: zero, flushed (amax < 448 * 2^-126), tiny
    (amax 2^-117 .. 2^-56, subnormal elements among them), signed zeros, huge, inf, NaN, ties after
    scaling by 448 / amax = 2^e, products just around E4M3's smallest subnormal."""
    assert k % FP8_BLOCK == 0
    x = H.activation_rows(rng, 24, k).astype(np.float32)
    x *= np.float32(1.0) + rng.uniform(-2.0 ** -8, 2.0 ** -8, size=x.shape).astype(np.float32)
    n = FP8_BLOCK
    blocks = [np.zeros(n), rng.standard_normal(n) * 1e-37, rng.standard_normal(n) * 2.0 ** -60,
              rng.standard_normal(n) * 2.0 ** -110, rng.standard_normal(n) * 2.0 ** -118,
              np.where(rng.random(n) < 0.5, -0.0, 0.0) + np.r_[2.0 ** -57, np.zeros(n - 1)],
              rng.standard_normal(n) * 1e37, np.r_[np.inf, rng.standard_normal(n - 1)],
              np.r_[-np.inf, np.nan, rng.standard_normal(n - 2)],
              np.resize([448.0, 1.0625, -1.1875, 17.0, -19.0, 0.0, -0.0, 2.0 ** -10, -(2.0 ** -10),
                         3 * 2.0 ** -10, 2.0 ** -11], n) * 2.0 ** -20,
              np.r_[448.0, rng.uniform(-1, 1, n - 1) * 2.0 ** -8], np.r_[448.0, rng.uniform(-1, 1, n - 1) * 2.0 ** -12]]
    sp = np.zeros((len(blocks), k), dtype=np.float32)
    for i, b in enumerate(blocks):
        sp[i, (i % (k // n)) * n:(i % (k // n) + 1) * n] = np.asarray(b, dtype=np.float64).astype(np.float32)
    sp[4, 1] = np.float32(2.0 ** -140)   # a subnormal input in a tiny block (m near 2^116)
    return np.concatenate([x[:7], sp, x[7:]])


@pytest.mark.parametrize("k", [128, 512])
def test_quantize_frag_rows_fp32_bitwise(stream, k):
    """The gate|up epilogue's quantiser (common/fp8.cuh quantize_frag_row128: fragment layout) on
    fp32 rows, byte for byte and scale for scale against the oracle."""
    x = _fp32_special_rows(np.random.default_rng(k), k)
    q, s = quantize_frag_rows_dev(stream, x)
    _assert_q_equal(q, s, H.quantize_rows_ref(x), "fragment rows (fp32), scales [M, KB]")


@pytest.mark.parametrize("shape", [(2, 272, 400), (1, 128, 128), (3, 384, 768)])
def test_quantize_weights_bitwise(stream, shape):
    g, r, c = shape
    rng = np.random.default_rng(r + c)
    w = H.weights(rng, g, r, c).astype(np.float32)
    if r > 128:
        w[0, 130, 5] = np.nan                       # a NaN block
        w[0, 200:220, 140:150] = 1e-40              # subnormal inputs (the block also holds normal values)
    w = w.astype(H.BF16)
    want, want_t = H.quantize_weights_ref(w)
    q, s, qt, st = quantize_weights_dev(stream, _dev_bf16(w), g, r, c)
    _assert_q_equal(q, s, want, "weights, forward copy")
    _assert_q_equal(qt, st, want_t, "weights, transposed copy")


# ---- the GEMM -----------------------------------------------------------------------------------------

class Gemm:
    """One grouped FP8 GEMM on the device from device operands: qa [cap, K] u8, sa_kmajor
    [KB, sa_ld] f32, qb [G, N, K] u8, sb [G, NB, KB] f32."""

    def __init__(self, *, rows, n, k, qa, sa_kmajor, qb, sb, c_bf16=False, quantize_out=False,
                 kernel=KERNELS[0]):
        self.rows, self.n, self.k = list(rows), n, k
        self.groups = len(self.rows)
        self.off, self.tiles = H.group_offsets(self.rows)
        self.total = int(self.off[-1])
        self.cap = qa.shape[0]
        assert self.total <= self.cap and qa.shape == (self.cap, k) and qb.shape == (self.groups, n, k)
        kb, nb = H.cdiv(k, FP8_BLOCK), H.cdiv(n, H.BLOCK_N)
        assert sa_kmajor.shape[0] == kb and sa_kmajor.shape[1] >= self.cap and sb.shape == (self.groups, nb, kb)
        self.qa, self.sa, self.qb, self.sb = qa, sa_kmajor, qb, sb
        self.d_off, self.d_tiles = cp.asarray(self.off), cp.asarray(self.tiles)
        self.c_bf16 = c_bf16
        self.c = cp.empty((self.cap, n), dtype=cp.uint16 if c_bf16 else cp.float32)
        self.cq_ld = H.cdiv(self.cap, 4) * 4
        self.cq = cp.empty((self.cap, n), dtype=cp.uint8) if quantize_out else None
        self.cq_scale = cp.empty((nb, self.cq_ld), dtype=cp.float32) if quantize_out else None
        self.err = cp.zeros(4, dtype=cp.int32)
        p = Fp8GemmParams()
        p.a = _tmap(_ptr(qa), "u8", (k, self.cap), (k,), (128, 128), True)
        p.b = _tmap(_ptr(qb), "u8", (k, n, self.groups), (k, n * k), (128, 128, 1), True)
        assert sa_kmajor.shape[1] % 4 == 0, "scale rows must start 16-byte aligned (TMA)"
        p.sa = _tmap(_ptr(sa_kmajor), "f32", (self.cap, kb), (sa_kmajor.shape[1] * 4,), (SA_BOX, 1), False)
        p.sb, p.group_offset, p.tile_offset = _ptr(sb), _ptr(self.d_off), _ptr(self.d_tiles)
        p.c, p.cq, p.cq_scale, p.err = _ptr(self.c), _ptr(self.cq), _ptr(self.cq_scale), _ptr(self.err)
        p.timeout_ns = TIMEOUT_NS
        p.groups, p.n, p.k, p.max_rows, p.c_bf16, p.cq_ld = self.groups, n, k, self.cap, int(c_bf16), self.cq_ld
        self.params = p
        self.kernel = _kernel(kernel)
        self.num_tiles = int(self.tiles[-1]) * nb

    def launch(self, stream, max_ctas=None):
        g = min(multiprocessor_count(cp.cuda.Device().id), max(self.num_tiles, 1))
        _run(self.kernel, min(g, max_ctas) if max_ctas else g, THREADS, self.params, stream, SMEM_BYTES)

    def run(self, stream, max_ctas=None):
        """Poison the outputs, launch, wait; the error word must stay clear.  Returns C's bits."""
        self.c.view(cp.uint32 if not self.c_bf16 else cp.uint16).fill(F32_NAN if not self.c_bf16 else 0x7FC0)
        if self.cq is not None:
            self.cq.fill(0xAA)
            self.cq_scale.fill(-1.0)
        stream.synchronize()
        self.launch(stream, max_ctas)
        stream.synchronize()
        err = cp.asnumpy(self.err)
        assert not err.any(), f"device error word set: {err.tolist()}"
        return self.c.copy()

    def c_f64(self, c) -> np.ndarray:
        h = cp.asnumpy(c)
        return (h.view(H.BF16) if self.c_bf16 else h).astype(np.float64)


def _gemm_from_host(a: QTensor, b: QTensor, rows, *, cls=None, **kw) -> Gemm:
    """A Gemm (or ``cls``, a subclass) on device copies of host-quantised operands."""
    ld = H.cdiv(a.values.shape[0], 4) * 4
    return (cls or Gemm)(rows=rows, n=b.values.shape[1], k=b.values.shape[2],
                qa=cp.asarray(H.bits_u8(a.values)), sa_kmajor=cp.asarray(H.act_scales_kmajor(a.scales, ld)),
                qb=cp.asarray(H.bits_u8(b.values)), sb=cp.asarray(np.ascontiguousarray(b.scales)), **kw)


def _bits(c):
    """C's bits (fp32 -> uint32, bf16 is uint16 already): NaN rows compare equal as bits."""
    return c.view(cp.uint32) if c.dtype == cp.float32 else c.view(cp.uint16)


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and bool(cp.array_equal(_bits(a), _bits(b)))


def _check_repeatable(stream, gm: Gemm, c):
    for ctas in (None, 1, 3):
        assert _same_bits(gm.run(stream, max_ctas=ctas), c), f"a run on {ctas or 'all'} CTAs gave other bits"


def _check_out_quantizer(gm: Gemm, c):
    """The epilogue's 1 x 128 quantiser on the GEMM's fp32 rows == the oracle on the same fp32 values."""
    want = quantize_fp8_block(cp.asnumpy(c)[: gm.total], (1, FP8_BLOCK))
    _assert_q_equal(gm.cq[: gm.total], cp.ascontiguousarray(gm.cq_scale[:, : gm.total].T), want, "epilogue quantiser")


EXACT = {
    # uneven groups with an empty one, M, N and K all off the tile / block grid (K = 3 blocks + 16)
    "uneven": dict(rows=[200, 0, 77, 300, 128], n=320, k=400, extra=50),
    "one_block": dict(rows=[128], n=128, k=128, extra=0),
    "tiny": dict(rows=[5], n=8, k=16, extra=3),
    "long_k": dict(rows=[256, 129], n=256, k=1024, extra=0),
    "three_blocks": dict(rows=[128, 64], n=128, k=384, extra=1),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", sorted(EXACT))
def test_gemm_exact_bitwise(request, stream, case, kernel):
    if run_isolated(request, env={_CUBIN_ENV: str(_probe_cubin())}) is not None:
        return
    cfg = EXACT[case]
    rng = np.random.default_rng(len(case))
    cap = sum(cfg["rows"]) + cfg["extra"]
    a, b = H.exact_problem(rng, cfg["rows"], cfg["n"], cfg["k"], cap)
    gm = _gemm_from_host(a, b, cfg["rows"], quantize_out=True, kernel=kernel)
    want = H.emulate_gemm(a, b, gm.off)
    assert np.array_equal(want.astype(np.float32).astype(np.float64), want)   # fp32-exact by construction
    c = gm.run(stream)
    got = gm.c_f64(c)
    bad = np.argwhere(got[: gm.total] != want)
    assert len(bad) == 0, f"{len(bad)} of {want.size} outputs differ, first {bad[:4].tolist()}: " \
                          f"got {got[tuple(bad[0])]} want {want[tuple(bad[0])]}"
    assert np.isnan(got[gm.total:]).all(), "rows past the groups were written"
    _check_out_quantizer(gm, c)
    _check_repeatable(stream, gm, c)


RANDOM = {
    "uneven": dict(rows=[256, 130, 0, 77], n=384, k=592),
    "partial_n": dict(rows=[300], n=200, k=256),
    "qwen3_like": dict(rows=[128, 384, 1, 255], n=1536, k=2048),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", sorted(RANDOM))
def test_gemm_random(request, stream, case, kernel):
    """Operands made by the device quantisers (checked bitwise against the oracle on the way), then
    the GEMM against the float64 emulation of the same quantised operands."""
    if run_isolated(request, env={_CUBIN_ENV: str(_probe_cubin())}) is not None:
        return
    cfg = RANDOM[case]
    rows, n, k = cfg["rows"], cfg["n"], cfg["k"]
    rng = np.random.default_rng(7 + n)
    total = sum(rows)
    x = H.activation_rows(rng, total + 8, k)
    w = H.weights(rng, len(rows), n, k)
    ld = H.cdiv(x.shape[0], 4) * 4
    qa, sa = quantize_rows_dev(stream, _dev_bf16(x), k, scale_ld=ld)
    qb, sb, _, _ = quantize_weights_dev(stream, _dev_bf16(w), len(rows), n, k)
    a_ref, (b_ref, _) = H.quantize_rows_ref(x), H.quantize_weights_ref(w)
    assert np.array_equal(cp.asnumpy(qa), H.bits_u8(a_ref.values))
    assert np.array_equal(cp.asnumpy(sa).view(np.uint32), H.bits_u32(H.act_scales_kmajor(a_ref.scales, ld)))
    assert np.array_equal(cp.asnumpy(qb), H.bits_u8(b_ref.values))
    gm = Gemm(rows=rows, n=n, k=k, qa=qa, sa_kmajor=sa, qb=qb, sb=sb, quantize_out=True, kernel=kernel)
    c = gm.run(stream)
    got = gm.c_f64(c)[: gm.total]
    want = H.emulate_gemm(a_ref, b_ref, gm.off)
    err = H.rel_err(got, want)
    # Row-wise too: rows have very different magnitudes (activation_rows), so a norm over all of
    # C would hide the small rows.
    row_err = max(H.rel_err(got[i], want[i]) for i in range(gm.total) if np.any(want[i]))
    print(f"\nFP8ERR {kernel} {case} frobenius {err:.3g} worst_row {row_err:.3g}")
    assert err <= TOL_GEMM and row_err <= 5 * TOL_GEMM, f"relative error {err:.3g}, worst row {row_err:.3g}"
    _check_out_quantizer(gm, c)
    _check_repeatable(stream, gm, c)
    other = [kn for kn in KERNELS if kn != kernel][0]
    assert _same_bits(Gemm(rows=rows, n=n, k=k, qa=qa, sa_kmajor=sa, qb=qb, sb=sb, kernel=other).run(stream), c), \
        f"{kernel} and {other} disagree"


@pytest.mark.parametrize("kernel", KERNELS)
def test_gemm_no_rows(request, stream, kernel):
    if run_isolated(request, env={_CUBIN_ENV: str(_probe_cubin())}) is not None:
        return
    rng = np.random.default_rng(3)
    a, b = H.exact_problem(rng, [0, 0], 128, 128, 128)
    gm = _gemm_from_host(a, b, [0, 0], kernel=kernel)
    assert np.isnan(gm.c_f64(gm.run(stream))).all()


# ---- timing ---------------------------------------------------------------------------------------------

TIMING = {
    "dense_4096": dict(groups=1, rows=4096, n=4096, k=4096),
    "qwen3_gate_up_g128x128": dict(groups=128, rows=128, n=1536, k=2048),
    "qwen3_down_g128x128": dict(groups=128, rows=128, n=2048, k=768),
    # the bf16 probe's shape (test_gemm_probe_gpu.py: 131072 routed rows), for a direct comparison
    "qwen3_gate_up_g128x1024": dict(groups=128, rows=1024, n=1536, k=2048),
    "qwen3_down_g128x1024": dict(groups=128, rows=1024, n=2048, k=768),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", list(TIMING))
def test_fp8_timing(request, stream, capsys, shape, kernel):
    if run_isolated(request, env={_CUBIN_ENV: str(_probe_cubin())}) is not None:
        return
    t = TIMING[shape]
    g, rows, n, k = t["groups"], t["rows"], t["n"], t["k"]
    m = g * rows
    kb, nb = H.cdiv(k, FP8_BLOCK), H.cdiv(n, H.BLOCK_N)
    cp.random.seed(5)
    qa = H.no_nan_bytes(cp.random.randint(0, 256, size=(m, k), dtype=cp.int32).astype(cp.uint8))
    qb = H.no_nan_bytes(cp.random.randint(0, 256, size=(g, n, k), dtype=cp.int32).astype(cp.uint8))
    sa = cp.random.uniform(0.5, 1.5, size=(kb, m)).astype(cp.float32) * np.float32(1 / 448)
    sb = cp.random.uniform(0.5, 1.5, size=(g, nb, kb)).astype(cp.float32) * np.float32(1 / 448)
    gm = Gemm(rows=[rows] * g, n=n, k=k, qa=qa, sa_kmajor=sa, qb=qb, sb=sb, c_bf16=True, kernel=kernel)
    c = gm.run(stream)
    # float64 check on up to 4 groups x 128 rows (bf16 output).
    rng = np.random.default_rng(1)
    sel = np.sort(rng.choice(g, size=min(4, g), replace=False))
    got, want = [], []
    for gi in sel:
        r = gi * rows + np.sort(rng.choice(rows, size=min(128, rows), replace=False))
        a_deq = H.dequant_rows(cp.asnumpy(qa[cp.asarray(r)]), cp.asnumpy(sa[:, cp.asarray(r)]), k)
        b_deq = H.dequant_weight_blocks(cp.asnumpy(qb[int(gi)]), cp.asnumpy(sb[int(gi)]), n, k)
        want.append(a_deq @ b_deq.T)
        got.append(gm.c_f64(c[cp.asarray(r)]))
    err = H.rel_err(np.concatenate(got), np.concatenate(want))
    assert err <= TOL_BF16_OUT, f"relative error {err:.3g}"

    ms = median_launch_ms(gm.launch, stream)
    assert not cp.asnumpy(gm.err).any()
    tflops = 2.0 * m * n * k / (ms * 1e-3) / 1e12
    with capsys.disabled():
        print(f"\nFP8PROBE {kernel} {shape} {ms:.3f} {tflops:.1f}")
