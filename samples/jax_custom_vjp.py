"""mok_rt inside JAX: the MoE layer as a ``jax.custom_vjp`` and a small MoE block that trains.

    python samples/jax_custom_vjp.py                        # CUDA backend when a GPU is present
    python samples/jax_custom_vjp.py --backend reference    # NumPy reference on the CPU (float32)
    python samples/jax_custom_vjp.py --checkpoint           # recompute activations in the backward
    python samples/jax_custom_vjp.py --jit                  # the training step under jax.jit (GPU or CPU)

``--jit`` trains through :mod:`mok_rt.frameworks.jax_ops` with the whole training step (forward,
``jax.value_and_grad``, the Adam update) in one XLA program under ``jax.jit``, on either backend:
the layer's forward and backward are XLA FFI custom calls whose ctypes handlers run mok_rt on
XLA's own stream (CUDA backend) or the NumPy reference on XLA's host buffers (reference backend).
jax_ops always recomputes the activations in the backward, so ``--checkpoint`` is implied.  After
each step the sample calls ``ws.check()``: errors only the GPU sees (bad expert ids, capacity)
surface there, as after any asynchronous mok_rt call.

Without ``--jit`` the sample's own wrapper (``make_moe``) calls mok_rt eagerly on concrete arrays:
a mok_rt call is a Python host function that needs the concrete device pointers of its inputs.
``jax.grad`` / ``jax.value_and_grad`` hand the fwd and bwd rules concrete arrays (checked by
tests/test_interop*.py), and the rest of the model may still be jitted around the layer.  This
wrapper keeps mok_rt's context between forward and backward (unless ``--checkpoint``), which a
jitted ``custom_vjp`` cannot: its residuals must be arrays.

Streams, eager wrapper: JAX does not expose its CUDA streams to Python, so mok_rt runs on the
workspace's stream and DLPack orders the two in both directions (JAX's ``__dlpack__(stream=ours)``
makes our stream wait for JAX's pending writes; ``jax.dlpack.from_dlpack(result)`` makes JAX's
stream wait for ours).  Under ``--jit`` XLA hands its stream to the custom calls.

jax is a sample-only dependency: mok_rt itself never imports it.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time

# Leave GPU memory to mok_rt's pool: JAX would otherwise grab 75% of it when it starts.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
    import jax  # noqa: E402
    import jax.numpy as jnp  # noqa: E402
except ImportError:
    if __name__ == "__main__":
        raise SystemExit("samples/jax_custom_vjp.py needs JAX, which is not installed: pip install jax "
                         "(jax[cuda13] on a GPU machine)")
    raise

import mok_rt as mok  # noqa: E402

__all__ = ["make_moe", "init_block", "block_forward", "main"]

_WEIGHTS = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


class _Opaque:
    """A pytree with no leaves carrying mok_rt's schedule and context from fwd to bwd."""

    def __init__(self, value):
        self.value = value


jax.tree_util.register_pytree_node(_Opaque, lambda o: ((), o), lambda aux, _: aux)


def _is_tracer(a) -> bool:
    return isinstance(a, jax.core.Tracer)


def _kernel_dtypes(ws, x):
    """(activation/weight dtype, routing-weight dtype): bf16/f32 on the cuda backend (and on a
    ``strict=True`` reference workspace, which takes only those); the reference backend otherwise
    takes float32/float64 as given."""
    if ws.strict:   # every CUDA workspace is strict
        return jnp.bfloat16, jnp.float32
    dt = x.dtype if x.dtype in (jnp.float32, jnp.float64) else jnp.float32
    return dt, dt


def _expert_weights(dtype, w):
    """(routed, shared) :class:`mok.ExpertWeights` of ``w`` (the six weights, shared ones None
    without a shared expert) cast to the kernel dtype."""
    wk = [None if a is None else a.astype(dtype) for a in w]
    return mok.ExpertWeights(*wk[:3]), (None if wk[3] is None else mok.ExpertWeights(*wk[3:]))


