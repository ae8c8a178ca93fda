"""The FP8 layer of the oracle: :func:`mok_rt.reference.forward` with ``precision="fp8_block"``
or ``"mxfp8"`` (docs/SEMANTICS.md §10).

It is the float64 layer of :mod:`mok_rt.reference.layer` with the quantisation points of the
FP8 kernels inserted, and nothing else rounded: each FP8 GEMM is emulated as the exact (float64)
product of the dequantised operands.  Per route ``r = (t, j)`` on expert ``e``::

    forward   xq  = Q(x[t]) along H                  once per token (the dispatch); shared uses it too
              g   = xq · Q(W_gate[e])ᵀ,  u = xq · Q(W_up[e])ᵀ
              a   = swiglu(g, u)  (with the clamp)
              aq  = Q(a) along I                     the gate|up epilogue
              y   = aq · Q(W_down[e])ᵀ
              (the context keeps g and u rounded to bf16, as the kernels store them)
              out = shared + Σ_j tw[t, j] · y
    backward  dq  = Q(d_out[t]) along H              once per token (the backward's dispatch)
              d_topk_weights[t, j] = <d_out[t], y[t, j]>     d_out NOT quantised (not a GEMM)
              da  = tw[t, j] · (dq · Q_t(W_down[e]))         dgrad of down, FP8
              dg, du = dswiglu(bf16(g), bf16(u), da)
              dgq = Q(dg), duq = Q(du) along I       the dswiglu epilogue
              dx  = Σ_j (dgq · Q_t(W_gate[e]) + duq · Q_t(W_up[e])) + shared part
              dW_down[e] += (tw · dq)ᵀ aq            weight gradients: BF16 GEMMs in the kernels,
              dW_gate[e] += dgqᵀ xq,  dW_up[e] += duqᵀ xq      on the same quantised operands

``Q`` is the activation quantiser (1 × 128 fp32 scales or 1 × 32 E8M0), ``Q``/``Q_t`` of a
weight its forward / transposed (input-gradient) copy (:class:`~mok_rt.reference.quantize.QuantizedExperts`).
The bf16 rounding of ``g``/``u`` is emulated because ``dg``/``du`` are quantised again: a
bf16-sized difference in their input would flip ~1 in 30 E4M3 roundings and show up as ~1%
in ``dx``; the forward's ``a`` comes from the fp32 accumulators and needs no such rounding.
The weight-gradient GEMMs read the dequantised operands (the kernels widen them to bf16, an
implementation rounding like every other bf16 store); by default they are never quantised a
second time.

FP8 weight gradients (``backward_fp8(..., wgrad=...)``, reference-only, for measuring; the kernels
run ``"bf16"``).  A wgrad GEMM reduces over an expert's rows (tokens), so FP8 needs both operands
quantised along the rows: ``Qc`` = 128 × 1 blocks, one scale per column and per 128 rows of the
expert's row block (rows in the schedule's order, (t, j); each expert's rows padded with zero rows
to whole blocks, as the kernel's padded row space; the shared expert's rows are the tokens)::

    "bf16"         dW_down = dyᵀ aq,             dW_gate = dgqᵀ xq,        dW_up = duqᵀ xq   (today)
    "fp8_requant"  dW_down = Qc(dy)ᵀ Qc(aq),     dW_gate = Qc(dgq)ᵀ Qc(xq), ...    the quantised
                   operands quantised again (a kernel that keeps only its E4M3 copies)
    "fp8_source"   dW_down = Qc(tw · d_out)ᵀ Qc(a),  dW_gate = Qc(dg)ᵀ Qc(x),  ...  quantised once,
                   from the unquantised values (a kernel that keeps bf16 copies); ``a`` is
                   swiglu(bf16(g), bf16(u)), which a kernel can recompute from its context
    "fp8_mixed"    routed x and dy as in fp8_requant; a, dg, du and the shared expert as in
                   fp8_source.  What expert parallelism allows without bf16 dispatches: an
                   expert's x and d_out rows reach its rank as E4M3 only, a, dg, du are made there

with ``dy = tw · dq``; the shared expert likewise (``tw = 1``).  Only the weight gradients change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import ml_dtypes
import numpy as np

from mok_rt.errors import ArgumentError
from mok_rt.reference import layer as _L
from mok_rt.reference.quantize import (FORMATS, QuantizedExperts, fake_quantize, fake_quantize_columns,
                                       quantize_experts)

__all__ = ["PRECISIONS", "WGRAD_MODES", "FP8Context", "forward_fp8", "backward_fp8", "quantize_weights_ref", "run_forward"]

PRECISIONS = ("bf16",) + FORMATS
WGRAD_MODES = ("bf16", "fp8_requant", "fp8_source", "fp8_mixed")   # backward_fp8's weight-gradient GEMMs


def check_precision(precision) -> str:
    if precision not in PRECISIONS:
        raise ArgumentError("precision", f"expected one of {PRECISIONS}, got {precision!r}")
    return precision


def quantize_weights_ref(precision: str, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None):
    """(routed, shared or None) :class:`QuantizedExperts` of host weights, after validation."""
    w = _L._check_weights(w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    routed = quantize_experts(w.w_gate, w.w_up, w.w_down, precision)
    shared = None if w.ws_gate is None else quantize_experts(w.ws_gate, w.ws_up, w.ws_down, precision)
    return routed, shared


@dataclass(frozen=True, eq=False)
class _Deq:
    """Dequantised float64 weights of one group, as each GEMM sees them."""
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    gate_t: np.ndarray
    up_t: np.ndarray
    down_t: np.ndarray

    @classmethod
    def of(cls, q: Optional[QuantizedExperts]):
        return None if q is None else cls(**q.dequantized())


@dataclass(frozen=True, eq=False)
class FP8Context:
    """What :func:`backward_fp8` needs (float64; routes in ``(t, j)`` order).  ``xq``/``aq`` are
    the quantised activations the forward's GEMMs saw; ``g``/``u`` the pre-activations."""
    precision: str
    x: np.ndarray
    xq: np.ndarray
    topk_ids: np.ndarray
    topk_weights: np.ndarray
    g: np.ndarray          # [T*k, I], rounded to bf16 (what the backward reads)
    u: np.ndarray
    aq: np.ndarray
    y: np.ndarray          # [T, k, H]
    shared_g: Optional[np.ndarray]
    shared_u: Optional[np.ndarray]
    shared_aq: Optional[np.ndarray]
    swiglu_limit: Optional[float]
    experts: QuantizedExperts
    shared: Optional[QuantizedExperts]
    _w: _Deq
    _ws: Optional[_Deq]


