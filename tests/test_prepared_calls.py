"""The CUDA backend's host-side caches (mok_rt/backends/cuda_calls.py), on the CPU against the null
driver of bench/null_driver.py: a call that repeats the previous ones' pointers, sizes and stream
enqueues its prepared launch again, bit for bit the launch it would have built; anything that
changes misses; validation still runs on every call; captured calls are never cached; result
blocks are recycled only once their results are gone, and only on their own stream."""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from null_driver import FakeDeviceArray, null_driver  # noqa: E402

import mok_rt as mok  # noqa: E402
from mok_rt.backends import cuda as cuda_backend  # noqa: E402
from mok_rt.runtime import launch as rlaunch  # noqa: E402

T, H, I, E, K = 256, 128, 128, 8, 2
BF = ml_dtypes.bfloat16


class _Inputs:
    """Fake device tensors for one layer, at distinct 4 KiB-aligned addresses."""

    def __init__(self, tokens=T, base=1 << 44, shared=0):
        self._next = base
        self.ids = self.new((tokens, K), np.int32)
        self.x, self.d_out = self.new((tokens, H), BF), self.new((tokens, H), BF)
        self.tw = self.new((tokens, K), np.float32)
        self.experts = mok.ExpertWeights(self.new((E, I, H), BF), self.new((E, I, H), BF), self.new((E, H, I), BF))
        self.shared = mok.ExpertWeights(self.new((shared, H), BF), self.new((shared, H), BF),
                                        self.new((H, shared), BF)) if shared else None

    def new(self, shape, dtype, *, offset=0):
        ptr = self._next + offset
        self._next += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 4096) * 4096 + 4096
        return FakeDeviceArray(shape, dtype, ptr=ptr)


def _step(ws, a, **kw):
    sched = mok.schedule(ws, a.ids, **kw)
    out, ctx = mok.forward(ws, sched, a.x, a.tw, a.experts, shared=a.shared, **kw)
    g = mok.backward(ws, ctx, a.d_out, **kw)
    return out, g


@pytest.fixture
def fake():
    with null_driver() as drv:
        yield drv


@pytest.fixture
def launches(monkeypatch):
    """Every launch enqueued: (kernel name, stream handle, bytes of its parameter struct)."""
    seen = []
    real = rlaunch.PreparedLaunch.__call__

    def record(self):
        p = self.params
        seen.append((self.kernel.name, int(self._cfg.hStream), ctypes.string_at(ctypes.addressof(p), ctypes.sizeof(p))))
        real(self)
    monkeypatch.setattr(rlaunch.PreparedLaunch, "__call__", record)
    return seen


def _workspace(**kw):
    cfg = mok.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K,
                        shared_intermediate=kw.pop("shared_intermediate", 0))
    return mok.Workspace(cfg, max_tokens=kw.pop("max_tokens", T), **kw)


def test_a_repeated_step_enqueues_the_launches_it_would_have_built(launches, monkeypatch):
    def run(cache: bool):
        if not cache:
            monkeypatch.setattr(cuda_backend.CudaBackend, "_cacheable", lambda self, capturing: False)
        # Each run in a fresh null driver: the same addresses for the error word, scratch and blocks.
        with null_driver(), _workspace() as ws:
            a = _Inputs()
            for _ in range(4):
                _step(ws, a)
            calls = ws._single()._impl._calls
            return list(launches), calls.hits, calls.misses

    cached, hits, misses = run(True)
    launches.clear()
    fresh, hits0, _ = run(False)
    assert len(cached) == 4 * 5          # count, scan, place, forward, backward per step
    assert cached == fresh               # the same kernels, streams and parameter bytes
    assert (hits, misses) == (9, 3) and hits0 == 0   # steps 2-4 hit all three calls


