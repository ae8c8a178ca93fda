"""mok_rt.frameworks.xla_ffi without XLA: call frames built by hand in ctypes (as XLA lays them
out, c_api.h 0.3) and a fake XLA_FFI_Api table whose functions are Python callbacks.  Covers the
decoding of buffers and attributes, the metadata query (version and traits, with no API table, as
XLA makes it), struct_size growth, the version checks, and exceptions turned into XLA_FFI_Errors.
Also the layer handler bodies (ffi_layer) on the reference backend through such frames.

No jax needed; tests/test_jax_ops.py runs the same handlers inside XLA.
"""
from __future__ import annotations

import ctypes as C
from types import SimpleNamespace

import numpy as np
import pytest

import mok_rt as mok
from mok_rt.frameworks import ffi_layer
from mok_rt.frameworks import xla_ffi as F


# --------------------------------------------------------------------------- a fake XLA
class FakeXla:
    """An XLA_FFI_Api table with Error_Create and Stream_Get, and call frames that point at it."""

    STREAM = 0xC0FFEE

    def __init__(self, *, version=(0, 3), api_struct_size=None, extra=0, ordinal=None):
        self.errors = []          # (message, errc) of every XLA_FFI_Error created
        self.keep = []            # ctypes objects the frames point into
        self.extra = extra        # bytes every struct XLA hands over grows by (a newer minor)

        def error_create(p):
            a = F._ErrorCreateArgs.from_address(p)
            assert a.struct_size == F.SIZE_ERROR_CREATE
            self.errors.append((a.message.decode(), a.errc))
            return 0x1000 + len(self.errors)   # an opaque XLA_FFI_Error*

        def stream_get(p):
            a = F._StreamGetArgs.from_address(p)
            assert a.struct_size == F.SIZE_STREAM_GET and a.ctx == 0xC7
            a.stream = self.STREAM
            return None

        def device_ordinal_get(p):
            a = F._DeviceOrdinalGetArgs.from_address(p)
            assert a.struct_size == F.SIZE_DEVICE_ORDINAL_GET and a.ctx == 0xC7
            a.device_ordinal = ordinal
            return None

        self._fns = [F._API_FN(error_create), F._API_FN(stream_get), F._API_FN(device_ordinal_get)]
        self.api = F._Api()
        self.api.struct_size = api_struct_size or C.sizeof(F._Api)
        self.api.api_version = F._ApiVersion(F.SIZE_API_VERSION, None, *version)
        self.api.Error_Create = C.cast(self._fns[0], C.c_void_p)
        self.api.Stream_Get = C.cast(self._fns[1], C.c_void_p)
        if ordinal is not None:
            self.api.DeviceOrdinal_Get = C.cast(self._fns[2], C.c_void_p)

    def _grown(self, cls):
        """A struct type with ``extra`` unknown bytes after the known fields."""
        if not self.extra:
            return cls
        return type(cls.__name__ + "Grown", (C.Structure,),
                    {"_fields_": list(cls._fields_) + [("_new", C.c_uint8 * self.extra)]})

    def buffer(self, arr: np.ndarray, code: int):
        dims = (C.c_int64 * arr.ndim)(*arr.shape)
        b = self._grown(F._Buffer)()
        b.struct_size, b.dtype, b.data, b.rank = F.SIZE_BUFFER + self.extra, code, arr.ctypes.data, arr.ndim
        b.dims = C.cast(dims, C.POINTER(C.c_int64))
        self.keep += [arr, dims, b]
        return C.addressof(b)

    def _list(self, ptrs):
        types = (C.c_int * len(ptrs))(*([1] * len(ptrs)))
        arr = (C.c_void_p * len(ptrs))(*ptrs)
        self.keep += [types, arr]
        return F._Args(F.SIZE_ARGS, None, len(ptrs), C.cast(types, C.POINTER(C.c_int)),
                       C.cast(arr, C.POINTER(C.c_void_p)))

    def frame(self, args, rets, attrs: dict, *, stage=3, frame_size=None):
        """A call frame; ``args`` / ``rets``: (array, dtype code) pairs; ``attrs``: name -> int
        (an i64 scalar) or str."""
        names, types, ptrs = [], [], []
        for name, v in attrs.items():
            raw = name.encode()
            span = F._ByteSpan(C.cast(C.c_char_p(raw), C.c_void_p), len(raw))
            self.keep += [raw, span]
            names.append(C.pointer(span))
            if isinstance(v, str):
                sv = v.encode()
                obj = F._ByteSpan(C.cast(C.c_char_p(sv), C.c_void_p), len(sv))
                self.keep.append(sv)
                types.append(F._ATTR_STRING)
            else:
                val = C.c_int64(v)
                obj = F._Scalar(5, C.addressof(val))
                self.keep.append(val)
                types.append(F._ATTR_SCALAR)
            self.keep.append(obj)
            ptrs.append(C.addressof(obj))
        n = len(names)
        name_arr = (C.POINTER(F._ByteSpan) * n)(*names)
        type_arr = (C.c_int * n)(*types)
        ptr_arr = (C.c_void_p * n)(*ptrs)
        self.keep += [name_arr, type_arr, ptr_arr]
        cf = self._grown(F._CallFrame)()
        cf.struct_size = frame_size or (F.SIZE_CALL_FRAME + self.extra)
        cf.api, cf.ctx, cf.stage = C.addressof(self.api), 0xC7, stage
        cf.args = self._list([self.buffer(a, c) for a, c in args])
        cf.rets = self._list([self.buffer(a, c) for a, c in rets])
        cf.attrs = F._Attrs(F.SIZE_ATTRS, None, n, C.cast(type_arr, C.POINTER(C.c_int)),
                            C.cast(name_arr, C.POINTER(C.POINTER(F._ByteSpan))),
                            C.cast(ptr_arr, C.POINTER(C.c_void_p)))
        self.keep.append(cf)
        return C.addressof(cf)