def _check_quantized(q, name: str, precision: str, ndim: int) -> None:
    if not isinstance(q, QuantizedExperts):
        raise ArgumentError(name, f"expected reference.quantize.QuantizedExperts, got {type(q).__name__}")
    if q.fmt != precision:
        raise ArgumentError(name, f"quantised as {q.fmt!r}, but the precision is {precision!r}")
    if q.gate.values.ndim != ndim:
        raise ArgumentError(name, f"expected {ndim}-D weights, got shape {q.gate.shape}")


def forward_fp8(x, topk_ids, topk_weights, experts: QuantizedExperts, shared: Optional[QuantizedExperts] = None,
                *, swiglu_limit: Optional[float] = None) -> tuple[np.ndarray, FP8Context]:
    """The FP8 forward on pre-quantised weights; returns ``(out [T, H] float64, ctx)``."""
    precision = getattr(experts, "fmt", None)
    check_precision(precision)
    _check_quantized(experts, "experts", precision, 3)
    if shared is not None:
        _check_quantized(shared, "shared", precision, 2)
    limit = _L._check_limit(swiglu_limit)
    num_e, inter, hidden = experts.gate.shape
    x64, ids, tw = _L._check_tokens(x, topk_ids, topk_weights, hidden=hidden, num_experts=num_e)
    tokens, k = ids.shape
    w, ws = _Deq.of(experts), _Deq.of(shared)

    xq = fake_quantize(x64, precision)                           # the dispatch, once per token
    n = tokens * k
    row_token = np.repeat(np.arange(tokens, dtype=np.int64), k)
    row_expert = ids.reshape(-1)
    g, u = np.empty((n, inter)), np.empty((n, inter))
    order, offsets = _L._group_by_expert(row_expert, num_e)
    for e in range(num_e):
        idx = order[offsets[e]:offsets[e + 1]]
        if idx.size:
            xe = xq[row_token[idx]]
            g[idx], u[idx] = xe @ w.gate[e].T, xe @ w.up[e].T
    aq = fake_quantize(_L._swiglu(g, u, limit), precision) if n else np.empty((0, inter))  # gate|up epilogue
    g, u = _bf16(g), _bf16(u)                                   # the context's copies
    sg = su = saq = None
    if ws is not None:
        sg, su = xq @ ws.gate.T, xq @ ws.up.T
        saq = fake_quantize(_L._swiglu(sg, su, limit), precision) if tokens else np.empty_like(sg)
        sg, su = _bf16(sg), _bf16(su)
    y, out = _down_and_combine(aq, ids, tw, w, saq, ws)
    ctx = FP8Context(precision, x64, xq, ids, tw, g, u, aq, y, sg, su, saq, limit, experts, shared, w, ws)
    return out, ctx


