"""SymmetricHeap, multicast and the error word against a fake CUDA driver (CPU).

The fake keeps the driver's bookkeeping (handles, reservations, mappings, access, contexts, free
memory) and checks the rules a real driver enforces (map inside a reservation, unmap before
freeing the range, bind only added devices ...), so these tests pin down call order, rounding
and teardown without a GPU.  Exported POSIX handles are real memfds, so two real processes
exchange them over the real socket path.
"""
from __future__ import annotations

import ctypes
import os
from collections import Counter

import numpy as np
import pytest
from cuda.bindings import driver as real_driver
from test_group import RankFailure, assert_ok, run_ranks

from mok_rt.runtime import errorword as _errorword
from mok_rt.runtime.errorword import ErrorWord
from mok_rt.dist.multicast import Multicast
from mok_rt.errors import ArgumentError, CudaDriverError, MokError, PeerTimeoutError
from mok_rt.dist.group import SingleProcessGroup
from mok_rt.dist.symmetric import SignalPad, SymmetricHeap

MiB = 1 << 20
_attr = real_driver.CUdevice_attribute
_ht = real_driver.CUmemAllocationHandleType


from fake_driver import FakeDriver  # noqa: E402

# ---------------------------------------------------------------------------------------------
# One process, several ranks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("devices", [[0, 1], [0, 0], [1]])
def test_one_process_heap_maps_every_block(devices):
    fake = FakeDriver()
    heap = SymmetricHeap(SingleProcessGroup(devices), 1000, _api=fake)
    P = len(devices)
    assert heap.handle_type == "none" and heap.block_bytes == 2 * MiB
    assert heap.control_offset == 1024  # user bytes rounded to 256, then the signal pad
    ptrs = heap.peer_ptrs(0)
    assert ptrs == [ptrs[0] + r * heap.block_bytes for r in range(P)]
    for r in range(P):
        assert heap.peer_ptrs(r) == ptrs and heap.local_ptr(r) == ptrs[r]
        # the device array holds the same addresses
        arr = np.frombuffer(fake.dmem[heap.peer_ptr_array(r)], dtype=np.uint64)
        assert arr.tolist() == ptrs
    # every block is mapped once and open to every local device
    assert sorted(fake.mappings) == ptrs
    assert all(fake.access[p] == set(devices) for p in ptrs)
    # nothing is exported inside one process
    assert "cuMemExportToShareableHandle" not in fake.calls and "cuMemImportFromShareableHandle" not in fake.calls
    assert all(info["types"] == 0 for info in fake.handles.values())
    # each rank's signal pad was zeroed: 1 + P words at the control offset
    assert sorted(fake.memsets) == [(p + heap.control_offset, 0, 1 + P) for p in ptrs]
    assert fake.used == Counter({d: 2 * MiB * devices.count(d) for d in set(devices)})
    heap.close()
    assert fake.leaks() == {}
    # teardown order: unmap every block, then free the range, then release the handles
    assert fake.last("cuMemUnmap") < fake.first("cuMemAddressFree") < fake.first("cuMemRelease")
    n = len(fake.calls)
    heap.close()  # idempotent
    assert len(fake.calls) == n
    with pytest.raises(MokError, match="closed"):
        heap.local_ptr(0)


def test_granularity_rounding_and_context_manager():
    fake = FakeDriver(gran=4 * MiB)
    with SymmetricHeap(SingleProcessGroup([0, 1]), 4 * MiB, _api=fake) as heap:
        # 4 MiB of user data plus the pad no longer fit in one granule
        assert heap.block_bytes == 8 * MiB and heap.granularity == 4 * MiB
        assert heap.nbytes == 4 * MiB and heap.control_offset == 4 * MiB
    assert fake.leaks() == {}


def test_default_path_never_creates_multicast():
    fake = FakeDriver(multicast=True)
    with SymmetricHeap(SingleProcessGroup([0, 1]), 123, _api=fake) as heap:
        assert heap.multicast is False
        with pytest.raises(ArgumentError, match="multicast=False"):
            heap.multicast_ptr(0)
    assert not [c for c in fake.calls if c.startswith("cuMulticast")]


