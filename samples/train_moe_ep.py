"""Train a MoE layer with expert parallelism (EP = the number of ranks) and print the loss per step.

As samples/train_moe.py (a fixed "teacher" layer makes the targets, a "student" learns them with
Adam), but the experts are spread over the ranks: rank r holds experts r*E_l ... (r+1)*E_l - 1 and
its own tokens; the megakernels move token rows to the experts' ranks and the results back over
NVLink, with no host synchronisation.  The shared expert is replicated (data parallel): its
gradient is summed over the ranks.

    mpirun -np 2 python samples/train_moe_ep.py            # one process per GPU (MPIGroup)
    python samples/train_moe_ep.py --one-process           # one process driving every GPU
    python samples/train_moe_ep.py --one-process --ranks-per-gpu 2   # test mode: ranks share GPUs
"""
from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

import mok_rt as mok

BF16 = ml_dtypes.bfloat16


def experts(p: dict):
    """(routed, shared) mok.ExpertWeights of a parameter dict."""
    return (mok.ExpertWeights(gate=p["w_gate"], up=p["w_up"], down=p["w_down"]),
            mok.ExpertWeights(gate=p["ws_gate"], up=p["ws_up"], down=p["ws_down"]))


def grad_of(g, n: str):
    """The gradient of parameter ``n`` ("w_gate" ... "ws_down") in mok.Gradients ``g``."""
    return getattr(g.dw_shared if n.startswith("ws_") else g.dw, n.split("_")[1])


