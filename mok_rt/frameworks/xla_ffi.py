"""XLA FFI custom-call handlers written in Python: a ctypes mirror of XLA's FFI C API.

XLA calls an FFI handler, ``XLA_FFI_Error* handler(XLA_FFI_CallFrame*)``, with a call frame that
holds the argument and result buffers (dtype, rank, dims, data pointer), the attributes, the
execution context and a table of API functions (``XLA_FFI_Api``: the platform stream, error
creation, ...).  :func:`make_handler` turns a Python function into such a handler with
``ctypes.CFUNCTYPE`` -- no compiled extension of ours -- and :func:`capsule` wraps it in the
PyCapsule ``jax.ffi.register_ffi_target`` takes.  The Python function receives an
:class:`FfiCall`: decoded buffers, attributes, and the stream on demand.

The layouts below mirror ``xla/ffi/api/c_api.h`` API version 0.3 (jaxlib 0.10.2), x86-64 / LP64.
Compatibility rules of that header: a major version change breaks the ABI (refused here:
:class:`XlaFfiVersionError`); a minor one only appends fields to ``XLA_FFI_Api`` and to argument
structs.  So every struct XLA hands us is read only after checking its ``struct_size`` covers the
fields we read (a larger one, from a newer minor, is fine), and an ``XLA_FFI_Api`` function is
called only when the table's ``struct_size`` shows that XLA provides it.

Registration: XLA calls the handler once with a metadata extension in the call frame (and
possibly no ``api``), and refuses the handler unless the API version it reports equals XLA's own
exactly.  A ctypes handler has no compiled-in header version, so it reports the version of the
header shipped with the installed jaxlib (``jax.ffi.include_dir()``, :func:`header_api_version`),
which is XLA's, after checking its major version is the one mirrored here.  The traits say
whether XLA may capture the call in a command buffer (a CUDA graph); :func:`make_handler`
declares that only when asked.

A Python exception in the handler never crosses into XLA: it becomes an ``XLA_FFI_Error`` (its
type and message), so the XLA program fails and JAX raises.  This module does not import jax.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import dataclass, field

import numpy as np

from mok_rt.errors import ArgumentError, MokError

__all__ = ["MIRRORED_API_VERSION", "XlaFfiVersionError", "FfiBuffer", "FfiCall", "header_api_version",
           "make_handler", "capsule", "DTYPE_CODES", "TRAIT_COMMAND_BUFFER_COMPATIBLE"]

MIRRORED_API_VERSION = (0, 3)   # the c_api.h whose layouts are mirrored here

_c = ctypes
_p = _c.c_void_p

# XLA_FFI_Extension_Type, XLA_FFI_ExecutionStage, arg/ret/attr types, error codes, traits.
_EXT_METADATA = 1
_STAGE_EXECUTE = 3
_ARG_BUFFER = _RET_BUFFER = 1
_ATTR_ARRAY, _ATTR_DICT, _ATTR_SCALAR, _ATTR_STRING = 1, 2, 3, 4
ERR_INVALID_ARGUMENT, ERR_FAILED_PRECONDITION, ERR_INTERNAL, ERR_UNKNOWN = 3, 9, 13, 2
TRAIT_COMMAND_BUFFER_COMPATIBLE = 1

# XLA_FFI_DataType codes of the dtypes the MoE layer passes, as NumPy dtype names.
DTYPE_CODES = {1: "bool", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "uint8", 7: "uint16",
               8: "uint32", 9: "uint64", 10: "float16", 11: "float32", 12: "float64", 16: "bfloat16"}


class XlaFfiVersionError(MokError):
    """The XLA FFI API of the installed jaxlib has a layout this mirror does not know."""


# --------------------------------------------------------------------------- struct mirrors
class _ExtensionBase(_c.Structure):
    _fields_ = [("struct_size", _c.c_size_t), ("type", _c.c_int), ("next", _p)]


class _ApiVersion(_c.Structure):
    _fields_ = [("struct_size", _c.c_size_t), ("extension_start", _p),
                ("major_version", _c.c_int), ("minor_version", _c.c_int)]


class _ByteSpan(_c.Structure):
    _fields_ = [("ptr", _p), ("len", _c.c_size_t)]


class _Scalar(_c.Structure):
    _fields_ = [("dtype", _c.c_int), ("value", _p)]


class _Array(_c.Structure):
    _fields_ = [("dtype", _c.c_int), ("size", _c.c_size_t), ("data", _p)]


class _Buffer(_c.Structure):
    _fields_ = [("struct_size", _c.c_size_t), ("extension_start", _p), ("dtype", _c.c_int),
                ("data", _p), ("rank", _c.c_int64), ("dims", _c.POINTER(_c.c_int64))]


class _Args(_c.Structure):
    _fields_ = [("struct_size", _c.c_size_t), ("extension_start", _p), ("size", _c.c_int64),
                ("types", _c.POINTER(_c.c_int)), ("ptrs", _c.POINTER(_p))]


class _Attrs(_c.Structure):
    _fields_ = [("struct_size", _c.c_size_t), ("extension_start", _p), ("size", _c.c_int64),
                ("types", _c.POINTER(_c.c_int)), ("names", _c.POINTER(_c.POINTER(_ByteSpan))),
                ("ptrs", _c.POINTER(_p))]


class _CallFrame(_c.Structure):
    _fields_ = [("struct_size", _c.c_size_t), ("extension_start", _c.POINTER(_ExtensionBase)),
                ("api", _p), ("ctx", _p), ("stage", _c.c_int), ("args", _Args), ("rets", _Args),
                ("attrs", _Attrs), ("future", _p)]


class _Metadata(_c.Structure):
    # state_type_id (after traits) is newer than metadata itself and never written here.
    _fields_ = [("struct_size", _c.c_size_t), ("api_version", _ApiVersion), ("traits", _c.c_uint32)]


class _MetadataExtension(_c.Structure):
    _fields_ = [("extension_base", _ExtensionBase), ("metadata", _c.POINTER(_Metadata))]


class _ErrorCreateArgs(_c.Structure):
    _fields_ = [("struct_size", _c.c_size_t), ("extension_start", _p), ("message", _c.c_char_p),
                ("errc", _c.c_int)]


class _StreamGetArgs(_c.Structure):
    _fields_ = [("struct_size", _c.c_size_t), ("extension_start", _p), ("ctx", _p), ("stream", _p)]


class _DeviceOrdinalGetArgs(_c.Structure):
    _fields_ = [("struct_size", _c.c_size_t), ("extension_start", _p), ("ctx", _p),
                ("device_ordinal", _c.c_int32)]


_API_FUNCTIONS = ("Error_Create", "Error_GetMessage", "Error_Destroy", "Handler_Register", "Stream_Get",
                  "Type_Register", "ExecutionContext_Get", "State_Set", "State_Get", "DeviceMemory_Allocate",
                  "DeviceMemory_Free", "ThreadPool_Schedule", "ThreadPool_NumThreads", "Future_Create",
                  "Future_SetAvailable", "Future_SetError", "RunId_Get", "DeviceOrdinal_Get")


class _Api(_c.Structure):
    _fields_ = [("struct_size", _c.c_size_t), ("extension_start", _p), ("api_version", _ApiVersion),
                ("internal_api", _p)] + [(n, _p) for n in _API_FUNCTIONS]


def _struct_size(cls, last: str) -> int:
    """``XLA_FFI_STRUCT_SIZE``: the offset of ``last`` plus its size (no tail padding)."""
    f = getattr(cls, last)
    return f.offset + f.size


# The sizes c_api.h 0.3 declares (XLA_FFI_DEFINE_STRUCT_TRAITS), used to check what XLA hands us
# and to fill in what we hand XLA.
SIZE_API_VERSION = _struct_size(_ApiVersion, "minor_version")
SIZE_BUFFER = _struct_size(_Buffer, "dims")
SIZE_ARGS = _struct_size(_Args, "ptrs")
SIZE_ATTRS = _struct_size(_Attrs, "ptrs")
SIZE_CALL_FRAME = _struct_size(_CallFrame, "attrs")
SIZE_METADATA = _struct_size(_Metadata, "traits")
SIZE_METADATA_EXTENSION = _struct_size(_MetadataExtension, "metadata")
SIZE_ERROR_CREATE = _struct_size(_ErrorCreateArgs, "errc")
SIZE_STREAM_GET = _struct_size(_StreamGetArgs, "stream")
SIZE_DEVICE_ORDINAL_GET = _struct_size(_DeviceOrdinalGetArgs, "device_ordinal")
# The ABI the offsets above assume (c_api.h's own numbers on LP64).
assert (SIZE_API_VERSION, SIZE_BUFFER, SIZE_ARGS, SIZE_ATTRS, SIZE_CALL_FRAME, SIZE_METADATA) == \
    (24, 48, 40, 48, 168, 36), "unexpected C ABI: mok_rt's XLA FFI mirror assumes x86-64/aarch64 LP64"

_API_FN = _c.CFUNCTYPE(_p, _p)          # every XLA_FFI_Api function we call: args* -> XLA_FFI_Error*
_HANDLER = _c.CFUNCTYPE(_p, _p)         # XLA_FFI_Handler: XLA_FFI_CallFrame* -> XLA_FFI_Error*


# --------------------------------------------------------------------------- versions
def header_api_version(include_dir: str) -> tuple[int, int]:
    """(major, minor) of ``xla/ffi/api/c_api.h`` under ``include_dir`` (``jax.ffi.include_dir()``):
    the XLA FFI API version of the jaxlib that ships the header.  Raises
    :class:`XlaFfiVersionError` when the header is missing or its major version is not mirrored."""
    path = os.path.join(include_dir, "xla", "ffi", "api", "c_api.h")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise XlaFfiVersionError(f"cannot read the XLA FFI header {path} ({e}): mok_rt needs it to report the "
                                 "FFI API version of the installed jaxlib") from None
    found = [re.search(rf"^#define\s+XLA_FFI_API_{w}\s+(\d+)", text, re.M) for w in ("MAJOR", "MINOR")]
    if not all(found):
        raise XlaFfiVersionError(f"{path} defines no XLA_FFI_API_MAJOR / XLA_FFI_API_MINOR")
    version = (int(found[0].group(1)), int(found[1].group(1)))
    check_api_version(version, where=path)
    return version


def check_api_version(version: tuple[int, int], *, where: str) -> None:
    """Refuse an XLA FFI API whose major version differs from the mirrored one (minor versions
    only append fields, which :func:`_decode` checks through ``struct_size``)."""
    if version[0] != MIRRORED_API_VERSION[0] or version[1] < 1:
        raise XlaFfiVersionError(
            f"the XLA FFI API version of {where} is {version[0]}.{version[1]}; mok_rt's ctypes mirror of "
            f"xla/ffi/api/c_api.h knows major version {MIRRORED_API_VERSION[0]} (minor >= 1, written against "
            f"{MIRRORED_API_VERSION[0]}.{MIRRORED_API_VERSION[1]}): this jaxlib is not supported")


# --------------------------------------------------------------------------- the decoded call
@dataclass(frozen=True)
class FfiBuffer:
    """One argument or result buffer: dtype (a NumPy dtype name), shape and data pointer."""

    dtype: str
    shape: tuple
    ptr: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _itemsize(self.dtype)

    def host_array(self) -> np.ndarray:
        """A writable NumPy view of a host (CPU platform) buffer, no copy."""
        dt = _np_dtype(self.dtype)
        if self.nbytes == 0:
            return np.empty(self.shape, dt)
        raw = (_c.c_char * self.nbytes).from_address(self.ptr)
        return np.frombuffer(raw, dtype=dt).reshape(self.shape)


@dataclass
class FfiCall:
    """What a handler receives: buffers, attributes by name, and the platform stream on demand."""

    args: list
    rets: list
    attrs: dict
    api_version: tuple
    _api: _Api = field(repr=False)
    _ctx: int = field(repr=False)

    def stream(self) -> int:
        """The platform stream (a ``CUstream`` on GPU) the call must run on (``XLA_FFI_Stream_Get``)."""
        args = _StreamGetArgs(SIZE_STREAM_GET, None, self._ctx, None)
        _check(_api_fn(self._api, "Stream_Get")(_c.addressof(args)), "XLA_FFI_Stream_Get")
        return int(args.stream or 0)

    def device_ordinal(self) -> int | None:
        """XLA's device ordinal for this call, or None when this XLA predates ``XLA_FFI_DeviceOrdinal_Get``."""
        if not _has_fn(self._api, "DeviceOrdinal_Get"):
            return None
        args = _DeviceOrdinalGetArgs(SIZE_DEVICE_ORDINAL_GET, None, self._ctx, -1)
        _check(_api_fn(self._api, "DeviceOrdinal_Get")(_c.addressof(args)), "XLA_FFI_DeviceOrdinal_Get")
        return int(args.device_ordinal)


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes   # a dependency of mok_rt (bf16 host arrays)
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _itemsize(name: str) -> int:
    return 2 if name == "bfloat16" else np.dtype(name).itemsize


