"""Passing file descriptors between the processes of a group: Unix-domain sockets with SCM_RIGHTS.

A POSIX file descriptor of a CUDA memory handle grants access to that GPU memory, so it must only
reach processes of the same user.  The exchange therefore:

* meets in a fresh directory created with mode 0700 (``tempfile.mkdtemp``) under
  ``$XDG_RUNTIME_DIR`` or the temporary directory; its name and a random session token travel
  through the group's own all-gather, and the directory is removed afterwards;
* checks, before it binds a socket there, that the directory is a real directory owned by this
  user and closed to everyone else;
* refuses a connecting peer whose uid (SO_PEERCRED) differs from ours, and a listener whose uid
  differs when connecting; a message without the session token is refused too.

Every process binds one SOCK_SEQPACKET listener (message boundaries kept, so one message carries
one header and its descriptors), connects to every other process, sends its descriptors, then
accepts one message from every other process.  All waits are bounded by ``timeout_s``.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import time
from typing import Mapping

from mok_rt.errors import MokError

__all__ = ["exchange_fds"]

_MAGIC = "mok_rt-fds/1"
_MAX_FDS = 253            # SCM_MAX_FD: most descriptors one message may carry
_MAX_MESSAGE = 1 << 16
_SUN_PATH_MAX = 107       # sizeof(sockaddr_un.sun_path) - 1 on Linux
_UCRED = struct.Struct("3i")  # struct ucred { pid_t pid; uid_t uid; gid_t gid; }


class FdExchangeError(MokError):
    """The descriptor exchange failed (timeout, refused peer, unsafe directory)."""


def runtime_base() -> str:
    """Where rendezvous directories go: ``$XDG_RUNTIME_DIR`` when it is ours and private, else the
    temporary directory (both short enough for socket paths)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            st = os.stat(xdg)
            if (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077
                    and len(xdg) < _SUN_PATH_MAX - 40):
                return xdg
        except OSError:
            pass
    return tempfile.gettempdir()


def make_rendezvous_dir(base: str | None = None) -> str:
    """A new directory with mode 0700 (``mkdtemp`` creates it so, atomically)."""
    path = tempfile.mkdtemp(prefix="mok_rt-", dir=base or runtime_base())
    if len(os.path.join(path, "0000.sock")) > _SUN_PATH_MAX:
        os.rmdir(path)
        raise FdExchangeError(f"rendezvous directory {path!r} is too long for a Unix socket path "
                              f"({_SUN_PATH_MAX} bytes); set TMPDIR or XDG_RUNTIME_DIR to a shorter path")
    return path


