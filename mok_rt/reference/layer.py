"""NumPy reference of the MoE layer (docs/SEMANTICS.md): the oracle every other path is tested against.

Everything is computed in float64 whatever the input dtype (float64, float32, float16 or
``ml_dtypes.bfloat16`` are accepted and cast first); results are float64 arrays.

Semantics, per token ``t`` with ``k`` routes ``(t, j)``::

    expert_e(v) = W_down[e] @ (silu(W_gate[e] @ v) * (W_up[e] @ v))
    out[t]      = shared(x[t]) + sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])

* Each route ``(t, j)`` is independent: the same expert id twice in one token's top-k is allowed
  and its two contributions (and gradients) simply add up.
* ``swiglu_limit=L`` clamps the pre-activations, ``g_c = min(g, L)``, ``u_c = clip(u, -L, L)``,
  and masks the gradient where the clamp was active (``g > L``, ``|u| > L``).  It applies to the
  shared expert too.
* ``T = 0`` is allowed; an expert that receives no route gets an all-zero weight gradient.

Expert parallelism is simulated by :func:`ep_forward` / :func:`ep_backward`: they really
partition the routes by destination rank (dispatch), run each rank's experts on what it received
and send the expert outputs / input gradients back to the source (combine), so they exercise the
same bookkeeping as the device path.  Routed work is vectorised per expert (one matmul per expert
and operand), never looped per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real
from typing import Optional, Sequence

import ml_dtypes
import numpy as np

from mok_rt.errors import ArgumentError

__all__ = [
    "Context", "Grads", "EPContext",
    "forward", "backward", "ep_forward", "ep_backward",
    "silu",
]

_FLOAT_DTYPES = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16),
                 np.dtype(ml_dtypes.bfloat16))


# ----------------------------------------------------------------------------------------------
# Data carriers
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class _Weights:
    """One rank's weights as given by the caller (not copied; cast to float64 per expert on use).

    Backward uses these same arrays, so they must not be modified between forward and backward.
    """
    w_gate: np.ndarray                  # [E, I, H]
    w_up: np.ndarray                    # [E, I, H]
    w_down: np.ndarray                  # [E, H, I]
    ws_gate: Optional[np.ndarray]       # [I_s, H] or None
    ws_up: Optional[np.ndarray]
    ws_down: Optional[np.ndarray]       # [H, I_s]


@dataclass(frozen=True, eq=False)
class _SharedActs:
    """Shared-expert pre-activations and activation, one row per token (float64)."""
    g: np.ndarray   # [T, I_s]
    u: np.ndarray   # [T, I_s]
    a: np.ndarray   # [T, I_s]


@dataclass(frozen=True, eq=False)
class Context:
    """What :func:`backward` needs from :func:`forward` (float64 arrays, routes in ``(t, j)`` order).

    ``g``, ``u`` are the routed pre-activations ``W_gate @ x``, ``W_up @ x`` (before the clamp),
    ``a`` the SwiGLU activation and ``y`` the *unweighted* expert output of each route.
    A float64 ``x`` and the weights are held by reference, not copied: leave them unchanged
    until :func:`backward` has run.
    """
    x: np.ndarray                    # [T, H]
    topk_ids: np.ndarray             # [T, k] int64
    topk_weights: np.ndarray         # [T, k]
    g: np.ndarray                    # [T, k, I]
    u: np.ndarray                    # [T, k, I]
    a: np.ndarray                    # [T, k, I]
    y: np.ndarray                    # [T, k, H]
    shared_g: Optional[np.ndarray]   # [T, I_s] (None without a shared expert)
    shared_u: Optional[np.ndarray]
    shared_a: Optional[np.ndarray]
    swiglu_limit: Optional[float]
    _weights: _Weights


@dataclass(frozen=True, eq=False)
class Grads:
    """Gradients of one rank (float64).  ``dws_*`` are None without a shared expert."""
    dx: np.ndarray                   # [T, H]
    d_topk_weights: np.ndarray       # [T, k]
    dw_gate: np.ndarray              # [E, I, H]
    dw_up: np.ndarray                # [E, I, H]
    dw_down: np.ndarray              # [E, H, I]
    dws_gate: Optional[np.ndarray]   # [I_s, H]
    dws_up: Optional[np.ndarray]     # [I_s, H]
    dws_down: Optional[np.ndarray]   # [H, I_s]


@dataclass(frozen=True, eq=False)
class _Received:
    """Routes a destination rank received in the simulated dispatch, in (source, token, j) order."""
    src_rank: np.ndarray      # [n] int64
    src_slot: np.ndarray      # [n] int64, t * k + j on the source
    local_expert: np.ndarray  # [n] int64
    x: np.ndarray             # [n, H] float64, the dispatched token rows
    g: np.ndarray             # [n, I]
    u: np.ndarray             # [n, I]
    a: np.ndarray             # [n, I]


@dataclass(frozen=True, eq=False)
class EPContext:
    """Context of a simulated expert-parallel forward: one :class:`Context`-like view per rank."""
    num_ranks: int
    experts_per_rank: int
    xs: tuple                 # per source rank, [T_r, H] float64
    topk_ids: tuple           # per source rank, [T_r, k] int64 (global ids)
    topk_weights: tuple       # per source rank, [T_r, k] float64
    y: tuple                  # per source rank, [T_r, k, H]: combined expert outputs, unweighted
    received: tuple           # per destination rank, _Received
    shared: tuple             # per rank, _SharedActs or None
    swiglu_limit: Optional[float]
    _weights: tuple           # per rank, _Weights


# ----------------------------------------------------------------------------------------------
# Math
# ----------------------------------------------------------------------------------------------

def _sigmoid(z: np.ndarray) -> np.ndarray:
    # From e = exp(-|z|) in (0, 1]: never overflows (exp(-z) would for z < -709), and each side
    # keeps full relative accuracy: 1 / (1 + e) for z >= 0, e / (1 + e) for z < 0.  The tanh form
    # 0.5 * (1 + tanh(z / 2)) cancels for z < -20 and returns 0 from z = -38 (true: 3e-17).
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0, e) / (1.0 + e)


def silu(z: np.ndarray) -> np.ndarray:
    """``z * sigmoid(z)`` in the dtype of ``z``."""
    return z * _sigmoid(z)


def _swiglu(g: np.ndarray, u: np.ndarray, limit: Optional[float]) -> np.ndarray:
    if limit is not None:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    return silu(g) * u


def _swiglu_backward(g: np.ndarray, u: np.ndarray, da: np.ndarray,
                     limit: Optional[float]) -> tuple[np.ndarray, np.ndarray]:
    """(dg, du) of ``a = silu(min(g, L)) * clip(u, -L, L)``; gradient masked where clamped."""
    if limit is not None:
        gc = np.minimum(g, limit)
        uc = np.clip(u, -limit, limit)
    else:
        gc, uc = g, u
    s = _sigmoid(gc)
    dsilu = s * (1.0 + gc * (1.0 - s))
    dg = da * uc * dsilu
    du = da * (gc * s)
    if limit is not None:
        dg *= (g <= limit)
        du *= (np.abs(u) <= limit)
    return dg, du


def _f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def _group_by_expert(expert: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Stable order grouping rows by expert and the [E+1] offsets of each group in it."""
    order = np.argsort(expert, kind="stable")
    offsets = np.zeros(num_experts + 1, dtype=np.int64)
    np.cumsum(np.bincount(expert, minlength=num_experts), out=offsets[1:])
    return order, offsets