def _has_fn(api: _Api, name: str) -> bool:
    f = getattr(_Api, name)
    return api.struct_size >= f.offset + f.size and bool(getattr(api, name))


def _api_fn(api: _Api, name: str):
    if not _has_fn(api, name):
        raise XlaFfiVersionError(f"this XLA's FFI API table has no XLA_FFI_{name} (struct_size {api.struct_size})")
    return _API_FN(getattr(api, name))


class _XlaError(Exception):
    """An XLA_FFI_Error returned by an XLA API function: passed back to XLA as it is."""

    def __init__(self, ptr: int, what: str):
        super().__init__(f"{what} failed")
        self.ptr = ptr


def _check(err, what: str) -> None:
    if err:
        raise _XlaError(int(err), what)


def _span(s: _ByteSpan) -> str:
    return _c.string_at(s.ptr, s.len).decode("utf-8") if s.len else ""


def _decode_buffers(a: _Args, kind: str) -> list:
    if a.struct_size < SIZE_ARGS:
        raise XlaFfiVersionError(f"XLA_FFI_{kind} struct_size {a.struct_size} < {SIZE_ARGS}")
    out = []
    for i in range(a.size):
        if a.types[i] != _ARG_BUFFER:
            raise ArgumentError(f"{kind.lower()}[{i}]", f"expected a buffer (type 1), got XLA FFI type {a.types[i]}")
        b = _Buffer.from_address(a.ptrs[i])
        if b.struct_size < SIZE_BUFFER:
            raise XlaFfiVersionError(f"XLA_FFI_Buffer struct_size {b.struct_size} < {SIZE_BUFFER}")
        if b.dtype not in DTYPE_CODES:
            raise ArgumentError(f"{kind.lower()}[{i}]", f"XLA FFI dtype code {b.dtype} is not supported")
        out.append(FfiBuffer(DTYPE_CODES[b.dtype], tuple(int(b.dims[d]) for d in range(b.rank)), int(b.data or 0)))
    return out


