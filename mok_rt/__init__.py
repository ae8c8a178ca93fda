"""mok_rt: a mixture-of-experts training megakernel with a pure cuda-python runtime.

    import mok_rt as mok
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k)
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=T) as ws:
        sched = mok.schedule(ws, topk_ids)
        out, ctx = mok.forward(ws, sched, x, topk_weights, w_gate, w_up, w_down)
        g = mok.backward(ws, sched, ctx, d_out, x, topk_weights, w_gate, w_up, w_down)
"""
from mok_rt.api.config import MoEConfig
from mok_rt.errors import (ArgumentError, CapacityError, CudaDriverError, DeviceError, ExpertIdError, MokError,
                     NoCubinError, PeerTimeoutError, TokenCountError)
from mok_rt.dist.group import CallableGroup, MPIGroup, SingleProcessGroup
from mok_rt.dist.symmetric import SymmetricHeap, device_barrier
from mok_rt.api.layer import Context, Gradients, backward, forward, recompute_context, schedule
from mok_rt.interop.tensor import Tensor
from mok_rt.api.workspace import Workspace, WorkspaceRank

__version__ = "0.1.0"

__all__ = [
    "MoEConfig", "Workspace", "WorkspaceRank", "SingleProcessGroup", "MPIGroup", "CallableGroup", "Tensor", "Context", "Gradients",
    "SymmetricHeap", "device_barrier", "schedule", "forward", "backward", "recompute_context",
    "MokError", "ArgumentError", "CudaDriverError", "NoCubinError", "DeviceError", "ExpertIdError",
    "CapacityError", "TokenCountError", "PeerTimeoutError",
]
