#!/usr/bin/env python3
"""Bitwise A/B of two source trees: run the same layer cases through the public API of the
tree on PYTHONPATH and save every output's bits, or compare two such files.

    PYTHONPATH=old python bench/ab_numerics.py --save old.npz [--precision fp8_block]
    PYTHONPATH=new python bench/ab_numerics.py --save new.npz
    python bench/ab_numerics.py --compare old.npz new.npz

The cases follow the one-GPU and expert-parallel GPU suites (ragged sizes, skewed and empty
experts, top-k 1 to 8, the shared expert, the SwiGLU clamp, T = 0 and 1, two ranks sharing one
GPU).  Inputs are drawn from fixed seeds, so both trees see the same values.  The script speaks
both the grouped-weights API (mok.ExpertWeights) and the earlier flat one, so that a redesign
can be checked against the tree before it.
"""
from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np

# name: (hidden, intermediate, experts, top_k, shared_intermediate, swiglu_limit, tokens per rank, ranks, routing)
CASES = {
    "shared": (320, 192, 5, 3, 128, None, (300,), 1, "distinct"),
    "limit": (192, 320, 6, 2, 0, 0.5, (257,), 1, "skewed"),
    "limit_shared": (256, 64, 3, 1, 64, 0.75, (130,), 1, "skewed"),
    "wide_k": (128, 128, 4, 8, 192, None, (200,), 1, "repeats"),
    "ragged": (320, 192, 7, 4, 320, None, (389,), 1, "skewed"),
    "deep_k": (512, 384, 4, 2, 128, 1.0, (1024,), 1, "distinct"),
    "blocks_64": (128, 64, 3, 1, 64, None, (8100,), 1, "distinct"),
    "blocks_128": (128, 64, 5, 2, 0, None, (16384,), 1, "distinct"),
    "wide_h": (4160, 128, 4, 8, 0, None, (300,), 1, "repeats"),
    "empty_experts": (256, 128, 16, 5, 0, None, (77,), 1, "skewed"),
    "topk6_shared": (256, 192, 12, 6, 128, 7.0, (513,), 1, "distinct"),
    "t1": (256, 128, 8, 7, 64, None, (1,), 1, "distinct"),
    "t0": (256, 128, 8, 2, 64, None, (0,), 1, "distinct"),
    "qwen3_4096": (2048, 768, 128, 8, 0, None, (4096,), 1, "distinct"),
    # >= 16 hidden tiles of 256: the sizes where an FP8 forward may band its down tiles (bench/experiments)
    "h4096": (4096, 256, 6, 4, 0, None, (300,), 1, "skewed"),
    "h4608_shared": (4608, 128, 5, 3, 128, None, (333,), 1, "distinct"),
    "ep_e6_1000_37": (1024, 512, 6, 3, 0, None, (1000, 37), 2, "distinct"),
    "ep_e6_shared_limit": (1024, 512, 6, 3, 512, 7.0, (1000, 37), 2, "skewed"),
    "ep_empty_rank": (256, 128, 4, 2, 128, None, (0, 300), 2, "distinct"),
    "ep_qwen3_4096x2": (2048, 768, 128, 8, 0, None, (4096, 4096), 2, "distinct"),
}
GRADS = ("dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")


def _ids(rng, T, E, k, routing):
    if routing == "distinct":
        return np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32) if T else \
            np.zeros((0, k), np.int32)
    if routing == "repeats":   # the same expert twice in a token's top-k is allowed
        return rng.integers(0, E, (T, k)).astype(np.int32)
    p = np.arange(E, dtype=np.float64) ** 3   # skewed: expert 0 empty, the last ones crowded
    return rng.choice(E, size=(T, k), p=p / p.sum()).astype(np.int32)


def make_inputs(name):
    import ml_dtypes
    bf = ml_dtypes.bfloat16
    H, I, E, k, Is, lim, tokens, P, routing = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    w = {"w_gate": rng.standard_normal((E, I, H)) * H ** -0.5, "w_up": rng.standard_normal((E, I, H)) * H ** -0.5,
         "w_down": rng.standard_normal((E, H, I)) * I ** -0.5}
    if Is:
        w.update(ws_gate=rng.standard_normal((Is, H)) * H ** -0.5, ws_up=rng.standard_normal((Is, H)) * H ** -0.5,
                 ws_down=rng.standard_normal((H, Is)) * Is ** -0.5)
    w = {n: v.astype(bf) for n, v in w.items()}
    ranks = [{"x": rng.standard_normal((T, H)).astype(bf), "ids": _ids(rng, T, E, k, routing),
              "tw": rng.random((T, k)).astype(np.float32), "d_out": rng.standard_normal((T, H)).astype(bf)}
             for T in tokens]
    cfg = dict(hidden=H, intermediate=I, num_experts=E, top_k=k, shared_intermediate=Is, swiglu_limit=lim)
    return cfg, w, ranks, P