def _experts_forward(x: np.ndarray, row_token: np.ndarray, row_expert: np.ndarray,
                     w: _Weights, limit: Optional[float]):
    """Run rows ``x[row_token[i]]`` through expert ``row_expert[i]``; returns g, u, a, y per row."""
    n = row_token.shape[0]
    num_e, inter, hidden = w.w_gate.shape
    g = np.empty((n, inter))
    u = np.empty((n, inter))
    a = np.empty((n, inter))
    y = np.empty((n, hidden))
    order, offsets = _group_by_expert(row_expert, num_e)
    for e in range(num_e):
        idx = order[offsets[e]:offsets[e + 1]]
        if idx.size == 0:
            continue
        xe = x[row_token[idx]]
        ge = xe @ _f64(w.w_gate[e]).T
        ue = xe @ _f64(w.w_up[e]).T
        ae = _swiglu(ge, ue, limit)
        g[idx], u[idx], a[idx] = ge, ue, ae
        y[idx] = ae @ _f64(w.w_down[e]).T
    return g, u, a, y


def _experts_backward(x: np.ndarray, row_token: np.ndarray, row_expert: np.ndarray,
                      g: np.ndarray, u: np.ndarray, a: np.ndarray, dy: np.ndarray,
                      w: _Weights, limit: Optional[float]):
    """Backward of :func:`_experts_forward` given ``dy`` per row: (dx per row, dW_gate, dW_up, dW_down)."""
    num_e, inter, hidden = w.w_gate.shape
    n = row_token.shape[0]
    dx_rows = np.empty((n, hidden))
    dw_gate = np.zeros((num_e, inter, hidden))
    dw_up = np.zeros((num_e, inter, hidden))
    dw_down = np.zeros((num_e, hidden, inter))
    order, offsets = _group_by_expert(row_expert, num_e)
    for e in range(num_e):
        idx = order[offsets[e]:offsets[e + 1]]
        if idx.size == 0:
            continue  # no rows: zero weight gradient
        xe = x[row_token[idx]]
        dye = dy[idx]
        np.matmul(dye.T, a[idx], out=dw_down[e])
        dg, du = _swiglu_backward(g[idx], u[idx], dye @ _f64(w.w_down[e]), limit)
        np.matmul(dg.T, xe, out=dw_gate[e])
        np.matmul(du.T, xe, out=dw_up[e])
        dxe = dg @ _f64(w.w_gate[e])
        dxe += du @ _f64(w.w_up[e])
        dx_rows[idx] = dxe
    return dx_rows, dw_gate, dw_up, dw_down


