"""A fake CUDA driver for the symmetric-memory tests (tests/test_symmetric_fake.py): it keeps the
driver's bookkeeping (handles, reservations, mappings, access, contexts, free memory) and checks
the rules a real driver enforces.  Exported POSIX handles are real memfds."""
from __future__ import annotations
import ctypes
import os
from collections import Counter
from types import SimpleNamespace
from cuda.bindings import driver as real_driver

from mok_rt.errors import CudaDriverError

MiB = 1 << 20
_attr = real_driver.CUdevice_attribute
_ht = real_driver.CUmemAllocationHandleType


class FakeDriver:
    """Enough of the CUDA driver for SymmetricHeap / Multicast / ErrorWord, with its rules checked."""

    driver = real_driver

    def __init__(self, *, gpus=("gpu0", "gpu1"), fabric=False, multicast=False, peer=True,
                 gran=2 * MiB, mc_gran=4 * MiB, fail=None, tag="p"):
        self.uuids = [g.encode().ljust(16, b"\0") for g in gpus]
        self.fabric, self.multicast_ok, self.peer = fabric, multicast, peer
        self.gran, self.mc_gran = gran, mc_gran
        self.fail = fail or {}            # call name -> fail on the n-th call (1-based)
        self.tag = tag                    # tells handles of different processes apart
        self.calls: list[str] = []
        self.log: list[tuple] = []
        self.counts: Counter = Counter()
        self.handles: dict[int, dict] = {}
        self.reservations: dict[int, int] = {}
        self.mappings: dict[int, tuple[int, int]] = {}
        self.access: dict[int, set] = {}
        self.dmem: dict[int, bytes] = {}
        self.hmem: dict[int, ctypes.Array] = {}
        self.streams: set = set()
        self.memsets: list[tuple[int, int, int]] = []
        self.retained: Counter = Counter()
        self.stack: list[int] = []
        self.total = 80 << 30
        self.used: Counter = Counter()
        self._next = 1
        self._va = 1 << 44

    # -- plumbing ----------------------------------------------------------------------------
    def init(self):
        pass

    def call(self, name, *args):
        self.calls.append(name)
        self.log.append((name, args))
        self.counts[name] += 1
        if self.fail.get(name) == self.counts[name]:
            raise CudaDriverError(name, real_driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        return getattr(self, "_" + name)(*args)

    def _id(self):
        self._next += 1
        return self._next

    def _ordinal(self, dev):
        assert isinstance(dev, tuple) and dev[0] == "dev", dev
        return dev[1]

    def _need_ctx(self):
        assert self.stack, "driver call without a current context"
        return self.stack[-1]

    def leaks(self) -> dict:
        live = {"handles": self.handles, "reservations": self.reservations, "mappings": self.mappings,
                "device allocations": self.dmem, "host allocations": self.hmem, "streams": self.streams,
                "retained contexts": +self.retained, "context stack": self.stack, "used": +self.used}
        return {k: v for k, v in live.items() if v}

    def first(self, name, pred=lambda args: True) -> int:
        return next(i for i, (n, a) in enumerate(self.log) if n == name and pred(a))

    def last(self, name, pred=lambda args: True) -> int:
        return max(i for i, (n, a) in enumerate(self.log) if n == name and pred(a))

    # -- devices and contexts ------------------------------------------------------------------
    def _cuDeviceGetCount(self):
        return len(self.uuids)

    def _cuDeviceGet(self, o):
        if not 0 <= o < len(self.uuids):
            raise CudaDriverError("cuDeviceGet", real_driver.CUresult.CUDA_ERROR_INVALID_DEVICE)
        return ("dev", o)

    def _cuDeviceGetUuid(self, dev):
        return SimpleNamespace(bytes=self.uuids[self._ordinal(dev)])

    def _cuDeviceGetAttribute(self, a, dev):
        self._ordinal(dev)
        return {_attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: 1,
                _attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: 1,
                _attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: int(self.fabric),
                _attr.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: int(self.multicast_ok)}[a]

    def _cuDeviceCanAccessPeer(self, a, b):
        assert self._ordinal(a) != self._ordinal(b)
        return int(self.peer)

    def _cuDevicePrimaryCtxRetain(self, dev):
        self.retained[self._ordinal(dev)] += 1
        return ("ctx", self._ordinal(dev))

    def _cuDevicePrimaryCtxRelease(self, dev):
        self.retained[self._ordinal(dev)] -= 1
        assert self.retained[self._ordinal(dev)] >= 0

    def _cuCtxPushCurrent(self, ctx):
        assert self.retained[ctx[1]] > 0, "pushing a context nobody retained"
        self.stack.append(ctx[1])

    def _cuCtxPopCurrent(self):
        return ("ctx", self.stack.pop())

    def _cuCtxSynchronize(self):
        self._need_ctx()

    def _cuStreamSynchronize(self, s):
        pass

    def _cuStreamCreate(self, flags):
        self._need_ctx()
        h = ("stream", self._id())
        self.streams.add(h)
        return h

    def _cuStreamDestroy(self, h):
        self.streams.remove(h)

    # -- physical memory -------------------------------------------------------------------------
    def _cuMemGetAllocationGranularity(self, prop, flag):
        assert prop.location.type == real_driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        return self.gran

    def _cuMemCreate(self, size, prop, flags):
        self._need_ctx()
        assert size % self.gran == 0 and flags == 0
        assert prop.type == real_driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        d = prop.location.id
        h = self._id()
        self.handles[h] = {"kind": "mem", "size": size, "device": d, "types": int(prop.requestedHandleTypes),
                           "identity": f"{self.tag}:{h}", "owned": True}
        self.used[d] += size
        return h

    def _identity_of(self, h):
        return self.handles[h]["identity"]

    def _cuMemExportToShareableHandle(self, h, kind, flags):
        info = self.handles[h]
        assert info["types"] & int(kind) or info["kind"] == "mc", "export of a type not requested at creation"
        text = f"{info['identity']}|{info['size']}|{info['kind']}"
        if kind == _ht.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
            fd = os.memfd_create("fake-cuda-handle")
            os.write(fd, text.encode())
            return fd
        assert kind == _ht.CU_MEM_HANDLE_TYPE_FABRIC
        fh = real_driver.CUmemFabricHandle()
        fh.data = text.encode().ljust(64, b"\0")
        return fh

    def _cuMemImportFromShareableHandle(self, os_handle, kind):
        if kind == _ht.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
            text = os.pread(os_handle, 256, 0).decode()
        else:
            assert kind == _ht.CU_MEM_HANDLE_TYPE_FABRIC
            text = ctypes.string_at(os_handle, 64).rstrip(b"\0").decode()
        identity, size, what = text.split("|")
        h = self._id()
        self.handles[h] = {"kind": what, "size": int(size), "device": None, "types": int(kind),
                           "identity": identity, "owned": False}
        return h

    def _cuMemRelease(self, h):
        info = self.handles.pop(h)
        assert not any(mh == h for _, mh in self.mappings.values()), "released while still mapped"
        if info["kind"] == "mc":
            assert not info.get("bound"), "multicast released while devices are still bound"
        if info["owned"] and info["kind"] == "mem":
            self.used[info["device"]] -= info["size"]

    # -- virtual memory ----------------------------------------------------------------------------
    def _cuMemAddressReserve(self, size, align, addr, flags):
        assert size % self.gran == 0 and align % self.gran == 0 and addr == 0
        va = -(-self._va // align) * align
        self._va = va + size + self.gran
        self.reservations[va] = size
        return va

    def _cuMemAddressFree(self, va, size):
        assert self.reservations.pop(va) == size
        assert not any(va <= m < va + size for m in self.mappings), "range freed while still mapped"

    def _reservation_of(self, va, size):
        for base, n in self.reservations.items():
            if base <= va and va + size <= base + n:
                return base
        raise AssertionError(f"{va:#x}+{size} is not inside a reservation")

    def _cuMemMap(self, va, size, offset, h, flags):
        self._reservation_of(va, size)
        assert offset == 0 and flags == 0 and self.handles[h]["size"] == size
        assert not any(m < va + size and va < m + n for m, (n, _) in self.mappings.items()), "overlapping map"
        self.mappings[va] = (size, h)

    def _cuMemUnmap(self, va, size):
        assert self.mappings.pop(va)[0] == size
        self.access.pop(va, None)

    def _cuMemSetAccess(self, va, size, descs, count):
        assert va in self.mappings and self.mappings[va][0] == size and len(descs) == count
        for d in descs:
            assert d.flags == real_driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access.setdefault(va, set()).update(d.location.id for d in descs)

    def _cuMemsetD32Async(self, ptr, value, n, stream):
        assert stream in self.streams
        self._need_ctx()
        assert len(self.dmem[ptr]) == 4 * n
        self.dmem[ptr] = int(value).to_bytes(4, "little") * n

    def _cuMemcpyDtoHAsync(self, dst, src, n, stream):
        assert stream in self.streams
        ctypes.memmove(dst, self.dmem[src], n)

    def _cuMemsetD32(self, ptr, value, n):
        dev = self._need_ctx()
        base = next(m for m, (size, _) in self.mappings.items() if m <= ptr and ptr + 4 * n <= m + size)
        assert dev in self.access.get(base, ()), "memset from a device without access"
        self.memsets.append((ptr, value, n))

    def _cuMemAlloc(self, n):
        self._need_ctx()
        p = self._id() << 20
        self.dmem[p] = bytes(n)
        return p

    def _cuMemcpyHtoD(self, dst, src, n):
        assert len(self.dmem[dst]) == n
        self.dmem[dst] = ctypes.string_at(src, n)

    def _cuMemFree(self, p):
        self._need_ctx()
        del self.dmem[p]

    def _cuMemHostAlloc(self, n, flags):
        self._need_ctx()
        assert flags == real_driver.CU_MEMHOSTALLOC_DEVICEMAP | real_driver.CU_MEMHOSTALLOC_PORTABLE
        buf = (ctypes.c_char * n)()
        ctypes.memset(buf, 0x5A, n)  # garbage: the owner must clear it
        self.hmem[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def _cuMemHostGetDevicePointer(self, p, flags):
        assert p in self.hmem and flags == 0
        return p

    def _cuMemFreeHost(self, p):
        del self.hmem[p]

    # -- multicast ---------------------------------------------------------------------------------
    def _cuMulticastGetGranularity(self, prop, flag):
        assert flag == real_driver.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED
        return self.mc_gran

    def _cuMulticastCreate(self, prop):
        self._need_ctx()
        assert prop.size % self.mc_gran == 0 and prop.numDevices >= 1
        h = self._id()
        self.handles[h] = {"kind": "mc", "size": prop.size, "device": None, "types": int(prop.handleTypes),
                           "identity": f"{self.tag}:{h}", "owned": True, "devices": [], "bound": [],
                           "num": prop.numDevices}
        return h

    def _cuMulticastAddDevice(self, h, dev):
        info = self.handles[h]
        assert info["kind"] == "mc" and not info.get("bound"), "device added after a bind"
        info.setdefault("devices", []).append(self._ordinal(dev))

    def _cuMulticastBindMem(self, h, mc_off, mem, mem_off, size, flags):
        info = self.handles[h]
        assert mc_off == 0 and mem_off == 0 and flags == 0
        assert size % self.mc_gran == 0 and size == info["size"] == self.handles[mem]["size"]
        d = self.handles[mem]["device"]
        assert d in info["devices"], "bind on a device that was not added"
        info.setdefault("bound", []).append(d)

    def _cuMulticastUnbind(self, h, dev, off, size):
        info = self.handles[h]
        info["bound"].remove(self._ordinal(dev))