def _metadata_frame(keep: list, *, with_api=None):
    """The frame XLA builds at registration: a metadata extension, no API table (XLA 0.10)."""
    md = F._Metadata(F.SIZE_METADATA, F._ApiVersion(F.SIZE_API_VERSION, None, 0, 0), 0xFFFF)
    ext = F._MetadataExtension(F._ExtensionBase(F.SIZE_METADATA_EXTENSION, F._EXT_METADATA, None), C.pointer(md))
    cf = F._CallFrame()
    cf.struct_size, cf.stage = F.SIZE_CALL_FRAME, 3
    cf.extension_start = C.cast(C.pointer(ext), C.POINTER(F._ExtensionBase))
    cf.api = with_api
    keep += [md, ext, cf]
    return C.addressof(cf), md


# --------------------------------------------------------------------------- the mirror
def test_struct_sizes_are_c_api_h_0_3s():
    # XLA_FFI_STRUCT_SIZE of each struct on LP64 (offset of the last field + its size).
    assert (F.SIZE_API_VERSION, F.SIZE_BUFFER, F.SIZE_ARGS, F.SIZE_ATTRS, F.SIZE_CALL_FRAME) == (24, 48, 40, 48, 168)
    assert (F.SIZE_METADATA, F.SIZE_METADATA_EXTENSION, F.SIZE_ERROR_CREATE, F.SIZE_STREAM_GET) == (36, 32, 28, 32)
    assert F._CallFrame.attrs.offset == 120 and F._CallFrame.future.offset == 168
    assert F._Api.Error_Create.offset == 48 and F._Api.Stream_Get.offset == 80
    assert F._Api.DeviceOrdinal_Get.offset == 48 + 17 * 8


@pytest.mark.parametrize("extra", [0, 16])
def test_decodes_buffers_attributes_and_stream(extra):
    xla = FakeXla(extra=extra)   # extra: every struct XLA hands over is larger (a newer minor version)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    ids = np.array([[1, 2], [0, 3], [2, 2]], np.int64)
    out = np.zeros((3, 4), np.float32)
    seen = {}

    def body(call):
        seen.update(call=call, stream=call.stream(), ordinal=call.device_ordinal())
        call.rets[0].host_array()[...] = call.args[0].host_array() * call.attrs["scale"]

    h = F.make_handler(body, name="t", api_version=(0, 3))
    assert h(xla.frame([(x, 11), (ids, 5)], [(out, 11)], {"scale": 3, "tag": "moe"})) is None
    call = seen["call"]
    assert [(b.dtype, b.shape) for b in call.args] == [("float32", (3, 4)), ("int64", (3, 2))]
    assert call.args[1].ptr == ids.ctypes.data and call.rets[0].nbytes == 48
    assert call.attrs == {"scale": 3, "tag": "moe"} and call.api_version == (0, 3)
    assert seen["stream"] == FakeXla.STREAM
    assert seen["ordinal"] is None                      # the fake table has no DeviceOrdinal_Get
    np.testing.assert_array_equal(out, x * 3)
    assert not xla.errors


