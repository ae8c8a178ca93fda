"""runtime/memory.py against a recorded driver (CPU): what the graph arena and the stream order
ask of the driver, and in which capture mode.  The GPU behaviour is covered by test_graphs_gpu.py."""
from __future__ import annotations

import pytest

from mok_rt.runtime import memory


class _Recorder:
    """Stands in for runtime.driver.call: records every call, answers what memory.py reads."""

    def __init__(self):
        self.calls = []
        self.mode = "global"
        self.next_ptr = 0x1000

    def __call__(self, name, *args):
        self.calls.append((name, args))
        if name == "cuThreadExchangeStreamCaptureMode":
            previous, self.mode = self.mode, args[0]
            return previous
        if name == "cuMemAlloc":
            assert self.mode == memory.driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED, \
                "cuMemAlloc outside the relaxed capture mode would break a capture"
            self.next_ptr += 0x10000
            return self.next_ptr
        if name == "cuEventCreate":
            return "event"
        return None

    def names(self):
        return [n for n, _ in self.calls]


@pytest.fixture
def driver(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(memory, "call", rec)
    return rec


def test_arena_allocates_in_relaxed_mode_restores_the_mode_and_frees_at_close(driver):
    arena = memory.GraphArena(0)
    a, b = arena.allocate(1000), arena.allocate(24)
    assert a and b and a != b and arena.allocate(0) == 0
    assert arena.nbytes == 1024
    assert driver.mode == "global"   # the thread's capture mode is back to what it was
    assert driver.names().count("cuMemAlloc") == 2
    arena.close()
    assert [n for n in driver.names() if n == "cuMemFree"] == ["cuMemFree", "cuMemFree"]
    assert arena.nbytes == 0
    arena.close()   # idempotent
    assert driver.names().count("cuMemFree") == 2


def test_stream_order_waits_only_when_the_stream_changes(driver):
    order = memory.StreamOrder()
    order.enter(11)
    order.enter(11)
    assert driver.calls == []        # one stream: nothing to order
    order.enter(22)                  # a new stream waits for the old one's work
    assert driver.names() == ["cuEventCreate", "cuEventRecord", "cuStreamWaitEvent"]
    assert int(driver.calls[1][1][1]) == 11 and int(driver.calls[2][1][0]) == 22
    order.enter(22)
    order.enter(11)
    assert driver.names()[3:] == ["cuEventRecord", "cuStreamWaitEvent"]   # the event is reused
    order.close()
    assert driver.names()[-1] == "cuEventDestroy"