def test_new_pointers_shapes_streams_and_flags_miss(fake, launches):
    with _workspace(max_tokens=2 * T) as ws:
        a = _Inputs()
        _step(ws, a)
        calls = ws._single()._impl._calls
        _step(ws, a)
        assert calls.misses == 3 and calls.hits == 3
        b = _Inputs(base=1 << 45)          # the same shapes elsewhere
        _step(ws, b)
        assert calls.misses == 6
        _step(ws, _Inputs(tokens=2 * T, base=1 << 46))   # another token count
        assert calls.misses == 9
        stream = type("S", (), {"__cuda_stream__": lambda self: (0, 0x7777)})()
        _step(ws, a, stream=stream)        # another stream
        assert calls.misses == 12
        assert {h for _, h, _ in launches[-5:]} == {0x7777}
        sched = mok.schedule(ws, a.ids)
        _, ctx = mok.forward(ws, sched, a.x, a.tw, a.experts)
        dw = mok.ExpertWeights(*(a.new(s, np.float32) for s in ((E, I, H), (E, I, H), (E, H, I))))
        before = calls.misses
        mok.backward(ws, ctx, a.d_out, dw=dw, accumulate=True)        # caller's buffers, accumulate
        assert calls.misses == before + 1
        before = calls.misses
        mok.recompute_context(ws, sched, a.x, a.tw, a.experts)        # context-only: its own launch
        assert calls.misses == before + 1
        assert len(calls) <= calls.size


def test_bad_input_still_raises_after_a_hit_and_launches_nothing(fake, launches):
    with _workspace() as ws:
        a = _Inputs()
        _step(ws, a)
        _step(ws, a)
        n = len(launches)
        sched = mok.schedule(ws, a.ids)
        cases = [
            ("x", lambda: mok.forward(ws, sched, a.new((T, H), BF, offset=8), a.tw, a.experts)),   # misaligned
            ("x", lambda: mok.forward(ws, sched, a.new((T, H), np.float32), a.tw, a.experts)),     # dtype
            ("topk_weights", lambda: mok.forward(ws, sched, a.x, a.new((T, K + 1), np.float32), a.experts)),
            ("experts.up", lambda: mok.forward(ws, sched, a.x, a.tw,
                                               mok.ExpertWeights(a.experts.gate, a.new((E, I, H + 64), BF),
                                                                 a.experts.down))),
            ("topk_ids", lambda: mok.schedule(ws, a.new((T + 1, K), np.int32))),                   # > max_tokens
            ("topk_ids", lambda: mok.schedule(ws, a.new((T, K), np.float32))),
            ("d_out", lambda: mok.backward(ws, mok.forward(ws, sched, a.x, a.tw, a.experts)[1],
                                           a.new((T, H), BF, offset=4))),
        ]
        hits = ws._single()._impl._calls.hits
        for argument, bad in cases:
            n = len(launches)
            with pytest.raises(mok.ArgumentError) as ei:
                bad()
            assert ei.value.argument == argument
            if argument != "d_out":        # (the forward in that case is a good call)
                assert len(launches) == n
        del cases
        _step(ws, a)                       # and the good calls still hit
        assert ws._single()._impl._calls.hits > hits


def test_close_drops_the_cache_and_refuses_calls(fake):
    ws = _workspace()
    a = _Inputs()
    _step(ws, a)
    impl = ws._single()._impl
    assert len(impl._calls) == 3
    ws.close()
    assert len(impl._calls) == 0 and impl._blocks.spares == [] and impl._blocks.graveyard == []
    with pytest.raises(mok.ArgumentError) as ei:
        _step(ws, a)
    assert ei.value.argument == "ws"


def test_captured_calls_are_not_cached_and_take_arena_memory(fake, launches):
    with _workspace() as ws:
        a = _Inputs()
        _step(ws, a)
        impl = ws._single()._impl
        cached, allocs = len(impl._calls), fake.counts.get("cuMemAlloc", 0)
        fake.capturing = True
        out, g = _step(ws, a)
        fake.capturing = False
        assert len(impl._calls) == cached and impl._calls.hits == 0
        assert fake.counts["cuMemAlloc"] > allocs and ws.memory_bytes()["graph_arena"] > 0
        arena = range(1 << 40, fake._ptr + (1 << 30))
        assert out.ptr in arena and g.dx.ptr in arena
        assert out._producer_stream is None   # written by replays, on whatever stream replays
        out2, _ = _step(ws, a)                # eager again: hits what the eager step prepared
        assert impl._calls.hits == 3 and out2.ptr not in arena