def check_rendezvous_dir(path: str, *, uid: int | None = None) -> None:
    """Raise unless ``path`` is a directory (not a link) owned by ``uid`` with no group/other access."""
    uid = os.geteuid() if uid is None else uid
    try:
        st = os.lstat(path)
    except OSError as e:
        raise FdExchangeError(f"rendezvous directory {path!r}: {e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise FdExchangeError(f"rendezvous directory {path!r} is not a directory")
    if st.st_uid != uid:
        raise FdExchangeError(f"rendezvous directory {path!r} belongs to uid {st.st_uid}, not {uid}")
    if st.st_mode & 0o077:
        raise FdExchangeError(f"rendezvous directory {path!r} has mode {stat.S_IMODE(st.st_mode):o}: "
                              f"others could reach its sockets (expected 700)")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class _Listener:
    """One process's listening socket; accepts exactly one valid message per expected sender."""

    def __init__(self, path: str, *, backlog: int, uid: int | None = None):
        self.path = path
        self.uid = os.geteuid() if uid is None else uid
        self.refused: list[str] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.sock.bind(path)
            self.sock.listen(max(backlog, 1))
        except BaseException:
            self.sock.close()
            raise

    def receive(self, *, token: str, expected: set[int], deadline: float) -> dict[int, tuple[list[int], list[int]]]:
        """``{sender: (ranks, fds)}`` for every sender in ``expected``; FdExchangeError at the deadline."""
        got: dict[int, tuple[list[int], list[int]]] = {}
        try:
            while set(got) != expected:
                self.sock.settimeout(_remaining(deadline))
                conn, _ = self.sock.accept()
                with conn:
                    pid, uid, _gid = peer_credentials(conn)
                    if uid != self.uid:
                        self.refused.append(f"pid {pid} with uid {uid}")
                        continue
                    conn.settimeout(_remaining(deadline))
                    msg, fds, flags, _ = socket.recv_fds(conn, _MAX_MESSAGE, _MAX_FDS)
                    reason = self._invalid(msg, fds, flags, token, expected, got)
                    if reason:
                        _close_all(fds)
                        self.refused.append(f"pid {pid}: {reason}")
                        continue
                    head = json.loads(msg)
                    got[head["sender"]] = (list(head["ranks"]), list(fds))
        except BaseException as e:
            for _, fds in got.values():
                _close_all(fds)
            if isinstance(e, TimeoutError):
                detail = f"; refused: {', '.join(self.refused)}" if self.refused else ""
                raise FdExchangeError(f"timed out waiting for descriptors from processes "
                                      f"{sorted(expected - set(got))}{detail}") from None
            raise
        return got

    @staticmethod
    def _invalid(msg: bytes, fds, flags: int, token: str, expected: set[int], got) -> str:
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            return "message or descriptors truncated"
        try:
            head = json.loads(msg)
            ok = (isinstance(head, dict) and head.get("magic") == _MAGIC
                  and secrets.compare_digest(str(head.get("token")), token))
        except ValueError:
            ok = False
        if not ok:
            return "not a message of this exchange"
        sender = head.get("sender")
        if sender not in expected or sender in got:
            return f"unexpected sender {sender!r}"
        if len(head.get("ranks", ())) != len(fds):
            return f"{len(fds)} descriptors for ranks {head.get('ranks')}"
        return ""

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _send(path: str, *, token: str, sender: int, ranks: list[int], fds: list[int], deadline: float,
          uid: int | None = None) -> None:
    """Connect to the listener at ``path`` (retrying while it is not there yet) and send ``fds``."""
    uid = os.geteuid() if uid is None else uid
    msg = json.dumps({"magic": _MAGIC, "token": token, "sender": sender, "ranks": ranks}).encode()
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(_remaining(deadline))
            try:
                sock.connect(path)
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                time.sleep(0.01)
                continue
            _pid, peer_uid, _gid = peer_credentials(sock)
            if peer_uid != uid:
                raise FdExchangeError(f"the listener at {path!r} runs as uid {peer_uid}, not {uid}: refused")
            try:
                socket.send_fds(sock, [msg], fds)
            except (BrokenPipeError, ConnectionResetError) as e:
                # The listener closed the connection before reading: it refused us (wrong uid).
                raise FdExchangeError(f"the listener at {path!r} closed the connection: refused ({e})") from e
            return
        finally:
            sock.close()


def exchange_fds(group, fds: Mapping[int, int], *, timeout_s: float = 60.0) -> dict[int, int]:
    """Send this process's ``{rank: fd}`` to every other process of ``group``; return theirs.

    A collective.  The caller keeps its own descriptors (they are duplicated in flight) and owns
    the returned ones (close them).  One process alone returns ``{}`` without touching sockets.
    """
    from mok_rt.dist.group import collective_step

    n, me = group.num_processes, group.process_index
    if n == 1:
        return {}
    deadline = time.monotonic() + timeout_s
    made = None  # the directory this process created (process 0 only)
    listener = None
    received: dict[int, tuple[list[int], list[int]]] = {}
    ranks: list[int] = []
    send_fds: list[int] = []

    def rendezvous():
        # This process's checks run inside the first step: failing before it would leave the
        # other processes waiting in its all-gather forever.
        nonlocal made, ranks, send_fds
        ranks = sorted(int(r) for r in fds)
        if len(ranks) > _MAX_FDS:
            raise FdExchangeError(f"process {me}: {len(ranks)} descriptors exceed the {_MAX_FDS} one message "
                                  f"may carry")
        send_fds = [int(fds[r]) for r in ranks]
        if me == 0:
            made = make_rendezvous_dir()
            return {"dir": made, "token": secrets.token_hex(16)}

    def listen():
        nonlocal listener
        check_rendezvous_dir(where)  # never bind into a directory others could reach
        listener = _Listener(os.path.join(where, f"{me}.sock"), backlog=n)

    def transfer():
        nonlocal received
        try:
            for k in range(1, n):
                peer = (me + k) % n
                _send(os.path.join(where, f"{peer}.sock"), token=token, sender=me, ranks=ranks,
                      fds=send_fds, deadline=deadline)
        except TimeoutError:
            raise FdExchangeError(f"process {me} timed out after {timeout_s} s sending its descriptors") from None
        received = listener.receive(token=token, expected=set(range(n)) - {me}, deadline=deadline)

    try:
        # Process 0 creates the directory; its path and the session token reach everyone through
        # the group.  Everyone listens there; then everyone sends, then receives.
        _, shared = collective_step(group, "fd exchange: rendezvous", rendezvous, share=lambda info: info)
        where, token = shared[0]["dir"], shared[0]["token"]
        collective_step(group, "fd exchange: listen", listen)
        collective_step(group, "fd exchange: transfer", transfer)
    except BaseException:
        for _, got in received.values():
            _close_all(got)
        raise
    finally:
        if listener is not None:
            listener.close()
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    out: dict[int, int] = {}
    for rks, got in received.values():
        out.update(zip(rks, got, strict=True))
    return out
