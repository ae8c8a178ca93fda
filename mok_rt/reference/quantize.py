"""Block quantisers of the FP8 precisions (docs/SEMANTICS.md §10): the oracle's definition.

Two formats, both with E4M3 elements (``ml_dtypes.float8_e4m3fn``: max ±448, no infinity,
NaN = 0x7F/0xFF):

``"fp8_block"`` (DeepSeek-V3 style)
    Blocks of ``1 × 128`` (activations, along the GEMM's reduction dimension) or ``128 × 128``
    (weights) over the last two axes; the last block along an axis whose length is not a
    multiple of 128 is the remainder.  One fp32 scale per block::

        v     = fp32(a)                         (the quantiser's input is an fp32 value)
        amax  = max |v| over the block          (exact)
        s     = fp32(amax / 448)                (IEEE fp32 division, round to nearest even)
        m     = fp32(448 / amax)                (the block's multiplier, IEEE fp32 division)
        q     = e4m3_rne(clamp(fp32(v · m), -448, 448))   (fp32 product, then one rounding)
        deq   = q · s                           (exact in float64)

    Scaling by a multiplier, as DeepSeek-V3's quantiser does (``x * (448 / amax)``), costs a kernel
    one multiplication per element where ``v / s`` would cost a division.

    ``s < 2^-126`` (an all-zero block, or one so small that its scale would be an fp32
    subnormal) flushes the block: ``s = 0``, every ``q = 0``, ``deq = 0``, no NaN.

``"mxfp8"`` (OCP Microscaling v1.0, MXFP8 E4M3)
    Blocks of ``1 × 32`` along the last axis; one E8M0 scale per block, stored as its biased
    exponent (``uint8``: ``X = 2^(b - 127)``, ``b = 255`` is NaN)::

        shared = floor(log2(amax)) - 8          (8 = emax of E4M3; exact, from the exponent bits)
        shared = max(shared, -127)              (amax = 0 or tiny: the smallest scale, 2^-127)
        q      = e4m3_rne(clamp(v / 2^shared, -448, 448))      (the division is exact)
        deq    = q · 2^shared

    As the spec defines it, ``amax / X`` lies in ``[256, 512)``, so values above ``448 · X``
    saturate to ±448 (the spec's clamp of normal values).

Non-finite inputs (both formats): a block holding a NaN or an ±inf gets a NaN scale (fp32 NaN,
or E8M0 255) and every element of it becomes E4M3 NaN, so the whole block dequantises to NaN.
Nothing raises: the device cannot, and the reference must agree with it.  (A kernel gets this
by computing amax as an integer max over ``bits & 0x7fffffff``, which orders NaN above inf;
``fmaxf`` would drop NaNs.)

Everything here is vectorised NumPy and deterministic: the same input gives the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = [
    "E4M3", "E4M3_MAX", "E4M3_EMAX", "E8M0_BIAS", "E8M0_NAN", "FP8_BLOCK", "MX_BLOCK", "FORMATS",
    "QTensor", "quantize", "dequantize", "fake_quantize", "fake_quantize_columns", "quantize_fp8_block",
    "quantize_mxfp8",
    "QuantizedExperts", "quantize_experts",
]

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0
E4M3_EMAX = 8            # floor(log2(448))
E8M0_BIAS = 127
E8M0_NAN = 255
FP8_BLOCK = 128
MX_BLOCK = 32
FORMATS = ("fp8_block", "mxfp8")
_F32_MIN_NORMAL = np.float32(2.0 ** -126)


@dataclass(frozen=True, eq=False)
class QTensor:
    """A block-quantised array: E4M3 ``values`` of the original shape and one scale per block.

    ``scales`` has the shape of ``values`` with the last two axes divided (rounded up) by
    ``block``: fp32 for ``"fp8_block"``, uint8 biased E8M0 exponents for ``"mxfp8"``."""

    values: np.ndarray
    scales: np.ndarray
    fmt: str
    block: tuple

    @property
    def shape(self) -> tuple:
        return self.values.shape

    def dequantize(self) -> np.ndarray:
        return dequantize(self)


def _blocks(shape: tuple, block: tuple) -> tuple:
    return tuple(-(-n // b) for n, b in zip(shape[-2:], block))


def _block_amax(v: np.ndarray, block: tuple) -> np.ndarray:
    """max |v| over each block of the last two axes (NaN if the block holds a NaN)."""
    br, bc = block
    *lead, r, c = v.shape
    nr, nc = _blocks(v.shape, block)
    a = np.abs(v)
    if nr * br != r or nc * bc != c:   # partial trailing blocks: pad with zeros (never the max)
        pad = [(0, 0)] * len(lead) + [(0, nr * br - r), (0, nc * bc - c)]
        a = np.pad(a, pad)
    a = a.reshape(*lead, nr, br, nc, bc)
    return a.max(axis=(-3, -1))


def _expand(s: np.ndarray, shape: tuple, block: tuple) -> np.ndarray:
    """Broadcast per-block values to the element shape."""
    br, bc = block
    e = np.repeat(np.repeat(s, br, axis=-2), bc, axis=-1)
    return e[..., :shape[-2], :shape[-1]]


def _as_2d(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim == 0:
        raise ValueError("quantize needs at least one dimension")
    return a.reshape(1, -1) if a.ndim == 1 else a


def _to_e4m3(scaled: np.ndarray, bad: np.ndarray) -> np.ndarray:
    """Saturating round-to-nearest-even cast of fp32 values; ``bad`` elements become NaN."""
    with np.errstate(invalid="ignore"):
        v = np.clip(scaled.astype(np.float32), -E4M3_MAX, E4M3_MAX)
    v = np.where(bad, np.float32(np.nan), v)
    return v.astype(E4M3)


def quantize_fp8_block(a, block: tuple = (1, FP8_BLOCK)) -> QTensor:
    """``"fp8_block"`` quantisation over the last two axes (a 1-D array is one row)."""
    shape = np.shape(a)
    v = _as_2d(np.asarray(a)).astype(np.float32)
    block = tuple(int(b) for b in block)
    amax = _block_amax(v, block)
    bad = ~np.isfinite(amax)
    with np.errstate(invalid="ignore", over="ignore"):
        s = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    flush = ~bad & (s < _F32_MIN_NORMAL)
    ok = ~bad & ~flush                  # m is finite and normal exactly here (amax >= 448 * 2^-126)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = np.where(ok, np.float32(E4M3_MAX) / np.where(ok, amax, np.float32(1.0)), np.float32(0.0))
    s = np.where(flush, np.float32(0.0), s)
    s = np.where(bad, np.float32(np.nan), s).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = v * _expand(m, v.shape, block)     # float32 x float32: one fp32 rounding
    scaled = np.where(_expand(ok, v.shape, block), scaled, np.float32(0.0))
    q = _to_e4m3(scaled, _expand(bad, v.shape, block))
    return QTensor(q.reshape(shape), s.reshape(shape[:-1] + s.shape[-1:]) if len(shape) == 1 else s,
                   "fp8_block", block)


def quantize_mxfp8(a, block: tuple = (1, MX_BLOCK)) -> QTensor:
    """``"mxfp8"`` (OCP MX v1.0) quantisation in ``1 × 32`` blocks along the last axis."""
    shape = np.shape(a)
    block = tuple(int(b) for b in block)
    if block != (1, MX_BLOCK):
        raise ValueError(f"mxfp8 blocks are (1, {MX_BLOCK}), got {block}")
    v = _as_2d(np.asarray(a)).astype(np.float32)
    amax = _block_amax(v, block)
    bad = ~np.isfinite(amax)
    _, e = np.frexp(np.where(bad | (amax == 0), np.float32(0.0), amax))   # amax = m·2^e, m in [0.5, 1)
    shared = np.where(amax > 0, e.astype(np.int32) - 1 - E4M3_EMAX, -E8M0_BIAS)
    shared = np.maximum(shared, -E8M0_BIAS)
    biased = np.where(bad, E8M0_NAN, shared + E8M0_BIAS).astype(np.uint8)
    sh = _expand(np.where(bad, 0, shared), v.shape, block)
    scaled = np.ldexp(v.astype(np.float64), -sh)            # exact: a power-of-two division
    q = _to_e4m3(scaled, _expand(bad, v.shape, block))
    return QTensor(q.reshape(shape), biased.reshape(shape[:-1] + biased.shape[-1:]) if len(shape) == 1 else biased,
                   "mxfp8", block)


def quantize(a, fmt: str, block: tuple | None = None) -> QTensor:
    """Quantise ``a`` (any float dtype; rounded to fp32 first) in ``fmt``; ``block`` defaults to
    the activation blocks along the last axis: ``(1, 128)`` or ``(1, 32)``."""
    if fmt == "fp8_block":
        return quantize_fp8_block(a, block or (1, FP8_BLOCK))
    if fmt == "mxfp8":
        return quantize_mxfp8(a, block or (1, MX_BLOCK))
    raise ValueError(f"unknown FP8 format {fmt!r}; expected one of {FORMATS}")


def dequantize(qt: QTensor) -> np.ndarray:
    """The exact float64 value ``q · scale`` of every element (NaN in a NaN block)."""
    shape = qt.values.shape
    q = _as_2d(qt.values).astype(np.float64)
    s = qt.scales if qt.scales.ndim >= 2 else qt.scales.reshape(1, -1)
    if qt.fmt == "fp8_block":
        return (q * _expand(s.astype(np.float64), q.shape, qt.block)).reshape(shape)
    if qt.fmt == "mxfp8":
        b = _expand(s.astype(np.int32), q.shape, qt.block)
        out = np.ldexp(q, np.where(b == E8M0_NAN, 0, b - E8M0_BIAS))
        return np.where(b == E8M0_NAN, np.nan, out).reshape(shape)
    raise ValueError(f"unknown FP8 format {qt.fmt!r}")


def fake_quantize(a, fmt: str, block: tuple | None = None) -> np.ndarray:
    """``dequantize(quantize(a))`` as float64: the value an FP8 GEMM sees for ``a``."""
    return dequantize(quantize(a, fmt, block))


def fake_quantize_columns(a, fmt: str) -> np.ndarray:
    """``fake_quantize`` with the blocks along the FIRST axis of a 2-D ``a``: ``128 × 1`` (or
    ``32 × 1`` for mxfp8), one scale per column and block of rows.  This is the quantisation of
    an operand whose GEMM reduces over rows (a weight gradient: K = tokens); the last block of a
    column is the remainder, which equals zero-padding the rows to a whole block.  Defined as the
    activation quantiser of the transpose, so the two directions share every rounding rule."""
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"fake_quantize_columns needs a 2-D array, got shape {a.shape}")
    if a.size == 0:                                      # no rows (an expert without routes)
        return np.zeros(a.shape)
    return np.ascontiguousarray(fake_quantize(a.T, fmt).T)


# ----------------------------------------------------------------------------------------------
# Expert weights: the forward operands and the dgrad (transposed) operands
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class QuantizedExperts:
    """SwiGLU weights quantised for every GEMM that reads them, each K-major (the GEMM's
    reduction dimension last, as FP8 wgmma needs):

    * forward: ``gate``, ``up`` ``[.., I, H]`` (reduce over H), ``down`` ``[.., H, I]`` (over I);
    * input gradient: ``gate_t``, ``up_t`` ``[.., H, I]`` (``dx = dg @ W_gate`` reduces over I),
      ``down_t`` ``[.., I, H]`` (``da = dy @ W_down`` reduces over H).

    ``"fp8_block"``: 128 × 128 blocks, so a ``*_t`` copy holds the same values and scales
    transposed.  ``"mxfp8"``: 1 × 32 blocks along the reduction dimension, so a ``*_t`` copy is
    quantised afresh along the other dimension (its values differ).  Leading axes (experts)
    are optional: the shared expert has none."""

    fmt: str
    gate: QTensor
    up: QTensor
    down: QTensor
    gate_t: QTensor
    up_t: QTensor
    down_t: QTensor

    def __iter__(self):
        return iter((self.gate, self.up, self.down, self.gate_t, self.up_t, self.down_t))

    def dequantized(self) -> dict:
        """float64 arrays by name, as the GEMMs see them."""
        names = ("gate", "up", "down", "gate_t", "up_t", "down_t")
        return {n: getattr(self, n).dequantize() for n in names}


def _weight_block(fmt: str) -> tuple:
    return (FP8_BLOCK, FP8_BLOCK) if fmt == "fp8_block" else (1, MX_BLOCK)


def _transposed(qt: QTensor) -> QTensor:
    """The same 2-D blocks, transposed (fp8_block's dgrad copy: values and scales unchanged)."""
    return QTensor(np.ascontiguousarray(np.swapaxes(qt.values, -1, -2)),
                   np.ascontiguousarray(np.swapaxes(qt.scales, -1, -2)), qt.fmt, qt.block[::-1])


def quantize_experts(gate, up, down, fmt: str) -> QuantizedExperts:
    """Quantise one group of SwiGLU weights (``[E, I, H]``, ``[E, I, H]``, ``[E, H, I]`` or the
    shared expert's 2-D ones) for the forward and the input-gradient GEMMs."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; expected one of {FORMATS}")
    blk = _weight_block(fmt)
    fwd = [quantize(np.asarray(w), fmt, blk) for w in (gate, up, down)]
    if fmt == "fp8_block":
        bwd = [_transposed(q) for q in fwd]
    else:
        bwd = [quantize(np.swapaxes(np.asarray(w), -1, -2), fmt, blk) for w in (gate, up, down)]
    return QuantizedExperts(fmt, *fwd, *bwd)
