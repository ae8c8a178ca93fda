"""Train a small MoE layer with mok_rt on a synthetic regression task and print the loss per step.

A fixed "teacher" MoE layer produces the targets; a "student" layer with the same routing starts
from other random weights and learns them with Adam through mok_rt's forward and backward.  Every
step draws a fresh batch of inputs from the same distribution, so the printed loss is the
student's error on data it has not trained on yet: it falls as the student learns the teacher.

    python samples/train_moe.py                      # CUDA + CuPy when a GPU is present
    python samples/train_moe.py --backend reference  # NumPy reference, any machine (default without a GPU)
    python samples/train_moe.py --precision fp8_block  # the GEMMs in block-scaled FP8 (E4M3)
"""
from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

import mok_rt as mok

BF16 = ml_dtypes.bfloat16


def gpu_available() -> bool:
    return mok.device_count() > 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cuda", "reference"), default=None,
                    help="default: cuda when a GPU is present, else reference")
    ap.add_argument("--precision", choices=("bf16", "fp8_block"), default="bf16",
                    help="fp8_block: E4M3 GEMMs, the weights quantised once per step (the reference "
                         "backend emulates them)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    backend = args.backend or ("cuda" if gpu_available() else "reference")
    if backend == "cuda":
        if not gpu_available():
            raise SystemExit("--backend cuda needs a CUDA GPU (none found); without --backend this sample "
                             "runs on the NumPy reference")
        try:
            import cupy as xp
        except ImportError:
            raise SystemExit("--backend cuda needs CuPy: pip install -e '.[cupy]'") from None
        H, I, E, k, Is, T = 1024, 512, 16, 4, 512, 4096
    else:
        xp = np
        H, I, E, k, Is, T = 128, 64, 8, 2, 64, 512
        if args.backend is None:
            print("no GPU found: running on the NumPy reference backend (pass --backend cuda on a GPU machine)")
    print(f"backend={backend}  precision={args.precision}  H={H} I={I} experts={E} top_k={k} shared={Is} tokens={T}")

    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k, shared_intermediate=Is,
                        precision=args.precision)
    rng = np.random.default_rng(args.seed)

    def param(*shape, scale):
        return xp.asarray((rng.standard_normal(shape) * scale).astype(np.float32))

    def layer_params():
        return {"w_gate": param(E, I, H, scale=H ** -0.5), "w_up": param(E, I, H, scale=H ** -0.5),
                "w_down": param(E, H, I, scale=I ** -0.5), "ws_gate": param(Is, H, scale=H ** -0.5),
                "ws_up": param(Is, H, scale=H ** -0.5), "ws_down": param(H, Is, scale=Is ** -0.5)}

    teacher, student = layer_params(), layer_params()
    router = xp.asarray(rng.standard_normal((H, E)).astype(np.float32))
    bf = {n: v.astype(BF16) for n, v in teacher.items()}

    def experts(p):  # (routed, shared) mok.ExpertWeights of a parameter dict
        return (mok.ExpertWeights(gate=p["w_gate"], up=p["w_up"], down=p["w_down"]),
                mok.ExpertWeights(gate=p["ws_gate"], up=p["ws_up"], down=p["ws_down"]))

    def run_forward(ws, sched, x, w, p):  # with FP8, quantise the bf16 weights once (per optimizer step)
        routed, shared = experts(p)
        if args.precision == "bf16":
            return mok.forward(ws, sched, x, w, routed, shared=shared)
        return mok.forward(ws, sched, x, w, mok.quantize_weights(ws, routed, shared))

    def grad_of(g, n):  # the gradient of parameter n in mok.Gradients g
        part = n.split("_")[1]
        return getattr(g.dw_shared if n.startswith("ws_") else g.dw, part)

    def batch(step):
        r = np.random.default_rng(1000 + step)                # a fresh batch every step
        x = xp.asarray(r.standard_normal((T, H)).astype(np.float32))
        logits = x @ router
        ids = xp.argsort(-logits, axis=1)[:, :k].astype(np.int32)
        top = xp.take_along_axis(logits, ids, axis=1)
        w = xp.exp(top - top.max(axis=1, keepdims=True))
        return x.astype(BF16), ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)

    def as_array(t):  # mok_rt results export through DLPack without a copy
        return xp.from_dlpack(t) if backend == "cuda" else t.to_numpy()

    group = mok.SingleProcessGroup(devices=[0]) if backend == "cuda" else None
    adam = {n: (xp.zeros_like(v), xp.zeros_like(v)) for n, v in student.items()}
    losses = []
    with mok.Workspace(cfg, group, max_tokens=T, backend=backend) as ws:
        for step in range(args.steps):
            t0 = time.perf_counter()
            x, ids, w = batch(step)
            sched = mok.schedule(ws, ids)
            target, _ = run_forward(ws, sched, x, w, bf)
            out, ctx = run_forward(ws, sched, x, w, {n: v.astype(BF16) for n, v in student.items()})
            diff = as_array(out).astype(np.float32) - as_array(target).astype(np.float32)
            loss = float((diff * diff).mean())
            d_out = (2.0 / diff.size * diff).astype(BF16)
            g = mok.backward(ws, ctx, d_out)   # the inputs and weights come from ctx
            ws.synchronize()
            b1, b2, eps = 0.9, 0.999, 1e-8
            for n in student:
                grad = as_array(grad_of(g, n))
                m, v = adam[n]
                m *= b1; m += (1 - b1) * grad
                v *= b2; v += (1 - b2) * grad * grad
                mh, vh = m / (1 - b1 ** (step + 1)), v / (1 - b2 ** (step + 1))
                student[n] -= args.lr * mh / (xp.sqrt(vh) + eps)
            losses.append(loss)
            print(f"step {step:3d}  loss {loss:.6f}  ({(time.perf_counter() - t0) * 1e3:.1f} ms)", flush=True)
    if losses:
        print(f"done: loss {losses[0]:.4g} -> {losses[-1]:.4g} over {len(losses)} steps (backend={backend})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
