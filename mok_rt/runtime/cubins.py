"""Loading precompiled cubins and looking up their kernels.

Cubins live in ``mok_rt/cubins/<stem>.<target>.cubin`` (built by ``python -m mok_rt.build``).
A cubin is loaded once per process as a context-independent CUDA library (``cuLibraryLoadData``),
so one load serves every device of the same target; kernels are ``CUkernel`` handles that
``cuLaunchKernelEx`` accepts directly.
"""
from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from mok_rt.runtime import driver as _driver
from mok_rt.runtime.driver import call, driver
from mok_rt.errors import NoCubinError

CUBIN_DIR = Path(__file__).resolve().parent.parent / "cubins"
_lock = threading.Lock()


def target_for_capability(major: int, minor: int) -> str:
    """The cubin target that runs on a device of this compute capability."""
    # Hopper's wgmma/TMA path needs the architecture-specific 'a' target.
    if (major, minor) == (9, 0):
        return "sm_90a"
    return f"sm_{major}{minor}"


def available_targets() -> list[str]:
    """Targets for which the manifest lists cubins."""
    manifest = CUBIN_DIR / "manifest.json"
    if not manifest.exists():
        return []
    data = json.loads(manifest.read_text())
    return sorted({entry["target"] for entry in data.get("cubins", [])})


@functools.lru_cache(maxsize=None)
def device_capability(device_id: int) -> tuple[int, int]:
    _driver.init()
    dev = call("cuDeviceGet", device_id)
    attr = driver.CUdevice_attribute
    major = call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    minor = call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    return int(major), int(minor)


@functools.lru_cache(maxsize=None)
def device_name(device_id: int) -> str:
    _driver.init()
    dev = call("cuDeviceGet", device_id)
    raw = call("cuDeviceGetName", 256, dev)
    return raw.split(b"\0", 1)[0].decode(errors="replace")


@functools.lru_cache(maxsize=None)
def _library(stem: str, target: str):
    path = CUBIN_DIR / f"{stem}.{target}.cubin"
    if not path.exists():
        raise NoCubinError(f"no cubin {path.name} in {CUBIN_DIR}")
    return _library_at(str(path))


@functools.lru_cache(maxsize=None)
def _library_at(path: str):
    _driver.init()
    data = Path(path).read_bytes()
    # Keep the bytes referenced for the library's lifetime (the driver may read them lazily).
    lib = call("cuLibraryLoadData", data, None, None, 0, None, None, 0)
    return lib, data


@dataclass(frozen=True)
class Kernel:
    """A kernel of a loaded cubin: the ``CUkernel`` handle plus where it came from."""

    handle: object
    stem: str
    name: str
    target: str

    @property
    def address(self) -> int:
        return int(self.handle)


def get_kernel(stem: str, name: str, device_id: int) -> Kernel:
    """The kernel ``name`` of cubin ``stem`` for device ``device_id``.

    Raises :class:`NoCubinError` naming the device and the targets that exist when there is no
    cubin for the device's compute capability.
    """
    major, minor = device_capability(device_id)
    target = target_for_capability(major, minor)
    with _lock:
        try:
            lib, _ = _library(stem, target)
        except NoCubinError:
            targets = available_targets()
            raise NoCubinError(
                f"mok_rt has no '{stem}' kernel for device {device_id} ({device_name(device_id)}, "
                f"compute capability {major}.{minor}, needs target {target}); cubins exist for: "
                f"{', '.join(targets) or 'none'}. Rebuild with `python -m mok_rt.build --target {target}` "
                f"if your nvcc supports it."
            ) from None
        handle = _kernel_handle(lib, name, device_id)
    return Kernel(handle=handle, stem=stem, name=name, target=target)


def get_kernel_at(path, name: str, device_id: int) -> Kernel:
    """The kernel ``name`` of the cubin at ``path`` (a cubin built outside the package, e.g. by
    the test suite's probes) for device ``device_id``."""
    path = Path(path).resolve()
    stem, _, target = path.name.removesuffix(".cubin").partition(".")
    with _lock:
        lib, _ = _library_at(str(path))
        handle = _kernel_handle(lib, name, device_id)
    return Kernel(handle=handle, stem=stem, name=name, target=target)


_handles: dict[tuple[int, str], object] = {}
_loaded: set[tuple[int, str, int]] = set()


def _kernel_handle(lib, name: str, device_id: int):
    key = (int(lib), name)
    h = _handles.get(key)
    if h is None:
        h = call("cuLibraryGetKernel", lib, name.encode())
        _handles[key] = h
    if (*key, device_id) not in _loaded:
        # Load the code into the device's primary context now.  With lazy loading, a first launch
        # would load it then, and loading can wait for running kernels: a persistent kernel spinning
        # for a peer that has not launched yet would never finish.
        from mok_rt.runtime.device import activate
        activate(device_id)
        call("cuKernelGetFunction", h)
        _loaded.add((*key, device_id))
    return h