def _decode_attr(kind: int, ptr: int, name: str):
    if kind == _ATTR_SCALAR:
        s = _Scalar.from_address(ptr)
        if s.dtype not in DTYPE_CODES or DTYPE_CODES[s.dtype] == "bfloat16":
            raise ArgumentError(name, f"scalar attribute of XLA FFI dtype {s.dtype} is not supported")
        dt = np.dtype(DTYPE_CODES[s.dtype])
        return np.frombuffer(_c.string_at(s.value, dt.itemsize), dt)[0].item()
    if kind == _ATTR_STRING:
        return _span(_ByteSpan.from_address(ptr))
    if kind == _ATTR_ARRAY:
        a = _Array.from_address(ptr)
        dt = np.dtype(DTYPE_CODES.get(a.dtype, "V1"))
        return np.frombuffer(_c.string_at(a.data, dt.itemsize * a.size), dt).copy() if a.size else np.empty(0, dt)
    raise ArgumentError(name, f"attribute of XLA FFI type {kind} (a dictionary?) is not supported")


def _decode(cf: _CallFrame) -> FfiCall:
    if cf.struct_size < SIZE_CALL_FRAME:
        raise XlaFfiVersionError(f"XLA_FFI_CallFrame struct_size {cf.struct_size} < {SIZE_CALL_FRAME}")
    api = _Api.from_address(cf.api)
    version = (api.api_version.major_version, api.api_version.minor_version)
    check_api_version(version, where="the running XLA")
    if cf.stage != _STAGE_EXECUTE:
        raise ArgumentError("stage", f"only the execute stage is handled, got stage {cf.stage}")
    if cf.attrs.struct_size < SIZE_ATTRS:
        raise XlaFfiVersionError(f"XLA_FFI_Attrs struct_size {cf.attrs.struct_size} < {SIZE_ATTRS}")
    attrs = {}
    for i in range(cf.attrs.size):
        name = _span(cf.attrs.names[i].contents)
        attrs[name] = _decode_attr(cf.attrs.types[i], cf.attrs.ptrs[i], name)
    return FfiCall(_decode_buffers(cf.args, "Args"), _decode_buffers(cf.rets, "Rets"), attrs, version,
                   api, int(cf.ctx or 0))