def test_result_blocks_are_recycled_once_their_results_are_gone(fake):
    with _workspace() as ws:
        a = _Inputs()
        impl = ws._single()._impl
        out, g = _step(ws, a)
        first = (out.ptr, g.dx.ptr)
        taken = impl._blocks.allocations
        del out, g
        out, g = _step(ws, a)                 # the previous step's blocks come back
        assert (out.ptr, g.dx.ptr) == first and impl._blocks.allocations == taken
        kept = out
        del out, g
        out, g = _step(ws, a)                 # `kept` holds its block: the forward takes another
        assert out.ptr != kept.ptr and g.dx.ptr == first[1]
        del kept, out, g
        stream = type("S", (), {"__cuda_stream__": lambda self: (0, 0x9999)})()
        out, g = _step(ws, a, stream=stream)  # a spare is reused on its own stream only
        assert out.ptr not in first and impl._blocks.allocations > taken
        assert len(impl._blocks.spares) <= impl._blocks.limit


def test_poison_and_counters_are_enqueued_on_every_hit(fake):
    with _workspace(poison_outputs=True) as ws:
        a = _Inputs()
        _step(ws, a)
        n8, n32 = fake.counts.get("cuMemsetD8Async", 0), fake.counts.get("cuMemsetD32Async", 0)
        _step(ws, a)
        assert ws._single()._impl._calls.hits == 3
        # forward and backward result blocks; the schedule's 3 scratch arrays (chunk_count,
        # expert_total, expert_row_base) and the backward's 3 (dy_routed, dgu, dx_slot), poisoned
        # on every call (backends/cuda_scratch.py: the counters are zeroed by each launch instead)
        assert fake.counts["cuMemsetD8Async"] - n8 == 2 + 3 + 3
        assert fake.counts["cuMemsetD32Async"] - n32 == 8 + 2    # 8 schedule arrays, 2 counter blocks


def test_shared_expert_and_validation_memo(fake, launches):
    with _workspace(shared_intermediate=128) as ws:
        a = _Inputs(shared=128)
        _step(ws, a)
        _step(ws, a)
        assert ws._single()._impl._calls.hits == 3
        sched = mok.schedule(ws, a.ids)
        with pytest.raises(mok.ArgumentError) as ei:
            mok.forward(ws, sched, a.x, a.tw, a.experts)              # the shared expert is required
        assert ei.value.argument == "shared"


def test_the_null_driver_leaves_nothing_behind():
    from cuda.bindings import driver as real
    from mok_rt.interop import tensor
    from mok_rt.runtime import device, driver
    before = (driver._drv, device._device, device.default_stream, device.wrap_stream, tensor._activate)
    with null_driver():
        assert driver._drv is not real
    assert (driver._drv, device._device, device.default_stream, device.wrap_stream, tensor._activate) == before
    assert driver._drv is real


def test_spares_of_sizes_no_longer_used_are_freed(fake):
    with _workspace(max_tokens=2 * T) as ws:
        impl = ws._single()._impl
        big, small = _Inputs(tokens=2 * T), _Inputs(tokens=T, base=1 << 45)
        for _ in range(2):
            _step(ws, big)
        ws.synchronize()               # (released blocks become spares at the next call or synchronize)
        big_sizes = {t._shape[0] for t, _, _ in impl._blocks.spares}
        assert big_sizes
        for _ in range(4):
            _step(ws, small)
        ws.synchronize()
        sizes = {t._shape[0] for t, _, _ in impl._blocks.spares}
        assert sizes and not sizes & big_sizes
        assert fake.devices[0].freed   # (handed back to the pool)


def test_zero_tokens_and_recomputed_contexts_hit_too(fake, launches):
    with _workspace() as ws:
        calls = ws._single()._impl._calls
        empty = _Inputs(tokens=0)
        for _ in range(2):
            out, g = _step(ws, empty)
            assert out.shape == (0, H) and g.dx.shape == (0, H)
            del out, g
        assert calls.hits == 3
        a = _Inputs(base=1 << 45)
        for _ in range(2):
            sched = mok.schedule(ws, a.ids)
            ctx = mok.recompute_context(ws, sched, a.x, a.tw, a.experts)
            g = mok.backward(ws, ctx, a.d_out)
            del sched, ctx, g
        assert calls.hits == 6


