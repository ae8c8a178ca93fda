"""The descriptor exchange (CPU): real processes passing real descriptors over SCM_RIGHTS, the
private rendezvous directory, and the uid / token checks that refuse strangers."""
from __future__ import annotations

import os
import pathlib
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
from test_group import RankFailure, assert_ok, run_ranks

from mok_rt.dist import fdpass as _fdpass
from mok_rt.dist.fdpass import FdExchangeError, _Listener, _send, check_rendezvous_dir, exchange_fds, make_rendezvous_dir
from mok_rt.errors import MokError

ROOT = os.geteuid() == 0


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _memfd(text: str) -> int:
    fd = os.memfd_create("mok_rt_test")
    os.write(fd, text.encode())
    return fd


# ---------------------------------------------------------------------------------------------
# Across processes
# ---------------------------------------------------------------------------------------------


def _exchange_worker(ctx, base, nfds):
    os.environ["XDG_RUNTIME_DIR"] = base
    group = ctx.group()
    before = _open_fds()
    ranks = [ctx.rank * 10 + i for i in range(nfds)]  # stand-ins for several ranks per process
    mine = {r: _memfd(f"block of rank {r}") for r in ranks}
    ids = {r: tuple(os.fstat(fd)[1:3]) for r, fd in mine.items()}  # (inode, device)
    got = exchange_fds(group, mine, timeout_s=30)
    seen = {r: os.pread(fd, 64, 0).decode() for r, fd in got.items()}
    got_ids = {r: tuple(os.fstat(fd)[1:3]) for r, fd in got.items()}
    for fd in list(mine.values()) + list(got.values()):
        os.close(fd)
    return {"seen": seen, "ids": ids, "got_ids": got_ids, "fd_delta": _open_fds() - before,
            "left": os.listdir(base)}


@pytest.mark.parametrize("nproc, nfds", [(2, 1), (3, 2)])
def test_processes_exchange_descriptors(tmp_path, nproc, nfds):
    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    res = assert_ok(run_ranks(_exchange_worker, nproc, str(base), nfds))
    all_ids = {r: i for v in res for r, i in v["ids"].items()}
    for p, v in enumerate(res):
        others = {r for r in all_ids if r // 10 != p}
        assert set(v["seen"]) == others
        for r in others:
            assert v["seen"][r] == f"block of rank {r}"
            assert v["got_ids"][r] == all_ids[r]  # the very same open file, not a copy
        assert v["fd_delta"] == 0
    assert os.listdir(base) == []  # the rendezvous directory is gone


def _exchange_default_base_worker(ctx):
    return exchange_fds(ctx.group(), {}, timeout_s=30)


def test_exchange_without_descriptors():
    assert assert_ok(run_ranks(_exchange_default_base_worker, 2)) == [{}, {}]


def test_one_process_needs_no_sockets():
    class One:
        num_processes, process_index = 1, 0

        def all_gather_bytes(self, b):
            raise AssertionError("no collective expected")

    assert exchange_fds(One(), {0: 5}) == {}


def _silent_worker(ctx, base):
    os.environ["XDG_RUNTIME_DIR"] = base
    if ctx.rank == 1:
        _fdpass._send = lambda *a, **k: None  # this process never sends
    fd = _memfd("x")
    try:
        return exchange_fds(ctx.group(), {ctx.rank: fd}, timeout_s=1.0)
    finally:
        os.close(fd)


def test_exchange_timeout_fails_everywhere_and_cleans_up(tmp_path):
    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    t0 = time.monotonic()
    res = run_ranks(_silent_worker, 2, str(base))
    assert time.monotonic() - t0 < 30
    assert all(isinstance(v, RankFailure) for v in res)
    assert res[0].type_name == "FdExchangeError"
    assert "timed out" in res[0].message and "[1]" in res[0].message
    assert res[1].type_name == "MokError" and "process 0 failed" in res[1].message
    assert os.listdir(base) == []


# ---------------------------------------------------------------------------------------------
# The directory
# ---------------------------------------------------------------------------------------------


def test_rendezvous_dir_is_private(tmp_path):
    d = make_rendezvous_dir(str(tmp_path))
    st = os.lstat(d)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert os.path.basename(d).startswith("mok_rt-")
    check_rendezvous_dir(d)


def test_rendezvous_dir_respects_xdg_runtime_dir(tmp_path, monkeypatch):
    private = tmp_path / "xdg"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(private))
    assert _fdpass.runtime_base() == str(private)
    private.chmod(0o755)  # not private: not used
    assert _fdpass.runtime_base() != str(private)


def test_rendezvous_dir_rejects_open_mode(tmp_path):
    d = make_rendezvous_dir(str(tmp_path))
    os.chmod(d, 0o755)
    with pytest.raises(FdExchangeError, match="mode 755"):
        check_rendezvous_dir(d)


def test_rendezvous_dir_rejects_links_and_files(tmp_path):
    d = make_rendezvous_dir(str(tmp_path))
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(FdExchangeError, match="not a directory"):
        check_rendezvous_dir(str(link))
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(FdExchangeError, match="not a directory"):
        check_rendezvous_dir(str(f))
    with pytest.raises(FdExchangeError):
        check_rendezvous_dir(str(tmp_path / "missing"))


def test_rendezvous_dir_rejects_other_owner(tmp_path):
    d = make_rendezvous_dir(str(tmp_path))
    with pytest.raises(FdExchangeError, match="belongs to uid"):
        check_rendezvous_dir(d, uid=os.geteuid() + 1)
    if ROOT:
        os.chown(d, 65534, 65534)
        with pytest.raises(FdExchangeError, match="belongs to uid 65534"):
            check_rendezvous_dir(d)