class Rank:
    """One rank's parameters, optimizer state and stream (CuPy work runs on the rank's stream)."""

    def __init__(self, rw, cp, *, seed: int, rank: int, num_ranks: int, H: int, I: int, el: int, Is: int):
        self.rw, self.cp, self.rank = rw, cp, rank
        self.device = cp.cuda.Device(rw.device_id)
        self.stream = cp.cuda.ExternalStream(int(rw.stream.handle), rw.device_id)
        with self.device, self.stream:
            def param(g, *shape, scale):
                return cp.asarray((g.standard_normal(shape) * scale).astype(np.float32))

            def layer(tag):
                # routed experts: generated per expert, so every P gives the same global layer
                gens = [np.random.default_rng([seed, tag, e]) for e in range(rank * el, (rank + 1) * el)]
                w = {"w_gate": cp.stack([param(g, I, H, scale=H ** -0.5) for g in gens]),
                     "w_up": cp.stack([param(g, I, H, scale=H ** -0.5) for g in gens]),
                     "w_down": cp.stack([param(g, H, I, scale=I ** -0.5) for g in gens])}
                g = np.random.default_rng([seed, tag, 10 ** 6])   # the shared expert: the same on every rank
                w.update(ws_gate=param(g, Is, H, scale=H ** -0.5), ws_up=param(g, Is, H, scale=H ** -0.5),
                         ws_down=param(g, H, Is, scale=Is ** -0.5))
                return w

            self.teacher = {n: v.astype(BF16) for n, v in layer(0).items()}
            self.student = layer(1)
            self.router = param(np.random.default_rng([seed, 2]), H, el * num_ranks, scale=1.0)
            self.adam = {n: (cp.zeros_like(v), cp.zeros_like(v)) for n, v in self.student.items()}

    def batch(self, step: int, T: int, k: int):
        cp = self.cp
        with self.device, self.stream:
            r = np.random.default_rng([1000 + step % 8, self.rank])   # a small fixed data set per rank
            x = cp.asarray(r.standard_normal((T, self.router.shape[0])).astype(np.float32))
            logits = x @ self.router
            ids = cp.argsort(-logits, axis=1)[:, :k].astype(np.int32)
            top = cp.take_along_axis(logits, ids, axis=1)
            w = cp.exp(top - top.max(axis=1, keepdims=True))
            return x.astype(BF16), ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one-process", action="store_true", help="one process drives every rank")
    ap.add_argument("--ranks-per-gpu", type=int, default=1, help="with --one-process: ranks sharing each GPU")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    if mok.device_count() == 0:
        raise SystemExit("samples/train_moe_ep.py needs CUDA GPUs (expert parallelism runs on the CUDA backend "
                         "only); on a machine without one, samples/train_moe.py runs on the NumPy reference")
    try:
        import cupy as cp
    except ImportError:
        raise SystemExit("samples/train_moe_ep.py needs CuPy: pip install -e '.[cupy]'") from None

    comm = None
    if args.one_process:
        gpus = mok.device_count()
        group = mok.SingleProcessGroup([g for g in range(gpus) for _ in range(args.ranks_per_gpu)])
    else:
        try:
            from mpi4py import MPI
        except ImportError:
            raise SystemExit("one process per GPU needs mpi4py (pip install -e '.[mpi]') and mpirun; or run "
                             "one process for every GPU: python samples/train_moe_ep.py --one-process") from None
        comm = MPI.COMM_WORLD
        group = mok.MPIGroup(comm)
    P, lead = group.size, 0 in group.local_ranks
    H, I, el, k, Is, T = 1024, 512, 4, 4, 512, args.tokens
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=el * P, top_k=k, shared_intermediate=Is)
    if lead:
        print(f"EP={P} ranks on devices {list(group.devices)} ({'one process' if comm is None else 'MPI'}): "
              f"H={H} I={I} experts={el * P} top_k={k} shared={Is} tokens/rank={T}", flush=True)

    def all_ranks_sum(values: list[np.ndarray]) -> np.ndarray:
        local = sum(values)
        return comm.allreduce(local) if comm is not None else local

    with mok.Workspace(cfg, group, max_tokens=T) as ws:
        ranks = [Rank(ws.rank(r), cp, seed=args.seed, rank=r, num_ranks=P, H=H, I=I, el=el, Is=Is)
                 for r in group.local_ranks]
        for step in range(args.steps):
            t0 = time.perf_counter()
            # Every rank's calls are enqueued before anything waits: the kernels meet on the device.
            state = []
            for rk in ranks:
                x, ids, w = rk.batch(step, T, k)
                sched = mok.schedule(rk.rw, ids)
                tb = rk.teacher
                with rk.device, rk.stream:
                    sb = {n: v.astype(BF16) for n, v in rk.student.items()}
                routed, shared = experts(tb)
                target, _ = mok.forward(rk.rw, sched, x, w, routed, shared=shared)
                routed, shared = experts(sb)
                out, ctx = mok.forward(rk.rw, sched, x, w, routed, shared=shared)
                state.append((target, out, ctx))   # ctx holds references to x, w and sb until the backward
            grads, losses = [], []
            for rk, (target, out, ctx) in zip(ranks, state):
                with rk.device, rk.stream:
                    diff = cp.from_dlpack(out).astype(np.float32) - cp.from_dlpack(target).astype(np.float32)
                    losses.append((diff * diff).sum())
                    d_out = (2.0 / (P * diff.size) * diff).astype(BF16)   # d(mean over every rank's tokens)
                grads.append(mok.backward(rk.rw, ctx, d_out))
            ws.synchronize()
            host_losses, host_shared = [], []
            for rk, v, g in zip(ranks, losses, grads):
                with rk.device, rk.stream:
                    host_losses.append(float(v))
                    host_shared.append({n: cp.asnumpy(cp.from_dlpack(grad_of(g, n)), stream=rk.stream)
                                        for n in ("ws_gate", "ws_up", "ws_down")})
            loss = float(all_ranks_sum(host_losses)) / (P * T * H)
            # The replicated shared expert: its gradient is the sum of every rank's part (the loss is
            # the mean over every rank's tokens); summed on the host, it is small.
            shared = {n: all_ranks_sum([h[n] for h in host_shared]) for n in ("ws_gate", "ws_up", "ws_down")}
            b1, b2, eps = 0.9, 0.999, 1e-8
            for rk, g in zip(ranks, grads):
                with rk.device, rk.stream:
                    for n in rk.student:
                        grad = cp.asarray(shared[n]) if n in shared else cp.from_dlpack(grad_of(g, n))
                        m, v = rk.adam[n]
                        m *= b1; m += (1 - b1) * grad
                        v *= b2; v += (1 - b2) * grad * grad
                        mh, vh = m / (1 - b1 ** (step + 1)), v / (1 - b2 ** (step + 1))
                        rk.student[n] -= args.lr * mh / (cp.sqrt(vh) + eps)
            for rk in ranks:
                rk.stream.synchronize()
            if lead:
                print(f"step {step:3d}  loss {loss:.6f}  ({(time.perf_counter() - t0) * 1e3:.1f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
