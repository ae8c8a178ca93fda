"""Expert-parallel MoE layer checks, under MPI or imported by the pytest GPU tests.

Run: ``mpirun --allow-run-as-root -np 2 python tests/mpi_ep_check.py`` (two ranks on one GPU, or
one rank per GPU).  Each rank prints ``[rank r] PASS name`` / ``[rank r] FAIL name: why`` and the
exit status is non-zero when any check failed.

The helpers (problem generation, one rank's sequence of calls, the float64 reference with EP
simulated, error measures) are shared with tests/test_ep_gpu.py and tests/test_ep_multigpu.py;
they import nothing from pytest or mpi4py.  Every rank's inputs come from its own seeded
generator, so any process can rebuild any rank's inputs (and the reference) without talking.
"""
from __future__ import annotations

import hashlib
import os
import sys
import traceback

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mok_rt as mok  # noqa: E402
from mok_rt import reference  # noqa: E402

BF16 = ml_dtypes.bfloat16
TOL = 1e-2
GRADS = ("dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")

# name -> (MoEConfig kwargs, tokens per rank).  The first two are the acceptance shapes.
CASES = {
    "qwen3_4096x2": (dict(hidden=2048, intermediate=768, num_experts=128, top_k=8), (4096, 4096)),
    "e6_1000_37": (dict(hidden=1024, intermediate=512, num_experts=6, top_k=3), (1000, 37)),
    "e6_shared_limit": (dict(hidden=1024, intermediate=512, num_experts=6, top_k=3, shared_intermediate=512,
                             swiglu_limit=7.0), (1000, 37)),
    "empty_rank": (dict(hidden=256, intermediate=128, num_experts=4, top_k=2, shared_intermediate=128), (0, 300)),
}


def config(case: str, **over) -> mok.MoEConfig:
    kw = dict(CASES[case][0])
    kw.update(over)
    return mok.MoEConfig(**kw)


def _bf16(a):
    """float32 -> bfloat16, round to nearest even (finite inputs; faster than a dtype cast)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).view(BF16)


_INPUTS: dict = {}


def rank_inputs(case: str, seed: int, rank: int, num_ranks: int, *, ids=None) -> dict:
    """Rank ``rank``'s tokens, routing, output gradient and its experts' weights (host arrays,
    cached: treat them as read-only)."""
    key = (case, seed, rank, num_ranks)
    if ids is None and key in _INPUTS:
        return _INPUTS[key]
    h = _make_inputs(case, seed, rank, num_ranks, ids)
    if ids is None:
        _INPUTS[key] = h
    return h


def _make_inputs(case: str, seed: int, rank: int, num_ranks: int, ids) -> dict:
    c, tokens = CASES[case]
    H, I, E, k = c["hidden"], c["intermediate"], c["num_experts"], c["top_k"]
    el, T = E // num_ranks, tokens[rank % len(tokens)]   # more ranks than listed: the counts repeat
    rng = np.random.default_rng([seed, rank])
    scale = 4.0 if c.get("swiglu_limit") else 1.0   # large activations: the clamp is active
    h = {
        "x": _bf16(rng.standard_normal((T, H)) * scale),
        "tw": rng.random((T, k)).astype(np.float32),
        "d_out": _bf16(rng.standard_normal((T, H))),
        "ids": (np.stack([rng.permutation(E)[:k] for _ in range(T)]) if T else np.zeros((0, k))).astype(np.int32),
    }
    if ids is not None:
        h["ids"] = np.asarray(ids, dtype=np.int32)
    # Expert e's weights come from a generator of their own: the same weights whatever P is.
    w = {n: [] for n in ("w_gate", "w_up", "w_down")}
    for e in range(rank * el, (rank + 1) * el):
        g = np.random.default_rng([seed, 1000 + e])
        w["w_gate"].append(_bf16(g.standard_normal((I, H), dtype=np.float32) * H ** -0.5))
        w["w_up"].append(_bf16(g.standard_normal((I, H), dtype=np.float32) * H ** -0.5))
        w["w_down"].append(_bf16(g.standard_normal((H, I), dtype=np.float32) * I ** -0.5))
    h.update({n: np.stack(v) for n, v in w.items()})
    Is = c.get("shared_intermediate", 0)
    h["shared"] = (None, None, None)
    if Is:
        g = np.random.default_rng([seed, 999])
        h["shared"] = (_bf16(g.standard_normal((Is, H)) * H ** -0.5), _bf16(g.standard_normal((Is, H)) * H ** -0.5),
                       _bf16(g.standard_normal((H, Is)) * Is ** -0.5))
    return h


def to_device(h: dict, device: int) -> dict:
    import cupy as cp
    with cp.cuda.Device(device):
        d = {n: cp.asarray(v) for n, v in h.items() if n != "shared"}
        d["shared"] = tuple(None if s is None else cp.asarray(s) for s in h["shared"])
        cp.cuda.runtime.deviceSynchronize()
    return d


def experts(d: dict) -> mok.ExpertWeights:
    """The routed experts' weights of a rank's inputs (host or device)."""
    return mok.ExpertWeights(gate=d["w_gate"], up=d["w_up"], down=d["w_down"])


def shared(d: dict):
    """The shared expert's weights of a rank's inputs, None without one."""
    return None if d["shared"][0] is None else mok.ExpertWeights(*d["shared"])


def grads_by_name(g) -> dict:
    """mok.Gradients by the names of GRADS (those of the reference), without the absent ones."""
    sh = tuple(g.dw_shared) if g.dw_shared is not None else (None, None, None)
    return {n: t for n, t in zip(GRADS, (g.dx, g.d_topk_weights, *g.dw, *sh)) if t is not None}


def forward(rank_ws, sched, d: dict):
    """mok.forward on a rank's inputs."""
    return mok.forward(rank_ws, sched, d["x"], d["tw"], experts(d), shared=shared(d))