def test_memory_bytes_counts_results_and_spares_and_keeps_the_peak(fake):
    """memory_bytes: scratch + result blocks (live and spare) + arena, and the high-water mark of
    their sum; steady steps hold steady, and aged-out spares leave ``results`` (not ``peak``)."""
    with _workspace(max_tokens=2 * T) as ws:
        big, small = _Inputs(tokens=2 * T), _Inputs(tokens=T, base=1 << 45)
        m0 = ws.memory_bytes()
        assert m0 == {"scratch": 0, "graph_arena": 0, "results": 0, "peak": 0}
        out, g = _step(ws, big)
        m1 = ws.memory_bytes()
        assert m1["results"] > 0 and m1["scratch"] > 0
        assert m1["peak"] == m1["scratch"] + m1["results"] + m1["graph_arena"]
        del out, g
        for _ in range(3):
            _step(ws, big)
        ws.synchronize()
        steady = ws.memory_bytes()
        for _ in range(3):
            _step(ws, big)
        ws.synchronize()
        assert ws.memory_bytes() == steady           # recycled blocks: nothing new
        for _ in range(12):
            _step(ws, small)
        ws.synchronize()
        m2 = ws.memory_bytes()
        assert m2["results"] < steady["results"]     # the big blocks aged out
        # (the small blocks came while the big spares were still kept: the peak saw both)
        assert m2["peak"] >= steady["peak"] >= steady["scratch"] + steady["results"]
        assert m2["peak"] >= m2["scratch"] + m2["results"]


def test_grown_scratch_is_never_served_stale(fake):
    """The scratch pointers of a kind are remembered per size table until a buffer is replaced:
    after a larger call grows them, a call of the old size gets the new buffers (and misses the
    launch it prepared over the old ones, which were freed)."""
    with _workspace(max_tokens=2 * T) as ws:
        impl = ws._single()._impl
        small, big = _Inputs(tokens=T), _Inputs(tokens=2 * T, base=1 << 45)

        def scratch(tokens):
            sizes = impl._shapes_for(tokens).forward_scratch
            ptrs, key = impl._scratch_ptrs("forward", sizes, ws.stream, False)
            live = {n: (impl._scratch[("forward", n)][0] if nb else 0) for n, nb in sizes.items()}
            assert ptrs == live and key == tuple(live.values())
            return ptrs

        _step(ws, small)
        before = scratch(T)
        assert scratch(T) is before               # remembered
        _step(ws, big)                            # grows the scratch, frees the old buffers
        after = scratch(T)
        assert after != before and not set(before.values()) & set(after.values()) - {0}
        misses = impl._calls.misses
        _step(ws, small)
        assert impl._calls.misses == misses + 2   # forward and backward re-prepared over the new scratch


def test_capture_is_asked_of_the_driver_on_every_call(fake):
    """No call trusts an earlier answer: a stream that starts capturing after a cached hit is
    captured (arena memory, nothing cached), and the next eager call is eager again."""
    with _workspace() as ws:
        a = _Inputs()
        _step(ws, a)
        n = fake.counts["cuStreamIsCapturing"]
        _step(ws, a)
        assert fake.counts["cuStreamIsCapturing"] == n + 3
        impl = ws._single()._impl
        hits = impl._calls.hits
        fake.capturing = True
        out, _ = _step(ws, a)
        fake.capturing = False
        assert impl._calls.hits == hits and out._producer_stream is None
        out, _ = _step(ws, a)
        assert impl._calls.hits == hits + 3 and out._producer_stream is not None


def test_only_the_ranks_own_stream_handle_is_remembered(fake):
    with _workspace() as ws:
        rank = ws._single()
        s1 = type("S", (), {"__cuda_stream__": lambda self: (0, 0x1234)})()
        s2 = type("S", (), {"__cuda_stream__": lambda self: (0, 0x5678)})()
        a = _Inputs()
        for s, h in ((s1, 0x1234), (s2, 0x5678), (None, int(ws.stream.handle)), (s1, 0x1234)):
            out, g = _step(ws, a, stream=s)
            assert out._producer_stream == h and g.dx._producer_stream == h
        assert rank._own_stream == (ws.stream, int(ws.stream.handle))
        other = fake.devices[0].create_stream()
        assert rank._stream_int(other) == other.handle and rank._own_stream[0] is ws.stream
        rank.stream = other   # (a rank's stream replaced: remembered anew, with its object)
        assert rank._stream_int(other) == other.handle and rank._own_stream == (other, other.handle)