# --------------------------------------------------------------------------- errors and metadata
def _error_code(e: BaseException) -> int:
    if isinstance(e, ArgumentError):
        return ERR_INVALID_ARGUMENT
    if isinstance(e, XlaFfiVersionError):
        return ERR_FAILED_PRECONDITION
    return ERR_INTERNAL if isinstance(e, MokError) else ERR_UNKNOWN


def _create_error(api_ptr: int, message: str, errc: int) -> int | None:
    """An XLA_FFI_Error* (XLA copies the message), or None when XLA gave no usable API table."""
    if not api_ptr:
        return None
    api = _Api.from_address(api_ptr)
    if not _has_fn(api, "Error_Create"):
        return None
    msg = message.encode("utf-8", "replace")
    args = _ErrorCreateArgs(SIZE_ERROR_CREATE, None, msg, errc)
    return _API_FN(api.Error_Create)(_c.addressof(args))


def _fill_metadata(cf: _CallFrame, version: tuple[int, int], traits: int) -> int | None:
    """Answer XLA's registration-time query: the API version and the traits."""
    ext = _MetadataExtension.from_address(_c.addressof(cf.extension_start.contents))
    if ext.extension_base.struct_size < SIZE_METADATA_EXTENSION or not ext.metadata \
            or ext.metadata.contents.struct_size < SIZE_METADATA:
        return _create_error(cf.api or 0, "mok_rt FFI handler: XLA's metadata structs are smaller than "
                             "c_api.h 0.3's", ERR_FAILED_PRECONDITION)
    md = ext.metadata.contents
    md.api_version = _ApiVersion(SIZE_API_VERSION, None, version[0], version[1])
    md.traits = traits
    return None


