"""DLPack producers that order a consumer after their framework's *current stream*.

DLPack has a consumer pass its stream ``s`` to ``__dlpack__(stream=s)`` and the producer make
``s`` wait for its pending writes.  CuPy's ``ndarray`` and torch's ``Tensor`` do it the same way
whichever array is exported: ``s`` waits for an event recorded on their current stream (nothing
when ``s`` is that stream).  Their "pending writes" are the current stream's work, not the
array's.

So when one mok_rt call imports several such arrays of one framework, the first export orders
all of them, and the others are exported with ``stream=-1`` (no synchronisation): one event per
call and framework instead of one per tensor (a layer step imports seven).  That holds because
the framework's current stream can neither change nor gain work between those imports: they run
back to back on this thread, inside mok_rt, which enqueues nothing on it (a current stream is
per thread; another thread writing an input during the call races with the call either way).
Producers that order per array (JAX, a mok_rt Tensor, anything not listed here) get the stream
on every import.

Only the exact classes are listed (``cupy.ndarray``; ``torch.Tensor`` and ``torch.nn.Parameter``
on a CUDA device): a subclass may export differently.  The frameworks are never imported here:
an instance of their class means they already are.

:func:`immutable_framework` names producers whose arrays must never be written through DLPack
(JAX's): a consumer cannot tell from the capsule, because a legacy (pre-1.0) capsule has no
read-only flag and jax exports legacy ones.
"""
from __future__ import annotations

import sys

__all__ = ["current_stream_framework", "immutable_framework"]

_UNSEEN = object()
_MAX_TYPES = 64
_by_type: dict = {}   # type -> "cupy", "torch" or None (made from the type alone, once)


def current_stream_framework(obj) -> str | None:
    """``"cupy"`` or ``"torch"`` when ``obj``'s ``__dlpack__(stream=s)`` makes ``s`` wait for
    that framework's current stream (a CUDA array of one of the classes above), else None."""
    tp = type(obj)
    fw = _by_type.get(tp, _UNSEEN)
    if fw is _UNSEEN:
        if len(_by_type) >= _MAX_TYPES:   # bounded: types made on the fly are not kept forever
            _by_type.clear()
        fw = _by_type[tp] = _classify(tp)
    if fw == "torch" and not obj.is_cuda:   # a host tensor takes no stream at all
        return None
    return fw


def _classify(tp) -> str | None:
    cupy = sys.modules.get("cupy")
    if cupy is not None and tp is getattr(cupy, "ndarray", None):
        return "cupy"
    torch = sys.modules.get("torch")
    if torch is not None and (tp is getattr(torch, "Tensor", None)
                              or tp is getattr(getattr(torch, "nn", None), "Parameter", None)):
        return "torch"
    return None


_immutable_by_type: dict = {}   # type -> "jax" or None


def immutable_framework(obj) -> str | None:
    """``"jax"`` when ``obj`` is a JAX array, which is immutable: JAX may share its buffer between
    arrays, cache it or donate it, so writing through a DLPack view of it corrupts values JAX
    still uses.  None otherwise (writability is then the capsule's read-only flag)."""
    tp = type(obj)
    fw = _immutable_by_type.get(tp, _UNSEEN)
    if fw is _UNSEEN:
        if len(_immutable_by_type) >= _MAX_TYPES:
            _immutable_by_type.clear()
        fw = _immutable_by_type[tp] = _classify_immutable(tp)
    return fw


def _classify_immutable(tp) -> str | None:
    jax = sys.modules.get("jax")
    array = getattr(jax, "Array", None) if jax is not None else None
    # jax.Array is the base class of JAX's concrete array type(s) (jaxlib's ArrayImpl), which is
    # private and has moved between modules: a subclass test against the public base is the exact
    # check on the type, not duck typing.  Unlike the stream classes above, a subclass is included:
    # immutability is part of jax.Array's contract, not of how one class exports.
    if isinstance(array, type) and issubclass(tp, array):
        return "jax"
    return None