def _down_and_combine(aq, ids, tw, w: _Deq, saq=None, ws: Optional[_Deq] = None) -> tuple[np.ndarray, np.ndarray]:
    """The forward after the SwiGLU's quantisation: the routed down GEMMs of aq [T*k, I] (routes in
    ``(t, j)`` order), the combine and, with ``saq`` [T, I], the shared expert's down GEMM; returns
    ``(y [T, k, H], out [T, H])``.  The GPU forward test feeds it the kernel's own aq."""
    tokens, k = ids.shape
    num_e, hidden = w.down.shape[:2]
    y = np.empty((tokens * k, hidden))
    order, offsets = _L._group_by_expert(ids.reshape(-1), num_e)
    for e in range(num_e):
        idx = order[offsets[e]:offsets[e + 1]]
        if idx.size:
            y[idx] = aq[idx] @ w.down[e].T
    y = y.reshape(tokens, k, hidden)
    out = _L._combine(y, tw)
    if saq is not None:
        out = saq @ ws.down.T + out
    return y, out


def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).astype(np.float64)


def _q(a: np.ndarray, precision: str) -> np.ndarray:
    return fake_quantize(a, precision) if a.shape[0] else a.copy()


def backward_fp8(ctx: FP8Context, d_out, *, wgrad: str = "bf16") -> _L.Grads:
    """Gradients of ``sum(out * d_out)`` (float64) under the FP8 semantics of the module doc.
    ``wgrad`` picks the weight-gradient GEMMs (:data:`WGRAD_MODES`, module doc); the default is
    what the kernels compute, the other two exist to measure FP8 weight gradients."""
    if not isinstance(ctx, FP8Context):
        raise ArgumentError("ctx", f"expected a reference FP8Context, got {type(ctx).__name__}")
    if wgrad not in WGRAD_MODES:
        raise ArgumentError("wgrad", f"expected one of {WGRAD_MODES}, got {wgrad!r}")
    p, limit, w, ws = ctx.precision, ctx.swiglu_limit, ctx._w, ctx._ws
    tokens, k = ctx.topk_ids.shape
    num_e, inter, hidden = ctx.experts.gate.shape
    d64 = _L._check_d_out(d_out, (tokens, hidden))
    d_topk_weights = np.einsum("th,tkh->tk", d64, ctx.y)        # unquantised d_out
    dq = _q(d64, p)                                              # the backward's dispatch

    n = tokens * k
    row_token = np.repeat(np.arange(tokens, dtype=np.int64), k)
    row_expert = ctx.topk_ids.reshape(-1)
    row_tw = ctx.topk_weights.reshape(-1)
    dy = row_tw[:, None] * dq[row_token]                         # tw · Q(d_out), per route
    da = np.empty((n, inter))
    order, offsets = _L._group_by_expert(row_expert, num_e)
    for e in range(num_e):
        idx = order[offsets[e]:offsets[e + 1]]
        if idx.size:
            da[idx] = dy[idx] @ w.down_t[e].T                     # dgrad of down, FP8
    dg, du = _L._swiglu_backward(ctx.g, ctx.u, da, limit)
    dgq, duq = _q(dg, p), _q(du, p)                              # the dswiglu epilogue
    # The weight-gradient operands (per route row): what the GEMMs read before any Qc.
    if wgrad in ("fp8_source", "fp8_mixed"):
        w_a, w_g, w_u = _L._swiglu(ctx.g, ctx.u, limit), dg, du
    else:
        w_a, w_g, w_u = ctx.aq, dgq, duq
    if wgrad == "fp8_source":
        w_dy, w_x = row_tw[:, None] * d64[row_token], ctx.x
    else:
        w_dy, w_x = dy, ctx.xq
    qc = _identity if wgrad == "bf16" else (lambda m: fake_quantize_columns(m, p))
    dx_rows = np.empty((n, hidden))
    dw_gate, dw_up = np.zeros((num_e, inter, hidden)), np.zeros((num_e, inter, hidden))
    dw_down = np.zeros((num_e, hidden, inter))
    for e in range(num_e):
        idx = order[offsets[e]:offsets[e + 1]]
        if not idx.size:
            continue
        dx_rows[idx] = dgq[idx] @ w.gate_t[e].T + duq[idx] @ w.up_t[e].T    # dgrad of gate|up, FP8
        # wgrads: Qc runs per expert, so a 128-row block never straddles two experts
        xe = qc(w_x[row_token[idx]])
        np.matmul(qc(w_dy[idx]).T, qc(w_a[idx]), out=dw_down[e])
        np.matmul(qc(w_g[idx]).T, xe, out=dw_gate[e])
        np.matmul(qc(w_u[idx]).T, xe, out=dw_up[e])
    dx = dx_rows.reshape(tokens, k, hidden).sum(axis=1)
    dws = (None, None, None)
    if ws is not None:
        sda = dq @ ws.down_t.T
        sdg, sdu = _L._swiglu_backward(ctx.shared_g, ctx.shared_u, sda, limit)
        sdgq, sduq = _q(sdg, p), _q(sdu, p)
        dx = (sdgq @ ws.gate_t.T + sduq @ ws.up_t.T) + dx
        if wgrad in ("fp8_source", "fp8_mixed"):       # the shared expert's rows are local tokens
            s_dy, s_a, s_g, s_u, s_x = d64, _L._swiglu(ctx.shared_g, ctx.shared_u, limit), sdg, sdu, ctx.x
        else:
            s_dy, s_a, s_g, s_u, s_x = dq, ctx.shared_aq, sdgq, sduq, ctx.xq
        xs = qc(s_x)
        dws = (qc(s_g).T @ xs, qc(s_u).T @ xs, qc(s_dy).T @ qc(s_a))
    return _L.Grads(dx=dx, d_topk_weights=d_topk_weights, dw_gate=dw_gate, dw_up=dw_up, dw_down=dw_down,
                    dws_gate=dws[0], dws_up=dws[1], dws_down=dws[2])


def _identity(a: np.ndarray) -> np.ndarray:
    return a


def run_forward(config, topk_ids, args, host):
    """The reference backend's FP8 forward of validated layer args (``host``: view -> ndarray):
    pre-quantised weights from ``args.quantized``, or bf16 master weights quantised here."""
    if args.quantized is not None:
        routed, shared = args.quantized.experts, args.quantized.shared
    else:
        routed, shared = quantize_weights_ref(config.precision, host(args.w_gate), host(args.w_up), host(args.w_down),
                                              host(args.shared_gate), host(args.shared_up), host(args.shared_down))
    return forward_fp8(host(args.x), topk_ids, host(args.topk_weights), routed, shared,
                       swiglu_limit=config.swiglu_limit)