def enqueue(rank_ws, d: dict, *, recompute: bool = True, backward: bool = True) -> dict:
    """One rank's calls: schedule, forward, backward (and recompute_context + backward).  Returns
    the result tensors (not yet waited for).  Every rank of the group must make the same calls.
    ``backward=False``: schedule and forward only (the FP8 backward has no EP yet)."""
    sched = mok.schedule(rank_ws, d["ids"])
    out, ctx = forward(rank_ws, sched, d)
    if not backward:
        return {"out": out}
    g = mok.backward(rank_ws, ctx, d["d_out"])
    res = {"out": out, **grads_by_name(g)}
    if recompute:
        ctx2 = mok.recompute_context(rank_ws, sched, d["x"], d["tw"], experts(d), shared=shared(d))
        g2 = mok.backward(rank_ws, ctx2, d["d_out"])
        res.update({"recomputed_" + n: t for n, t in grads_by_name(g2).items()})
    return res


def to_numpy(res: dict) -> dict:
    return {n: t.to_numpy() for n, t in res.items()}


def run_one_process(case: str, seed: int, devices, *, recompute: bool = True, cfg=None, inputs=None,
                    backward: bool = True) -> list[dict]:
    """Every rank driven by this process (SingleProcessGroup(devices)); per-rank host results."""
    P = len(devices)
    cfg = cfg or config(case)
    hs = inputs or [rank_inputs(case, seed, r, P) for r in range(P)]
    ds = [to_device(hs[r], devices[r]) for r in range(P)]
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices), max_tokens=max([1] + [h["x"].shape[0] for h in hs]),
                       poison_outputs=True) as ws:
        pending = [enqueue(ws.rank(r), ds[r], recompute=recompute, backward=backward) for r in range(P)]
        ws.synchronize()
        return [to_numpy(p) for p in pending]


_REF: dict = {}


def reference_results(case: str, seed: int, num_ranks: int, inputs=None) -> list[dict]:
    """Float64 reference with EP simulated (mok_rt.reference.ep_forward / ep_backward)."""
    key = (case, seed, num_ranks)
    if inputs is None and key in _REF:
        return _REF[key]
    hs = inputs or [rank_inputs(case, seed, r, num_ranks) for r in range(num_ranks)]
    c = CASES[case][0]
    f64 = lambda a: None if a is None else a.astype(np.float64)  # noqa: E731
    sh = hs[0]["shared"]
    outs, ctx = reference.ep_forward([h["x"] for h in hs], [h["ids"] for h in hs],
                                     [h["tw"].astype(np.float64) for h in hs], [h["w_gate"] for h in hs],
                                     [h["w_up"] for h in hs], [h["w_down"] for h in hs], num_ranks=num_ranks,
                                     ws_gate=f64(sh[0]), ws_up=f64(sh[1]), ws_down=f64(sh[2]),
                                     swiglu_limit=c.get("swiglu_limit"))
    grads = reference.ep_backward(ctx, [h["d_out"] for h in hs])
    res = []
    for r in range(num_ranks):
        d = {"out": outs[r]}
        d.update({n: getattr(grads[r], n) for n in GRADS if getattr(grads[r], n) is not None})
        res.append(d)
    if inputs is None:
        _REF[key] = res
    return res


def rel_err(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if b.size == 0:
        return 0.0
    n = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (n if n > 0 else 1.0))


def compare(got: dict, ref: dict) -> tuple[dict, list[str]]:
    """Relative errors per result and the problems found (NaN/unwritten, shape, above TOL,
    recomputed context not bitwise equal)."""
    errs, problems = {}, []
    for n, r in ref.items():
        if n not in got:
            problems.append(f"{n} missing")
            continue
        g = np.asarray(got[n]).astype(np.float64)
        if g.shape != r.shape:
            problems.append(f"{n} shape {g.shape} != {r.shape}")
            continue
        if not np.isfinite(g).all():
            problems.append(f"{n} has NaN/inf (unwritten?)")
        errs[n] = rel_err(g, r)
        if errs[n] > TOL:
            problems.append(f"{n} relative error {errs[n]:.2e} > {TOL}")
        again = got.get("recomputed_" + n)
        if again is not None and not np.array_equal(np.asarray(again).view(np.uint8),
                                                    np.asarray(got[n]).view(np.uint8)):
            problems.append(f"{n} differs with the recomputed context")
    return errs, problems


