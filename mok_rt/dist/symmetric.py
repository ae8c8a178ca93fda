"""Symmetric memory: one equal-sized block per rank, every block mapped into every rank.

``SymmetricHeap(group, nbytes)`` allocates ``nbytes`` (plus a small control region holding the
barrier's signal pad) on every rank's GPU with ``cuMemCreate``, exchanges the handles between the
group's processes, imports and maps every block into one virtual range per process, and grants
each local GPU read/write access to all of them.  Kernels get the array of block addresses
(:meth:`SymmetricHeap.peer_ptr_array`); block ``r`` lives at ``peer_ptrs(me)[r]``.

Handles travel as POSIX file descriptors over Unix sockets (``_fdpass``: same host), or as FABRIC
handles through the group's all-gather (multi-node NVLink domains, when asked for and supported).
Ranks of the same process share handles directly: nothing is exported.  Multicast (NVLS) objects
are created only with ``multicast=True``.

Every setup step that can fail on one process only is followed by a status all-gather, so a
failure raises on every process instead of leaving the others waiting in the next collective.
"""
from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from mok_rt.runtime import driver as _driver
from mok_rt.runtime.errorword import ErrorWord, PrimaryContext
from mok_rt.dist.fdpass import exchange_fds
from mok_rt.dist.multicast import Multicast
from mok_rt.errors import ArgumentError, MokError
from mok_rt.dist.group import ProcessGroup, collective_step

__all__ = ["SymmetricHeap", "SignalPad", "HANDLE_TYPES"]

