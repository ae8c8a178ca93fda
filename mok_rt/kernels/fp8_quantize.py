"""Host side of the CUDA weight quantiser (cuda_src/fp8/quantize_weights.cu): the "fp8_block"
copies of SwiGLU expert weights on the device, for ``mok.quantize_weights``.

Each weight ``[G, R, C]`` (C = the forward GEMM's reduction dimension, already contiguous) gets
an E4M3 copy of the same layout and fp32 scales ``[G, ceil(R/128), ceil(C/128)]``: exactly the
oracle's ``quantize_experts(...).gate / .up / .down`` (values and scales), bit for bit.  With
``for_backward`` it also gets the input-gradient copy ``[G, C, R]`` (R contiguous: the dgrad GEMM's
reduction dimension) and scales ``[G, ceil(C/128), ceil(R/128)]``, the oracle's ``gate_t`` /
``up_t`` / ``down_t``: the same bytes and scales transposed (128 x 128 blocks), one more byte per
weight (the forward copy's size again; the scales add 4 bytes per 16,384 weights).

:func:`plan_jobs` (pure arithmetic, tested on the CPU) lays the tensors out as the kernel's jobs;
:func:`launch_quantize` fills the parameter struct and launches one grid for all of them.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from mok_rt.errors import ArgumentError

__all__ = ["prepare", "BLOCK", "MAX_JOBS", "THREADS", "QuantJob", "Params", "DeviceQuantized", "plan_jobs", "scale_shape",
           "transposed_shape", "fill_params", "JOB_BYTES",
           "as_shape3", "launch_quantize"]

BLOCK = 128        # 128 x 128 weight blocks (fp8q::quantize_block)
MAX_JOBS = 6       # fp8q::kMaxJobs: routed gate, up, down + the shared expert's
THREADS = 256      # fp8q::kThreads
_MAX_GRID = 1 << 20   # CTAs launched at most (the kernel strides over the rest)
JOB_BYTES = 56     # sizeof(fp8q::Job)


class QuantJob(ctypes.Structure):
    _fields_ = [("w", ctypes.c_uint64), ("q", ctypes.c_uint64), ("s", ctypes.c_uint64),
                ("qt", ctypes.c_uint64), ("st", ctypes.c_uint64),    # 0: no transposed copy
                ("groups", ctypes.c_int32), ("r", ctypes.c_int32), ("c", ctypes.c_int32),
                ("first_block", ctypes.c_int32)]


class Params(ctypes.Structure):
    _fields_ = [("jobs", QuantJob * MAX_JOBS), ("num_jobs", ctypes.c_int32), ("pad_", ctypes.c_int32)]


assert ctypes.sizeof(QuantJob) == JOB_BYTES and ctypes.sizeof(Params) == MAX_JOBS * JOB_BYTES + 8   # static_assert'ed



def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(shape: tuple) -> tuple:
    """Scales of a ``[..., R, C]`` weight: one fp32 per 128 x 128 block (the oracle's layout)."""
    *lead, r, c = shape
    return (*lead, _cdiv(r, BLOCK), _cdiv(c, BLOCK))


def transposed_shape(shape: tuple) -> tuple:
    """The input-gradient copy of a ``[..., R, C]`` weight: ``[..., C, R]``."""
    *lead, r, c = shape
    return (*lead, c, r)


def plan_jobs(tensors) -> tuple[list[tuple[int, int, int, int]], int]:
    """``tensors``: shapes ``(G, R, C)`` -> per job (groups, r, c, first_block) and the total
    number of 128 x 128 blocks (the grid the kernel strides over)."""
    if len(tensors) > MAX_JOBS:
        raise ArgumentError("weights", f"at most {MAX_JOBS} tensors per launch, got {len(tensors)}")
    jobs, at = [], 0
    for g, r, c in tensors:
        if r % 4 or c % 4 or min(g, r, c) < 1:
            raise ArgumentError("weights", f"shape {(g, r, c)}: the kernel needs positive sizes, R and C multiples "
                                           f"of 4")
        jobs.append((g, r, c, at))
        at += g * _cdiv(r, BLOCK) * _cdiv(c, BLOCK)
    if at >= 2 ** 31:
        raise ArgumentError("weights", "too many 128 x 128 blocks for one launch")
    return jobs, at


@dataclass(frozen=True, eq=False)
class DeviceQuantized:
    """One group of SwiGLU weights quantised on the device (the routed experts, or the shared
    expert without the leading axis): the forward copies ``gate``, ``up`` ``[.., I, H]`` and
    ``down`` ``[.., H, I]`` (float8_e4m3fn tensors) and their fp32 scales; with ``for_backward``
    also the input-gradient copies ``gate_t``, ``up_t`` ``[.., H, I]`` and ``down_t`` ``[.., I, H]``
    (None otherwise); ``sources``: the bf16 views quantised.  Opaque to users (the ``experts`` /
    ``shared`` of a :class:`mok_rt.QuantizedWeights`)."""

    gate: object
    up: object
    down: object
    gate_scale: object
    up_scale: object
    down_scale: object
    device_id: int
    gate_t: object = None
    up_t: object = None
    down_t: object = None
    gate_t_scale: object = None
    up_t_scale: object = None
    down_t_scale: object = None
    # The bf16 views quantised (kept alive with the copies): where the FP8 backward makes the
    # transposed copies from when these were quantised with for_backward=False.
    sources: tuple | None = field(default=None, repr=False)

    @property
    def for_backward(self) -> bool:
        """Whether the input-gradient copies exist (what the FP8 backward reads)."""
        return self.gate_t is not None

    def to_numpy(self) -> dict:
        """Host copies by name (waits for the producing stream): what tests compare bitwise
        with the oracle's ``quantize_experts``; the ``*_t`` ones only when they exist."""
        names = ["gate", "up", "down", "gate_scale", "up_scale", "down_scale"]
        if self.for_backward:
            names += ["gate_t", "up_t", "down_t", "gate_t_scale", "up_t_scale", "down_t_scale"]
        return {n: getattr(self, n).to_numpy() for n in names}


def fill_params(pairs) -> tuple[Params, int]:
    """The kernel's parameters for ``pairs`` (see :func:`launch_quantize`) and its block count."""
    jobs, total = plan_jobs([pr[1] for pr in pairs])
    p = Params()
    for i, (pr, (g, r, c, first)) in enumerate(zip(pairs, jobs)):
        src, _, q, s = pr[:4]
        qt, st = (pr[4], pr[5]) if len(pr) > 4 else (0, 0)
        if bool(qt) != bool(st) or bool(q) != bool(s):
            raise ArgumentError("weights", "a copy needs both its values and its scales")
        if not q and not qt:
            raise ArgumentError("weights", "a job must write the forward copy, the transposed copy or both")
        p.jobs[i] = QuantJob(int(src), int(q), int(s), int(qt or 0), int(st or 0), g, r, c, first)
    p.num_jobs = len(jobs)
    return p, total


def launch_quantize(pairs, *, stream, device_id: int) -> None:
    """Quantise every ``(src bf16 pointer, shape (G, R, C), dst e4m3 pointer, dst scale pointer
    [, transposed e4m3 pointer, transposed scale pointer])`` of ``pairs`` in one launch on
    ``stream`` (transposed pointers 0 or left out: forward copy only; forward pointers 0:
    transposed copy only)."""
    from mok_rt.runtime.cubins import get_kernel
    from mok_rt.runtime.launch import launch
    p, total = fill_params(pairs)
    if total == 0:
        return
    kernel = get_kernel("quantize_weights", "fp8_quantize_weights", device_id)
    launch(kernel, grid=min(total, _MAX_GRID), block=THREADS, params=p, stream=stream, device_id=device_id)


def prepare(device_id: int) -> None:
    """Load the quantiser on ``device_id`` now (see ``moe_launch.prepare``: with expert
    parallelism nothing may load while a rank's megakernel waits for a peer)."""
    from mok_rt.runtime.cubins import get_kernel
    get_kernel("quantize_weights", "fp8_quantize_weights", device_id)


def as_shape3(shape: tuple) -> tuple:
    """(G, R, C) of a 2-D (shared expert) or 3-D weight shape."""
    return tuple(shape) if len(shape) == 3 else (1, *shape)

