"""Symmetric-memory checks on real GPUs, under MPI or imported by the pytest GPU tests.

Run: ``mpirun --allow-run-as-root -np 2 python tests/mpi_symmetric_check.py`` (two ranks on one GPU
or one rank per GPU).  Each rank prints ``[rank r] PASS name`` / ``[rank r] FAIL name: why`` and
the exit status is non-zero when any check failed.

The helpers below (the pattern kernels' parameters, their NumPy twin, one full
poison -> barrier -> write -> barrier -> verify round) are shared with tests/test_symmetric_gpu.py
and tests/test_symmetric_multigpu.py; they import nothing from pytest or mpi4py.
"""
from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mok_rt.runtime import driver as _driver  # noqa: E402
from mok_rt.runtime.cubins import get_kernel  # noqa: E402
from mok_rt.runtime.device import activate  # noqa: E402
from mok_rt.runtime.launch import launch, stream_handle  # noqa: E402
from mok_rt.dist.barrier import device_barrier
from mok_rt.dist.symmetric import SymmetricHeap  # noqa: E402

POISON = 0xFFFFFFFF


class PatternParams(ctypes.Structure):
    """Mirror of mok::PatternParams (cuda_src/comm/symm_kernels.cu)."""

    _fields_ = [("peer_bases", ctypes.c_uint64), ("result", ctypes.c_uint64), ("slot_offset", ctypes.c_uint64),
                ("slot_words", ctypes.c_uint64), ("rank", ctypes.c_int32), ("size", ctypes.c_int32),
                ("seed", ctypes.c_uint32), ("unused", ctypes.c_int32)]


assert ctypes.sizeof(PatternParams) == 48


def pattern(seed: int, src: int, dst: int, n: int) -> np.ndarray:
    """NumPy twin of pattern_word() in symm_kernels.cu: what rank src writes into rank dst's slot."""
    m = 0xFFFFFFFF
    i = np.arange(n, dtype=np.uint64)
    x = (seed ^ ((src * 0x9E3779B1) & m) ^ ((dst * 0x85EBCA77) & m)) ^ ((i * 0xC2B2AE3D) & m)
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & m
    x ^= x >> 12
    return x.astype(np.uint32)


KERNELS = ("symm_barrier", "symm_write_pattern", "symm_verify_pattern")


def preload(device: int) -> None:
    """Load the kernels into the device's context now.  With lazy loading, a kernel's first
    launch may wait for the context's running work: for a barrier spinning on a rank that has not
    launched yet, that would be a stall until its timeout."""
    activate(device)
    for name in KERNELS:
        _driver.call("cuKernelGetFunction", get_kernel("symm_kernels", name, device).handle)


def _stream_of(stream) -> int:
    return stream_handle(stream)