def run_case(name, precision="bf16"):
    import cupy as cp
    import mok_rt as mok
    cfg_kw, w, ranks, P = make_inputs(name)
    if precision != "bf16":
        cfg_kw = dict(cfg_kw, precision=precision)
    cfg = mok.MoEConfig(**cfg_kw)
    El = cfg.num_experts // P
    grouped = hasattr(mok, "ExpertWeights")
    T_max = max(1, max(r["x"].shape[0] for r in ranks))
    out = {}
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0] * P), max_tokens=T_max, poison_outputs=True) as ws:
        handles = [ws.rank(r) if P > 1 else ws for r in range(P)]
        dev = []
        for r in range(P):
            d = {n: cp.asarray(v) for n, v in ranks[r].items()}
            d.update({n: cp.asarray(v[r * El:(r + 1) * El]) for n, v in w.items() if n.startswith("w_")})
            d.update({n: cp.asarray(v) for n, v in w.items() if n.startswith("ws_")})
            dev.append(d)
        cp.cuda.Device(0).synchronize()
        scheds = [mok.schedule(handles[r], dev[r]["ids"]) for r in range(P)]
        fwd = []
        for r in range(P):
            d = dev[r]
            if grouped:
                experts = mok.ExpertWeights(d["w_gate"], d["w_up"], d["w_down"])
                shared = mok.ExpertWeights(d["ws_gate"], d["ws_up"], d["ws_down"]) if cfg.shared_intermediate else None
                fwd.append(mok.forward(handles[r], scheds[r], d["x"], d["tw"], experts, shared=shared))
            else:
                sh = [d.get(n) for n in ("ws_gate", "ws_up", "ws_down")]
                fwd.append(mok.forward(handles[r], scheds[r], d["x"], d["tw"], d["w_gate"], d["w_up"], d["w_down"], *sh))
        grads = []
        for r in range(P):
            d, ctx = dev[r], fwd[r][1]
            if grouped:
                g = mok.backward(handles[r], ctx, d["d_out"])
                flat = {"dx": g.dx, "d_topk_weights": g.d_topk_weights, "dw_gate": g.dw.gate, "dw_up": g.dw.up,
                        "dw_down": g.dw.down}
                if g.dw_shared is not None:
                    flat.update(dws_gate=g.dw_shared.gate, dws_up=g.dw_shared.up, dws_down=g.dw_shared.down)
            else:
                sh = [d.get(n) for n in ("ws_gate", "ws_up", "ws_down")]
                g = mok.backward(handles[r], scheds[r], ctx, d["d_out"], d["x"], d["tw"], d["w_gate"], d["w_up"],
                                 d["w_down"], *sh)
                flat = {n: getattr(g, n) for n in GRADS if getattr(g, n, None) is not None}
            grads.append(flat)
        ws.synchronize()
        for r in range(P):
            res = {"out": fwd[r][0], **grads[r]}
            for n, t in res.items():
                a = cp.asnumpy(cp.from_dlpack(t))
                # The bits' digest: equal digests mean equal bits, and the files stay small.
                out[f"{name}/r{r}/{n}"] = np.frombuffer(
                    hashlib.sha256(np.ascontiguousarray(a).tobytes()).digest() + str(a.shape).encode(), np.uint8)
                if a.dtype.kind == "f" or a.dtype.itemsize == 2:
                    f = a.astype(np.float32)
                    if not np.isfinite(f).all():
                        raise SystemExit(f"{name} rank {r}: {n} has non-finite values")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", help="run every case on GPU 0 and save the output bits here (.npz)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saved files bit for bit")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp8_block"),
                    help="MoEConfig.precision of every case (default bf16)")
    a = ap.parse_args()
    if a.save:
        import mok_rt
        print(f"mok_rt from {mok_rt.__file__}", flush=True)
        bits = {}
        for name in a.cases.split(","):
            bits.update(run_case(name, a.precision))
            print(f"ran {name}", flush=True)
        np.savez(a.save, **bits)
        return 0
    if a.compare:
        x, y = np.load(a.compare[0]), np.load(a.compare[1])
        keys = sorted(set(x.files) | set(y.files))
        bad = [k for k in keys if k not in x.files or k not in y.files or not np.array_equal(x[k], y[k])]
        for k in bad:
            print(f"DIFFERS {k}")
        print(f"bitwise: {len(keys) - len(bad)} equal, {len(bad)} differ, over {len(keys)} arrays of "
              f"{len({k.split('/')[0] for k in keys})} cases")
        return 1 if bad or not keys else 0
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
