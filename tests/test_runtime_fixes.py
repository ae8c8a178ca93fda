"""The CUDA backend's host runtime on the CPU, against the null driver of bench/null_driver.py:
scratch that fails to grow, when check() may clear the error word, what a synchronize releases
(the stream order, the recycled blocks' streams), a close that keeps releasing after a failure,
the expert-parallel epoch of a launch that is not enqueued, and what poison_outputs fills."""
from __future__ import annotations

import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from cuda.bindings import driver as real

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import null_driver as nd  # noqa: E402
from null_driver import null_driver  # noqa: E402

import mok_rt as mok  # noqa: E402
from mok_rt.errors import CudaDriverError  # noqa: E402
from mok_rt.interop.tensor import Tensor  # noqa: E402
from mok_rt.kernels import fp8_quantize as Q8  # noqa: E402
from mok_rt.kernels import moe_fp8_bwd as MB  # noqa: E402
from mok_rt.kernels import moe_launch as L  # noqa: E402
from mok_rt.runtime import memory  # noqa: E402
from mok_rt.runtime.errorword import ERR_EXPERT_ID, ERR_CAPACITY  # noqa: E402

import _fp8_null as F8  # noqa: E402
from test_prepared_calls import _Inputs, _step, _workspace  # noqa: E402

_OK = real.CUresult.CUDA_SUCCESS
_NOT_READY = real.CUresult.CUDA_ERROR_NOT_READY