def test_python_exceptions_become_xla_errors():
    xla = FakeXla()

    def body(call):
        raise mok.ArgumentError("x", "bad")

    h = F.make_handler(body, name="mok_t", api_version=(0, 3))
    err = h(xla.frame([], [], {}))
    assert err == 0x1001
    assert xla.errors == [("mok_t: ArgumentError: x: bad", F.ERR_INVALID_ARGUMENT)]
    h2 = F.make_handler(lambda call: 1 / 0, name="z", api_version=(0, 3))
    assert h2(xla.frame([], [], {})) and xla.errors[-1] == ("z: ZeroDivisionError: division by zero", F.ERR_UNKNOWN)
    # KeyboardInterrupt / SystemExit are caught too: nothing may unwind into XLA.
    h3 = F.make_handler(lambda call: (_ for _ in ()).throw(SystemExit(3)), name="s", api_version=(0, 3))
    assert h3(xla.frame([], [], {})) and xla.errors[-1][0] == "s: SystemExit: 3"


def test_refuses_frames_and_versions_it_does_not_know():
    calls = []
    h = F.make_handler(calls.append, name="v", api_version=(0, 3))
    for xla, kw, what in [(FakeXla(version=(1, 0)), {}, "major version 0"),
                          (FakeXla(), {"frame_size": F.SIZE_CALL_FRAME - 8}, "XLA_FFI_CallFrame struct_size"),
                          (FakeXla(), {"stage": 0}, "execute stage")]:
        assert h(xla.frame([], [], {}, **kw))
        assert what in xla.errors[-1][0], xla.errors
    assert not calls
    # An API table too short to hold Stream_Get: the call fails, clearly, instead of reading past it.
    xla = FakeXla(api_struct_size=F._Api.Stream_Get.offset)
    assert F.make_handler(lambda c: c.stream(), name="s", api_version=(0, 3))(xla.frame([], [], {}))
    assert "no XLA_FFI_Stream_Get" in xla.errors[-1][0]
    with pytest.raises(F.XlaFfiVersionError, match="not supported"):
        F.make_handler(calls.append, name="v", api_version=(1, 0))


@pytest.mark.parametrize("cb", [False, True])
def test_metadata_query_reports_the_version_and_traits(cb):
    keep = []
    frame, md = _metadata_frame(keep)
    calls = []
    h = F.make_handler(calls.append, name="m", api_version=(0, 2), command_buffer_compatible=cb)
    assert h(frame) is None and not calls              # answered, the body not run
    assert (md.api_version.struct_size, md.api_version.major_version, md.api_version.minor_version) == (24, 0, 2)
    assert md.traits == (F.TRAIT_COMMAND_BUFFER_COMPATIBLE if cb else 0)
    # A metadata struct smaller than 0.3's: refused through the API table when there is one.
    xla = FakeXla()
    frame, md = _metadata_frame(keep, with_api=C.addressof(xla.api))
    md.struct_size = 20
    assert h(frame) and "metadata" in xla.errors[-1][0]


def test_header_api_version(tmp_path):
    d = tmp_path / "xla" / "ffi" / "api"
    d.mkdir(parents=True)
    (d / "c_api.h").write_text("#define XLA_FFI_API_MAJOR 0\n// x\n#define XLA_FFI_API_MINOR 7\n")
    assert F.header_api_version(str(tmp_path)) == (0, 7)    # a newer minor: fields appended only
    (d / "c_api.h").write_text("#define XLA_FFI_API_MAJOR 1\n#define XLA_FFI_API_MINOR 0\n")
    with pytest.raises(F.XlaFfiVersionError, match="1.0.*not supported"):
        F.header_api_version(str(tmp_path))
    with pytest.raises(F.XlaFfiVersionError, match="cannot read"):
        F.header_api_version(str(tmp_path / "nowhere"))


