"""mok_rt inside PyTorch autograd: a ``torch.autograd.Function`` and a small MoE block that trains.

``MoEFunction`` wraps ``mok.schedule`` / ``mok.forward`` / ``mok.backward``; tensors cross through
DLPack without copies and mok_rt runs on torch's current CUDA stream, so autograd's ordering
holds.  ``checkpoint=True`` keeps only the inputs and rebuilds the layer's activations in the
backward with ``mok.recompute_context`` (activation checkpointing).  ``--compile`` trains under
``torch.compile(fullgraph=True)`` instead, through the ``mok_rt::moe_forward`` custom op of
``mok_rt.frameworks.torch_ops`` (whose backward always recomputes the layer's context).

    python samples/torch_autograd.py                        # CUDA backend when a GPU is present
    python samples/torch_autograd.py --backend reference    # NumPy reference on the CPU (float32)
    python samples/torch_autograd.py --checkpoint           # recompute activations in the backward
    python samples/torch_autograd.py --compile              # forward + loss under torch.compile(fullgraph=True)

torch is an optional dependency (``pip install -e '.[torch]'``): ``import mok_rt`` never imports it.
"""
from __future__ import annotations

import argparse
import sys
import time

try:
    import torch
except ImportError:
    if __name__ == "__main__":
        sys.exit("samples/torch_autograd.py needs PyTorch, which is not installed: pip install 'torch>=2.8' "
                 "(or pip install -e '.[torch]')")
    raise

import mok_rt as mok

__all__ = ["MoEFunction", "moe", "MoEBlock", "mok_stream", "main"]