def test_queries_name_bad_ranks():
    fake = FakeDriver()
    with SymmetricHeap(SingleProcessGroup([0, 1]), 64, _api=fake) as heap:
        for bad in (2, -1, "0"):
            with pytest.raises(ArgumentError) as e:
                heap.peer_ptrs(bad)
            assert e.value.argument == "rank"


@pytest.mark.parametrize("kwargs, argument", [
    (dict(nbytes=0), "nbytes"), (dict(nbytes=-5), "nbytes"), (dict(nbytes=1.5), "nbytes"),
    (dict(nbytes=True), "nbytes"), (dict(handle_type="ipc"), "handle_type"),
    (dict(multicast=1), "multicast"), (dict(timeout_s=0), "timeout_s"), (dict(timeout_s=float("inf")), "timeout_s"),
])
def test_argument_validation(kwargs, argument):
    fake = FakeDriver()
    args = dict(nbytes=1024)
    args.update(kwargs)
    with pytest.raises(ArgumentError) as e:
        SymmetricHeap(SingleProcessGroup([0]), args.pop("nbytes"), _api=fake, **args)
    assert e.value.argument == argument
    assert fake.leaks() == {}


def test_group_must_be_a_process_group():
    with pytest.raises(ArgumentError, match="ProcessGroup"):
        SymmetricHeap([0, 1], 64, _api=FakeDriver())


def test_unreachable_peer_is_reported():
    fake = FakeDriver(peer=False)
    match = r"rank 0 \(cuda:0\) cannot access .* rank 1 \(cuda:1\).*cuDeviceCanAccessPeer"
    with pytest.raises(ArgumentError, match=match):
        SymmetricHeap(SingleProcessGroup([0, 1]), 64, _api=fake)
    assert fake.leaks() == {}
    # the same GPU twice needs no peer path
    SymmetricHeap(SingleProcessGroup([0, 0]), 64, _api=fake).close()
    assert fake.leaks() == {}


def test_fabric_requested_but_unsupported():
    fake = FakeDriver(fabric=False)
    with pytest.raises(ArgumentError, match="FABRIC") as e:
        SymmetricHeap(SingleProcessGroup([0, 1]), 64, handle_type="fabric", _api=fake)
    assert e.value.argument == "handle_type" and fake.leaks() == {}


def test_fabric_in_one_process_allocates_fabric_handles():
    fake = FakeDriver(fabric=True)
    with SymmetricHeap(SingleProcessGroup([0, 1]), 64, handle_type="fabric", _api=fake) as heap:
        assert heap.handle_type == "fabric"
        assert all(i["types"] == int(_ht.CU_MEM_HANDLE_TYPE_FABRIC) for i in fake.handles.values())
        assert "cuMemExportToShareableHandle" not in fake.calls
    assert fake.leaks() == {}


def test_missing_device_is_a_driver_error():
    fake = FakeDriver(gpus=("gpu0",))
    with pytest.raises(CudaDriverError, match="cuDeviceGet"):
        SymmetricHeap(SingleProcessGroup([0, 3]), 64, _api=fake)
    assert fake.leaks() == {}


@pytest.mark.parametrize("call, nth", [("cuMemCreate", 2), ("cuMemMap", 2), ("cuMemSetAccess", 1),
                                       ("cuMemsetD32", 2), ("cuMemAlloc", 2), ("cuMemcpyHtoD", 1),
                                       ("cuMemAddressReserve", 1), ("cuStreamCreate", 2)])
def test_failure_midway_releases_everything(call, nth):
    fake = FakeDriver(fail={call: nth})
    with pytest.raises(CudaDriverError, match=call):
        SymmetricHeap(SingleProcessGroup([0, 1]), 64, _api=fake)
    assert fake.leaks() == {}


def test_teardown_failure_still_releases_the_rest():
    fake = FakeDriver()
    heap = SymmetricHeap(SingleProcessGroup([0, 1]), 64, _api=fake)
    fake.fail = {"cuMemUnmap": fake.counts["cuMemUnmap"] + 1}
    with pytest.raises(CudaDriverError, match="cuMemUnmap"):
        heap.close()
    leaks = fake.leaks()
    # only the mapping whose unmap failed (and what that pins: its range, its handle) remains
    assert len(leaks["mappings"]) == 1 and "device allocations" not in leaks and "retained contexts" not in leaks


