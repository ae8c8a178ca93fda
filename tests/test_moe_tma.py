"""Host side of the warp-specialised TMA + wgmma kernels (no GPU): parameter-struct layout, the
tensor-map specs every operand view gets, and the task counts."""
from __future__ import annotations

import ctypes

import pytest

import mok_rt as mok
from mok_rt.kernels import moe_launch as L
from mok_rt.kernels import moe_maps as M
from mok_rt.kernels import moe_params as P
from mok_rt.runtime.tensormap import Swizzle
from mok_rt.errors import ArgumentError

QWEN = dict(tokens=16384, hidden=2048, intermediate=768, top_k=8, local_experts=128)


def _dims(**kw):
    base = dict(tokens=300, hidden=320, intermediate=192, top_k=3, local_experts=5, capacity_rows=1280,
                shared_intermediate=320)
    base.update(kw)
    return L.LayerDims(**base)


def _fwd_bufs(shared=True, tokens=True):
    v = iter(range(1 << 20, 1 << 30, 1 << 20))
    names = [f.name for f in L.ForwardBuffers.__dataclass_fields__.values()]
    b = {n: next(v) for n in names}
    if not shared:
        b.update({n: 0 for n in ("shared_gate", "shared_up", "shared_down", "sgu", "sact", "shared_y")})
    if not tokens:
        b.update({n: 0 for n in ("x", "topk_weights", "out", "y_slot", "sgu", "sact", "shared_y")})
    return L.ForwardBuffers(**b)


def _bwd_bufs():
    v = iter(range(1 << 20, 1 << 30, 1 << 20))
    return L.BackwardBuffers(**{n: next(v) for n in L.BackwardBuffers.__dataclass_fields__})


def test_parameter_structs_mirror_params_tma():
    assert ctypes.sizeof(P.MoEForwardTmaParams) == 2368
    assert ctypes.sizeof(P.MoEBackwardTmaParams) == 3520 <= 4096
    assert P.MoEForwardTmaParams.maps.offset == 0 and P.MoEForwardTmaParams.p.offset == 10 * 128
    assert P.MoEBackwardTmaParams.maps.offset == 0 and P.MoEBackwardTmaParams.p.offset == 18 * 128
    for cls, names in ((P.MoEForwardMaps, P.FORWARD_MAP_NAMES), (P.MoEBackwardMaps, P.BACKWARD_MAP_NAMES)):
        assert [f[0] for f in cls._fields_] == list(names)
        for i, n in enumerate(names):
            assert getattr(cls, n).offset == 128 * i   # each map 64-byte aligned
    assert P.SMEM_BYTES == 197800 and P.THREADS == 384


def test_forward_map_specs():
    d = _dims()
    b = _fwd_bufs()
    s = M.map_specs(b, d, backward=False)
    assert tuple(s) == P.FORWARD_MAP_NAMES
    x = s["x_k"]
    assert x.address == b.x and x.dims == (320, 300, 1) and x.box == (64, 128, 1) and x.swizzle == Swizzle.B128
    assert x.strides == (320 * 2, 300 * 320 * 2)
    wg = s["w_gate_k"]   # one expert per group: a box never reads the next expert's rows
    assert wg.dims == (320, 192, 5) and wg.box == (64, 128, 1) and wg.strides == (640, 192 * 320 * 2)
    assert s["w_down_k"].dims == (192, 320, 5) and s["w_down_k"].box == (64, 256, 1)
    assert s["shared_down_k"].dims == (320, 320, 1) and s["shared_down_k"].box == (64, 256, 1)
    assert s["act_k"].dims == (192, 1280, 1)
    # No shared expert, no tokens: those maps are zeros.
    s = M.map_specs(_fwd_bufs(shared=False), _dims(shared_intermediate=0), backward=False)
    assert all(s[n] is None for n in ("sact_k", "shared_gate_k", "shared_up_k", "shared_down_k"))
    s = M.map_specs(_fwd_bufs(tokens=False), _dims(tokens=0), backward=False)
    assert s["x_k"] is None and s["sact_k"] is None and s["x_routed_k"] is not None


def test_backward_map_specs():
    d = _dims()
    b = _bwd_bufs()
    s = M.map_specs(b, d, backward=True)
    assert tuple(s) == P.BACKWARD_MAP_NAMES
    mn = [n for n in s if n.endswith("_mn")]
    assert all(s[n].box == (64, 64, 1) for n in mn)
    assert all(s[n].box == (64, 128, 1) for n in s if n.endswith("_k"))
    # dA's B: w_down[e] [H, I] read as (n = i contiguous, k = h).
    assert s["w_down_mn"].dims == (192, 320, 5) and s["w_down_mn"].address == b.w_down
    # dX's B: w_gate[e] [I, H] as (n = h, k = i); wgrads run K over the routed rows / tokens.
    assert s["w_gate_mn"].dims == (320, 192, 5)
    assert s["dgu_mn"].dims == (384, 1280, 1) and s["dgu_k"].dims == (384, 1280, 1)
    assert s["x_mn"].dims == (320, 300, 1) and s["dsgu_mn"].dims == (640, 300, 1)


def test_encode_maps_writes_zeros_for_unused_views():
    maps = P.MoEForwardMaps()
    ctypes.memset(ctypes.addressof(maps), 0xAB, ctypes.sizeof(maps))
    M.encode_maps({n: None for n in P.FORWARD_MAP_NAMES}, maps)
    assert bytes(maps) == bytes(ctypes.sizeof(maps))


def test_task_counts():
    d = L.LayerDims(capacity_rows=16384 * 8 + 128 * 128, **QWEN)
    mb, tb = d.max_blocks, d.token_blocks
    cb = tb * P.combine_parts(tb)  # combine tasks
    # gate|up tiles of 128 columns (768 / 128 = 6), N tiles of 256 (2048 / 256 = 8).
    assert L.forward_task_count(d) == mb + mb * 6 + mb * 8 + cb
    E = 128
    assert L.backward_task_count(d) == (mb + tb + mb * 3 + mb * 8 + E * 16 * 3 + E * 2 * 6 * 8 + cb)
    # Ragged widths round up: I = 192 -> 2 gate|up tiles, 1 dA tile; H = 320 -> 2 N tiles.
    r = _dims()
    si_t, si_r = 2, 3   # I_s = 320: 256-wide tiles, 128-row tiles
    want = (r.max_blocks + r.token_blocks + r.token_blocks * si_t + r.max_blocks * 1 + r.token_blocks * 2
            + r.max_blocks * 2 + 5 * 3 * 1 + 5 * 2 * 2 * 2 + (3 * si_t + 2 * si_r * 2) + r.token_blocks * P.combine_parts(r.token_blocks))
    assert L.backward_task_count(r) == want