def mok_stream(device: torch.device):
    """The stream mok_rt should run on: torch's current stream on ``device`` (None on the CPU).

    Returned as a CUstream int: torch's default stream has handle 0, which DLPack reserves as
    ambiguous, so it is spelled 1 (CU_STREAM_LEGACY, the same stream)."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device).cuda_stream or 1


def _kernel_dtypes(ws, like: torch.Tensor):
    """(activation/weight dtype, routing-weight dtype, weight-gradient dtype) for ``ws``.

    The cuda backend computes in bf16 with fp32 routing weights and fp32 gradients (and so does a
    ``strict=True`` reference workspace, which takes only those); the reference backend otherwise
    takes float32/float64 as given (float64 makes it an exact oracle)."""
    if ws.strict:   # every CUDA workspace is strict
        return torch.bfloat16, torch.float32, torch.float32
    dt = like.dtype if like.dtype in (torch.float32, torch.float64) else torch.float32
    return dt, dt, dt


def _as(t, dtype):
    # detach: torch refuses to export a tensor that requires grad; .to is a no-op when equal.
    return None if t is None else t.detach().to(dtype).contiguous()


def _expert_weights(dtype, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None):
    """(routed, shared) :class:`mok.ExpertWeights` cast to the kernel dtype (shared: None without one)."""
    experts = mok.ExpertWeights(*(_as(t, dtype) for t in (w_gate, w_up, w_down)))
    shared = None if ws_gate is None else mok.ExpertWeights(*(_as(t, dtype) for t in (ws_gate, ws_up, ws_down)))
    return experts, shared


class MoEFunction(torch.autograd.Function):
    """``out = shared(x) + Σ_j topk_weights[:, j] · expert_{topk_ids[:, j]}(x)`` through mok_rt.

    ``apply(ws, checkpoint, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up,
    ws_down)``.  Inputs may be fp32 master copies: they are cast to the kernel's dtype here and
    the weight gradients come back in fp32 (cast to each input's dtype), so nothing is lost to a
    bf16 round trip.  Gradients: x, topk_weights, every weight; none for topk_ids.
    """

    @staticmethod
    def forward(ctx, ws, checkpoint, x, topk_ids, topk_weights, w_gate, w_up, w_down,
                ws_gate=None, ws_up=None, ws_down=None):
        act, route, _ = _kernel_dtypes(ws, x)
        stream = mok_stream(x.device)
        ids = topk_ids.detach().contiguous()
        experts, shared = _expert_weights(act, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
        sched = mok.schedule(ws, ids, stream=stream)
        out, mctx = mok.forward(ws, sched, _as(x, act), _as(topk_weights, route), experts, shared=shared,
                                stream=stream)
        ctx.ws, ctx.checkpoint = ws, bool(checkpoint)
        # Checkpointing keeps only the inputs (and the ids to rebuild the schedule from);
        # otherwise the layer's context (the schedule, references to the kernel-dtype inputs it
        # read and its activations) lives until backward.
        ctx.mctx = None if checkpoint else mctx
        ctx.save_for_backward(x, ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
        return torch.from_dlpack(out).to(x.dtype)  # zero copy when x is already in the kernel dtype

    @staticmethod
    def backward(ctx, d_out):
        ws = ctx.ws
        x, ids, topk_weights, *w = ctx.saved_tensors
        act, route, grad_dt = _kernel_dtypes(ws, x)
        stream = mok_stream(x.device)
        mctx = ctx.mctx
        if mctx is None:  # checkpointing, or a second backward (retain_graph) after we let go
            sched = mok.schedule(ws, ids, stream=stream)
            experts, shared = _expert_weights(act, *w)
            mctx = mok.recompute_context(ws, sched, _as(x, act), _as(topk_weights, route), experts, shared=shared,
                                         stream=stream)
        # Weight gradients land straight in torch-owned buffers (mok_rt writes through DLPack).
        bufs = [None if t is None else torch.empty(t.shape, dtype=grad_dt, device=t.device) for t in w]
        dw = mok.ExpertWeights(*bufs[:3])
        dw_shared = None if bufs[3] is None else mok.ExpertWeights(*bufs[3:])
        g = mok.backward(ws, mctx, _as(d_out, act), dw=dw, dw_shared=dw_shared, stream=stream)
        ctx.mctx = None  # free the activations now, not when the graph goes
        dx = torch.from_dlpack(g.dx).to(x.dtype) if ctx.needs_input_grad[2] else None
        dtw = torch.from_dlpack(g.d_topk_weights).to(topk_weights.dtype) if ctx.needs_input_grad[4] else None
        dws = [None if b is None else b.to(t.dtype) for b, t in zip(bufs, w)]
        return (None, None, dx, None, dtw, *dws)


def moe(ws, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None, *,
        checkpoint: bool = False) -> torch.Tensor:
    """The MoE layer as a differentiable torch function (see :class:`MoEFunction`)."""
    return MoEFunction.apply(ws, checkpoint, x, topk_ids, topk_weights, w_gate, w_up, w_down,
                             ws_gate, ws_up, ws_down)


class MoEBlock(torch.nn.Module):
    """Router (Linear -> softmax -> top-k, renormalised) then the mok_rt layer.

    Parameters are fp32 masters; :class:`MoEFunction` (or the custom op) casts them for the
    kernel.  ``custom_op=True`` calls the layer through ``mok_rt::moe_forward``
    (``mok_rt.frameworks.torch_ops.moe_layer``), which ``torch.compile(fullgraph=True)`` traces
    without a graph break; its backward always recomputes the layer's context."""

    def __init__(self, ws, *, device, checkpoint: bool = False, custom_op: bool = False,
                 generator: torch.Generator | None = None):
        super().__init__()
        cfg = ws.config
        H, I, E, Is = cfg.hidden, cfg.intermediate, cfg.num_experts, cfg.shared_intermediate
        self.ws, self.top_k, self.checkpoint, self.custom_op = ws, cfg.top_k, checkpoint, custom_op
        self.router = torch.nn.Linear(H, E, bias=False, device=device)

        def param(*shape, fan_in):
            w = torch.randn(*shape, generator=generator) * fan_in ** -0.5
            return torch.nn.Parameter(w.to(device))

        self.w_gate, self.w_up = param(E, I, H, fan_in=H), param(E, I, H, fan_in=H)
        self.w_down = param(E, H, I, fan_in=I)
        if Is:
            self.ws_gate, self.ws_up = param(Is, H, fan_in=H), param(Is, H, fan_in=H)
            self.ws_down = param(H, Is, fan_in=Is)
        else:
            self.ws_gate = self.ws_up = self.ws_down = None
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(E, H, generator=generator).to(device) * H ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x.float()), dim=-1)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = top / top.sum(dim=-1, keepdim=True)
        if self.custom_op:
            from mok_rt.frameworks import torch_ops
            shared = None if self.ws_gate is None else (self.ws_gate, self.ws_up, self.ws_down)
            return torch_ops.moe_layer(self.ws, x, ids, weights, self.w_gate, self.w_up, self.w_down, shared=shared)
        return moe(self.ws, x, ids, weights, self.w_gate, self.w_up, self.w_down, self.ws_gate, self.ws_up,
                   self.ws_down, checkpoint=self.checkpoint)