def _shared_forward(x: np.ndarray, w: _Weights, limit: Optional[float]):
    if w.ws_gate is None:
        return None, None
    g = x @ _f64(w.ws_gate).T
    u = x @ _f64(w.ws_up).T
    a = _swiglu(g, u, limit)
    return _SharedActs(g, u, a), a @ _f64(w.ws_down).T


def _shared_backward(x: np.ndarray, acts: _SharedActs, d_out: np.ndarray, w: _Weights,
                     limit: Optional[float]):
    """(dx contribution, dws_gate, dws_up, dws_down) of the shared expert."""
    dws_down = d_out.T @ acts.a
    dg, du = _swiglu_backward(acts.g, acts.u, d_out @ _f64(w.ws_down), limit)
    dx = dg @ _f64(w.ws_gate) + du @ _f64(w.ws_up)
    return dx, dg.T @ x, du.T @ x, dws_down


def _combine(y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """sum_j weights[t, j] * y[t, j] in fixed j order (y: [T, k, H])."""
    out = np.zeros((y.shape[0], y.shape[2]))
    for j in range(y.shape[1]):
        out += weights[:, j, None] * y[:, j]
    return out


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

def _float_array(name: str, value, ndim: int) -> np.ndarray:
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.dtype not in _FLOAT_DTYPES:
        raise ArgumentError(name, f"dtype {arr.dtype} is not one of float64, float32, float16, bfloat16")
    if arr.ndim != ndim:
        raise ArgumentError(name, f"expected {ndim} dimensions, got shape {arr.shape}")
    return arr


def _expect_shape(name: str, arr: np.ndarray, shape: tuple) -> None:
    if arr.shape != tuple(shape):
        raise ArgumentError(name, f"expected shape {tuple(shape)}, got {arr.shape}")


def _check_limit(swiglu_limit) -> Optional[float]:
    if swiglu_limit is None:
        return None
    if isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, Real):
        raise ArgumentError("swiglu_limit", f"expected a float or None, got {swiglu_limit!r}")
    limit = float(swiglu_limit)
    if not (np.isfinite(limit) and limit > 0.0):
        raise ArgumentError("swiglu_limit", f"must be finite and > 0, got {limit}")
    return limit