def _to_jax(t):
    return jax.dlpack.from_dlpack(t)  # zero copy: the array keeps the mok_rt tensor alive


def make_moe(ws, *, checkpoint: bool = False):
    """``moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
    ws_down=None)`` running on ``ws``, differentiable with ``jax.grad`` (eager mode only).

    Inputs may be fp32 masters: they are cast to the kernel dtype inside, and the weight
    gradients come back in fp32 (cast to each primal's dtype).  ``checkpoint=True`` keeps only
    the inputs and rebuilds the activations in the backward (``mok.recompute_context``)."""

    def run_forward(x, ids, tw, *w):
        if any(_is_tracer(a) for a in (x, ids, tw, *w) if a is not None):
            raise TypeError("this eager wrapper calls mok_rt on concrete arrays: call it outside jax.jit, "
                            "or use mok_rt.frameworks.jax_ops (XLA FFI custom calls) under jit (--jit)")
        act, route = _kernel_dtypes(ws, x)
        experts, shared = _expert_weights(act, w)
        sched = mok.schedule(ws, ids)
        out, mctx = mok.forward(ws, sched, x.astype(act), tw.astype(route), experts, shared=shared)
        return _to_jax(out).astype(x.dtype), mctx

    @jax.custom_vjp
    def moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None):
        return run_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)[0]

    def fwd(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None):
        w = (w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
        out, mctx = run_forward(x, topk_ids, topk_weights, *w)
        # The context holds the schedule and references to the kernel-dtype inputs it read.
        kept = _Opaque(None if checkpoint else mctx)
        return out, (x, topk_ids, topk_weights, w, kept)

    def bwd(res, d_out):
        x, ids, tw, w, kept = res
        act, route = _kernel_dtypes(ws, x)
        mctx = kept.value
        if mctx is None:
            experts, shared = _expert_weights(act, w)
            sched = mok.schedule(ws, ids)
            mctx = mok.recompute_context(ws, sched, x.astype(act), tw.astype(route), experts, shared=shared)
        g = mok.backward(ws, mctx, d_out.astype(act))
        dws = tuple(g.dw) + (tuple(g.dw_shared) if g.dw_shared is not None else (None,) * 3)
        grads = [None if a is None else _to_jax(d).astype(a.dtype) for d, a in zip(dws, w)]
        return (_to_jax(g.dx).astype(x.dtype), None, _to_jax(g.d_topk_weights).astype(tw.dtype), *grads)

    moe.defvjp(fwd, bwd)
    return moe


# --------------------------------------------------------------------------- a small MoE block
def init_block(cfg, key, dtype=jnp.float32) -> dict:
    """Router and expert parameters (fp32 masters) for ``cfg``."""
    H, I, E, Is = cfg.hidden, cfg.intermediate, cfg.num_experts, cfg.shared_intermediate
    keys = jax.random.split(key, 7)

    def param(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) * fan_in ** -0.5).astype(dtype)

    p = {"router": param(keys[0], (H, E), H), "w_gate": param(keys[1], (E, I, H), H),
         "w_up": param(keys[2], (E, I, H), H), "w_down": param(keys[3], (E, H, I), I)}
    if Is:
        p.update(ws_gate=param(keys[4], (Is, H), H), ws_up=param(keys[5], (Is, H), H),
                 ws_down=param(keys[6], (H, Is), Is))
    return p