class _Stream:
    """A caller's stream (torch, CuPy ...): a handle behind ``__cuda_stream__``."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


# ---- 1. scratch that fails to grow -----------------------------------------------------------------
def test_a_failed_scratch_growth_leaves_no_freed_buffer_in_use(monkeypatch):
    with null_driver() as fake:
        ws = _workspace(max_tokens=1024)
        be = ws._single()._impl
        small, big = _Inputs(tokens=128), _Inputs(tokens=1024, base=1 << 45)
        _step(ws, small)
        dev = fake.devices[0]
        made = []
        allocate = dev.allocate

        def tracked(nbytes, stream=None):
            buf = allocate(nbytes, stream)
            made.append(buf)
            return buf
        dev.allocate = tracked
        real_empty = Tensor.empty.__func__

        def oom(cls, shape, dtype, *, device_id, stream=None):
            # Out of memory for the scratch (every allocation but the result blocks' Recycler.take).
            if not any(f.function == "take" for f in inspect.stack()):
                raise CudaDriverError("cuMemAllocFromPoolAsync", real.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
            return real_empty(cls, shape, dtype, device_id=device_id, stream=stream)
        monkeypatch.setattr(Tensor, "empty", classmethod(oom))
        with pytest.raises(CudaDriverError):
            _step(ws, big)
        monkeypatch.setattr(Tensor, "empty", classmethod(real_empty))
        closed = [k for k, v in be._scratch.items() if v[2]._owner._heap is None]
        assert closed == [], f"scratch entries naming freed buffers: {closed}"
        # The usual recovery, a retry at the old size: no counter memset into freed memory.
        fake.record_launches = True
        _step(ws, small)
        pool = range(1 << 36, 1 << 38)
        live = {b.handle for b in made if b._heap is not None} | {v[0] for v in be._scratch.values()}
        assert all(p in live for p, _, _ in fake.memsets if p in pool)
        assert all(v[2]._owner._heap is not None for v in be._scratch.values())
        ws.close()


# ---- 2. check(): cleared only when nothing can still read the word ----------------------------------
class _Word:
    """The error word as the host sees it (the null driver's copies read zeros)."""

    def __init__(self, word):
        self.value, self.clears = (0, 0, 0, 0), 0
        word.read = lambda: self.value
        word.clear = self._clear

    def _clear(self):
        self.clears += 1
        self.value = (0, 0, 0, 0)


@pytest.fixture
def word_ws():
    with null_driver() as fake:
        ws = _workspace()
        be = ws._single()._impl
        word = _Word(be.error)
        fake.pending = False
        fake._cuStreamQuery = lambda s: ((_NOT_READY if fake.pending else _OK),)
        yield fake, ws, be, word
        ws.close()


def test_check_leaves_the_word_set_while_the_failed_step_may_still_run(word_ws):
    fake, ws, be, word = word_ws
    a = _Inputs()
    _step(ws, a)
    fake.pending = True                      # the step's kernels are still queued
    word.value = (ERR_EXPERT_ID, 0, 5, 99)
    with pytest.raises(mok.ExpertIdError):
        ws.check()
    assert word.clears == 0 and word.value[0] == ERR_EXPERT_ID   # the pending kernels keep exiting
    ws.check()                               # reported once
    fake.pending = False
    ws.check()                               # idle now: cleared, not raised again
    assert word.clears == 1 and word.value[0] == 0
    word.value = (ERR_CAPACITY, 0, 900, 512)  # a later error is new
    with pytest.raises(mok.CapacityError):
        ws.check()
    assert word.clears == 2


def test_check_clears_at_once_when_every_stream_is_idle(word_ws):
    fake, ws, be, word = word_ws
    _step(ws, _Inputs())
    word.value = (ERR_EXPERT_ID, 0, 5, 99)
    with pytest.raises(mok.ExpertIdError):
        ws.check()
    assert word.clears == 1
    ws.check()


def test_synchronize_clears_an_error_check_raised_without_raising_it_again(word_ws):
    fake, ws, be, word = word_ws
    _step(ws, _Inputs())
    fake.pending = True
    word.value = (ERR_EXPERT_ID, 0, 5, 99)
    with pytest.raises(mok.ExpertIdError):
        ws.check()
    ws.synchronize()                         # waits (the null streams are done), then clears
    assert word.clears == 1 and word.value[0] == 0
    word.value = (ERR_EXPERT_ID, 0, 7, 99)
    with pytest.raises(mok.ExpertIdError):
        ws.synchronize()
    assert word.clears == 2


def test_the_next_call_clears_the_raised_error_on_its_stream_before_its_kernels(word_ws):
    fake, ws, be, word = word_ws
    a = _Inputs()
    _step(ws, a)
    fake.pending = True
    word.value = (ERR_EXPERT_ID, 0, 5, 99)
    with pytest.raises(mok.ExpertIdError):
        ws.check()
    log = []
    fake._cuMemsetD32Async = lambda p, v, n, s: (log.append(("memset", int(p), v, n, int(s))), (_OK,))[1]
    fake._cuEventRecord = lambda ev, s: (log.append(("record", int(s))), (_OK,))[1]
    fake._cuLaunchKernelEx = lambda cfg, fn, params, extra: (log.append(("launch", int(cfg.hStream))), (_OK,))[1]
    _step(ws, a, stream=_Stream(0x5151))
    clear = log.index(("memset", be.error.device_ptr, 0, 4, 0x5151))   # on the call's stream
    first = next(i for i, e in enumerate(log) if e[0] == "launch")
    assert log[clear + 1] == ("record", 0x5151) and clear < first           # then its event, then the kernels
    fake.query_ready = False
    fake._cuEventQuery = lambda ev: ((_OK if fake.query_ready else _NOT_READY),)
    ws.check()                               # the clear has not run: still the error raised
    _step(ws, a)
    assert sum(e[:2] == ("memset", be.error.device_ptr) for e in log) == 1   # enqueued once
    fake.query_ready = True                  # it ran: what the word holds now is new
    with pytest.raises(mok.ExpertIdError):
        ws.check()


def test_after_a_capture_check_never_clears(word_ws):
    fake, ws, be, word = word_ws
    a = _Inputs()
    fake.capturing = True
    _step(ws, a)                             # replays run on streams mok_rt never sees
    fake.capturing = False
    word.value = (ERR_EXPERT_ID, 0, 5, 99)
    with pytest.raises(mok.ExpertIdError):
        ws.check()
    assert word.clears == 0
    ws.synchronize()                         # cuCtxSynchronize, then cleared
    assert word.clears == 1


# ---- 3. what a synchronize releases -------------------------------------------------------------------
def test_after_synchronize_no_event_is_recorded_on_the_previous_stream():
    with null_driver() as fake, _workspace() as ws:
        rec = []
        fake._cuEventRecord = lambda ev, s: (rec.append(int(s)), (_OK,))[1]
        a = _Inputs()
        _step(ws, a, stream=_Stream(0xA1A1))
        ws.synchronize()                     # the caller may destroy 0xA1A1 now
        _step(ws, a, stream=_Stream(0xB2B2))
        assert 0xA1A1 not in rec
        _step(ws, a, stream=_Stream(0xC3C3))  # without a synchronize, calls are still ordered
        assert rec == [0xB2B2]


def test_stream_order_forgets_the_last_stream_when_drained():
    with null_driver() as fake:
        order = memory.StreamOrder()
        order.enter(11)
        order.drained()
        order.enter(22)
        assert "cuEventRecord" not in fake.counts
        order.enter(33)
        assert fake.counts["cuEventRecord"] == 1
        fake._cuEventDestroy = lambda ev: (real.CUresult.CUDA_ERROR_INVALID_HANDLE,)
        with pytest.raises(CudaDriverError):
            order.close()
        order.close()                        # dropped before the failed destroy: not retried
        assert fake.counts["cuEventDestroy"] == 1


def test_drained_blocks_belong_to_no_stream_and_are_freed_on_the_ranks(monkeypatch):
    closes = []
    close = nd._Buffer.close

    def recorded(self, stream=None):
        if self._heap is not None:
            closes.append((self.handle, stream))
        close(self, stream)
    monkeypatch.setattr(nd._Buffer, "close", recorded)
    with null_driver(), _workspace(max_tokens=512) as ws:
        be = ws._single()._impl
        a = _Inputs()
        out, g = _step(ws, a, stream=_Stream(0xA1A1))
        ptrs = {out.ptr, g.dx.ptr}
        blocks = {out._owner.tensor.ptr, g.dx._owner[0].tensor.ptr}   # the blocks' bases
        del out, g
        ws.synchronize()                     # 0xA1A1 may be destroyed, and its handle reused
        taken = be._blocks.allocations
        out, g = _step(ws, a, stream=_Stream(0xB2B2))
        assert {out.ptr, g.dx.ptr} == ptrs and be._blocks.allocations == taken   # served on any stream
        del out, g
        ws.synchronize()
        for _ in range(12):                  # another size: the drained spares age out and are freed
            _step(ws, _Inputs(tokens=512, base=1 << 45))
        freed = {h: s for h, s in closes if h in blocks}
        assert freed and all(s is ws.stream for s in freed.values()), freed


# ---- 4. close() attempts every step ------------------------------------------------------------------
def test_close_releases_everything_after_a_failed_step():
    with null_driver() as fake:
        ws = _workspace()
        a = _Inputs()
        _step(ws, a, stream=_Stream(0x11))
        _step(ws, a, stream=_Stream(0x22))  # StreamOrder's event exists
        fake.capturing = True
        _step(ws, a)                         # graph arena blocks exist
        fake.capturing = False
        fake._cuEventDestroy = lambda ev: (real.CUresult.CUDA_ERROR_INVALID_HANDLE,)
        before = dict(fake.counts)
        with pytest.raises(CudaDriverError) as ei:
            ws.close()
        assert ei.value.call == "cuEventDestroy"
        made = {k: fake.counts.get(k, 0) - before.get(k, 0) for k in
                ("cuMemFree", "cuStreamDestroy", "cuDevicePrimaryCtxRelease")}
        assert made["cuMemFree"] >= 2 and made["cuStreamDestroy"] == 1 and made["cuDevicePrimaryCtxRelease"] == 1


def test_the_graph_arena_frees_every_block_when_one_free_fails():
    with null_driver() as fake:
        arena = memory.GraphArena(0)
        ptrs = [arena.allocate(1024) for _ in range(3)]
        freed = []

        def free(p):
            freed.append(int(p))
            return (real.CUresult.CUDA_ERROR_INVALID_VALUE if len(freed) == 1 else _OK,)
        fake._cuMemFree = free
        with pytest.raises(CudaDriverError):
            arena.close()
        assert freed == ptrs and arena.nbytes == 0


# ---- 5. the EP epoch of a launch that is not enqueued -------------------------------------------------
def _expert_parallel(be):
    """Make ``be`` rank 0 of a 2-rank group on the host (no symmetric heap behind it): its launches
    take epochs from a real EPRank."""
    from mok_rt.dist.ep import EPHealth, EPRank, HeapLayout
    cfg, ws = be.ws.config, be.ws
    layout = HeapLayout.make(max_tokens=ws.max_tokens, top_k=cfg.top_k, hidden=cfg.hidden,
                             capacity_rows=ws.capacity_rows, push_tasks=cfg.comm_sms)
    heap = SimpleNamespace(size=2, peer_ptrs=lambda r: [1 << 38, 1 << 39], peer_ptr_array=lambda r: 1 << 37,
                           error_word=lambda r: be.error)
    shared = SimpleNamespace(layout=layout, health=EPHealth(), heap=heap, ranks_sharing_gpu=lambda r: 1)
    be.ep = EPRank(shared, 0, timeout_s=10.0, push_tasks=cfg.comm_sms)
    return be.ep


def _failing(exc):
    def fail(*args, **kw):
        raise exc
    return fail


def _backward_keeps_the_epoch_until_enqueued(monkeypatch, module, prepare: str, ws, be, ctx, d_out):
    """After one forward (epoch 1): a backward whose preparation (``module.prepare``) raises keeps
    epoch 1, the next one takes epoch 2; then the workspace is closed."""
    monkeypatch.setattr(module, prepare, _failing(mok.ArgumentError("bufs", "refused")))
    with pytest.raises(mok.ArgumentError):
        mok.backward(ws, ctx, d_out)
    assert be.ep._epoch == 1
    monkeypatch.undo()
    mok.backward(ws, ctx, d_out)
    assert be.ep._epoch == 2
    be.ep = None
    ws.close()


def test_an_ep_schedule_that_fails_to_allocate_takes_no_routing_area():
    # build_schedule_ep takes the routing area (EPRank.exchange advances the rank's schedule count)
    # only once its outputs and scratch are allocated: a rank that failed before would otherwise
    # publish its next schedule into the other area than its peers.
    with null_driver():
        ws = _workspace()
        be = ws._single()._impl
        ep = _expert_parallel(be)
        a = _Inputs()
        oom = CudaDriverError("cuMemAllocFromPoolAsync", real.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        be._block = _failing(oom)           # the schedule's output block
        with pytest.raises(CudaDriverError):
            mok.schedule(ws, a.ids)
        assert ep.mark() == (0, 0)
        del be._block
        mok.schedule(ws, a.ids)
        assert ep.mark() == (0, 1)
        be.ep = None


def test_bf16_launches_that_fail_before_they_are_enqueued_keep_the_epoch(monkeypatch):
    with null_driver() as fake:
        ws = _workspace(trace=True)
        be = ws._single()._impl
        ep = _expert_parallel(be)
        a = _Inputs()
        sched = mok.schedule(ws, a.ids)
        oom = CudaDriverError("cuMemAllocFromPoolAsync", real.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        be._trace_buffer = _failing(oom)     # the trace buffer's allocation
        with pytest.raises(CudaDriverError):
            mok.forward(ws, sched, a.x, a.tw, a.experts)
        assert ep._epoch == 0
        del be._trace_buffer
        fake._cuLaunchKernelEx = lambda *args: (real.CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,)
        with pytest.raises(CudaDriverError):
            mok.forward(ws, sched, a.x, a.tw, a.experts)
        assert ep._epoch == 0
        del fake._cuLaunchKernelEx
        _, ctx = mok.forward(ws, sched, a.x, a.tw, a.experts)
        assert ep._epoch == 1
        _backward_keeps_the_epoch_until_enqueued(monkeypatch, L, "prepare_backward", ws, be, ctx, a.d_out)


def test_fp8_launches_that_fail_before_they_are_enqueued_keep_the_epoch(monkeypatch):
    with null_driver():
        cfg = mok.MoEConfig(hidden=F8.H, intermediate=F8.I, num_experts=F8.E, top_k=F8.K,
                            shared_intermediate=F8.Is, precision="fp8_block")
        ws = mok.Workspace(cfg, max_tokens=F8.T, trace=True)
        be = ws._single()._impl
        ep = _expert_parallel(be)
        a = F8.Inputs()
        qw = mok.quantize_weights(ws, a.experts, a.shared)
        sched = mok.schedule(ws, a.ids)
        oom = CudaDriverError("cuMemAllocFromPoolAsync", real.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        be._trace_buffer = _failing(oom)
        with pytest.raises(CudaDriverError):
            mok.forward(ws, sched, a.x, a.tw, qw)
        assert ep._epoch == 0
        del be._trace_buffer
        _, ctx = mok.forward(ws, sched, a.x, a.tw, qw)
        assert ep._epoch == 1
        _backward_keeps_the_epoch_until_enqueued(monkeypatch, MB, "prepare_backward_fp8", ws, be, ctx, a.d_out)


# ---- 6. poison_outputs fills the scratch and the quantised weights -----------------------------------
def _covered(ptr, nbytes, fills) -> bool:
    return any(p <= ptr and ptr + nbytes <= p + n for p, v, n in fills if v == 0xFF)


def test_poison_fills_every_scratch_buffer_but_the_counters_on_every_call():
    with null_driver() as fake, _workspace(poison_outputs=True, shared_intermediate=128) as ws:
        be = ws._single()._impl
        a = _Inputs(shared=128)
        log = []
        fake._cuMemsetD8Async = lambda p, v, n, s: (log.append(("fill", int(p), v, n)), (_OK,))[1]
        fake._cuLaunchKernelEx = lambda cfg, fn, params, extra: (log.append(("launch",)), (_OK,))[1]
        sh = be._shapes_for(256)
        kinds = (("schedule", sh.schedule_scratch, 3), ("forward", sh.forward_scratch, 4),
                 ("backward", sh.backward_scratch, 5))
        for _ in range(2):                   # the second step hits every prepared launch
            log.clear()
            _step(ws, a)
            launches = [i for i, e in enumerate(log) if e[0] == "launch"]
            assert len(launches) == 5        # count, scan, place, forward, backward
            for kind, sizes, nth in kinds:
                end = launches[nth - 1]      # the first launch that reads this kind's scratch
                start = launches[nth - 2] if kind != "schedule" else 0
                fills = [e[1:] for e in log[start:end] if e[0] == "fill"]
                for name, nbytes in sizes.items():
                    if not nbytes:
                        continue
                    ptr = be._scratch[(kind, name)][0]
                    if name == "counters":   # zeroed by the launch itself, never poisoned
                        assert not any(p == ptr for p, _, _ in fills)
                    else:
                        assert (ptr, 0xFF, nbytes) in fills, (kind, name)
        assert be._calls.hits == 3


def test_poison_fills_the_fp8_scratch_and_every_quantised_weight(monkeypatch):
    with null_driver() as fake:
        cfg = mok.MoEConfig(hidden=F8.H, intermediate=F8.I, num_experts=F8.E, top_k=F8.K,
                            shared_intermediate=F8.Is, precision="fp8_block")
        ws = mok.Workspace(cfg, max_tokens=F8.T, poison_outputs=True)
        be = ws._single()._impl
        fills, quantised = [], []
        fake._cuMemsetD8Async = lambda p, v, n, s: (fills.append((int(p), v, n)), (_OK,))[1]
        launch = Q8.launch_quantize

        def quantize(pairs, **kw):
            # Every destination (forward copy, scale, transposed copy, its scale) poisoned first.
            for src, (g, r, c), *dst in pairs:
                shapes = [(g, r, c), Q8.scale_shape((g, r, c)), Q8.transposed_shape((g, r, c)),
                          Q8.scale_shape(Q8.transposed_shape((g, r, c)))]
                sizes = [s[0] * s[1] * s[2] * item for s, item in zip(shapes, (1, 4, 1, 4))]
                quantised.extend((p, n, _covered(p, n, fills)) for p, n in zip(dst, sizes) if p)
            launch(pairs, **kw)
        monkeypatch.setattr(Q8, "launch_quantize", quantize)
        a = F8.Inputs()
        qw = mok.quantize_weights(ws, a.experts, a.shared)
        sched = mok.schedule(ws, a.ids)
        _, ctx = mok.forward(ws, sched, a.x, a.tw, qw)
        mok.backward(ws, ctx, a.d_out)
        qf = mok.quantize_weights(ws, a.experts, a.shared, for_backward=False)   # the backward quantises
        _, ctx = mok.forward(ws, sched, a.x, a.tw, qf)
        mok.backward(ws, ctx, a.d_out)
        assert len(quantised) == 6 * 4 + 6 * 2 + 6 * 2 and all(ok for _, _, ok in quantised), quantised
        assert {k for k, _ in be._scratch} >= {"forward_fp8", "backward_fp8"}
        for (kind, name), (ptr, nbytes, _) in be._scratch.items():
            if kind in ("forward_fp8", "backward_fp8"):
                assert _covered(ptr, 1, fills) != (name == "counters"), name
        ws.close()
