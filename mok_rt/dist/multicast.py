"""NVLink SHARP (NVLS) multicast over a symmetric heap -- opt-in only.

Only :class:`~mok_rt.dist.symmetric.SymmetricHeap` with ``multicast=True`` ever builds one of these;
the default path never calls ``cuMulticast*``.  (The shared test machines must never create
multicast objects: the tests drive this module against a fake driver.)

One multicast object spans the heap's ``size`` GPUs; each GPU binds its own rank's block at
multicast offset 0, so a ``multimem`` store to the multicast address reaches every rank's block.
The driver requires, in order: create (one process) -> export/import to the others -> every
device added -> bind -> map; teardown goes the other way: unmap, free the range, unbind every
device, release.  The heap runs the collective steps in between (see ``symmetric.py``).
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["Multicast"]


class Multicast:
    """One multicast object of ``size`` bytes over ``num_devices`` GPUs.

    ``api`` is the checked driver (``mok_rt.runtime.driver``: ``call(name, *args)`` and ``driver`` for
    the types), or a test fake with the same shape.
    """

    def __init__(self, api, *, num_devices: int, size: int, handle_type):
        self.api = api
        self.num_devices = num_devices
        self.size = size
        self.handle_type = handle_type
        self.handle = None
        self.va = 0
        self._added: list = []
        self._bound: list = []
        self._mapped = False

    @staticmethod
    def _prop(api, num_devices: int, size: int, handle_type):
        prop = api.driver.CUmulticastObjectProp()
        prop.numDevices = num_devices
        prop.size = size
        prop.handleTypes = handle_type
        prop.flags = 0
        return prop

    @staticmethod
    def granularity(api, *, num_devices: int, size: int, handle_type) -> int:
        """The recommended granularity: the bound blocks' size must be a multiple of it."""
        flag = api.driver.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED
        return int(api.call("cuMulticastGetGranularity", Multicast._prop(api, num_devices, size, handle_type), flag))

    def create(self) -> None:
        """Create the object (on exactly one process; the others :meth:`adopt` an imported handle)."""
        self.handle = self.api.call("cuMulticastCreate",
                                    self._prop(self.api, self.num_devices, self.size, self.handle_type))

    def adopt(self, handle) -> None:
        """Take a handle imported from the creating process (released by :meth:`close`)."""
        self.handle = handle

    def add_device(self, device) -> None:
        """Add a local device (CUdevice); every device of the group before any :meth:`bind`."""
        self.api.call("cuMulticastAddDevice", self.handle, device)
        self._added.append(device)

    def bind(self, device, mem_handle) -> None:
        """Bind ``device``'s block (a cuMemCreate handle of ``size`` bytes) at offset 0."""
        self.api.call("cuMulticastBindMem", self.handle, 0, mem_handle, 0, self.size, 0)
        self._bound.append(device)

    def map(self, access_descs: Sequence, *, alignment: int) -> int:
        """Map the object into this process and apply ``access_descs`` (CUmemAccessDesc, one per
        local device); returns its address."""
        self.va = int(self.api.call("cuMemAddressReserve", self.size, alignment, 0, 0))
        self.api.call("cuMemMap", self.va, self.size, 0, self.handle, 0)
        self._mapped = True
        self.api.call("cuMemSetAccess", self.va, self.size, list(access_descs), len(access_descs))
        return self.va

    def close(self) -> None:
        """Undo whatever was done, in reverse order; idempotent.  Raises the first failure after
        attempting every step."""
        errors: list[BaseException] = []

        def attempt(name, *args):
            try:
                self.api.call(name, *args)
            except BaseException as e:  # keep going: a failed step must not leak the rest
                errors.append(e)

        if self._mapped:
            self._mapped = False
            attempt("cuMemUnmap", self.va, self.size)
        if self.va:
            va, self.va = self.va, 0
            attempt("cuMemAddressFree", va, self.size)
        while self._bound:
            attempt("cuMulticastUnbind", self.handle, self._bound.pop(), 0, self.size)
        self._added.clear()  # devices leave the object with its release
        if self.handle is not None:
            handle, self.handle = self.handle, None
            attempt("cuMemRelease", handle)
        if errors:
            raise errors[0]
