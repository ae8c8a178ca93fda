"""Expert parallelism after a device error, on the CPU: which errors leave a workspace usable
(every rank sees them alike) and which make it refuse further calls, how a rank's backend turns
its error word into an exception, and source-level invariants of the device waits that make a
timeout name the peer that is behind.  The device side itself: tests/test_ep_gpu.py."""
from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest

import mok_rt as mok
from mok_rt.backends.cuda import CudaBackend
from mok_rt.dist.ep import GROUP_CONSISTENT_ERRORS, EPHealth
from mok_rt.runtime.errorword import ERR_CAPACITY, ERR_EXPERT_ID, ERR_INTERNAL, ERR_TIMEOUT, device_error
from mok_rt.kernels.schedule import scan_shared_bytes

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cuda_src")


# ---------------------------------------------------------------------------------------------
# EPHealth: which errors break the shared state
# ---------------------------------------------------------------------------------------------

def test_group_consistent_errors_leave_the_workspace_usable():
    h = EPHealth()
    assert set(GROUP_CONSISTENT_ERRORS) == {ERR_CAPACITY, ERR_EXPERT_ID}
    for code in GROUP_CONSISTENT_ERRORS:
        assert h.record(code, "whatever") == ""
    h.check(0)   # no exception


@pytest.mark.parametrize("code", [ERR_TIMEOUT, ERR_INTERNAL, 99])
def test_other_errors_make_the_workspace_refuse_calls(code):
    h = EPHealth()
    note = h.record(code, "first failure")
    assert "create a new one" in note
    h.record(ERR_TIMEOUT, "second failure")   # the first reason is kept
    with pytest.raises(mok.MokError, match="first failure") as e:
        h.check(3)
    assert "rank 3" in str(e.value) and "create a new one" in str(e.value)
    assert not isinstance(e.value, mok.DeviceError)


# ---------------------------------------------------------------------------------------------
# CudaBackend.check with a fake error word (no GPU needed)
# ---------------------------------------------------------------------------------------------

class _FakeWord:
    def __init__(self, words):
        self.words = tuple(words)
        self.cleared = 0

    def read(self):
        return self.words

    def clear(self):
        self.words = (0, 0, 0, 0)
        self.cleared += 1


def _backend(words, *, ep=True, health=None):
    b = object.__new__(CudaBackend)
    b.device_id = 0
    b.error = _FakeWord(words)
    b.ep = SimpleNamespace(rank=1, shared=SimpleNamespace(health=health or EPHealth())) if ep else None
    return b


def test_check_timeout_names_the_peer_and_breaks_the_workspace():
    b = _backend((ERR_TIMEOUT, 1, 0, 2))
    with pytest.raises(mok.PeerTimeoutError) as e:
        b.check()
    assert e.value.rank == 0 and e.value.info == (1, 0, 2)
    assert "rank 1 timed out waiting for rank 0" in str(e.value) and "create a new one" in str(e.value)
    assert b.error.cleared == 1
    b.check()   # cleared: nothing more to report
    with pytest.raises(mok.MokError, match="create a new one"):
        b._check_usable()


def test_check_capacity_keeps_the_workspace_usable():
    b = _backend((ERR_CAPACITY, 0, 4096, 2560))
    with pytest.raises(mok.CapacityError) as e:
        b.check()
    assert e.value.info == (0, 4096, 2560) and "undefined" not in str(e.value)
    b._check_usable()


def test_check_without_expert_parallelism_has_no_health():
    b = _backend((ERR_TIMEOUT, 0, -1, 7), ep=False)
    with pytest.raises(mok.PeerTimeoutError, match="an unknown rank"):
        b.check()
    b._check_usable()


def test_device_error_note_is_appended():
    e = device_error(ERR_CAPACITY, (2, 10, 5), "ctx", note="; more")
    assert isinstance(e, mok.CapacityError) and str(e).endswith("; more") and e.info == (2, 10, 5)


# ---------------------------------------------------------------------------------------------
# Source invariants of the device waits (see ep.cuh: local deadlines outlast peer deadlines)
# ---------------------------------------------------------------------------------------------

def _read(*parts):
    with open(os.path.join(SRC, *parts)) as f:
        return f.read()


@pytest.mark.parametrize("name", ["tasks/forward.cuh", "tasks/backward.cuh"])
def test_peer_waits_use_the_peer_deadline_and_local_waits_the_longer_one(name):
    # The producer's one-thread waits: the rows' readiness chunks (dispatch) and the returns.
    src = _read("moe", name)
    peer_waits = re.findall(r"ep::wait_(?:all|block_rows)(?:_thread)?\(([^;]*)\)", src)
    assert len(peer_waits) == 2
    for call in peer_waits:
        assert "peer_wait_ctx()" in call, call
    # The return waits name a peer that has not even pushed its rows first (P > 2).
    assert re.search(r"wait_all(_thread)?\(p\.peers, kFlag(Fwd|Bwd)Return, kFlag(Fwd|Bwd)Rows,", src)
    counter_waits = re.findall(r"wait_counter(?:_thread)?\(([^;]*)\)", src)
    assert counter_waits
    for call in counter_waits:
        assert ("wait_ctx()" in call or call.rstrip().endswith("w, task)")) and "peer_wait_ctx" not in call, call
    assert "WaitCtx wait_ctx() const { return ep::local_wait_ctx(p); }" in src
    assert "WaitCtx peer_wait_ctx() const { return ep::peer_wait_ctx(p); }" in src


def test_wait_contexts_give_local_waits_the_longer_deadline():
    src = _read("moe", "tasks", "ep.cuh")
    local = src[src.index("WaitCtx local_wait_ctx("):src.index("WaitCtx peer_wait_ctx(")]
    assert "local_timeout_ns(p.peers, p.dims.timeout_ns)" in local
    peer = src[src.index("WaitCtx peer_wait_ctx("):]
    assert "WaitCtx{p.err, p.dims.timeout_ns, p.dims.rank}" in peer[:300]


def test_local_deadline_outlasts_the_peer_deadline():
    src = _read("moe", "tasks", "ep.cuh")
    factor = int(re.search(r"kLocalTimeoutFactor = (\d+);", src).group(1))
    assert factor >= 2
    # Only the own-flag part of wait_all may report an unknown peer (-1).
    body = src[src.index("bool wait_all_thread("):src.index("// Push this rank's token rows")]
    assert body.count("set_error(w.err, kErrTimeout, pe.rank, -1, stage)") == 1
    assert "peer_to_blame(pe, kind, earlier)" in body
    # A readiness chunk: this rank's own gets the local deadline and reports -1, a peer's the peer
    # deadline and names that peer (the chunk's source: its push waits on nothing).
    chunk = src[src.index("bool wait_chunk_thread("):src.index("bool wait_block_rows_thread(")]
    assert "own ? local_timeout_ns(pe, w.timeout_ns) : w.timeout_ns" in chunk
    assert "set_error(w.err, kErrTimeout, pe.rank, own ? -1 : src, stage)" in chunk


def test_scan_shared_memory_fits_every_supported_expert_count():
    # schedule_place bounds E (33 * E ints of shared memory, <= 227 KB on Hopper); the scan's
    # footprint must fit in the default 48 KB for all of those.
    max_e = (227 * 1024) // (33 * 4)
    assert scan_shared_bytes(max_e) <= 48 * 1024
