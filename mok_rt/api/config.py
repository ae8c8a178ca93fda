"""MoEConfig: the layer's shape and the kernels' knobs, validated once."""
from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, field

import numpy as np

from mok_rt.errors import ArgumentError

__all__ = ["MoEConfig"]

PRECISIONS = ("bf16", "fp8_block", "mxfp8")   # docs/SEMANTICS.md §10
_ALIGN = 64  # hidden / intermediate sizes must be multiples of the GEMM's K and N granule
MAX_TOP_K = 8  # routes per token the layer supports (the README promises top-k 1-8)


_INT_FIELDS = ("hidden", "intermediate", "num_experts", "top_k", "shared_intermediate", "block_m", "ctas_per_sm",
               "comm_sms")


def is_int(v) -> bool:
    """An int or a NumPy integer, not a bool: 128.0 or True compare equal to 128 or 1 and would
    slip through the range checks below."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _positive_int(name: str, v) -> int:
    if not is_int(v) or v <= 0:
        raise ArgumentError(name, f"expected a positive int, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer: routed SwiGLU experts plus an optional shared expert.

    Shapes (docs/SEMANTICS.md): x [T, hidden]; w_gate/w_up [E_local, intermediate, hidden];
    w_down [E_local, hidden, intermediate]; shared expert [shared_intermediate, hidden] (×2) and
    [hidden, shared_intermediate].  A token may name the same expert twice in its top-k: the two
    routes are independent and their weighted outputs add up.

    Kernel knobs (defaults suit H100/H200):
      block_m       rows per GEMM row block; each expert's rows are padded to it.  The kernels
                    use 128 (the only accepted value; the field documents the padding).
      ctas_per_sm   persistent CTAs per SM (1 or 2).
      comm_sms      with experts spread over ranks: how many tasks push this rank's token rows
                    to their experts' ranks (forward and backward), hence at most how many CTAs
                    (about one per SM) move rows at the start of a launch while the others
                    already run shared-expert and local work.  Rows returning to their source
                    ride the down / dgrad GEMM epilogues.  Any CTA may take a push task.  The
                    push releases its rows in 4 x comm_sms chunks of tokens, so a row block's
                    GEMMs start once the chunks holding its rows are in.
      timeout_s     how long a kernel waits for a dependency or a peer before it gives up and
                    reports a timeout (the error names what was missing).
      capacity_factor  None: every rank can hold the worst case (all routed rows of all ranks);
                    a float f: each rank holds f × (average rows per rank) rows, rounded up.

    Numerics (keyword only): ``precision`` "bf16" (default), "fp8_block" (E4M3, fp32 scales per
    1×128 / 128×128 block) or "mxfp8" (E4M3, E8M0 scales per 1×32 block); docs/SEMANTICS.md §10.
    """

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    shared_intermediate: int = 0
    swiglu_limit: float | None = None
    _: KW_ONLY  # the kernel knobs and the precision: keyword only (docs/API.md)
    block_m: int = 128
    ctas_per_sm: int = 1
    comm_sms: int = 32
    timeout_s: float = 10.0
    capacity_factor: float | None = None
    precision: str = "bf16"

    def __post_init__(self):
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if not is_int(v):
                raise ArgumentError(name, f"expected an int, got {v!r} ({type(v).__name__})")
            # Plain ints from here on: NumPy integers would reach the kernel parameters and the
            # configuration the ranks compare (JSON) as they are.
            object.__setattr__(self, name, int(v))
        for name in ("hidden", "intermediate", "num_experts", "top_k"):
            _positive_int(name, getattr(self, name))
        for name in ("hidden", "intermediate"):
            v = getattr(self, name)
            if v % _ALIGN:
                raise ArgumentError(name, f"must be a multiple of {_ALIGN}, got {v}")
        si = self.shared_intermediate
        if si < 0 or si % _ALIGN:
            raise ArgumentError("shared_intermediate", f"expected 0 (no shared expert) or a positive multiple "
                                                       f"of {_ALIGN}, got {si!r}")
        # A token may name one expert twice (its routes add up), so top_k may exceed num_experts.
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise ArgumentError("top_k", f"top_k must be 1..{MAX_TOP_K}, got {self.top_k}")
        if self.swiglu_limit is not None:
            lim = self.swiglu_limit
            if isinstance(lim, bool) or not isinstance(lim, (int, float)) or not math.isfinite(lim) or lim <= 0:
                raise ArgumentError("swiglu_limit", f"expected None or a positive finite float, got {lim!r}")
            object.__setattr__(self, "swiglu_limit", float(lim))
        if self.block_m != 128:
            raise ArgumentError("block_m", f"the kernels pad each expert's rows to blocks of 128, got {self.block_m!r}")
        if self.ctas_per_sm not in (1, 2):
            raise ArgumentError("ctas_per_sm", f"expected 1 or 2, got {self.ctas_per_sm!r}")
        if not 1 <= self.comm_sms <= 64:
            raise ArgumentError("comm_sms", f"expected an int in [1, 64], got {self.comm_sms!r}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 < t <= 3600:
            raise ArgumentError("timeout_s", f"expected seconds in (0, 3600], got {t!r}")
        cf = self.capacity_factor
        # Finite: inf (or nan) would reach math.ceil in capacity_rows as an OverflowError.
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not math.isfinite(cf)
                               or not cf > 0):
            raise ArgumentError("capacity_factor", f"expected None or a positive finite float, got {cf!r}")
        if self.precision not in PRECISIONS:
            raise ArgumentError("precision", f"expected one of {PRECISIONS}, got {self.precision!r}")

    @property
    def has_shared(self) -> bool:
        return self.shared_intermediate > 0

    def experts_per_rank(self, num_ranks: int) -> int:
        if not is_int(num_ranks) or num_ranks < 1:
            raise ArgumentError("num_ranks", f"expected an int >= 1, got {num_ranks!r}")
        if self.num_experts % num_ranks:
            raise ArgumentError("num_experts", f"{self.num_experts} experts cannot be split evenly over "
                                               f"{num_ranks} ranks")
        return self.num_experts // int(num_ranks)

    def capacity_rows(self, *, max_tokens: int, num_ranks: int) -> int:
        """Padded rows one rank's buffers hold (a multiple of block_m)."""
        el = self.experts_per_rank(num_ranks)
        if not is_int(max_tokens) or max_tokens < 0:
            raise ArgumentError("max_tokens", f"expected an int >= 0, got {max_tokens!r}")
        routes = int(num_ranks) * int(max_tokens) * self.top_k
        if self.capacity_factor is not None:
            # Compared as a float first: a huge (finite) factor times the rows overflows to inf,
            # which math.ceil cannot convert; such a factor means no limit below the worst case.
            limit = self.capacity_factor * max_tokens * self.top_k
            if limit < routes:
                routes = math.ceil(limit)
        rows = routes + el * (self.block_m - 1)   # worst-case padding: every expert one row short
        return -(-rows // self.block_m) * self.block_m

    def forward_flops(self, tokens: int) -> int:
        """FLOPs of one forward over ``tokens`` tokens (routed + shared): 6 · T · (k · H · I + H · I_s),
        the count bench/bench_moe.py and the README use (the backward: twice that)."""
        return 6 * tokens * (self.top_k * self.hidden * self.intermediate + self.hidden * self.shared_intermediate)
