"""Checked access to the CUDA driver API (cuda.bindings.driver).

``call("cuMemAlloc", size)`` runs ``driver.cuMemAlloc(size)``, raises :class:`CudaDriverError`
naming the call and the CUresult when it fails, and returns the remaining results (``None``
for none, the value for one, a tuple for several).  Everything in mok_rt that talks to the
driver goes through here so that no return code is ever ignored.
"""
from __future__ import annotations

import functools

from mok_rt.errors import CudaDriverError

try:  # cuda-bindings >= 12.8 layout
    from cuda.bindings import driver as _drv
except ImportError:  # pragma: no cover - very old cuda-python
    from cuda import cuda as _drv  # type: ignore

driver = _drv
CUresult = _drv.CUresult


def check(call: str, result) -> None:
    """Raise :class:`CudaDriverError` unless ``result`` is CUDA_SUCCESS."""
    if result != CUresult.CUDA_SUCCESS:
        detail = ""
        try:
            err, s = _drv.cuGetErrorString(result)
            if err == CUresult.CUDA_SUCCESS and s:
                detail = s.decode() if isinstance(s, bytes) else str(s)
        except Exception:  # pragma: no cover - best effort only
            pass
        raise CudaDriverError(call, result, detail)


_SUCCESS = CUresult.CUDA_SUCCESS


def call(name: str, *args):
    """Call ``driver.<name>(*args)``, check its CUresult and return the other results."""
    # On the path of every launch: no slicing or helper call unless there is something to return
    # or an error to raise.
    out = getattr(_drv, name)(*args)
    if type(out) is not tuple:
        out = (out,)
    if out[0] != _SUCCESS:
        check(name, out[0])
    n = len(out)
    if n == 1:
        return None
    if n == 2:
        return out[1]
    return out[1:]


_NOT_READY = CUresult.CUDA_ERROR_NOT_READY


def ready(name: str, *args) -> bool:
    """``cuStreamQuery`` / ``cuEventQuery`` (``name``): True when the work is complete, False while
    it is not (CUDA_ERROR_NOT_READY, which :func:`call` would raise); any other result raises."""
    out = getattr(_drv, name)(*args)
    res = out[0] if type(out) is tuple else out
    if res == _NOT_READY:
        return False
    if res != _SUCCESS:
        check(name, res)
    return True


@functools.lru_cache(maxsize=None)
def init() -> None:
    """cuInit(0), once per process; a missing driver becomes a :class:`CudaDriverError`."""
    try:
        res = _drv.cuInit(0)[0]
    except Exception as ex:  # cuda.pathfinder raises when libcuda.so is not installed
        raise CudaDriverError("cuInit", None, f"no NVIDIA driver could be loaded ({ex}); "
                                              f"use backend='reference' on machines without a GPU") from ex
    check("cuInit", res)


def device_count() -> int:
    """Number of visible CUDA devices; 0 when there is no driver or no device."""
    try:
        res, n = _drv.cuInit(0)[0], None
        if res != CUresult.CUDA_SUCCESS:
            return 0
        res, n = _drv.cuDeviceGetCount()
        return int(n) if res == CUresult.CUDA_SUCCESS else 0
    except Exception:
        return 0