def test_capsule_wraps_the_function_pointer():
    h = F.make_handler(lambda c: None, name="c", api_version=(0, 3))
    cap = F.capsule(h)
    get = C.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = C.c_void_p, (C.py_object, C.c_char_p)
    assert get(cap, None) == C.cast(h, C.c_void_p).value


# --------------------------------------------------------------------------- the layer's handlers
def _layer_problem(seed, T=9, H=64, I=64, E=4, k=2):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((T, H)).astype(np.float32),
            "ids": np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32),
            "tw": rng.random((T, k)).astype(np.float32),
            "w_gate": (rng.standard_normal((E, I, H)) * H ** -0.5).astype(np.float32),
            "w_up": (rng.standard_normal((E, I, H)) * H ** -0.5).astype(np.float32),
            "w_down": (rng.standard_normal((E, H, I)) * I ** -0.5).astype(np.float32),
            "d_out": rng.standard_normal((T, H)).astype(np.float32)}


def test_layer_handlers_on_the_reference_backend_match_the_api():
    p = _layer_problem(5)
    cfg = mok.MoEConfig(hidden=64, intermediate=64, num_experts=4, top_k=2)
    codes = {np.dtype(np.float32): 11, np.dtype(np.int32): 4}
    with mok.Workspace(cfg, max_tokens=16, backend="reference") as ws:
        experts = mok.ExpertWeights(p["w_gate"], p["w_up"], p["w_down"])
        want_out, ctx = mok.forward(ws, mok.schedule(ws, p["ids"]), p["x"], p["tw"], experts)
        want = mok.backward(ws, ctx, p["d_out"])
        xla = FakeXla()
        ins = [(p[n], codes[p[n].dtype]) for n in ("x", "ids", "tw", "w_gate", "w_up", "w_down")]
        out = np.full_like(p["x"], np.nan)
        fwd = F.make_handler(lambda c: ffi_layer.run_forward("cpu", c), name="f", api_version=(0, 3))
        assert fwd(xla.frame(ins, [(out, 11)], {"handle": ws._handle})) is None, xla.errors
        np.testing.assert_array_equal(out, np.asarray(want_out.to_numpy()))
        grads = [np.full_like(a, np.nan) for a in (p["x"], p["tw"], p["w_gate"], p["w_up"], p["w_down"])]
        bwd = F.make_handler(lambda c: ffi_layer.run_backward("cpu", c), name="b", api_version=(0, 3))
        assert bwd(xla.frame([(p["d_out"], 11)] + ins, [(g, 11) for g in grads], {"handle": ws._handle})) is None
        for got, ref in zip(grads, (want.dx, want.d_topk_weights, *want.dw)):
            np.testing.assert_array_equal(got, np.asarray(ref.to_numpy()))
        # An expert id out of range: the call succeeds, the reference backend records the error as
        # the device does, and the workspace raises it at check(); out is NaN.
        bad = [(np.full_like(p["ids"], 7), 4) if i == 1 else a for i, a in enumerate(ins)]
        assert fwd(xla.frame(bad, [(out, 11)], {"handle": ws._handle})) is None and not xla.errors
        assert np.isnan(out).all()
        with pytest.raises(mok.ExpertIdError):
            ws.check()
        # Errors the host sees fail the call: no handle, the CUDA platform for a reference workspace.
        assert fwd(xla.frame(ins, [(out, 11)], {}))
        assert "no 'handle' attribute" in xla.errors[-1][0]
        on_gpu = F.make_handler(lambda c: ffi_layer.run_forward("CUDA", c), name="g", api_version=(0, 3))
        assert on_gpu(xla.frame(ins, [(out, 11)], {"handle": ws._handle}))
        assert "backend='reference'" in xla.errors[-1][0] and "on the CPU" in xla.errors[-1][0]


