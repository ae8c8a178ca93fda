"""The PyTorch MoE layer a user would run instead of mok_rt: the benchmark's baseline.

One layer of docs/SEMANTICS.md built from stock PyTorch ops, the way Megatron-style trainers do it:

    argsort the routes by expert (permute) -> torch._grouped_mm over fused gate|up weights ->
    SwiGLU -> torch._grouped_mm over down weights -> weight each row by its router probability
    and index_add it back into its token (fp32 accumulate, bf16 out) [+ a dense shared expert]

Autograd gives the backward.  With expert parallelism (a torch.distributed NCCL group of P
processes, one GPU each) rows travel to the rank that owns their expert and back through
``all_to_all_single``; the split sizes are copied to the host first (one host sync per
forward, as Megatron's all-to-all dispatcher does).

Weights come in mok_rt's layout so the same tensors feed both: w_gate/w_up [E_l, I, H],
w_down [E_l, H, I], shared ws_gate/ws_up [I_s, H], ws_down [H, I_s].  Rank r owns global experts
r*E_l ... (r+1)*E_l - 1.  torch is a benchmark-only dependency; mok_rt never imports this file.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["TorchMoEBaseline"]


class _AllToAll(torch.autograd.Function):
    """Variable-size all_to_all_single whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):
        import torch.distributed as dist
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = rows.new_empty((sum(recv_splits), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_splits,
                               input_split_sizes=send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty((sum(send_splits), grad.shape[1]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=send_splits,
                               input_split_sizes=recv_splits, group=ctx.group)
        return out, None, None, None


def _swiglu(h: torch.Tensor, limit: float | None) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    if limit is not None:   # clamp semantics of docs/SEMANTICS.md (clamp masks the gradient)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class TorchMoEBaseline:
    """Dropless MoE layer (routed SwiGLU experts + optional shared expert) in stock PyTorch.

    The routed weights become two autograd leaves: ``w13`` [E_l, 2I, H] (gate rows then up rows,
    one copy made here so one grouped GEMM serves both) and ``w2`` (the caller's ``w_down``
    storage, not copied).  ``group``: a torch.distributed process group for expert parallelism,
    or None for one rank.
    """

    def __init__(self, *, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                 num_experts: int, ws_gate: torch.Tensor | None = None, ws_up: torch.Tensor | None = None,
                 ws_down: torch.Tensor | None = None, swiglu_limit: float | None = None, group=None):
        self.group = group
        self.num_ranks, self.rank = 1, 0
        if group is not None:
            import torch.distributed as dist
            self.num_ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts={num_experts} does not split over {self.num_ranks} ranks")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.num_ranks
        el, i, h = w_gate.shape
        if el != self.local_experts or tuple(w_up.shape) != (el, i, h) or tuple(w_down.shape) != (el, h, i):
            raise ValueError(f"expected w_gate/w_up [{self.local_experts}, I, H] and w_down [{self.local_experts},"
                             f" H, I], got {tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}")
        self.hidden, self.intermediate = h, i
        self.swiglu_limit = swiglu_limit
        self.w13 = torch.cat([w_gate.detach(), w_up.detach()], dim=1).requires_grad_(True)
        self.w2 = w_down.detach().requires_grad_(True)
        shared = (ws_gate, ws_up, ws_down)
        if any(s is not None for s in shared) and not all(s is not None for s in shared):
            raise ValueError("the shared expert needs ws_gate, ws_up and ws_down together")
        self.shared_intermediate = 0 if ws_gate is None else ws_gate.shape[0]
        self.ws13 = self.ws2 = None
        if ws_gate is not None:
            self.ws13 = torch.cat([ws_gate.detach(), ws_up.detach()], dim=0).requires_grad_(True)
            self.ws2 = ws_down.detach().requires_grad_(True)

    # -- parameters ----------------------------------------------------------------------------
    def parameters(self) -> list[torch.Tensor]:
        return [p for p in (self.w13, self.w2, self.ws13, self.ws2) if p is not None]

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def grads(self) -> dict[str, torch.Tensor | None]:
        """The weight gradients of the last backward, in mok_rt's names and layout (views)."""
        i, si = self.intermediate, self.shared_intermediate
        g13, g2 = self.w13.grad, self.w2.grad
        out = {"dw_gate": None if g13 is None else g13[:, :i], "dw_up": None if g13 is None else g13[:, i:],
               "dw_down": g2}
        if self.ws13 is not None:
            gs = self.ws13.grad
            out.update(dws_gate=None if gs is None else gs[:si], dws_up=None if gs is None else gs[si:],
                       dws_down=self.ws2.grad)
        return out

    # -- the layer -----------------------------------------------------------------------------
    def _experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """SwiGLU experts over rows grouped by local expert (``counts`` rows each, in order)."""
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        # _grouped_mm wants B as [G, K, N]; the transposed views are column-major, which it takes.
        h = torch._grouped_mm(rows, self.w13.transpose(-2, -1), offs=offs)
        a = _swiglu(h, self.swiglu_limit)
        return torch._grouped_mm(a, self.w2.transpose(-2, -1), offs=offs)

    def _experts_parallel(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send rows (sorted by global expert) to their expert's rank, run, send back."""
        import torch.distributed as dist
        p, el = self.num_ranks, self.local_experts
        # recv_counts[s, e]: rows rank s sends to my local expert e.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_counts = recv_counts.view(p, el)
        # The one host sync of the step: NCCL needs the split sizes on the host.
        splits = torch.stack([counts.view(p, el).sum(1), recv_counts.sum(1)]).tolist()
        send_splits, recv_splits = splits
        n_recv = sum(recv_splits)
        recv = _AllToAll.apply(rows, send_splits, recv_splits, self.group)
        # Rows arrive grouped by (source rank, local expert): regroup by local expert (stable).
        expert_of_row = torch.repeat_interleave(torch.arange(el, device=rows.device).repeat(p),
                                                recv_counts.reshape(-1), output_size=n_recv)
        perm = torch.argsort(expert_of_row, stable=True)
        y = self._experts(recv.index_select(0, perm), recv_counts.sum(0))
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(n_recv, device=perm.device)
        return _AllToAll.apply(y.index_select(0, inverse), recv_splits, send_splits, self.group)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        a = _swiglu(x @ self.ws13.t(), self.swiglu_limit)
        return a @ self.ws2.t()

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``x`` bf16 [T, H], ``topk_ids`` int [T, k] global expert ids, ``topk_weights`` f32 [T, k]
        -> bf16 [T, H].  ``x`` and ``topk_weights`` may require grad."""
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)          # routes grouped by expert, then token
        token_of_row = order // k
        rows = x.index_select(0, token_of_row)             # permute
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.num_ranks == 1:
            y = self._experts(rows, counts)
        else:
            y = self._experts_parallel(rows, counts)
        w = topk_weights.reshape(-1).index_select(0, order)
        contrib = y * w.unsqueeze(1)                       # bf16 * f32 -> f32 in one kernel
        if self.ws13 is not None:
            acc = self._shared(x).float()
        else:
            acc = torch.zeros((t, self.hidden), device=x.device, dtype=torch.float32)
        return acc.index_add(0, token_of_row, contrib).to(x.dtype)   # unpermute, fp32 accumulate

    __call__ = forward