# --------------------------------------------------------------------------- handlers
def make_handler(fn, *, name: str, api_version: tuple[int, int], command_buffer_compatible: bool = False):
    """An ``XLA_FFI_Handler`` (a ctypes function object; keep it alive for as long as XLA may call
    it, that is for the life of the process) that runs ``fn(call: FfiCall)``.

    ``api_version``: what the handler reports at registration (XLA's own, from
    :func:`header_api_version`).  ``command_buffer_compatible``: the trait that lets XLA capture the
    call into a CUDA graph; only for a handler whose every execution may be replaced by a replay."""
    check_api_version(tuple(api_version), where=f"the handler {name!r}")
    traits = TRAIT_COMMAND_BUFFER_COMPATIBLE if command_buffer_compatible else 0

    def handler(frame_ptr):
        api_ptr = 0
        try:
            cf = _CallFrame.from_address(frame_ptr)
            api_ptr = int(cf.api or 0)
            ext = cf.extension_start
            if ext and ext.contents.type == _EXT_METADATA:
                return _fill_metadata(cf, api_version, traits)
            fn(_decode(cf))
            return None
        except _XlaError as e:   # an error XLA made: hand it back
            return e.ptr
        except BaseException as e:   # noqa: BLE001 -- nothing may unwind into XLA's C++ frames
            message = f"{name}: {type(e).__name__}: {e}"
            try:
                err = _create_error(api_ptr, message, _error_code(e))
            except BaseException:   # noqa: BLE001
                err = None
            if err:
                return err
            # No API table to report through (cannot happen at execute time): say it at least.
            print(f"mok_rt XLA FFI handler could not return an error: {message}", file=sys.stderr)
            return None

    return _HANDLER(handler)


_capsule_new = _c.pythonapi.PyCapsule_New
_capsule_new.restype = _c.py_object
_capsule_new.argtypes = (_p, _c.c_char_p, _p)


def capsule(handler):
    """A PyCapsule of ``handler``'s function pointer (unnamed, no destructor), as
    ``jax.ffi.register_ffi_target`` takes it."""
    return _capsule_new(_c.cast(handler, _p).value, None, None)