HANDLE_TYPES = ("auto", "posix_fd", "fabric")
_CONTROL_ALIGN = 256  # the control region (signal pad) starts and ends on this boundary


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _host_id() -> str:
    """Same string on processes of one OS instance (POSIX descriptors only travel within one)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _pad_bytes(size: int) -> int:
    """Bytes of a signal pad for ``size`` ranks (mirrors pad_words() in barrier.cuh)."""
    return 4 * (1 + size)


@dataclass(frozen=True)
class SignalPad:
    """Where a group barrier keeps its signals: ``offset`` bytes into every rank's block.

    ``heap.signal_pad`` is the heap's own (in its control region, zeroed at creation).  Another
    pad in the user region must be zeroed on every rank before its first use.  One barrier per
    pad and rank may be in flight at a time.
    """

    heap: "SymmetricHeap"
    offset: int

    def __post_init__(self):
        need = _pad_bytes(self.heap.size)
        if (isinstance(self.offset, bool) or not isinstance(self.offset, int) or self.offset < 0
                or self.offset % 4 or self.offset + need > self.heap.block_bytes):
            raise ArgumentError("offset", f"a signal pad needs {need} bytes at a 4-byte aligned offset inside "
                                          f"the {self.heap.block_bytes}-byte block, got offset {self.offset!r}")

    @property
    def nbytes(self) -> int:
        return _pad_bytes(self.heap.size)


class SymmetricHeap:
    """Equal-sized blocks on every rank of ``group``, each mapped into every rank's address space.

    ``handle_type``: ``"posix_fd"`` (processes on one host), ``"fabric"`` (multi-node NVLink; the
    GPUs must support it) or ``"auto"`` (nothing when one process drives every rank, POSIX
    descriptors on one host, FABRIC across hosts).  ``multicast=True`` also builds an NVLS
    multicast object over the blocks (opt-in; never on the shared test machines).
    ``timeout_s`` bounds the handle exchange.  Construction and :meth:`reset_signal_pad` are
    collective; :meth:`close` is not (each process releases its own mappings).  Block contents
    start undefined, except the signal pad which starts zeroed.
    """

    def __init__(self, group: ProcessGroup, nbytes: int, *, handle_type: str = "auto", multicast: bool = False,
                 timeout_s: float = 60.0, _api=None):
        self._closed = True  # until the resources exist; close() must work on a half-built heap
        # Without a group there is no one to tell; every other argument is checked in the first
        # collective step (_setup), so that a bad value on one process fails every process.
        if not isinstance(group, ProcessGroup):
            raise ArgumentError("group", f"expected a ProcessGroup, got {type(group).__name__}")
        self.group = group
        self.size = group.size
        self.nbytes = nbytes
        self.multicast = multicast
        self._api = _api or _driver
        self._local_devices: list[int] = []
        self._ctx: dict[int, PrimaryContext] = {}
        self._handles: dict[int, object] = {}
        self._fds: list[int] = []
        self._va = 0
        self._va_size = 0
        self._mapped: list[int] = []
        self._ptr_arrays: dict[int, int] = {}
        self._error_words: dict[int, ErrorWord] = {}
        self._mc: Multicast | None = None
        self._closed = False
        try:
            self._setup(handle_type, timeout_s)
        except BaseException:
            self.close()
            raise

    # -- setup ---------------------------------------------------------------------------------
    @staticmethod
    def _check_args(nbytes, handle_type, multicast, timeout_s) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ArgumentError("nbytes", f"expected an int > 0, got {nbytes!r}")
        if handle_type not in HANDLE_TYPES:
            raise ArgumentError("handle_type", f"expected one of {HANDLE_TYPES}, got {handle_type!r}")
        if not isinstance(multicast, bool):
            raise ArgumentError("multicast", f"expected a bool, got {multicast!r}")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
            raise ArgumentError("timeout_s", f"expected a positive number of seconds, got {timeout_s!r}")

    def _setup(self, handle_type: str, timeout_s: float) -> None:
        api, group = self._api, self.group

        # 1. Every process checks its arguments and describes its ranks; everyone validates the
        #    same table (which also holds the arguments that must agree).  Nothing runs before
        #    this step: a failure on one process would leave the others waiting in it forever.
        def describe():
            self._check_args(self.nbytes, handle_type, self.multicast, timeout_s)
            api.init()
            self._local_devices = sorted({group.devices[r] for r in group.local_ranks})
            return self._local_facts(handle_type)

        _, table = collective_step(group, "SymmetricHeap: describe ranks", describe, share=lambda facts: facts)
        drv = api.driver
        ranks = self._validate(table, handle_type)
        self._uuids = [ranks[r]["uuid"] for r in range(self.size)]
        nproc = group.num_processes
        ht = self.handle_type = self._resolve_handle_type(handle_type, table, ranks)
        self._ht = {"none": drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE,
                    "posix_fd": drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    "fabric": drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC}[ht]

        # 2. Peer reachability and granularity (local facts, agreed by all).
        self.control_offset = _round_up(self.nbytes, _CONTROL_ALIGN)
        base = self.control_offset + _round_up(_pad_bytes(self.size), _CONTROL_ALIGN)
        _, grans = collective_step(group, "SymmetricHeap: granularity", lambda: self._local_granularity(base),
                                   share=lambda g: g)
        self.granularity = math.lcm(*(g for gs in grans for g in gs))
        self.block_bytes = _round_up(base, self.granularity)

        # 3. Create every local block; export and exchange when several processes share the heap.
        mine, shared = collective_step(group, "SymmetricHeap: create blocks",
                                       lambda: self._create_blocks(export=nproc > 1),
                                       share=(lambda m: m) if ht == "fabric" else None)
        if nproc > 1 and ht == "posix_fd":
            remote = exchange_fds(group, mine, timeout_s=timeout_s)
            self._fds.extend(remote.values())
        elif nproc > 1:
            remote = {int(r): bytes.fromhex(h) for p in shared for r, h in p.items()
                      if int(r) not in group.local_ranks}
        else:
            remote = {}

        # 4. Import, map, open to local devices, zero the signal pads, publish the pointer arrays.
        collective_step(group, "SymmetricHeap: map blocks", lambda: self._import_and_map(remote))

        if self.multicast:
            self._setup_multicast(timeout_s)

    def _local_facts(self, handle_type: str) -> dict:
        api, drv = self._api, self._api.driver
        attr = drv.CUdevice_attribute
        devs = {}
        for d in self._local_devices:
            ctx = self._ctx[d] = PrimaryContext(d, api=api)
            get = lambda a, dev=ctx.device: int(api.call("cuDeviceGetAttribute", a, dev))  # noqa: E731
            devs[d] = {
                "uuid": bytes(api.call("cuDeviceGetUuid", ctx.device).bytes).hex(),
                "vmm": get(attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED),
                "posix_fd": get(attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED),
                "fabric": get(attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED),
                "multicast": get(attr.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED),
            }
        return {"size": self.group.size, "devices": list(self.group.devices), "nbytes": self.nbytes,
                "handle_type": handle_type, "multicast": self.multicast, "host": _host_id(),
                "ranks": {str(r): dict(devs[self.group.devices[r]], device=self.group.devices[r])
                          for r in self.group.local_ranks}}

    def _validate(self, table: list[dict], handle_type: str) -> dict[int, dict]:
        """Checks that every process agrees; returns ``{rank: facts}`` (identical on all processes)."""
        first = table[0]
        ranks: dict[int, dict] = {}
        for p, t in enumerate(table):
            if t["size"] != first["size"] or t["devices"] != first["devices"]:
                raise ArgumentError("group", f"process {p} sees a group of {t['size']} ranks on devices "
                                             f"{t['devices']}, process 0 sees {first['size']} on {first['devices']}")
            for key, arg in (("nbytes", "nbytes"), ("handle_type", "handle_type"), ("multicast", "multicast")):
                if t[key] != first[key]:
                    r = min(int(k) for k in t["ranks"]) if t["ranks"] else p
                    r0 = min(int(k) for k in first["ranks"]) if first["ranks"] else 0
                    raise ArgumentError(arg, f"rank {r} asked for {arg}={t[key]!r} but rank {r0} for "
                                             f"{first[key]!r}: every rank must pass the same value")
            for k, facts in t["ranks"].items():
                r = int(k)
                if r in ranks:
                    raise ArgumentError("group", f"rank {r} is driven by two processes")
                ranks[r] = dict(facts, process=p, host=t["host"])
        missing = sorted(set(range(first["size"])) - set(ranks))
        if missing:
            raise ArgumentError("group", f"no process drives ranks {missing}")
        novmm = [r for r in range(self.size) if not ranks[r]["vmm"]]
        if novmm:
            raise ArgumentError("group", f"the GPUs of ranks {novmm} do not support CUDA virtual memory management")
        if self.multicast:
            nomc = [r for r in range(self.size) if not ranks[r]["multicast"]]
            if nomc:
                raise ArgumentError("multicast", f"the GPUs of ranks {nomc} do not support multicast (NVLS)")
            seen: dict[str, int] = {}
            for r in range(self.size):
                if ranks[r]["uuid"] in seen:
                    raise ArgumentError("multicast", f"ranks {seen[ranks[r]['uuid']]} and {r} share a GPU; a "
                                                     f"multicast object binds one block per GPU")
                seen[ranks[r]["uuid"]] = r
        return ranks

    def _resolve_handle_type(self, requested: str, table: list[dict], ranks: dict[int, dict]) -> str:
        hosts = sorted({t["host"] for t in table})
        one_host = len(hosts) == 1
        lacking = lambda key: [r for r in range(self.size) if not ranks[r][key]]  # noqa: E731
        if requested == "auto":
            if len(table) == 1:
                return "none"
            requested = "posix_fd" if one_host else "fabric"
        if requested == "posix_fd":
            if len(table) > 1 and not one_host:
                raise ArgumentError("handle_type", f"POSIX descriptors only travel within one host; the ranks run on "
                                                   f"{len(hosts)} hosts: use handle_type='fabric'")
            if lacking("posix_fd"):
                raise ArgumentError("handle_type", f"the GPUs of ranks {lacking('posix_fd')} do not support POSIX "
                                                   f"file-descriptor handles")
        elif lacking("fabric"):
            raise ArgumentError("handle_type", f"the GPUs of ranks {lacking('fabric')} do not support FABRIC handles "
                                               f"(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 0)")
        return requested

    def _check_peer_access(self) -> None:
        """Every local device must reach every rank's GPU (cuDeviceCanAccessPeer; same GPU is fine).
        A GPU this process cannot see is left to the driver."""
        api = self._api
        visible = {}
        for o in range(int(api.call("cuDeviceGetCount"))):
            dev = api.call("cuDeviceGet", o)
            visible[bytes(api.call("cuDeviceGetUuid", dev).bytes).hex()] = (o, dev)
        for d in self._local_devices:
            mine = self._ctx[d]
            for r, uuid in enumerate(self._uuids):
                if uuid not in visible or visible[uuid][0] == d:
                    continue
                o, dev = visible[uuid]
                if not int(api.call("cuDeviceCanAccessPeer", mine.device, dev)):
                    me = [q for q in self.group.local_ranks if self.group.devices[q] == d][0]
                    raise ArgumentError("group", f"rank {me} (cuda:{d}) cannot access the memory of rank {r} "
                                                 f"(cuda:{o}): cuDeviceCanAccessPeer says no peer path")

    def _alloc_prop(self, device_id: int):
        drv = self._api.driver
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_id
        prop.requestedHandleTypes = self._ht
        return prop

    def _local_granularity(self, base: int) -> list[int]:
        """Every local device's allocation (and multicast) granularity, after checking that it can
        reach every rank's GPU."""
        self._check_peer_access()
        api, drv = self._api, self._api.driver
        flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        out = []
        for d in self._local_devices:
            with self._ctx[d].current():
                out.append(int(api.call("cuMemGetAllocationGranularity", self._alloc_prop(d), flag)))
                if self.multicast:
                    out.append(Multicast.granularity(api, num_devices=self.size, size=_round_up(base, out[0]),
                                                     handle_type=self._mc_handle_type()))
        return out

    def _mc_handle_type(self) -> int:
        return 0 if self.group.num_processes == 1 else int(self._ht)

    def _export(self, handle):
        """A shareable form of ``handle``: an fd (owned by the heap until closed) or FABRIC hex."""
        if self.handle_type == "posix_fd":
            fd = int(self._api.call("cuMemExportToShareableHandle", handle, self._ht, 0))
            self._fds.append(fd)
            return fd
        return bytes(self._api.call("cuMemExportToShareableHandle", handle, self._ht, 0).data).hex()

    def _import(self, shareable):
        if self.handle_type == "posix_fd":
            return self._api.call("cuMemImportFromShareableHandle", int(shareable), self._ht)
        fh = self._api.driver.CUmemFabricHandle()
        fh.data = bytes(shareable)
        return self._api.call("cuMemImportFromShareableHandle", fh.getPtr(), self._ht)

    def _create_blocks(self, *, export: bool) -> dict[int, object]:
        out = {}
        for r in self.group.local_ranks:
            d = self.group.devices[r]
            with self._ctx[d].current():
                self._handles[r] = self._api.call("cuMemCreate", self.block_bytes, self._alloc_prop(d), 0)
            if export:
                out[r] = self._export(self._handles[r])
        return out

    def _access_descs(self) -> list:
        drv = self._api.driver
        descs = []
        for d in self._local_devices:
            desc = drv.CUmemAccessDesc()
            desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = d
            desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            descs.append(desc)
        return descs

    def _import_and_map(self, remote: dict[int, object]) -> None:
        api, stride = self._api, self.block_bytes
        with self._ctx[self._local_devices[0]].current():
            for r in sorted(remote):
                self._handles[r] = self._import(remote[r])
            self._close_fds()  # the imported handles keep the memory alive
            self._va_size = self.size * stride
            self._va = int(api.call("cuMemAddressReserve", self._va_size, self.granularity, 0, 0))
            descs = self._access_descs()
            for r in range(self.size):
                api.call("cuMemMap", self._va + r * stride, stride, 0, self._handles[r], 0)
                self._mapped.append(self._va + r * stride)
                api.call("cuMemSetAccess", self._va + r * stride, stride, descs, len(descs))
        ptrs = np.array([self._va + r * stride for r in range(self.size)], dtype=np.uint64)
        for d in self._local_devices:
            with self._ctx[d].current():
                for r in self.group.local_ranks:
                    if self.group.devices[r] == d:
                        self._zero_pad(r, self.control_offset)
                self._ptr_arrays[d] = int(api.call("cuMemAlloc", ptrs.nbytes))
                api.call("cuMemcpyHtoD", self._ptr_arrays[d], ptrs.ctypes.data, ptrs.nbytes)
                api.call("cuCtxSynchronize")
        # Now rather than on first use: allocating device memory may serialise streams, which would
        # stall a barrier kernel already spinning on another stream.
        for r in self.group.local_ranks:
            self._error_words[r] = ErrorWord(self.group.devices[r], _api=api)

    def _zero_pad(self, rank: int, offset: int) -> None:
        self._api.call("cuMemsetD32", self._va + rank * self.block_bytes + offset, 0, _pad_bytes(self.size) // 4)

    def _setup_multicast(self, timeout_s: float) -> None:
        group, nproc = self.group, self.group.num_processes
        owner = 0 in group.local_ranks  # the process of rank 0 creates the object
        first = self._ctx[self._local_devices[0]]
        self._mc = Multicast(self._api, num_devices=self.size, size=self.block_bytes,
                             handle_type=self._mc_handle_type())

        def create():
            if owner:
                with first.current():
                    self._mc.create()
                    if nproc > 1:
                        return {0: self._export(self._mc.handle)}
            return {}

        mine, shared = collective_step(group, "SymmetricHeap: multicast create", create,
                                       share=(lambda m: m) if self.handle_type == "fabric" else None)
        if nproc > 1 and self.handle_type == "posix_fd":
            got = exchange_fds(group, mine, timeout_s=timeout_s)
            self._fds.extend(got.values())
        else:
            got = {int(k): bytes.fromhex(v) for p in shared if p for k, v in p.items()}

        def add_devices():
            if not owner:
                with first.current():
                    self._mc.adopt(self._import(got[0]))
            self._close_fds()
            for d in self._local_devices:
                self._mc.add_device(self._ctx[d].device)

        def bind_and_map():
            for r in group.local_ranks:
                with self._ctx[group.devices[r]].current():
                    self._mc.bind(self._ctx[group.devices[r]].device, self._handles[r])
            with first.current():
                self._mc.map(self._access_descs(), alignment=self.granularity)

        # Every device must be added (on every process) before any block is bound.
        collective_step(group, "SymmetricHeap: multicast add devices", add_devices)
        collective_step(group, "SymmetricHeap: multicast bind", bind_and_map)

    # -- queries ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise MokError("the SymmetricHeap is closed")

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self.group.local_ranks

    def device_id(self, rank: int) -> int:
        return self.group.device_id(rank)

    def local_ptr(self, rank: int) -> int:
        """Address of ``rank``'s own block (``rank`` must be driven by this process)."""
        self._check_open()
        return self._va + self.group.check_local(rank) * self.block_bytes

    def peer_ptrs(self, rank: int) -> list[int]:
        """Addresses, valid on ``rank``'s device, of every rank's block (index = rank)."""
        self._check_open()
        self.group.check_local(rank)
        return [self._va + r * self.block_bytes for r in range(self.size)]

    def peer_ptr_array(self, rank: int) -> int:
        """Device address of ``uint64[size]`` holding :meth:`peer_ptrs` (on ``rank``'s device)."""
        self._check_open()
        return self._ptr_arrays[self.group.devices[self.group.check_local(rank)]]

    def multicast_ptr(self, rank: int) -> int:
        """Address of the multicast mapping on ``rank``'s device (``multicast=True`` only)."""
        self._check_open()
        self.group.check_local(rank)
        if self._mc is None:
            raise ArgumentError("multicast", "this heap was created with multicast=False")
        return self._mc.va

    @property
    def signal_pad(self) -> SignalPad:
        """The heap's own signal pad (in the control region after the user's ``nbytes``)."""
        return SignalPad(self, self.control_offset)

    def error_word(self, rank: int) -> ErrorWord:
        """The error word the heap's kernels of ``rank`` report to (one per local rank)."""
        self._check_open()
        return self._error_words[self.group.check_local(rank)]

    def as_tensor(self, rank: int, dtype, shape: Sequence[int], offset: int = 0, *, peer: int | None = None):
        """A DLPack-exportable tensor over ``rank``'s block (or, with ``peer``, over peer's block as
        mapped on ``rank``'s device), ``offset`` bytes in.  It keeps the heap referenced, but
        :meth:`close` still unmaps the memory: do not use tensors of a closed heap."""
        from mok_rt.interop.dtypes import as_dtype
        from mok_rt.interop.tensor import Tensor
        self._check_open()
        self.group.check_local(rank)
        dt = as_dtype(dtype)
        if isinstance(shape, int):
            shape = (shape,)
        shape = tuple(shape)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape):
            raise ArgumentError("shape", f"expected non-negative ints, got {shape!r}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset % dt.itemsize:
            raise ArgumentError("offset", f"expected a non-negative multiple of {dt.itemsize} bytes, got {offset!r}")
        end = offset + math.prod(shape) * dt.itemsize
        if end > self.nbytes:
            raise ArgumentError("shape", f"{shape} {dt.name} at offset {offset} ends at byte {end}, past the "
                                         f"heap's {self.nbytes} bytes")
        owner = rank if peer is None else peer
        if isinstance(owner, bool) or not isinstance(owner, int) or not 0 <= owner < self.size:
            raise ArgumentError("peer", f"expected a rank in [0, {self.size}), got {peer!r}")
        ptr = self._va + owner * self.block_bytes + offset
        return Tensor._from_pointer(ptr, shape, dt, self.group.devices[rank], self)

    # -- collective maintenance --------------------------------------------------------------------
    def reset_signal_pad(self, pad: SignalPad | None = None) -> None:
        """Zero ``pad`` (default: the heap's) on every rank, e.g. after a barrier timed out.  A
        collective; no barrier on that pad may be running."""
        self._check_open()
        pad = pad or self.signal_pad

        def zero():
            for r in self.group.local_ranks:
                with self._ctx[self.group.devices[r]].current():
                    self._zero_pad(r, pad.offset)
                    self._api.call("cuCtxSynchronize")

        collective_step(self.group, "SymmetricHeap.reset_signal_pad", zero)

    # -- teardown --------------------------------------------------------------------------------
    def _close_fds(self) -> None:
        while self._fds:
            try:
                os.close(self._fds.pop())
            except OSError:
                pass

    def close(self) -> None:
        """Wait for the local devices, then unmap, release and free everything; idempotent.

        Not collective: each process drops its own mappings, and a peer's memory lives on until
        the last process that maps it lets go.  Raises the first failure after trying every step.
        """
        if self._closed:
            return
        self._closed = True
        api, errors = self._api, []

        def attempt(fn, *args):
            try:
                fn(*args)
            except BaseException as e:  # keep releasing: one failure must not leak the rest
                errors.append(e)

        def with_ctx(d, name, *args):
            with self._ctx[d].current():
                api.call(name, *args)

        for d in list(self._ctx):
            attempt(with_ctx, d, "cuCtxSynchronize")
        if self._mc is not None:
            mc, self._mc = self._mc, None

            def close_multicast():
                with self._ctx[self._local_devices[0]].current():
                    mc.close()
            attempt(close_multicast)
        while self._error_words:
            attempt(self._error_words.popitem()[1].close)
        while self._ptr_arrays:
            d, ptr = self._ptr_arrays.popitem()
            attempt(with_ctx, d, "cuMemFree", ptr)
        first = self._local_devices[0] if self._ctx else None
        while self._mapped:
            attempt(with_ctx, first, "cuMemUnmap", self._mapped.pop(), self.block_bytes)
        if self._va:
            va, self._va = self._va, 0
            attempt(with_ctx, first, "cuMemAddressFree", va, self._va_size)
        while self._handles:
            attempt(with_ctx, first, "cuMemRelease", self._handles.popitem()[1])
        self._close_fds()
        while self._ctx:
            attempt(self._ctx.popitem()[1].release)
        if errors:
            raise errors[0]

    def __enter__(self) -> "SymmetricHeap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"block_bytes={self.block_bytes}, handle_type={self.handle_type!r}"
        return (f"SymmetricHeap(size={self.size}, nbytes={self.nbytes}, local_ranks={list(self.local_ranks)}, "
                f"multicast={self.multicast}, {state})")
