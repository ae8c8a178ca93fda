"""Diagnostic: cubins stamping worker 0 at one point into TraceRec.grab of FP8 backward GEMM tasks;
per phase, median ready->stamp and stamp->end."""
import sys, statistics
from pathlib import Path
sys.path.insert(0, str(Path.cwd()))
import numpy as np, cupy as cp, ml_dtypes
import mok_rt as mok
shapes = {"qwen3": (2048, 768, 128, 8, 16384), "slice": (7168, 2048, 32, 8, 8192), "dsv3": (7168, 2048, 256, 8, 8192)}
for name, (H, I, E, k, T) in shapes.items():
    if len(sys.argv) > 1 and name not in sys.argv[1:]: continue
    rng = np.random.default_rng(0)
    bf = ml_dtypes.bfloat16
    def randn(shape, scale=1.0):
        f = cp.random.standard_normal(shape, dtype=cp.float32) * cp.float32(scale)
        return ((f.view(cp.uint32) >> 16).astype(cp.uint16)).view(bf)
    x = randn((T, H)); ids = cp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
    tw = cp.asarray(rng.random((T, k)).astype(np.float32)); dout = randn((T, H))
    ew = mok.ExpertWeights(gate=randn((E, I, H), H ** -0.5), up=randn((E, I, H), H ** -0.5), down=randn((E, H, I), I ** -0.5))
    dw = mok.ExpertWeights(*(cp.zeros(w.shape, dtype=np.float32) for w in ew))
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k, precision="fp8_block")
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=T, trace=True) as ws:
        w8 = mok.quantize_weights(ws, ew)
        for it in range(3):
            sched = mok.schedule(ws, ids); out, ctx = mok.forward(ws, sched, x, tw, w8)
            g = mok.backward(ws, ctx, dout, dw=dw); ws.synchronize()
            tr = ws.take_traces(); del out, ctx, g
        for t in tr:
            if "backward" not in t.kind: continue
            print(f"== {name} {t.kind} span {t.span_us:.1f} us")
            # dA tasks while the dispatch still runs vs after it
            last_disp = max((s.end_us for s in t.spans if s.phase == "dispatch"), default=0)
            for ph in ("routed_da", "routed_dx", "dispatch", "widen", "wgrad_down", "wgrad_gate_up"):
                sp = [s for s in t.spans if s.phase == ph]
                if not sp: continue
                ml = statistics.median(s.grab_us - s.ready_us for s in sp)
                ep = statistics.median(s.end_us - s.grab_us for s in sp)
                tot = statistics.median(s.end_us - s.ready_us for s in sp)
                late = [s for s in sp if s.ready_us > last_disp]
                lt = statistics.median(s.end_us - s.ready_us for s in late) if late else float("nan")
                lm = statistics.median(s.grab_us - s.ready_us for s in late) if late else float("nan")
                print(f"  {ph:14s} n={len(sp):6d} total {tot:7.2f}  ready->stamp {ml:7.2f}  stamp->end {ep:7.2f} us;"
                      f" after the dispatch n={len(late)} total {lt:7.2f} ready->stamp {lm:7.2f}")
