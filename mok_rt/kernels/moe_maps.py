"""TMA tensor maps of the warp-specialised MoE kernels (cuda_src/moe/params_tma.cuh).

Every operand view the kernels load gets one 3D map (``_tensormap.gemm_operand``): K-major views
(names ending ``_k``) with the box height of their role (128 rows for A and for each half of a
gate|up B, 256 for a whole B tile), MN-major views (``_mn``) with 64 x 64 panels.  A view over a
buffer the launch never reads (no shared expert, T = 0, a null pointer) is 128 zero bytes.

:func:`map_specs` is pure host arithmetic (testable without a GPU); :func:`encode_maps` runs
``cuTensorMapEncodeTiled`` for each spec, through a small cache keyed by the spec (maps depend
only on pointers and sizes, so a training loop that reuses its buffers encodes them once).
"""
from __future__ import annotations

import ctypes
from collections import OrderedDict

from mok_rt.kernels import moe_params as P
from mok_rt.runtime.tensormap import Major, TensorMapSpec, encode, gemm_operand

__all__ = ["map_specs", "encode_maps"]

_A_ROWS = P.BLOCK_M          # box height of an A operand and of each half of a gate|up B
_B_ROWS = P.TILE_N       # box height of a whole K-major B tile


def _view(address: int, major: Major, rows: int, k: int, box_rows: int, groups: int = 1) -> TensorMapSpec | None:
    if not address or rows <= 0 or k <= 0:
        return None
    return gemm_operand(address, major=major, rows=rows, k=k, box_rows=box_rows, groups=groups)


def map_specs(bufs, dims, *, backward: bool) -> dict[str, TensorMapSpec | None]:
    """The spec of every map of the forward (``backward=False``; ``bufs``: ForwardBuffers) or the
    backward (BackwardBuffers), in the struct's field order; None = unused (zero bytes)."""
    d = dims
    T, H, I, Is, R, E = (d.tokens, d.hidden, d.intermediate, d.shared_intermediate, d.capacity_rows,
                         d.local_experts)
    K, MN = Major.K, Major.MN
    b = bufs
    if not backward:
        specs = {
            "x_k": _view(b.x, K, T, H, _A_ROWS),
            "x_routed_k": _view(b.x_routed, K, R, H, _A_ROWS),
            "sact_k": _view(b.sact, K, T, Is, _A_ROWS),
            "act_k": _view(b.act, K, R, I, _A_ROWS),
            "w_gate_k": _view(b.w_gate, K, I, H, _A_ROWS, E),
            "w_up_k": _view(b.w_up, K, I, H, _A_ROWS, E),
            "w_down_k": _view(b.w_down, K, H, I, _B_ROWS, E),
            "shared_gate_k": _view(b.shared_gate, K, Is, H, _A_ROWS),
            "shared_up_k": _view(b.shared_up, K, Is, H, _A_ROWS),
            "shared_down_k": _view(b.shared_down, K, H, Is, _B_ROWS),
        }
        names = P.FORWARD_MAP_NAMES
    else:
        specs = {
            "dy_routed_k": _view(b.dy_routed, K, R, H, _A_ROWS),
            "d_out_k": _view(b.d_out, K, T, H, _A_ROWS),
            "dgu_k": _view(b.dgu, K, R, 2 * I, _A_ROWS),
            "dsgu_k": _view(b.dsgu, K, T, 2 * Is, _A_ROWS),
            # B of dA: w_down[e] is [H, I] = (k = h, n = i) with n contiguous.
            "w_down_mn": _view(b.w_down, MN, I, H, _B_ROWS, E),
            "shared_down_mn": _view(b.shared_down, MN, Is, H, _B_ROWS),
            # B of dX: w_gate[e] / w_up[e] are [I, H] = (k = i, n = h).
            "w_gate_mn": _view(b.w_gate, MN, H, I, _B_ROWS, E),
            "w_up_mn": _view(b.w_up, MN, H, I, _B_ROWS, E),
            "shared_gate_mn": _view(b.shared_gate, MN, H, Is, _B_ROWS),
            "shared_up_mn": _view(b.shared_up, MN, H, Is, _B_ROWS),
            # wgrads: K = rows (routed row space, or tokens for the shared expert).
            "dy_routed_mn": _view(b.dy_routed, MN, H, R, _A_ROWS),
            "act_mn": _view(b.act, MN, I, R, _B_ROWS),
            "dgu_mn": _view(b.dgu, MN, 2 * I, R, _A_ROWS),
            "x_routed_mn": _view(b.x_routed, MN, H, R, _B_ROWS),
            "d_out_mn": _view(b.d_out, MN, H, T, _A_ROWS),
            "sact_mn": _view(b.sact, MN, Is, T, _B_ROWS),
            "dsgu_mn": _view(b.dsgu, MN, 2 * Is, T, _A_ROWS),
            "x_mn": _view(b.x, MN, H, T, _B_ROWS),
        }
        names = P.BACKWARD_MAP_NAMES
    assert tuple(specs) == names
    return specs


_CACHE_SIZE = 256
_cache: OrderedDict[TensorMapSpec, bytes] = OrderedDict()


def _encoded(spec: TensorMapSpec) -> bytes:
    raw = _cache.get(spec)
    if raw is None:
        raw = encode(spec)
        _cache[spec] = raw
        if len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(spec)
    return raw


def encode_maps(specs: dict[str, TensorMapSpec | None], struct: ctypes.Structure) -> None:
    """Writes every map of ``specs`` into the ctypes maps struct (zeros for None)."""
    for name, spec in specs.items():
        field = getattr(struct, name)
        raw = bytes(len(field)) if spec is None else _encoded(spec)
        ctypes.memmove(ctypes.addressof(field), raw, len(field))


class StructCache(dict):
    """Encoded maps structs (bytes) by key (a launch's dims and buffer pointers): a training loop
    that reuses its buffers (weights always, the rest as often as the memory pool hands the same
    blocks back) copies its maps instead of building and encoding them again.  The oldest entry
    goes first.  A dict, so that tools can save and restore it (bench/null_driver.py)."""

    def __init__(self, size: int = 64):
        super().__init__()
        self.size = size

    def fill(self, key, struct: ctypes.Structure, specs) -> None:
        """Writes the maps of ``key`` into ``struct``; ``specs()`` (name -> spec, as encode_maps
        takes) is called only when the key is new."""
        raw = self.get(key)
        if raw is None:
            encode_maps(specs(), struct)
            raw = self[key] = bytes(struct)
            if len(self) > self.size:
                self.pop(next(iter(self)))
        else:
            ctypes.memmove(ctypes.addressof(struct), raw, len(raw))