def block_forward(moe, params: dict, x, top_k: int):
    """Router (softmax, top-k, renormalised) then the mok_rt layer."""
    probs = jax.nn.softmax(x.astype(jnp.float32) @ params["router"].astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(probs, top_k)
    weights = top / top.sum(axis=-1, keepdims=True)
    return moe(x, ids, weights, *(params.get(n) for n in _WEIGHTS))


def _gpu_available() -> bool:
    return mok.device_count() > 0 and any(d.platform == "gpu" for d in jax.devices())


def main(argv=None) -> list[float]:
    """Train a student MoE block to imitate a fixed random teacher; print and return the losses."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cuda", "reference"), default=None,
                    help="default: cuda when a GPU is present, else reference")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", action="store_true", help="recompute activations in the backward")
    ap.add_argument("--jit", action="store_true",
                    help="jit the training step (mok_rt.frameworks.jax_ops: XLA FFI custom calls)")
    args = ap.parse_args(argv)

    backend = args.backend or ("cuda" if _gpu_available() else "reference")
    if backend == "cuda" and not _gpu_available():   # one clear line, as samples/train_moe.py
        if mok.device_count() == 0:
            raise SystemExit("--backend cuda needs a CUDA GPU (none found); without --backend this sample "
                             "runs on the NumPy reference")
        raise SystemExit("--backend cuda needs a JAX that sees the GPU: pip install 'jax[cuda13]'")
    if args.jit:
        args.checkpoint = True   # jax_ops recomputes the context in the backward
    if backend == "cuda":
        x_dtype, group = jnp.bfloat16, mok.SingleProcessGroup(devices=[0])
        H, I, E, k, Is, T = 1024, 512, 16, 4, 512, 4096
        placement = contextlib.nullcontext()
    else:
        x_dtype, group = jnp.float32, None
        H, I, E, k, Is, T = 128, 64, 8, 2, 64, 256
        placement = jax.default_device(jax.devices("cpu")[0])  # the reference backend reads host memory
    print(f"backend={backend} jax={jax.__version__} H={H} I={I} experts={E} top_k={k} "
          f"shared={Is} tokens={T} checkpoint={args.checkpoint} jit={args.jit}")
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k, shared_intermediate=Is)
    losses = []
    with placement, mok.Workspace(cfg, group, max_tokens=T, backend=backend) as ws:
        key_t, key_s, key_x = jax.random.split(jax.random.PRNGKey(args.seed), 3)
        if args.jit:
            from mok_rt.frameworks import jax_ops

            def moe(x, ids, tw, wg, wu, wd, sg=None, su=None, sd=None):
                return jax_ops.moe_layer(ws, x, ids, tw, wg, wu, wd, shared=None if sg is None else (sg, su, sd))
        else:
            moe = make_moe(ws, checkpoint=args.checkpoint)
        teacher = init_block(cfg, key_t)
        student = dict(init_block(cfg, key_s), router=teacher["router"])  # same routing to start from
        data = [jax.random.normal(kx, (T, H), jnp.float32).astype(x_dtype) for kx in jax.random.split(key_x, 4)]

        def loss_fn(params, x, target):
            diff = block_forward(moe, params, x, k).astype(jnp.float32) - target
            return jnp.mean(diff * diff)

        b1, b2, eps = 0.9, 0.999, 1e-8

        def target_fn(params, x):
            return block_forward(moe, params, x, k).astype(jnp.float32)

        def train_step(params, m, v, x, target, c1, c2):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
            m = jax.tree_util.tree_map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
            v = jax.tree_util.tree_map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
            params = jax.tree_util.tree_map(
                lambda p, a, b: p - args.lr * (a / c1) / (jnp.sqrt(b / c2) + eps), params, m, v)
            return loss, params, m, v

        if args.jit:   # one XLA program per step; the layer calls are FFI custom calls inside it
            target_fn, train_step = jax.jit(target_fn), jax.jit(train_step)
        m = jax.tree_util.tree_map(jnp.zeros_like, student)
        v = jax.tree_util.tree_map(jnp.zeros_like, student)
        for step in range(args.steps):
            t0 = time.perf_counter()
            x = data[step % len(data)]
            target = target_fn(teacher, x)
            c1, c2 = jnp.float32(1 - b1 ** (step + 1)), jnp.float32(1 - b2 ** (step + 1))
            loss, student, m, v = train_step(student, m, v, x, target, c1, c2)
            losses.append(float(loss))   # waits for the step
            ws.check()                   # raise any error a kernel reported (bad ids, capacity)
            print(f"step {step:3d}  loss {losses[-1]:.6f}  ({(time.perf_counter() - t0) * 1e3:.1f} ms)", flush=True)
        ws.synchronize()
    return losses


if __name__ == "__main__":
    main()
