"""mok_rt: a mixture-of-experts training megakernel with a pure cuda-python runtime.

    import mok_rt as mok
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=k)
    experts = mok.ExpertWeights(gate=w_gate, up=w_up, down=w_down)
    with mok.Workspace(cfg, mok.SingleProcessGroup(devices=[0]), max_tokens=T) as ws:
        sched = mok.schedule(ws, topk_ids)
        out, ctx = mok.forward(ws, sched, x, topk_weights, experts)
        g = mok.backward(ws, ctx, d_out)        # g.dx, g.d_topk_weights, g.dw.gate/.up/.down

docs/API.md describes every name exported here; ``mok_rt.dist`` holds the expert-parallel
plumbing and ``mok_rt.reference`` the NumPy oracle.  Everything else is internal.
"""
from mok_rt.api.config import MoEConfig
from mok_rt.api.layer import backward, forward, recompute_context, schedule
from mok_rt.api.quantize import quantize_weights
from mok_rt.api.workspace import Workspace, WorkspaceRank
from mok_rt.dist.group import CallableGroup, MPIGroup, SingleProcessGroup
from mok_rt.errors import (ArgumentError, CapacityError, CudaDriverError, DeviceError, ExpertIdError, MokError,
                           NoCubinError, PeerTimeoutError, TokenCountError)
from mok_rt.interop.tensor import Tensor
from mok_rt.runtime.driver import device_count
from mok_rt.types import Context, ExpertWeights, Gradients, QuantizedWeights

__version__ = "0.1.0"

__all__ = [
    "MoEConfig", "Workspace", "WorkspaceRank", "SingleProcessGroup", "MPIGroup", "CallableGroup",
    "ExpertWeights", "Tensor", "Context", "Gradients", "schedule", "forward", "backward", "recompute_context",
    "device_count", "QuantizedWeights", "quantize_weights",
    "MokError", "ArgumentError", "CudaDriverError", "NoCubinError", "DeviceError", "ExpertIdError",
    "CapacityError", "TokenCountError", "PeerTimeoutError",
]