def digest(res: dict) -> dict:
    """sha256 of every result's bytes (bitwise comparisons across processes)."""
    return {n: hashlib.sha256(np.ascontiguousarray(v).view(np.uint8).tobytes()).hexdigest() for n, v in res.items()}


# ---------------------------------------------------------------------------------------------
# Under MPI: one process per rank
# ---------------------------------------------------------------------------------------------

def run_rank(group, case: str, seed: int, *, cfg=None) -> dict:
    """This process's rank of a one-process-per-rank group: its host results."""
    r, P = group.rank, group.size
    cfg = cfg or config(case)
    h = rank_inputs(case, seed, r, P)
    d = to_device(h, group.device)
    with mok.Workspace(cfg, group, max_tokens=max(max(CASES[case][1]), 1), poison_outputs=True) as ws:
        pending = enqueue(ws, d)
        ws.synchronize()
        return to_numpy(pending)


def _checks(group) -> list[tuple[str, object]]:
    seed = 5
    out = []

    def small():
        res = run_rank(group, "e6_1000_37", seed)
        _, problems = compare(res, reference_results("e6_1000_37", seed, group.size)[group.rank])
        if problems:
            raise AssertionError("; ".join(problems))
        again = run_rank(group, "e6_1000_37", seed)
        if digest(again) != digest(res):
            raise AssertionError("two identical runs differ (not bitwise deterministic)")

    def shared_limit():
        res = run_rank(group, "e6_shared_limit", seed)
        _, problems = compare(res, reference_results("e6_shared_limit", seed, group.size)[group.rank])
        if problems:
            raise AssertionError("; ".join(problems))

    def capacity():
        cfg = config("e6_1000_37", capacity_factor=0.75)
        h = rank_inputs("e6_1000_37", seed, group.rank, group.size,
                        ids=np.tile([0, 1, 2], (CASES["e6_1000_37"][1][group.rank % 2], 1)))  # everything on rank 0
        d = to_device(h, group.device)
        good = to_device(rank_inputs("e6_1000_37", seed, group.rank, group.size), group.device)
        with mok.Workspace(cfg, group, max_tokens=1000) as ws:
            enqueue(ws, d, recompute=False)   # the forward and backward are skipped alike on every rank
            try:
                ws.synchronize()
            except mok.CapacityError as e:
                if e.info[0] != 0:
                    raise AssertionError(f"the error names rank {e.info[0]}, not the overflowing rank 0") from None
            else:
                raise AssertionError("no CapacityError")
            for _ in range(2):   # usable again, epochs in step
                res = enqueue(ws, good, recompute=False)
                ws.synchronize()
                _, problems = compare(to_numpy(res), reference_results("e6_1000_37", seed, group.size)[group.rank])
                if problems:
                    raise AssertionError("after the capacity error: " + "; ".join(problems))

    def dead_peer():
        cfg = config("e6_1000_37", timeout_s=1.0)
        h = rank_inputs("e6_1000_37", seed, group.rank, group.size)
        d = to_device(h, group.device)
        missing = group.size - 1
        with mok.Workspace(cfg, group, max_tokens=1000) as ws:
            sched = mok.schedule(ws, d["ids"])
            if group.rank != missing:
                mok.forward(ws, sched, d["x"], d["tw"], experts(d))
                try:
                    ws.synchronize()
                except mok.PeerTimeoutError as e:
                    if e.rank != missing:
                        raise AssertionError(f"the timeout names rank {e.rank}, not {missing}: {e}") from None
                else:
                    raise AssertionError("no PeerTimeoutError")
                try:
                    mok.schedule(ws, d["ids"])
                except mok.MokError as e:
                    if "create a new one" not in str(e):
                        raise
                else:
                    raise AssertionError("the workspace accepted a call after a peer timed out")
            else:
                ws.synchronize()
            group.barrier()

    out += [("forward_backward_vs_reference_and_determinism", small), ("shared_expert_and_limit", shared_limit),
            ("capacity_error_on_every_rank", capacity), ("dead_peer_times_out", dead_peer)]
    return out


def main() -> int:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    group = mok.MPIGroup(comm)
    failed = 0
    for name, fn in _checks(group):
        try:
            fn()
            print(f"[rank {group.rank}] PASS {name}", flush=True)
        except Exception as e:  # report and go on: every rank runs every check
            failed += 1
            print(f"[rank {group.rank}] FAIL {name}: {type(e).__name__}: {e}\n{traceback.format_exc()}", flush=True)
        comm.Barrier()
    total = comm.allreduce(failed)
    if group.rank == 0:
        print("ALL PASS" if total == 0 else f"{total} FAILURES", flush=True)
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
