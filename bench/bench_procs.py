"""The processes of a bench_moe.py run: this process's rank in the EP group, its device, the host
collectives the harness needs, and logging / error capture that keeps the ranks in step."""
from __future__ import annotations

import gc
import os
import sys
import traceback
from typing import Any, Callable


# -- processes -------------------------------------------------------------------------------------
class _Ranks:
    """This process's place in the EP group, its device, and the host collectives the harness
    needs.  ``cpu``: the --cpu-smoke self-test (torch on the CPU, gloo)."""

    def __init__(self, torch, *, rank: int, size: int, local_rank: int, cpu: bool = False):
        self.torch, self.rank, self.size, self.device, self.cpu = torch, rank, size, local_rank, cpu
        self.dev = torch.device("cpu") if cpu else torch.device("cuda", local_rank)
        self.group = None
        if size > 1:
            import torch.distributed as dist
            if cpu:
                dist.init_process_group("gloo")
            else:
                dist.init_process_group("nccl", device_id=self.dev)
            self.group = dist.group.WORLD

    def synchronize(self) -> None:
        if not self.cpu:
            self.torch.cuda.synchronize()

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (a collective)."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist
            dist.barrier()

    def close(self) -> None:
        if self.size > 1:
            import torch.distributed as dist
            dist.destroy_process_group()


def _launcher_env() -> tuple[int, int, int]:
    """(rank, size, local rank) from torchrun's variables, or from mpirun's (Open MPI, PMI)."""
    env = os.environ
    if "WORLD_SIZE" not in env:
        for size, rank, local in (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
                                  ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID")):
            if size in env:
                env["WORLD_SIZE"], env["RANK"] = env[size], env[rank]
                env["LOCAL_RANK"] = env.get(local, env[rank])
                # torch.distributed's env:// rendezvous; one node, so loopback suffices
                env.setdefault("MASTER_ADDR", "127.0.0.1")
                env.setdefault("MASTER_PORT", "29517")
                break
    size = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    return rank, size, int(env.get("LOCAL_RANK", str(rank)))


def _log(ranks, *a) -> None:
    if ranks is None or ranks.rank == 0:
        print(*a, flush=True)


def _attempt(ranks: _Ranks, what: str, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """Run ``fn`` on every rank; if it failed on any, all ranks learn it (so none waits alone in
    a later collective).  Returns (value, None) or (None, error text)."""
    try:
        value, err = fn(), None
    except Exception as ex:   # OOM, a mok_rt error, a missing API: recorded, the run goes on
        value, err = None, f"{type(ex).__name__}: {ex}"[:600]
        # mok_rt's own errors explain themselves; anything else gets its traceback
        detail = "" if type(ex).__module__.startswith("mok_rt") else "\n" + traceback.format_exc()
        print(f"[rank {ranks.rank}] {what} failed: {err}{detail}", file=sys.stderr, flush=True)
    errors = ranks.gather(err)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if not bad:
        return value, None
    if ranks.size == 1:
        return None, f"{what}: {bad[0][1]}"
    if len(bad) == ranks.size and len(set(errors)) == 1:
        return None, f"{what}: every rank: {bad[0][1]}"
    return None, f"{what}: " + "; ".join(f"rank {r}: {e}" for r, e in bad)


def _free(torch) -> None:
    """Give what the last shape held back to the device (torch's cache included), so the next
    starts from the same free memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