def _gpu_available() -> bool:
    return mok.device_count() > 0 and torch.cuda.is_available()


def main(argv=None) -> list[float]:
    """Train a student MoE block to imitate a fixed random teacher; print and return the losses."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cuda", "reference"), default=None,
                    help="default: cuda when a GPU is present, else reference")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", action="store_true", help="recompute activations in the backward")
    ap.add_argument("--compile", action="store_true",
                    help="run the student's forward and loss under torch.compile(fullgraph=True) through the "
                         "mok_rt::moe_forward custom op (its backward recomputes the layer's activations)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend for --compile (default inductor; aot_eager compiles faster)")
    args = ap.parse_args(argv)

    backend = args.backend or ("cuda" if _gpu_available() else "reference")
    if backend == "cuda" and not _gpu_available():   # one clear line, as samples/train_moe.py
        if mok.device_count() == 0:
            raise SystemExit("--backend cuda needs a CUDA GPU (none found); without --backend this sample "
                             "runs on the NumPy reference")
        raise SystemExit("--backend cuda needs a CUDA build of PyTorch (torch.cuda.is_available() is False)")
    if backend == "cuda":
        device, x_dtype = torch.device("cuda", 0), torch.bfloat16
        H, I, E, k, Is, T = 1024, 512, 16, 4, 512, 4096
        group = mok.SingleProcessGroup(devices=[0])
    else:
        device, x_dtype = torch.device("cpu"), torch.float32
        H, I, E, k, Is, T = 128, 64, 8, 2, 64, 256
        group = None
    print(f"backend={backend} device={device} H={H} I={I} experts={E} top_k={k} shared={Is} tokens={T} "
          f"checkpoint={args.checkpoint} compile={args.compile_backend if args.compile else False}")
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k, shared_intermediate=Is)
    gen = torch.Generator().manual_seed(args.seed)
    losses = []
    with mok.Workspace(cfg, group, max_tokens=T, backend=backend) as ws:
        teacher = MoEBlock(ws, device=device, generator=gen).requires_grad_(False)
        student = MoEBlock(ws, device=device, checkpoint=args.checkpoint, custom_op=args.compile, generator=gen)
        student.router.load_state_dict(teacher.router.state_dict())  # same routing to start from
        opt = torch.optim.Adam(student.parameters(), lr=args.lr)

        def loss_fn(x, target):
            return torch.nn.functional.mse_loss(student(x).float(), target)

        if args.compile:
            # One graph for router, top-k, the layer (the custom op) and the loss; AOTAutograd
            # compiles the matching backward, which loss.backward() runs.  The optimizer stays eager.
            loss_fn = torch.compile(loss_fn, fullgraph=True, backend=args.compile_backend)
        data = [torch.randn(T, H, generator=gen).to(device, x_dtype) for _ in range(4)]
        for step in range(args.steps):
            t0 = time.perf_counter()
            x = data[step % len(data)]
            with torch.no_grad():
                target = teacher(x).float()
            loss = loss_fn(x, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())   # waits for the step (torch's stream, mok_rt's work on it)
            ws.check()                   # raise any error a kernel reported (bad ids, capacity)
            print(f"step {step:3d}  loss {losses[-1]:.6f}  ({(time.perf_counter() - t0) * 1e3:.1f} ms)", flush=True)
        ws.synchronize()
    return losses


if __name__ == "__main__":
    main()