class RankCheck:
    """One local rank's part of a pattern round: its stream, its result buffer, its seed."""

    def __init__(self, heap: SymmetricHeap, rank: int, stream, *, slot_words: int, seed: int):
        if heap.size * slot_words * 4 > heap.nbytes:
            raise ValueError("the heap is too small for the slots")
        self.heap, self.rank, self.stream = heap, rank, stream
        self.device = heap.device_id(rank)
        self.slot_words, self.seed = slot_words, seed
        preload(self.device)
        self.result = int(_driver.call("cuMemAlloc", 8))

    def _params(self) -> PatternParams:
        h = self.heap
        return PatternParams(peer_bases=h.peer_ptr_array(self.rank), result=self.result, slot_offset=0,
                             slot_words=self.slot_words, rank=self.rank, size=h.size, seed=self.seed)

    def _launch(self, name: str) -> None:
        activate(self.device)
        launch(get_kernel("symm_kernels", name, self.device), grid=32, block=256, params=self._params(),
               stream=self.stream, device_id=self.device)

    def poison(self) -> None:
        """Fill this rank's own block with 0xFFFFFFFF and arm the result words (0 bad, first = ~0)."""
        activate(self.device)
        s = _stream_of(self.stream)
        _driver.call("cuMemsetD32Async", self.heap.local_ptr(self.rank), POISON, self.heap.nbytes // 4, s)
        _driver.call("cuMemsetD32Async", self.result, 0, 1, s)
        _driver.call("cuMemsetD32Async", self.result + 4, POISON, 1, s)

    def barrier(self, timeout_s: float = 20.0) -> None:
        activate(self.device)
        device_barrier(self.heap, rank=self.rank, stream=self.stream, timeout_s=timeout_s)

    def write(self) -> None:
        self._launch("symm_write_pattern")

    def verify(self) -> None:
        self._launch("symm_verify_pattern")

    def finish(self) -> dict:
        """Synchronise; the device's verdict, the host's own comparison and the error word."""
        activate(self.device)
        _driver.call("cuStreamSynchronize", _stream_of(self.stream))
        res = np.zeros(2, dtype=np.uint32)
        _driver.call("cuMemcpyDtoH", res.ctypes.data, self.result, 8)
        n = self.heap.size * self.slot_words
        got = np.zeros(n, dtype=np.uint32)
        _driver.call("cuMemcpyDtoH", got.ctypes.data, self.heap.local_ptr(self.rank), got.nbytes)
        want = np.concatenate([pattern(self.seed, s, self.rank, self.slot_words) for s in range(self.heap.size)])
        bad = np.flatnonzero(got != want)
        return {"device_bad": int(res[0]), "device_first": int(res[1]), "host_bad": int(bad.size),
                "host_first": int(bad[0]) if bad.size else None, "error": self.heap.error_word(self.rank).read()}

    def close(self) -> None:
        activate(self.device)
        _driver.call("cuMemFree", self.result)


def pattern_round(heap: SymmetricHeap, streams: dict, *, seed: int, slot_words: int = 1 << 14) -> dict:
    """Every local rank: poison own block, barrier, write its slot into every block, barrier, verify.

    Stages are issued rank by rank before anything waits, so ranks sharing a process (and a GPU)
    run concurrently on their own streams.  Returns ``{rank: finish()}``.
    """
    checks = {r: RankCheck(heap, r, streams[r], slot_words=slot_words, seed=seed) for r in heap.local_ranks}
    try:
        for stage in ("poison", "barrier", "write", "barrier", "verify"):
            for c in checks.values():
                getattr(c, stage)()
        return {r: c.finish() for r, c in checks.items()}
    finally:
        for c in checks.values():
            c.close()


def round_ok(result: dict) -> bool:
    return (result["device_bad"] == 0 and result["device_first"] == POISON and result["host_bad"] == 0
            and result["error"] == (0, 0, 0, 0))


def free_memory(device: int) -> int:
    activate(device)
    free, _total = _driver.call("cuMemGetInfo")
    return int(free)


# ---------------------------------------------------------------------------------------------
# The MPI run
# ---------------------------------------------------------------------------------------------


def _main() -> int:
    from mpi4py import MPI

    from mok_rt.errors import PeerTimeoutError
    from mok_rt.dist.group import MPIGroup

    comm = MPI.COMM_WORLD
    group = MPIGroup(comm)
    me = group.rank
    failures = 0

    def report(name: str, ok: bool, why: str = "") -> None:
        nonlocal failures
        failures += not ok
        print(f"[rank {me}] {'PASS' if ok else 'FAIL'} {name}{'' if ok else ': ' + why}", flush=True)

    stream = activate(group.device).create_stream()
    with SymmetricHeap(group, 1 << 20, handle_type="posix_fd") as heap:
        report("handle exchange (posix_fd)", heap.handle_type == "posix_fd" and len(heap.peer_ptrs(me)) == group.size,
               repr(heap))
        res = pattern_round(heap, {me: stream}, seed=0x5EED)[me]
        report("peer writes and verification", round_ok(res), str(res))

        for _ in range(20):
            device_barrier(heap, rank=me, stream=stream, timeout_s=20)
        stream.sync()
        report("barrier reused 20 times", heap.error_word(me).read() == (0, 0, 0, 0), str(heap.error_word(me).read()))

        # The last rank withholds; every other rank must time out naming it.
        missing = group.size - 1
        if me != missing:
            try:
                device_barrier(heap, rank=me, stream=stream, timeout_s=0.5, wait=True)
                report("barrier timeout names the missing rank", False, "no timeout")
            except PeerTimeoutError as e:
                report("barrier timeout names the missing rank", e.rank == missing, f"named rank {e.rank}: {e}")
            heap.error_word(me).clear()
        comm.Barrier()
        heap.reset_signal_pad()
        device_barrier(heap, rank=me, stream=stream, timeout_s=20, wait=True)
        report("barrier works again after a reset", True)

    comm.Barrier()
    before = free_memory(group.device)
    for _ in range(20):
        with SymmetricHeap(group, 4 << 20) as heap:
            heap.peer_ptr_array(me)
            heap.error_word(me)
    comm.Barrier()
    after = free_memory(group.device)
    report("20 create/destroy cycles leave free memory unchanged", before == after, f"{before} -> {after}")

    total = comm.allreduce(failures)
    if me == 0:
        print(f"{'ALL PASS' if total == 0 else f'{total} FAILURES'} ({group.size} ranks)", flush=True)
    return 1 if total else 0


if __name__ == "__main__":
    try:
        sys.exit(_main())
    except Exception:  # a crash is a FAIL line too, and must not leave the other ranks waiting
        import traceback

        from mpi4py import MPI
        print(f"[rank {MPI.COMM_WORLD.Get_rank()}] FAIL crashed:\n{traceback.format_exc()}", flush=True)
        MPI.COMM_WORLD.Abort(1)