def test_too_long_socket_path_is_refused(tmp_path):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    with pytest.raises(FdExchangeError, match="too long"):
        make_rendezvous_dir(str(deep))


# ---------------------------------------------------------------------------------------------
# Refusing strangers
# ---------------------------------------------------------------------------------------------


def _listen(tmp_path, **kw):
    d = make_rendezvous_dir(str(tmp_path))
    return d, _Listener(os.path.join(d, "0.sock"), backlog=4, **kw)


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e
    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_listener_refuses_peer_with_another_uid(tmp_path):
    # The listener expects a uid that is not ours, so our own connection plays the stranger.
    d, lst = _listen(tmp_path, uid=os.geteuid() + 1)
    fd = _memfd("secret")
    try:
        t, box = _in_thread(lambda: lst.receive(token="t", expected={1}, deadline=time.monotonic() + 0.5))
        try:
            _send(lst.path, token="t", sender=1, ranks=[1], fds=[fd], deadline=time.monotonic() + 5)
        except FdExchangeError:
            pass   # the listener may hang up before our message is written: a refusal either way
        t.join()
        assert isinstance(box.get("error"), FdExchangeError)
        assert len(lst.refused) == 1 and f"uid {os.geteuid()}" in lst.refused[0]
    finally:
        os.close(fd)
        lst.close()


def test_sender_refuses_listener_with_another_uid(tmp_path):
    d, lst = _listen(tmp_path)
    try:
        with pytest.raises(FdExchangeError, match="refused"):
            _send(lst.path, token="t", sender=1, ranks=[], fds=[], deadline=time.monotonic() + 5,
                  uid=os.geteuid() + 1)
    finally:
        lst.close()


@pytest.mark.parametrize("token, sender, ranks, reason", [
    ("wrong", 1, [7], "not a message of this exchange"),
    ("t", 5, [7], "unexpected sender 5"),
    ("t", 1, [7, 8], "1 descriptors for ranks [7, 8]"),
])
def test_listener_refuses_bad_messages(tmp_path, token, sender, ranks, reason):
    d, lst = _listen(tmp_path)
    fd = _memfd("x")
    before = _open_fds()
    try:
        t, box = _in_thread(lambda: lst.receive(token="t", expected={1}, deadline=time.monotonic() + 0.5))
        _send(lst.path, token=token, sender=sender, ranks=ranks, fds=[fd], deadline=time.monotonic() + 5)
        t.join()
        assert isinstance(box.get("error"), FdExchangeError)
        assert len(lst.refused) == 1 and reason in lst.refused[0]
        assert _open_fds() == before  # the refused message's descriptors were closed
    finally:
        os.close(fd)
        lst.close()


def test_listener_takes_each_sender_once(tmp_path):
    d, lst = _listen(tmp_path)
    fds = [_memfd("a"), _memfd("b")]
    try:
        t, box = _in_thread(lambda: lst.receive(token="t", expected={1, 2}, deadline=time.monotonic() + 2.0))
        _send(lst.path, token="t", sender=1, ranks=[4], fds=[fds[0]], deadline=time.monotonic() + 5)
        _send(lst.path, token="t", sender=1, ranks=[4], fds=[fds[0]], deadline=time.monotonic() + 5)
        _send(lst.path, token="t", sender=2, ranks=[5], fds=[fds[1]], deadline=time.monotonic() + 5)
        t.join()
        got = box["value"]
        assert sorted(got) == [1, 2] and got[1][0] == [4] and got[2][0] == [5]
        assert lst.refused == [lst.refused[0]] and "unexpected sender 1" in lst.refused[0]
        assert os.pread(got[2][1][0], 1, 0) == b"b"
        for _, received in got.values():
            for fd in received:
                os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)
        lst.close()


_STRANGER = textwrap.dedent("""
    import os, socket, sys
    os.setgid(65534); os.setuid(65534)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(sys.argv[1])
    except PermissionError:
        print("EACCES"); sys.exit(0)
    print("CONNECTED", flush=True)
    try:
        s.send(b"hello")  # the listener may already have hung up on us
    except OSError:
        pass
""")


@pytest.mark.skipif(not ROOT, reason="needs root to run a process under another uid")
def test_other_user_cannot_reach_or_is_refused():
    # Under a directory everyone may traverse, so that only the rendezvous directory keeps them out.
    base = tempfile.mkdtemp(prefix="mok_rt_test-", dir="/tmp")
    os.chmod(base, 0o755)
    d, lst = _listen(pathlib.Path(base))
    try:
        # 1. The 0700 directory keeps another user from even connecting.
        out = subprocess.run([sys.executable, "-c", _STRANGER, lst.path], capture_output=True, text=True, timeout=60)
        if "EACCES" not in out.stdout and "CONNECTED" not in out.stdout:
            pytest.skip(f"cannot run Python as uid 65534 here: {out.stderr[-300:]}")
        assert out.stdout.strip() == "EACCES"
        # 2. Were the directory open, SO_PEERCRED still refuses the stranger.
        os.chmod(d, 0o711)
        os.chmod(lst.path, 0o777)
        t, box = _in_thread(lambda: lst.receive(token="t", expected={1}, deadline=time.monotonic() + 3.0))
        out = subprocess.run([sys.executable, "-c", _STRANGER, lst.path], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "CONNECTED"
        t.join()
        assert isinstance(box.get("error"), FdExchangeError)
        assert len(lst.refused) == 1 and "uid 65534" in lst.refused[0]
    finally:
        lst.close()
        shutil.rmtree(base, ignore_errors=True)


def test_errors_are_mok_errors():
    assert issubclass(FdExchangeError, MokError)
    assert socket.SO_PEERCRED  # Linux only, as is the exchange
