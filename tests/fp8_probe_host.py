"""Host side of the FP8 probe (tests/cuda/fp8_gemm_probe.cu): problem construction, the device
layouts of the operands and scales, and the float64 emulation the GPU test compares against.
Pure NumPy (no GPU): tests/test_fp8_probe_host.py checks it on the CPU.

The oracle is mok_rt.reference.quantize (docs/SEMANTICS.md §10).  The probe's GEMM computes, for
row r of group g and column n,

    C[r, n] = sum_kb  s_a[r, kb] * s_b[g, n // 128, kb] * sum_{k in kb} qa[r, k] * qb[g, n, k]

which is exactly ``dequantize(a) @ dequantize(b[g]).T``: :func:`emulate_gemm` evaluates that in
float64.  The device rounds the scale product and each promotion (fp32), and the tensor cores
round inside each K block; :func:`exact_problem` builds operands for which every one of those
roundings is exact, so there the comparison is bitwise.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from mok_rt.reference.quantize import FP8_BLOCK, QTensor, dequantize, quantize_fp8_block

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
BLOCK_M = 128           # GEMM tile rows
BLOCK_N = 128           # GEMM tile columns (= the weight scale block along N)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_offsets(rows) -> tuple[np.ndarray, np.ndarray]:
    """(row offsets [G+1], row-block offsets [G+1]) of groups with these row counts (any)."""
    rows = np.asarray(list(rows), dtype=np.int64)
    off = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
    tiles = np.concatenate([[0], np.cumsum(-(-rows // BLOCK_M))]).astype(np.int32)
    return off, tiles


def act_scales_kmajor(scales: np.ndarray, ld: int) -> np.ndarray:
    """Activation scales [M, KB] (the oracle's layout) -> the GEMM's [KB, ld] (rows contiguous),
    zeros past row M."""
    m, kb = scales.shape
    assert ld >= m and ld % 4 == 0
    out = np.zeros((kb, ld), dtype=np.float32)
    out[:, :m] = scales.T
    return out


def bits_u8(q: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(q).view(np.uint8)


def bits_u32(s: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(s, dtype=np.float32).view(np.uint32)


def emulate_gemm(a: QTensor, b: QTensor, off: np.ndarray) -> np.ndarray:
    """float64 C [off[-1], N] of the grouped block-scaled GEMM: dequantised operands, exact products."""
    da, db = dequantize(a), dequantize(b)
    out = np.zeros((int(off[-1]), db.shape[1]))
    for g in range(len(off) - 1):
        if off[g + 1] > off[g]:
            out[off[g]:off[g + 1]] = da[off[g]:off[g + 1]] @ db[g].T
    return out


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """Relative Frobenius error (inf when got holds a NaN)."""
    diff = np.linalg.norm(got - want)
    if not np.isfinite(diff):
        return float("inf")
    ref = np.linalg.norm(want)
    return float(diff / ref) if ref > 0 else float(diff)


# ---- problems ---------------------------------------------------------------------------------------

def exact_problem(rng, rows, n: int, k: int, capacity: int) -> tuple[QTensor, QTensor]:
    """Quantised operands whose GEMM the device computes without any rounding: small integer
    E4M3 values (|q| <= 4, so a K block's partial sum is an integer below 2^11 whatever the MMA's
    internal precision) and power-of-two scales in {1/2, 1, 2} (so s_a * s_b and each promoted
    term are exact, and the fp32 total of ceil(K/128) such terms fits 24 bits).  A: [capacity, K]
    with scales [capacity, KB]; B: [G, N, K] with scales [G, NB, KB]."""
    g = len(list(rows))
    kb, nb = cdiv(k, FP8_BLOCK), cdiv(n, BLOCK_N)
    qa = rng.integers(-4, 5, size=(capacity, k)).astype(np.float32).astype(E4M3)
    qb = rng.integers(-4, 5, size=(g, n, k)).astype(np.float32).astype(E4M3)
    sa = np.exp2(rng.integers(-1, 2, size=(capacity, kb))).astype(np.float32)
    sb = np.exp2(rng.integers(-1, 2, size=(g, nb, kb))).astype(np.float32)
    return (QTensor(qa, sa, "fp8_block", (1, FP8_BLOCK)), QTensor(qb, sb, "fp8_block", (FP8_BLOCK, FP8_BLOCK)))


def activation_rows(rng, rows: int, k: int) -> np.ndarray:
    """bf16 [rows, K] with a different magnitude per 1 x 128 block (10^-3 .. 10^4, so many blocks
    hold values far beyond +-448 that their scale brings back), one all-zero block, one row of
    large-magnitude values (1e20) and signed zeros."""
    kb = cdiv(k, FP8_BLOCK)
    mag = 10.0 ** rng.uniform(-3, 4, size=(rows, kb))
    x = rng.standard_normal((rows, k)) * np.repeat(mag, FP8_BLOCK, axis=1)[:, :k]
    if rows > 2:
        x[0, :min(k, FP8_BLOCK)] = 0.0                  # an all-zero block
        x[1, :] *= 1e20                                  # far beyond +-448 (fp32 sums stay finite)
        x[2, ::7] = -0.0
    return x.astype(BF16)


def special_rows(k: int) -> np.ndarray:
    """bf16 rows that exercise every branch of the quantiser (K >= 4 blocks, the last one partial):
    row 0: zero block, tiny block (scale would be subnormal: flushed), huge block, inf block;
    row 1: NaN block, subnormal inputs with a normal amax, exact powers of two (448 * 2^e),
           a block whose elements sit on E4M3 rounding midpoints after scaling."""
    assert k > 3 * FP8_BLOCK and k % 16 == 0
    x = np.zeros((2, k), dtype=np.float32)
    b = [slice(i * FP8_BLOCK, min(k, (i + 1) * FP8_BLOCK)) for i in range(cdiv(k, FP8_BLOCK))]
    rng = np.random.default_rng(99)
    x[0, b[1]] = rng.standard_normal(b[1].stop - b[1].start) * 1e-37
    x[0, b[2]] = rng.standard_normal(b[2].stop - b[2].start) * 1e37
    x[0, b[3]] = rng.standard_normal(b[3].stop - b[3].start)
    x[0, b[3].start + 3] = np.inf
    x[1, b[0]] = rng.standard_normal(b[0].stop - b[0].start)
    x[1, b[0].start + 5] = np.nan
    x[1, b[1]] = rng.standard_normal(b[1].stop - b[1].start) * 1e-39   # bf16 subnormals
    x[1, b[1].start] = 1e-30
    x[1, b[2]] = np.float32(448.0 * 2.0 ** -3) * rng.integers(-8, 9, size=b[2].stop - b[2].start) / 8.0
    x[1, b[2].start] = 448.0 * 2.0 ** -3
    # amax 448 -> s = 1: elements 1.0625 .. midpoints between E4M3 neighbours (ties to even).
    x[1, b[3]] = np.resize(np.array([1.0625, 1.1875, 17.0, -19.0, 448.0, 0.0], dtype=np.float32),
                           b[3].stop - b[3].start)
    return x.astype(BF16)


def weights(rng, groups: int, r: int, c: int) -> np.ndarray:
    """bf16 [G, R, C] ~ N(0, 1/C) with one all-zero 128 x 128 block and one 1e4-scaled block."""
    w = rng.standard_normal((groups, r, c)) / np.sqrt(c)
    w[0, :FP8_BLOCK, :FP8_BLOCK] = 0.0
    if r > FP8_BLOCK and c > FP8_BLOCK:
        w[-1, FP8_BLOCK:, FP8_BLOCK:] *= 1e4
    return w.astype(BF16)


def quantize_rows_ref(x: np.ndarray) -> QTensor:
    return quantize_fp8_block(np.asarray(x).astype(np.float32), (1, FP8_BLOCK))


def quantize_weights_ref(w: np.ndarray) -> tuple[QTensor, QTensor]:
    """(forward copy [G, R, C], transposed copy [G, C, R]) as reference.quantize_experts makes them."""
    q = quantize_fp8_block(np.asarray(w).astype(np.float32), (FP8_BLOCK, FP8_BLOCK))
    qt = QTensor(np.ascontiguousarray(np.swapaxes(q.values, -1, -2)),
                 np.ascontiguousarray(np.swapaxes(q.scales, -1, -2)), "fp8_block", (FP8_BLOCK, FP8_BLOCK))
    return q, qt


# ---- timing problems: random E4M3 bytes (no NaN) and scales ----------------------------------------

def e4m3_table() -> np.ndarray:
    """float64 value of each of the 256 E4M3 bytes (NaN for 0x7f, 0xff)."""
    return np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)


# ---- float64 oracles of the probes' GEMMs (host arrays) ---------------------------------------------

def dequant_rows(q_u8: np.ndarray, sa_kmajor: np.ndarray, k: int) -> np.ndarray:
    """float64 [r, k] of E4M3 activation rows (bytes [r, >= k]) times their 1 x 128 scales, given in the
    GEMM's K-major layout for these rows (sa_kmajor [KB, r])."""
    return e4m3_table()[q_u8] * np.repeat(np.asarray(sa_kmajor, dtype=np.float64).T, FP8_BLOCK, axis=1)[:, :k]


def dequant_weight_blocks(q_u8: np.ndarray, sb: np.ndarray, n: int, k: int) -> np.ndarray:
    """float64 [n, k] of one group's E4M3 weights (bytes [n, k]) with 128 x 128 block scales sb [NB, KB]."""
    sbe = np.repeat(np.repeat(np.asarray(sb, dtype=np.float64), FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[:n, :k]
    return e4m3_table()[q_u8] * sbe


def dequant_weight_cols(q_u8: np.ndarray, sb_cols: np.ndarray, k: int) -> np.ndarray:
    """float64 [n, k] of one group's E4M3 B rows (bytes [n, k]) with one scale per (row, K block):
    sb_cols [KB, n] (a weight gradient's token-direction scales)."""
    return e4m3_table()[q_u8] * np.repeat(np.asarray(sb_cols, dtype=np.float64).T, FP8_BLOCK, axis=1)[:, :k]


def grouped_oracle(qa_u8: np.ndarray, sa_kmajor: np.ndarray, b_of_group, off: np.ndarray, n: int,
                   k: int) -> np.ndarray:
    """float64 C [off[-1], n] of a grouped GEMM: rows off[g] .. off[g + 1] of the dequantised A times
    b_of_group(g)ᵀ (a float64 [n, k], from dequant_weight_blocks / dequant_weight_cols)."""
    total = int(off[-1])
    a = dequant_rows(qa_u8[:total], sa_kmajor[:, :total], k)
    out = np.zeros((total, n))
    for g in range(len(off) - 1):
        if off[g + 1] > off[g]:
            out[off[g]:off[g + 1]] = a[off[g]:off[g + 1]] @ b_of_group(g).T
    return out


def no_nan_bytes(b: np.ndarray) -> np.ndarray:
    """Random bytes with the two NaN encodings replaced by zero (works on NumPy and CuPy arrays)."""
    return b * ((b & 0x7F) != 0x7F).astype(b.dtype)
