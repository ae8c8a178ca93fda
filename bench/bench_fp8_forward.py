"""The "fp8_block" forward against the bf16 forward of mok_rt on one GPU (issue 18 step 2).

    python bench/bench_fp8_forward.py                       # qwen3-30b-a3b, deepseek-v3-ep8-slice, deepseek-v3-shared
    python bench/bench_fp8_forward.py --shapes quick,quick-shared --iters 5
    python bench/bench_fp8_forward.py --shapes qwen3-30b-a3b --tokens 4096
    python bench/bench_fp8_forward.py --shapes qwen3-30b-a3b --backward   # forward + backward too

Per shape (bench_moe.SHAPES; one GPU, all experts local) it prints the mean time of a forward in
bf16 and in fp8_block (on QuantizedWeights made once by mok.quantize_weights, as a training step
would), their ratio, TFLOP/s (bench_moe's FLOP count), the time of quantize_weights, and the
relative Frobenius difference between the two outputs (FP8's own error: ~6% against the exact
layer, docs/SEMANTICS.md §10; a gross mismatch means a broken kernel).  Times are wall-clock over
`iters` calls enqueued back to back on the workspace's stream, one synchronize at the end (the
host runs ahead of the GPU, as in training).  ``--backward`` also times forward + backward (one
step's layer work, 3x the forward's FLOPs; fp8 on the QuantizedWeights with their transposed
copies) and compares the two dx (the FP8 backward's kernel is incomplete on some branches: it then
reports an internal device error).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import SHAPES  # noqa: E402

import mok_rt as mok  # noqa: E402
from mok_rt.interop import dtypes  # noqa: E402

DEFAULT = ("qwen3-30b-a3b", "deepseek-v3-ep8-slice", "deepseek-v3-shared")


def _device(arr: np.ndarray, stream):
    t = mok.Tensor.empty(arr.shape, dtypes.as_dtype(arr.dtype), device_id=0, stream=stream)
    t.copy_from_numpy(arr, stream=stream)
    return t


def _problem(shape, tokens: int, stream, seed: int = 0):
    rng = np.random.default_rng(seed)
    H, I, E, k, Is = shape.hidden, shape.intermediate, shape.experts, shape.top_k, shape.shared

    def bf16(*dims, scale=1.0):
        return _device((rng.standard_normal(dims, dtype=np.float32) * scale).astype(ml_dtypes.bfloat16), stream)

    logits = rng.standard_normal((tokens, E), dtype=np.float32)
    ids = np.argpartition(-logits, k - 1, axis=1)[:, :k].astype(np.int32)
    p = {"x": bf16(tokens, H), "ids": _device(ids, stream),
         "tw": _device(rng.random((tokens, k), dtype=np.float32) / k, stream),
         "experts": mok.ExpertWeights(bf16(E, I, H, scale=H ** -0.5), bf16(E, I, H, scale=H ** -0.5),
                                      bf16(E, H, I, scale=I ** -0.5)),
         "shared": None}
    if Is:
        p["shared"] = mok.ExpertWeights(bf16(Is, H, scale=H ** -0.5), bf16(Is, H, scale=H ** -0.5),
                                        bf16(H, Is, scale=Is ** -0.5))
    return p


def _time(ws, fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    ws.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    ws.synchronize()
    return (time.perf_counter() - t0) * 1e3 / iters


def run_shape(shape, tokens: int, iters: int, warmup: int, backward: bool = False) -> str:
    common = dict(hidden=shape.hidden, intermediate=shape.intermediate, num_experts=shape.experts,
                  top_k=shape.top_k, shared_intermediate=shape.shared, swiglu_limit=shape.swiglu_limit)
    res = {}
    for precision in ("bf16", "fp8_block"):
        with mok.Workspace(mok.MoEConfig(**common, precision=precision), max_tokens=tokens) as ws:
            p = _problem(shape, tokens, ws.stream)
            d_out = _device(np.random.default_rng(1).standard_normal((tokens, shape.hidden), dtype=np.float32)
                            .astype(ml_dtypes.bfloat16), ws.stream)
            sched = mok.schedule(ws, p["ids"])
            if precision == "bf16":
                weights, kw = p["experts"], {"shared": p["shared"]}
            else:
                res["quantize_ms"] = _time(ws, lambda: mok.quantize_weights(ws, p["experts"], p["shared"]),
                                           max(3, iters // 4), 1)
                weights, kw = mok.quantize_weights(ws, p["experts"], p["shared"]), {}
            res[precision] = _time(ws, lambda: mok.forward(ws, sched, p["x"], p["tw"], weights, **kw), iters, warmup)
            out, _ = mok.forward(ws, sched, p["x"], p["tw"], weights, **kw)
            ws.synchronize()
            res[precision + "_out"] = out.to_numpy().astype(np.float64)
            if backward:
                def step():
                    _, ctx = mok.forward(ws, sched, p["x"], p["tw"], weights, **kw)
                    return mok.backward(ws, ctx, d_out)
                res[precision + "_fb"] = _time(ws, step, iters, warmup)
                res[precision + "_dx"] = step().dx.to_numpy().astype(np.float64)
    a, b = res["fp8_block_out"], res["bf16_out"]
    diff = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)) if np.isfinite(a).all() else float("inf")
    tf = shape.forward_flops(tokens) / 1e9
    line = (f"{shape.name:24s} T={tokens:6d}  bf16 {res['bf16']:8.3f} ms ({tf / res['bf16']:6.1f} TFLOP/s)  "
            f"fp8_block {res['fp8_block']:8.3f} ms ({tf / res['fp8_block']:6.1f} TFLOP/s)  "
            f"fp8/bf16 {res['fp8_block'] / res['bf16']:5.2f}x  quantize_weights {res['quantize_ms']:7.3f} ms  "
            f"|out_fp8 - out_bf16| / |out_bf16| = {diff:.3f}")
    if backward:
        a, b = res["fp8_block_dx"], res["bf16_dx"]
        ddx = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)) if np.isfinite(a).all() else float("inf")
        fb, fb8 = res["bf16_fb"], res["fp8_block_fb"]
        line += (f"\n{'':24s} f+b     bf16 {fb:8.3f} ms ({3 * tf / fb:6.1f} TFLOP/s)  fp8_block {fb8:8.3f} ms "
                 f"({3 * tf / fb8:6.1f} TFLOP/s)  fp8/bf16 {fb8 / fb:5.2f}x  |dx_fp8 - dx_bf16| / |dx_bf16| = {ddx:.3f}")
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(DEFAULT), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", type=int, default=None, help="tokens (default: the shape's)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backward", action="store_true", help="also time forward + backward and compare dx")
    args = ap.parse_args(argv)
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        print(run_shape(shape, args.tokens or shape.tokens, args.iters, args.warmup, args.backward), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