def test_signal_pad_and_error_words():
    fake = FakeDriver()
    with SymmetricHeap(SingleProcessGroup([0, 0]), 4096, _api=fake) as heap:
        assert heap.signal_pad == SignalPad(heap, heap.control_offset) and heap.signal_pad.nbytes == 12
        SignalPad(heap, 0)  # a pad in the user region is fine
        for bad in (2, -4, heap.block_bytes - 8, "0"):
            with pytest.raises(ArgumentError, match="signal pad"):
                SignalPad(heap, bad)
        ew = heap.error_word(1)
        assert heap.error_word(1) is ew and ew.read() == (0, 0, 0, 0)
        n = len(fake.memsets)
        heap.reset_signal_pad()
        assert len(fake.memsets) == n + 2
    assert fake.leaks() == {}  # the heap closed its error words


def test_as_tensor_checks_bounds():
    fake = FakeDriver()
    with SymmetricHeap(SingleProcessGroup([0, 1]), 4096, _api=fake) as heap:
        for kwargs, argument in [(dict(shape=(1025,)), "shape"), (dict(shape=(2, -1)), "shape"),
                                 (dict(shape=(4,), offset=2), "offset"), (dict(shape=(1024,), offset=4), "shape"),
                                 (dict(shape=(4,), peer=2), "peer")]:
            with pytest.raises(ArgumentError) as e:
                heap.as_tensor(0, "float32", **kwargs)
            assert e.value.argument == argument
        with pytest.raises(ArgumentError) as e:
            heap.as_tensor(0, "complex512", (4,))
        assert e.value.argument == "dtype"


def test_as_tensor_wraps_the_block():
    tensor = pytest.importorskip("mok_rt.interop.tensor")
    calls = []

    def fake_from_pointer(ptr, shape, dtype, device_id, owner, stream=None):
        calls.append((ptr, shape, dtype.name, device_id, owner))
        return "tensor"

    fake = FakeDriver()
    with SymmetricHeap(SingleProcessGroup([0, 1]), 4096, _api=fake) as heap:
        orig = tensor.Tensor._from_pointer
        tensor.Tensor._from_pointer = staticmethod(fake_from_pointer)
        try:
            assert heap.as_tensor(1, "bfloat16", (16, 8), offset=256) == "tensor"
            heap.as_tensor(1, "float32", 4, peer=0)
        finally:
            tensor.Tensor._from_pointer = orig
        assert calls[0] == (heap.local_ptr(1) + 256, (16, 8), "bfloat16", 1, heap)
        assert calls[1][0] == heap.peer_ptrs(1)[0] and calls[1][3] == 1
        # and the real thing: a typed CUDA tensor over the block (nothing touches the memory here)
        t = heap.as_tensor(1, "float32", (4, 2), offset=16)
        assert t.ptr == heap.local_ptr(1) + 16 and t.shape == (4, 2) and t.dtype.name == "float32"
        assert t.__dlpack_device__() == (2, 1)  # kDLCUDA, device 1
        del t
    assert fake.leaks() == {}


# ---------------------------------------------------------------------------------------------
# Multicast (opt-in), against the fake only
# ---------------------------------------------------------------------------------------------


def test_multicast_call_order_rounding_and_teardown():
    fake = FakeDriver(multicast=True, gran=2 * MiB, mc_gran=8 * MiB)
    heap = SymmetricHeap(SingleProcessGroup([0, 1]), 1000, multicast=True, _api=fake)
    assert heap.block_bytes == 8 * MiB  # rounded to the multicast granularity, not just 2 MiB
    mc = next(h for h, i in fake.handles.items() if i["kind"] == "mc")
    info = fake.handles[mc]
    assert info["devices"] == [0, 1] and sorted(info["bound"]) == [0, 1] and info["num"] == 2
    assert info["types"] == 0  # nothing to export in one process
    va = heap.multicast_ptr(0)
    assert heap.multicast_ptr(1) == va and fake.access[va] == {0, 1}
    c = fake.first
    assert c("cuMulticastGetGranularity") < c("cuMemCreate")
    assert c("cuMulticastCreate") < c("cuMulticastAddDevice") < c("cuMulticastBindMem")
    assert fake.last("cuMulticastAddDevice") < c("cuMulticastBindMem")
    assert fake.last("cuMulticastBindMem") < c("cuMemMap", lambda a: a[3] == mc)
    heap.close()
    assert fake.leaks() == {}
    L = fake.last
    unmap_mc = L("cuMemUnmap", lambda a: a[0] == va)
    free_mc = L("cuMemAddressFree", lambda a: a[0] == va)
    release_mc = L("cuMemRelease", lambda a: a[0] == mc)
    assert unmap_mc < free_mc < c("cuMulticastUnbind") <= L("cuMulticastUnbind") < release_mc
    assert L("cuMemRelease", lambda a: a[0] == mc) < c("cuMemRelease", lambda a: a[0] != mc)