def _check_weights(w_gate, w_up, w_down, ws_gate, ws_up, ws_down, *, suffix: str = "") -> _Weights:
    w_gate = _float_array("w_gate" + suffix, w_gate, 3)
    num_e, inter, hidden = w_gate.shape
    if num_e < 1 or inter < 1 or hidden < 1:
        raise ArgumentError("w_gate" + suffix, f"every dimension must be >= 1, got shape {w_gate.shape}")
    w_up = _float_array("w_up" + suffix, w_up, 3)
    _expect_shape("w_up" + suffix, w_up, (num_e, inter, hidden))
    w_down = _float_array("w_down" + suffix, w_down, 3)
    _expect_shape("w_down" + suffix, w_down, (num_e, hidden, inter))
    given = [v is not None for v in (ws_gate, ws_up, ws_down)]
    if any(given) and not all(given):
        missing = [n for n, g in zip(("ws_gate", "ws_up", "ws_down"), given) if not g]
        raise ArgumentError(missing[0] + suffix,
                            "the shared expert needs all of ws_gate, ws_up, ws_down (or none)")
    if all(given):
        ws_gate = _float_array("ws_gate" + suffix, ws_gate, 2)
        inter_s = ws_gate.shape[0]
        _expect_shape("ws_gate" + suffix, ws_gate, (inter_s, hidden))
        if inter_s < 1:
            raise ArgumentError("ws_gate" + suffix, "shared intermediate size must be >= 1")
        ws_up = _float_array("ws_up" + suffix, ws_up, 2)
        _expect_shape("ws_up" + suffix, ws_up, (inter_s, hidden))
        ws_down = _float_array("ws_down" + suffix, ws_down, 2)
        _expect_shape("ws_down" + suffix, ws_down, (hidden, inter_s))
    return _Weights(w_gate, w_up, w_down, ws_gate, ws_up, ws_down)


def _check_tokens(x, topk_ids, topk_weights, *, hidden: int, num_experts: int, suffix: str = "",
                  top_k: Optional[int] = None, x_name: str = "x"):
    """Validate one rank's x / topk_ids / topk_weights; returns float64 x, int64 ids, float64 weights."""
    x = _float_array(x_name + suffix, x, 2)
    if x.shape[1] != hidden:
        raise ArgumentError(x_name + suffix, f"hidden size {x.shape[1]} != weights' hidden size {hidden}")
    tokens = x.shape[0]
    ids = topk_ids if isinstance(topk_ids, np.ndarray) else np.asarray(topk_ids)
    if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise ArgumentError("topk_ids" + suffix, f"expected an integer dtype, got {ids.dtype}")
    if ids.ndim != 2 or ids.shape[0] != tokens or ids.shape[1] < 1:
        raise ArgumentError("topk_ids" + suffix, f"expected shape ({tokens}, k >= 1), got {ids.shape}")
    if top_k is not None and ids.shape[1] != top_k:
        raise ArgumentError("topk_ids" + suffix, f"k = {ids.shape[1]} differs from rank 0's k = {top_k}")
    bad = np.argwhere((ids < 0) | (ids >= num_experts))
    if bad.size:
        t, j = (int(v) for v in bad[0])
        raise ArgumentError("topk_ids" + suffix,
                            f"token {t} slot {j} has expert id {int(ids[t, j])} outside [0, {num_experts})")
    weights = _float_array("topk_weights" + suffix, topk_weights, 2)
    _expect_shape("topk_weights" + suffix, weights, ids.shape)
    return _f64(x), ids.astype(np.int64), _f64(weights)


# ----------------------------------------------------------------------------------------------
# Single rank
# ----------------------------------------------------------------------------------------------

def forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, *,
            ws_gate=None, ws_up=None, ws_down=None,
            swiglu_limit: Optional[float] = None) -> tuple[np.ndarray, Context]:
    """Forward of the whole layer with all ``E`` experts local; returns ``(out [T, H], ctx)``.

    ``x [T, H]``, ``topk_ids [T, k]`` (integers in ``[0, E)``, duplicates allowed and summed),
    ``topk_weights [T, k]``, ``w_gate``/``w_up [E, I, H]``, ``w_down [E, H, I]``, optional
    shared expert ``ws_gate``/``ws_up [I_s, H]``, ``ws_down [H, I_s]``.
    Exact float64; :func:`mok_rt.reference.forward` adds the FP8 precisions (reference/fp8.py).
    """
    limit = _check_limit(swiglu_limit)
    w = _check_weights(w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    num_e, _, hidden = w.w_gate.shape
    x64, ids, weights = _check_tokens(x, topk_ids, topk_weights, hidden=hidden, num_experts=num_e)
    tokens, k = ids.shape

    row_token = np.repeat(np.arange(tokens, dtype=np.int64), k)   # route t*k+j reads token t
    g, u, a, y = _experts_forward(x64, row_token, ids.reshape(-1), w, limit)
    y = y.reshape(tokens, k, hidden)
    out = _combine(y, weights)
    shared, shared_out = _shared_forward(x64, w, limit)
    if shared_out is not None:
        out = shared_out + out
    inter = w.w_gate.shape[1]
    ctx = Context(
        x=x64, topk_ids=ids, topk_weights=weights,
        g=g.reshape(tokens, k, inter), u=u.reshape(tokens, k, inter),
        a=a.reshape(tokens, k, inter), y=y,
        shared_g=None if shared is None else shared.g,
        shared_u=None if shared is None else shared.u,
        shared_a=None if shared is None else shared.a,
        swiglu_limit=limit, _weights=w)
    return out, ctx


def _check_d_out(d_out, shape: tuple, name: str = "d_out") -> np.ndarray:
    d_out = _float_array(name, d_out, 2)
    _expect_shape(name, d_out, shape)
    return _f64(d_out)


def backward(ctx: Context, d_out) -> Grads:
    """Gradients of ``sum(out * d_out)`` w.r.t. every input of :func:`forward` (in the
    precision of the forward that made ``ctx``)."""
    if not isinstance(ctx, Context):
        raise ArgumentError("ctx", f"expected a reference.Context, got {type(ctx).__name__}")
    w, limit = ctx._weights, ctx.swiglu_limit
    tokens, k = ctx.topk_ids.shape
    hidden = ctx.x.shape[1]
    d_out = _check_d_out(d_out, (tokens, hidden))

    d_topk_weights = np.einsum("th,tkh->tk", d_out, ctx.y)
    dy = (ctx.topk_weights[:, :, None] * d_out[:, None, :]).reshape(tokens * k, hidden)
    inter = w.w_gate.shape[1]
    row_token = np.repeat(np.arange(tokens, dtype=np.int64), k)
    dx_rows, dw_gate, dw_up, dw_down = _experts_backward(
        ctx.x, row_token, ctx.topk_ids.reshape(-1),
        ctx.g.reshape(-1, inter), ctx.u.reshape(-1, inter), ctx.a.reshape(-1, inter),
        dy, w, limit)
    dx = dx_rows.reshape(tokens, k, hidden).sum(axis=1)
    dws = (None, None, None)
    if ctx.shared_g is not None:
        dx_s, *dws = _shared_backward(ctx.x, _SharedActs(ctx.shared_g, ctx.shared_u, ctx.shared_a),
                                      d_out, w, limit)
        dx = dx_s + dx
    return Grads(dx=dx, d_topk_weights=d_topk_weights, dw_gate=dw_gate, dw_up=dw_up,
                 dw_down=dw_down, dws_gate=dws[0], dws_up=dws[1], dws_down=dws[2])


# ----------------------------------------------------------------------------------------------
# Expert parallelism, simulated
# ----------------------------------------------------------------------------------------------

def _per_rank(name: str, value, num_ranks: int, *, replicable: bool) -> list:
    """A per-rank list; a single array (or None) is replicated when ``replicable``."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_ranks:
            raise ArgumentError(name, f"expected {num_ranks} entries (one per rank), got {len(value)}")
        return list(value)
    if replicable:
        return [value] * num_ranks
    raise ArgumentError(name, f"expected a list of {num_ranks} per-rank arrays, got {type(value).__name__}")


def ep_forward(xs: Sequence, topk_ids: Sequence, topk_weights: Sequence,
               w_gate: Sequence, w_up: Sequence, w_down: Sequence, *, num_ranks: int,
               ws_gate=None, ws_up=None, ws_down=None,
               swiglu_limit: Optional[float] = None) -> tuple[list, EPContext]:
    """Simulated expert-parallel forward over ``num_ranks`` ranks; returns (per-rank outputs, ctx).

    ``xs``, ``topk_ids`` (GLOBAL expert ids), ``topk_weights`` are per-rank lists (token counts
    may differ, 0 included, ``k`` the same on every rank).  ``w_gate``, ``w_up``, ``w_down`` are
    per-rank lists of ``[E_l, ...]`` arrays: rank ``r`` owns experts ``r*E_l .. (r+1)*E_l - 1``.
    The shared expert (``ws_*``: one array, replicated, or a per-rank list) is applied by each rank
    to its own tokens.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, Integral) or num_ranks < 1:
        raise ArgumentError("num_ranks", f"expected an integer >= 1, got {num_ranks!r}")
    num_ranks = int(num_ranks)
    limit = _check_limit(swiglu_limit)
    per = {name: _per_rank(name, v, num_ranks, replicable=False)
           for name, v in (("xs", xs), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                           ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down))}
    shared = {name: _per_rank(name, v, num_ranks, replicable=True)
              for name, v in (("ws_gate", ws_gate), ("ws_up", ws_up), ("ws_down", ws_down))}
    weights = [_check_weights(per["w_gate"][r], per["w_up"][r], per["w_down"][r],
                              shared["ws_gate"][r], shared["ws_up"][r], shared["ws_down"][r],
                              suffix=f"[{r}]") for r in range(num_ranks)]
    e_local, inter, hidden = weights[0].w_gate.shape
    for r, w in enumerate(weights[1:], start=1):
        if w.w_gate.shape != (e_local, inter, hidden):
            raise ArgumentError(f"w_gate[{r}]", f"shape {w.w_gate.shape} differs from rank 0's "
                                                f"{(e_local, inter, hidden)}")
        if (w.ws_gate is None) != (weights[0].ws_gate is None) or (
                w.ws_gate is not None and w.ws_gate.shape != weights[0].ws_gate.shape):
            raise ArgumentError(f"ws_gate[{r}]", "the shared expert must be the same shape on every rank")
    num_e = e_local * num_ranks
    xs64, ids, tw = [], [], []
    for r in range(num_ranks):
        x64, i64, w64 = _check_tokens(per["xs"][r], per["topk_ids"][r], per["topk_weights"][r],
                                      hidden=hidden, num_experts=num_e, suffix=f"[{r}]",
                                      top_k=ids[0].shape[1] if ids else None, x_name="xs")
        xs64.append(x64), ids.append(i64), tw.append(w64)
    k = ids[0].shape[1]

    # Dispatch: each destination gathers, from every source in rank order, the routes (t, j)
    # that land on its experts, in (t, j) order -- the schedule's row order within an expert.
    received = []
    y_src = [np.full((ids[s].shape[0] * k, hidden), np.nan) for s in range(num_ranks)]
    for d in range(num_ranks):
        src_rank, src_slot, local = [], [], []
        for s in range(num_ranks):
            flat = ids[s].reshape(-1)
            slots = np.nonzero(flat // e_local == d)[0]
            src_rank.append(np.full(slots.size, s, dtype=np.int64))
            src_slot.append(slots)
            local.append(flat[slots] - d * e_local)
        src_rank = np.concatenate(src_rank)
        src_slot = np.concatenate(src_slot)
        local = np.concatenate(local)
        x_recv = np.empty((src_slot.size, hidden))
        for s in range(num_ranks):
            mine = src_rank == s
            x_recv[mine] = xs64[s][src_slot[mine] // k]
        rows = np.arange(src_slot.size, dtype=np.int64)
        g, u, a, y = _experts_forward(x_recv, rows, local, weights[d], limit)
        # Combine, part 1: every expert output row goes back to its (token, j) slot on the source.
        for s in range(num_ranks):
            mine = src_rank == s
            y_src[s][src_slot[mine]] = y[mine]
        received.append(_Received(src_rank, src_slot, local, x_recv, g, u, a))

    outs, shared_acts, y_out = [], [], []
    for s in range(num_ranks):
        tokens = ids[s].shape[0]
        y = y_src[s].reshape(tokens, k, hidden)
        out = _combine(y, tw[s])   # combine, part 2: fixed-order reduction of the k slots
        acts, shared_out = _shared_forward(xs64[s], weights[s], limit)
        if shared_out is not None:
            out = shared_out + out
        outs.append(out), shared_acts.append(acts), y_out.append(y)
    ctx = EPContext(num_ranks=num_ranks, experts_per_rank=e_local, xs=tuple(xs64),
                    topk_ids=tuple(ids), topk_weights=tuple(tw), y=tuple(y_out),
                    received=tuple(received), shared=tuple(shared_acts),
                    swiglu_limit=limit, _weights=tuple(weights))
    return outs, ctx


def ep_backward(ctx: EPContext, d_outs: Sequence) -> list[Grads]:
    """Per-rank gradients of a simulated EP forward.

    ``dx``/``d_topk_weights`` are for that rank's tokens; ``dw_*`` for that rank's experts (summed
    over every rank's tokens); ``dws_*`` that rank's shared-expert gradients from its own tokens.
    """
    if not isinstance(ctx, EPContext):
        raise ArgumentError("ctx", f"expected a reference.EPContext, got {type(ctx).__name__}")
    num_ranks, limit = ctx.num_ranks, ctx.swiglu_limit
    d_outs = _per_rank("d_outs", d_outs, num_ranks, replicable=False)
    k = ctx.topk_ids[0].shape[1]
    hidden = ctx.xs[0].shape[1]
    d64 = [_check_d_out(d_outs[s], ctx.xs[s].shape, name=f"d_outs[{s}]") for s in range(num_ranks)]

    # Source side: d_topk_weights from the combined outputs, and the weighted output gradient of
    # every route, which travels back to the expert's rank (the reverse of combine).
    d_tw, dy_src = [], []
    for s in range(num_ranks):
        d_tw.append(np.einsum("th,tkh->tk", d64[s], ctx.y[s]))
        dy_src.append((ctx.topk_weights[s][:, :, None] * d64[s][:, None, :]).reshape(-1, hidden))

    dx_src = [np.full((ctx.xs[s].shape[0] * k, hidden), np.nan) for s in range(num_ranks)]
    dw = []
    for d in range(num_ranks):
        rec = ctx.received[d]
        dy = np.empty((rec.src_slot.size, hidden))
        for s in range(num_ranks):
            mine = rec.src_rank == s
            dy[mine] = dy_src[s][rec.src_slot[mine]]
        rows = np.arange(rec.src_slot.size, dtype=np.int64)
        dx_rows, *dws = _experts_backward(rec.x, rows, rec.local_expert, rec.g, rec.u, rec.a,
                                          dy, ctx._weights[d], limit)
        for s in range(num_ranks):   # dx rows return to their (token, j) slot on the source
            mine = rec.src_rank == s
            dx_src[s][rec.src_slot[mine]] = dx_rows[mine]
        dw.append(dws)

    grads = []
    for r in range(num_ranks):
        tokens = ctx.xs[r].shape[0]
        dx = dx_src[r].reshape(tokens, k, hidden).sum(axis=1)
        dws = (None, None, None)
        if ctx.shared[r] is not None:
            dx_s, *dws = _shared_backward(ctx.xs[r], ctx.shared[r], d64[r], ctx._weights[r], limit)
            dx = dx_s + dx
        grads.append(Grads(dx=dx, d_topk_weights=d_tw[r], dw_gate=dw[r][0], dw_up=dw[r][1],
                           dw_down=dw[r][2], dws_gate=dws[0], dws_up=dws[1], dws_down=dws[2]))
    return grads
