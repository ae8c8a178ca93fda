"""Workspace: everything one rank needs to run MoE layers, sized once for a maximum token count."""
from __future__ import annotations

from .config import MoEConfig
from .errors import ArgumentError

__all__ = ["Workspace", "BACKENDS"]

BACKENDS = ("cuda", "reference")


def _group_devices(group) -> tuple[int, ...]:
    devices = getattr(group, "devices", None)
    if devices is not None:
        return tuple(int(d) for d in devices)
    dev = getattr(group, "device_id", None)
    if dev is None:
        raise ArgumentError("group", f"{type(group).__name__} has neither 'devices' nor 'device_id'")
    return (int(dev),)


class Workspace:
    """The buffers, stream and error word of one rank, reusable across the layers of a model.

    ``Workspace(cfg, group, max_tokens=T_max, backend="cuda")``: ``group`` says which ranks share
    the experts (``None``: one rank on device 0); ``max_tokens`` bounds the tokens of one call on
    this rank and sizes every buffer; ``backend="reference"`` runs the NumPy reference behind the
    same API on any machine.  Calls enqueue work on ``stream`` (default: a stream the workspace
    owns) and return without waiting; :meth:`synchronize` waits and raises any error a kernel
    reported.  Use it as a context manager or call :meth:`close`.  ``poison_outputs=True`` (for
    tests) fills every result and context buffer with NaN before the kernels write it.
    """

    def __init__(self, config: MoEConfig, group=None, *, max_tokens: int, backend: str = "cuda", stream=None,
                 poison_outputs: bool = False):
        if not isinstance(config, MoEConfig):
            raise ArgumentError("config", f"expected a MoEConfig, got {type(config).__name__}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ArgumentError("max_tokens", f"expected an int >= 0, got {max_tokens!r}")
        if backend not in BACKENDS:
            raise ArgumentError("backend", f"expected one of {BACKENDS}, got {backend!r}")
        self.config = config
        self.group = group
        self.max_tokens = max_tokens
        self.backend = backend
        # Testing aid: fill every buffer mok_rt allocates for a result or a context with NaN
        # (0xFF bytes) before the kernels run, so an element they fail to write cannot pass.
        self.poison_outputs = bool(poison_outputs)
        devices = _group_devices(group) if group is not None else (0,)
        self.num_ranks = len(devices) if getattr(group, "devices", None) is not None else \
            int(getattr(group, "size", 1))
        if self.num_ranks != 1:
            raise ArgumentError("group", f"expert parallelism over {self.num_ranks} ranks is not available in "
                                         f"this version yet; use a group of one rank")
        self.rank = 0
        self.device_id = devices[0]
        self.experts_per_rank = config.experts_per_rank(self.num_ranks)
        self.capacity_rows = config.capacity_rows(max_tokens=max_tokens, num_ranks=self.num_ranks)
        self._closed = False
        if backend == "reference":
            from ._backend_reference import ReferenceBackend
            self._impl = ReferenceBackend(self)
            self.stream = None
        else:
            from ._backend_cuda import CudaBackend
            from .device import wrap_stream
            self.stream = wrap_stream(stream, self.device_id)
            self._impl = CudaBackend(self)

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Release every buffer (after the work already enqueued has finished); idempotent."""
        if self._closed:
            return
        self._closed = True
        impl, self._impl = self._impl, None
        if impl is not None:
            impl.close()

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _backend(self):
        if self._closed:
            raise ArgumentError("ws", "the workspace is closed")
        return self._impl

    # -- errors and waiting ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for the streams this workspace enqueued work on and raise the first error a kernel reported."""
        self._backend().synchronize()

    def check(self) -> None:
        """Raise the error a kernel reported, if any, without waiting (see :meth:`synchronize`)."""
        self._backend().check()

    def __repr__(self) -> str:
        c = self.config
        return (f"Workspace(backend={self.backend!r}, device={self.device_id}, rank={self.rank}/{self.num_ranks}, "
                f"H={c.hidden}, I={c.intermediate}, E={c.num_experts}, k={c.top_k}, max_tokens={self.max_tokens})")