@pytest.mark.parametrize("call", ["cuMulticastCreate", "cuMulticastAddDevice", "cuMulticastBindMem", "cuMemMap"])
def test_multicast_failure_releases_everything(call):
    nth = 3 if call == "cuMemMap" else 1  # the multicast map comes after the two blocks
    fake = FakeDriver(multicast=True, fail={call: nth})
    with pytest.raises(CudaDriverError, match=call):
        SymmetricHeap(SingleProcessGroup([0, 1]), 1000, multicast=True, _api=fake)
    assert fake.leaks() == {}


def test_multicast_validation():
    with pytest.raises(ArgumentError, match="do not support multicast") as e:
        SymmetricHeap(SingleProcessGroup([0, 1]), 64, multicast=True, _api=FakeDriver(multicast=False))
    assert e.value.argument == "multicast"
    with pytest.raises(ArgumentError, match="share a GPU"):
        SymmetricHeap(SingleProcessGroup([0, 0]), 64, multicast=True, _api=FakeDriver(multicast=True))


def test_multicast_module_alone():
    fake = FakeDriver(multicast=True)
    fake.retained[0] += 1
    fake.stack.append(0)
    assert Multicast.granularity(fake, num_devices=2, size=MiB, handle_type=0) == 4 * MiB
    mc = Multicast(fake, num_devices=1, size=4 * MiB, handle_type=0)
    mc.create()
    mc.close()
    mc.close()
    assert fake.calls[-2:] == ["cuMulticastCreate", "cuMemRelease"]


# ---------------------------------------------------------------------------------------------
# The error word
# ---------------------------------------------------------------------------------------------


def test_error_word_reads_and_raises():
    fake = FakeDriver()
    ew = ErrorWord(1, _api=fake)
    assert ew.read() == (0, 0, 0, 0)  # cleared despite the allocator's garbage
    assert ew.device_ptr in fake.dmem and fake.retained[1] == 1   # device memory, not host-mapped

    class _Words:   # writes land in the fake device allocation, as a kernel's would
        def __setitem__(self, i, v):
            vals = list(ctypes.cast(fake.dmem[ew.device_ptr], ctypes.POINTER(ctypes.c_int32))[:4])
            if isinstance(i, slice):
                vals[i] = v
            else:
                vals[i] = v
            fake.dmem[ew.device_ptr] = bytes((ctypes.c_int32 * 4)(*vals))

    ew.raise_if_set("x")
    words = _Words()
    words[:] = [_errorword.ERR_TIMEOUT, 0, 1, 7]
    with pytest.raises(PeerTimeoutError, match="rank 0 timed out waiting for rank 1") as e:
        ew.raise_if_set("barrier")
    assert e.value.rank == 1 and e.value.info == (0, 1, 7) and e.value.code == 3
    for code, cls in [(1, "ExpertIdError"), (2, "CapacityError"), (4, "TokenCountError"), (5, "DeviceError"),
                      (99, "DeviceError")]:
        words[0] = code
        with pytest.raises(Exception) as e:
            ew.raise_if_set("k")
        assert type(e.value).__name__ == cls
    ew.clear()
    assert ew.read() == (0, 0, 0, 0)
    ew.close()
    ew.close()
    assert fake.leaks() == {} and ew.closed
    with pytest.raises(MokError, match="closed"):
        ew.read()


def test_error_word_validates_device():
    with pytest.raises(ArgumentError):
        ErrorWord(-1, _api=FakeDriver())