def test_cuda_handler_plumbing_without_a_gpu(monkeypatch):
    """The CUDA platform's handler bodies with mok_rt's calls and the driver faked: every call gets
    XLA's stream, XLA's buffers are wrapped in place on the workspace's device, the weight
    gradients are XLA's result buffers, and out / dx / d_topk_weights are copied on that stream."""
    from mok_rt.interop.tensor import Tensor
    from mok_rt.runtime import driver as drv

    T, H, I, E, k = 5, 64, 64, 4, 2
    xla = FakeXla(ordinal=1)
    ws = SimpleNamespace(backend="cuda", device_id=1)
    monkeypatch.setattr(ffi_layer, "from_handle", lambda h: ws if h == 77 else None)
    log = []

    def result(shape, dtype, ptr):
        return Tensor._from_pointer(ptr, shape, dtype, 1, None)

    def schedule(w, ids, *, stream):
        log.append(("schedule", ids.ptr, ids.dtype, ids.device_id, stream))
        return "sched"

    def forward(w, sched, x, tw, experts, *, shared, stream):
        log.append(("forward", x.ptr, tw.ptr, experts.down.ptr, shared, stream))
        return result((T, H), "bfloat16", 0xA000), "ctx"

    def recompute_context(w, sched, x, tw, experts, *, shared, stream):
        log.append(("recompute", x.ptr, stream))
        return "ctx"

    def backward(w, ctx, d_out, *, dw, dw_shared, stream):
        log.append(("backward", d_out.ptr, dw.gate.ptr, dw.down.ptr, dw.down.readonly, dw_shared, stream))
        return SimpleNamespace(dx=result((T, H), "bfloat16", 0xB000), d_topk_weights=result((T, k), "float32", 0xC000))

    for name, fn in (("schedule", schedule), ("forward", forward), ("recompute_context", recompute_context),
                     ("backward", backward)):
        monkeypatch.setattr(mok, name, fn)
    monkeypatch.setattr(drv, "call", lambda name, *args: log.append((name, *[int(a) for a in args[:2]], *args[2:3],
                                                                             int(args[3]))))
    bf = lambda *s: np.zeros(s, np.uint16)  # noqa: E731  (bf16 bytes; never read: the kernels are faked)
    x, ids, tw, d_out = bf(T, H), np.zeros((T, k), np.int32), np.zeros((T, k), np.float32), bf(T, H)
    w = [bf(E, I, H), bf(E, I, H), bf(E, H, I)]
    ins = [(x, 16), (ids, 4), (tw, 11)] + [(a, 16) for a in w]
    S = FakeXla.STREAM

    out = bf(T, H)
    fwd = F.make_handler(lambda c: ffi_layer.run_forward("CUDA", c), name="f", api_version=(0, 3))
    assert fwd(xla.frame(ins, [(out, 16)], {"handle": 77})) is None, xla.errors
    assert log == [("schedule", ids.ctypes.data, "int32", 1, S),
                   ("forward", x.ctypes.data, tw.ctypes.data, w[2].ctypes.data, None, S),
                   ("cuMemcpyDtoDAsync", out.ctypes.data, 0xA000, T * H * 2, S)]
    log.clear()
    grads = [bf(T, H), np.zeros((T, k), np.float32)] + [np.zeros(a.shape, np.float32) for a in w]
    bwd = F.make_handler(lambda c: ffi_layer.run_backward("CUDA", c), name="b", api_version=(0, 3))
    assert bwd(xla.frame([(d_out, 16)] + ins, [(grads[0], 16)] + [(g, 11) for g in grads[1:]], {"handle": 77})) is None
    assert log == [("schedule", ids.ctypes.data, "int32", 1, S), ("recompute", x.ctypes.data, S),
                   ("backward", d_out.ctypes.data, grads[2].ctypes.data, grads[4].ctypes.data, False, None, S),
                   ("cuMemcpyDtoDAsync", grads[0].ctypes.data, 0xB000, T * H * 2, S),
                   ("cuMemcpyDtoDAsync", grads[1].ctypes.data, 0xC000, T * k * 4, S)]
    # XLA's device is not the workspace's: refused before anything is enqueued.
    log.clear()
    other = FakeXla(ordinal=0)
    assert fwd(other.frame(ins, [(out, 16)], {"handle": 77})) and not log
    assert "drives device 1 but XLA runs this call on its device 0" in other.errors[-1][0]
