"""CPU checks of the FP8 probe's host side (tests/fp8_probe_host.py), which the GPU test
(tests/test_fp8_gemm_probe_gpu.py) relies on: the problems really exercise what they claim, the
scale layouts, and the error budget of the engine's fp32 side (the promotion order of the device,
emulated in float32 here) -- which is what separates the GEMM's tolerance from the tensor cores'.
"""
from __future__ import annotations

import numpy as np
import pytest

import fp8_probe_host as H
from mok_rt.reference.quantize import FP8_BLOCK, QTensor, dequantize


def _device_order_fp32(a: QTensor, b: QTensor, off: np.ndarray) -> np.ndarray:
    """The probe's data flow with an exact MMA: per K block the exact partial sum rounded to fp32,
    s = fp32(s_a * s_b), total = fp32(partial * s + total) (an fma: one rounding; float64 holds
    partial * s exactly, so one rounding of the float64 sum models it except in double-rounding
    ties, irrelevant at this size)."""
    qa, qb = a.values.astype(np.float64), b.values.astype(np.float64)
    k = qa.shape[1]
    out = np.zeros((int(off[-1]), qb.shape[1]), dtype=np.float32)
    for g in range(len(off) - 1):
        r0, r1 = off[g], off[g + 1]
        if r1 == r0:
            continue
        sb = np.repeat(b.scales[g], H.BLOCK_N, axis=0)[: qb.shape[1]]   # [N, KB]
        for kb in range(H.cdiv(k, FP8_BLOCK)):
            ks = slice(kb * FP8_BLOCK, min(k, (kb + 1) * FP8_BLOCK))
            part = (qa[r0:r1, ks] @ qb[g][:, ks].T).astype(np.float32)
            s = (a.scales[r0:r1, kb][:, None] * sb[None, :, kb]).astype(np.float32)
            out[r0:r1] = (part.astype(np.float64) * s.astype(np.float64) + out[r0:r1]).astype(np.float32)
    return out.astype(np.float64)


def test_group_offsets():
    off, tiles = H.group_offsets([200, 0, 77, 300, 128])
    assert off.tolist() == [0, 200, 200, 277, 577, 705]
    assert tiles.tolist() == [0, 2, 2, 3, 6, 7]


def test_act_scales_kmajor():
    s = np.arange(12, dtype=np.float32).reshape(3, 4) + 1
    t = H.act_scales_kmajor(s, 8)
    assert t.shape == (4, 8) and np.array_equal(t[:, :3], s.T) and not t[:, 3:].any()


@pytest.mark.parametrize("rows,n,k", [([200, 0, 77, 300, 128], 320, 400), ([256, 129], 256, 1024), ([5], 8, 16)])
def test_exact_problem_is_exact(rows, n, k):
    rng = np.random.default_rng(1)
    a, b = H.exact_problem(rng, rows, n, k, sum(rows) + 3)
    off, _ = H.group_offsets(rows)
    want = H.emulate_gemm(a, b, off)
    assert np.array_equal(want.astype(np.float32).astype(np.float64), want)
    assert np.array_equal(_device_order_fp32(a, b, off), want)
    # Integer E4M3 with |q| <= 4, partial sums below 2^11: exact in any accumulator of >= 12 bits.
    assert np.abs(a.values.astype(np.float64)).max() <= 4 and np.abs(b.values.astype(np.float64)).max() <= 4
    assert set(np.unique(a.scales)) <= {0.5, 1.0, 2.0}


def test_fp32_side_error_budget():
    """With an exact MMA, the fp32 promotion alone lands ~1e-7 from the float64 emulation: the
    GEMM's tolerance is all the tensor cores' (see test_fp8_gemm_probe_gpu.TOL_GEMM)."""
    rng = np.random.default_rng(2)
    rows, n, k = [256, 130, 0, 77], 256, 592
    x = H.activation_rows(rng, sum(rows), k)
    w = H.weights(rng, len(rows), n, k)
    a, (b, _) = H.quantize_rows_ref(x), H.quantize_weights_ref(w)
    off, _ = H.group_offsets(rows)
    want = H.emulate_gemm(a, b, off)
    got = _device_order_fp32(a, b, off)
    err = H.rel_err(got, want)
    rows_err = max(H.rel_err(got[i], want[i]) for i in range(len(want)) if np.any(want[i]))
    assert err < 1e-6 and rows_err < 1e-6, (err, rows_err)


def test_special_rows_hit_every_branch():
    k = 464
    q = H.quantize_rows_ref(H.special_rows(k))
    s = q.scales
    assert s.shape == (2, 4)
    assert s[0, 0] == 0 and s[0, 1] == 0                       # zero block, flushed tiny block
    assert np.isfinite(s[0, 2]) and s[0, 2] > 1e30             # huge block
    assert np.isnan(s[0, 3]) and np.isnan(s[1, 0])             # inf block, NaN block
    assert (H.bits_u8(q.values[0, 384:464]) == 0x7F).all()     # the inf block is all NaN
    assert s[1, 1] > 0 and s[1, 2] == np.float32(0.125) and s[1, 3] == 1.0
    # ties to even: 1.0625 -> 1.0, 1.1875 -> 1.25, 17 -> 16, -19 -> -20; 168 (= 56 * 3) -> 160
    v = q.values[1, 384:390].astype(np.float64)
    assert v.tolist() == [1.0, 1.25, 16.0, -20.0, 448.0, 0.0]
    deq = dequantize(q)
    assert np.isnan(deq[1, :128]).all() and not np.isnan(deq[1, 128:]).any()


def test_activation_rows_and_weights_have_their_blocks():
    rng = np.random.default_rng(3)
    x = H.activation_rows(rng, 10, 464)
    q = H.quantize_rows_ref(x)
    assert q.scales[0, 0] == 0 and (np.abs(x.astype(np.float64)) > 448).any()
    assert np.isfinite(q.scales).all()
    w = H.weights(rng, 2, 272, 400)
    qw, qt = H.quantize_weights_ref(w)
    assert qw.scales.shape == (2, 3, 4) and qw.scales[0, 0, 0] == 0
    assert qt.values.shape == (2, 400, 272) and np.array_equal(qt.scales, np.swapaxes(qw.scales, 1, 2))


def test_no_nan_bytes_and_table():
    b = np.arange(256, dtype=np.uint8)
    t = H.e4m3_table()
    assert np.isnan(t[0x7F]) and np.isnan(t[0xFF]) and t[0x7E] == 448.0
    assert not np.isnan(t[H.no_nan_bytes(b)]).any()