# ---------------------------------------------------------------------------------------------
# Several processes: the real exchange path with fake GPUs
# ---------------------------------------------------------------------------------------------


def _heap_worker(ctx, kwargs, fake_kwargs, nbytes_by_rank=None):
    gpus = fake_kwargs.pop("gpus_by_rank", None)
    fake = FakeDriver(tag=f"p{ctx.rank}", **(dict(gpus=gpus[ctx.rank]) if gpus else {}), **fake_kwargs)
    group = ctx.group(device_id=0)
    fds_before = len(os.listdir("/proc/self/fd"))
    nbytes = nbytes_by_rank[ctx.rank] if nbytes_by_rank else 3000
    try:
        heap = SymmetricHeap(group, nbytes, _api=fake, timeout_s=20, **kwargs)
    except BaseException:
        assert fake.leaks() == {}, fake.leaks()
        raise
    # which allocation ended up at each slot of the range
    ident = [fake.handles[fake.mappings[p][1]]["identity"] for p in heap.peer_ptrs(ctx.rank)]
    out = {"handle_type": heap.handle_type, "identities": ident, "calls": list(fake.calls),
           "mc": [fake.handles[h]["identity"] for h, i in fake.handles.items() if i["kind"] == "mc"],
           "fds_open": len(os.listdir("/proc/self/fd")) - fds_before}
    heap.close()
    out["leaks"] = fake.leaks()
    return out


@pytest.mark.parametrize("nproc", [2, 3])
def test_processes_exchange_posix_handles(nproc):
    res = assert_ok(run_ranks(_heap_worker, nproc, {}, {"gpus": ("gpu0",)}))
    for v in res:
        assert v["handle_type"] == "posix_fd"
        # slot q holds process q's own allocation, imported from its descriptor
        assert [i.split(":")[0] for i in v["identities"]] == [f"p{q}" for q in range(nproc)]
        assert v["calls"].count("cuMemExportToShareableHandle") == 1
        assert v["calls"].count("cuMemImportFromShareableHandle") == nproc - 1
        assert v["fds_open"] == 0 and v["leaks"] == {}
        assert not [c for c in v["calls"] if c.startswith("cuMulticast")]
    # every process agrees which allocation is whose
    assert len({tuple(v["identities"]) for v in res}) == 1


def test_processes_exchange_fabric_handles():
    res = assert_ok(run_ranks(_heap_worker, 2, {"handle_type": "fabric"}, {"fabric": True}))
    for v in res:
        assert v["handle_type"] == "fabric" and v["leaks"] == {}
        assert [i.split(":")[0] for i in v["identities"]] == ["p0", "p1"]


def test_processes_must_agree_on_size():
    res = run_ranks(_heap_worker, 2, {}, {}, [4096, 8192])
    assert all(isinstance(v, RankFailure) and v.type_name == "ArgumentError" for v in res)
    assert "nbytes: rank 1 asked for nbytes=8192 but rank 0 for 4096" in res[0].message


def test_failure_on_one_process_fails_all():
    res = run_ranks(_failing_create_worker, 2)
    assert isinstance(res[1], RankFailure) and res[1].type_name == "CudaDriverError"
    assert isinstance(res[0], RankFailure) and res[0].type_name == "MokError"
    assert "create blocks: process 1 failed: CudaDriverError: cuMemCreate" in res[0].message


def _failing_create_worker(ctx):
    fake_kwargs = {"fail": {"cuMemCreate": 1}} if ctx.rank == 1 else {}
    return _heap_worker(ctx, {}, fake_kwargs)


def test_processes_build_multicast_through_the_exchange():
    res = assert_ok(run_ranks(_heap_worker, 2, {"multicast": True},
                              {"multicast": True, "gpus_by_rank": [("gpu0",), ("gpu1",)]}))
    for r, v in enumerate(res):
        assert v["leaks"] == {} and v["fds_open"] == 0
        assert v["mc"] == ["p0:" + res[0]["mc"][0].split(":")[1]]  # process 0's object, everywhere
        assert v["calls"].count("cuMulticastCreate") == (1 if r == 0 else 0)
        assert v["calls"].count("cuMulticastAddDevice") == 1 and v["calls"].count("cuMulticastBindMem") == 1
