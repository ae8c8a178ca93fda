"""mok_rt: a mixture-of-experts training megakernel with a pure cuda-python runtime.

    import mok_rt as mok
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k)
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=T) as ws:
        sched = mok.schedule(ws, topk_ids)
        out, ctx = mok.forward(ws, sched, x, topk_weights, w_gate, w_up, w_down)
        g = mok.backward(ws, sched, ctx, d_out, x, topk_weights, w_gate, w_up, w_down)
"""
from .config import MoEConfig
from .errors import (ArgumentError, CapacityError, CudaDriverError, DeviceError, ExpertIdError, MokError,
                     NoCubinError, PeerTimeoutError, TokenCountError)
from .group import CallableGroup, MPIGroup, SingleProcessGroup
from .symmetric import SymmetricHeap, device_barrier
from .layer import Context, Gradients, backward, forward, recompute_context, schedule
from .tensor import Tensor
from .workspace import Workspace, WorkspaceRank

__version__ = "0.1.0"

__all__ = [
    "MoEConfig", "Workspace", "WorkspaceRank", "SingleProcessGroup", "MPIGroup", "CallableGroup", "Tensor", "Context", "Gradients",
    "SymmetricHeap", "device_barrier", "schedule", "forward", "backward", "recompute_context",
    "MokError", "ArgumentError", "CudaDriverError", "NoCubinError", "DeviceError", "ExpertIdError",
    "CapacityError", "TokenCountError", "PeerTimeoutError",
]
