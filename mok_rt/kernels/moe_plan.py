"""The task plan of the MoE megakernels, built once on the host per launch shape.

A launch's task index space is a fixed sequence of phases, each a contiguous range of task indices
sized from host-known bounds (row-block capacity, token blocks, tile counts); the kernels skip the
tasks beyond their routing counts, which only the device reads.  The plan holds, for the kernels
(``MoEForwardPlan`` / ``MoEBackwardPlan`` in cuda_src/moe/params.cuh, inside the parameter struct):

* the phase table: first task index and count of every phase, and the total;
* the tile counts the task decoders need;
* for every dependency counter, how many signals a waiter expects (``Wait``), per counter element,
  or per row block in use where the producer count depends on routing (the device multiplies);

and, for the host only, the counter layout (where each counter array lives in the one counter
allocation that is zeroed before every launch) and which phase produces and which consume each
counter (what tests/test_task_order.py checks).  The kernels walk some phases in another order
(cuda_src/moe/pipeline: a permutation that keeps every task after what it waits on); the trace
records carry the plan index, so :meth:`Plan.phase_of` labels them.
"""
from __future__ import annotations

import functools

import bisect
import ctypes
from dataclasses import dataclass

from mok_rt.kernels import moe_params as P
from mok_rt.kernels.moe_params_fp8 import FP8_TILE_N, token_ld

__all__ = ["Phase", "Counter", "Wait", "Plan", "forward_plan", "backward_plan", "combine_parts",
           "CHUNKS_PER_PUSH_TASK", "readiness_chunks", "fp8_push_tasks"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# Expert parallelism: the push releases its rows in readiness chunks of source tokens
# (cuda_src/moe/tasks/ep.cuh), push task i pushing chunks i, i + P, i + 2P, ... (P push tasks).
# Four chunks per push task: the first quarter of every rank's tokens is released after about a
# quarter of the push, so the blocks made of early tokens start their GEMMs then; more chunks
# would cost a dispatch more flag loads (a 128-row block spans 128 / (k / E) source tokens).
CHUNKS_PER_PUSH_TASK = 4


def readiness_chunks(max_tokens: int, push_tasks: int) -> tuple[int, int]:
    """``(chunk_tokens, chunks)``: source tokens per readiness chunk and the chunk flags a rank's
    block holds per source.  Computed from what every rank of a group shares (max_tokens and the
    configuration's push tasks), so every rank cuts its tokens at the same places; a rank with
    fewer tokens simply has fewer chunks."""
    if max_tokens < 1 or push_tasks < 1:
        raise AssertionError(f"readiness_chunks({max_tokens}, {push_tasks})")
    chunk_tokens = _ceil_div(max_tokens, CHUNKS_PER_PUSH_TASK * push_tasks)
    return chunk_tokens, _ceil_div(max_tokens, chunk_tokens)


combine_parts = P.combine_parts


@dataclass(frozen=True)
class Phase:
    name: str
    begin: int
    count: int

    @property
    def end(self) -> int:
        return self.begin + self.count


@dataclass(frozen=True)
class Counter:
    """One int32 array of the counter allocation: ``offset`` and ``length`` in words."""
    name: str
    offset: int
    length: int


@dataclass(frozen=True)
class Wait:
    """A dependency: waiters on ``counter`` expect ``target`` signals per element (``per_block``:
    per row block in use, multiplied on the device).  ``producer``: the phase whose tasks signal
    it, once each, spread over ``units`` elements (row blocks, token blocks, experts' blocks, or
    1); ``consumers``: the phases that wait on it."""
    field: str              # the plan struct's field (wait_<counter>...)
    counter: str
    target: int
    producer: str
    units: int
    consumers: tuple[str, ...]
    per_block: bool = False


@dataclass(frozen=True)
class Plan:
    kind: str                        # "forward" or "backward"
    phases: tuple[Phase, ...]
    tiles: dict                      # the plan struct's tile-count fields
    waits: tuple[Wait, ...]
    counters: tuple[Counter, ...]
    precision: str = "bf16"          # "fp8_block": the FP8 forward (MoEFp8Plan holds the extras)

    @property
    def total(self) -> int:
        return self.phases[-1].end if self.phases else 0

    @property
    def counter_words(self) -> int:
        return sum(c.length for c in self.counters)

    def phase(self, name: str) -> Phase:
        for ph in self.phases:
            if ph.name == name:
                return ph
        raise KeyError(name)

    def phase_table(self) -> tuple[tuple[str, int], ...]:
        """(phase name, task count) in index order."""
        return tuple((ph.name, ph.count) for ph in self.phases)

    def phase_of(self, task: int) -> str:
        """The phase holding plan index ``task``."""
        if not 0 <= task < self.total:
            raise IndexError(f"task {task} outside the plan [0, {self.total})")
        return self.phases[bisect.bisect_right([ph.end for ph in self.phases], task)].name

    def counter_pointers(self, base: int) -> dict[str, int]:
        """Device address of every counter array in an allocation at ``base``."""
        return {c.name: base + 4 * c.offset for c in self.counters}

    def struct(self) -> ctypes.Structure:
        """The kernels' plan struct (MoEForwardPlan / MoEBackwardPlan); for an FP8 plan its
        bf16-shaped part (the rest: :meth:`fp8_struct`)."""
        cls = P.MoEForwardPlan if self.kind == "forward" else P.MoEBackwardPlan
        s = cls()
        values = {n for n, _ in cls._fields_}
        extra = set(_FP8_EXTRA) if self.precision != "bf16" else set()
        for ph in self.phases:
            if ph.name not in extra:
                r = getattr(s, ph.name)
                r.begin, r.count = ph.begin, ph.count
        s.total = self.total
        for name, v in self.tiles.items():
            if name not in extra:
                setattr(s, name, v)
        for w in self.waits:
            if w.field not in extra:
                setattr(s, w.field, w.target)
        given = {ph.name for ph in self.phases} | {"total"} | set(self.tiles) | {w.field for w in self.waits}
        if given - extra != values:
            raise AssertionError(f"plan fields {sorted((given - extra) ^ values)} do not match {cls.__name__}")
        return s

    def fp8_struct(self) -> ctypes.Structure:
        """What the FP8 plan adds: MoEFp8Plan (cuda_src/moe/params_fp8.cuh) of the forward,
        MoEFp8BackwardPlan (params_fp8_bwd.cuh) of the backward."""
        from mok_rt.kernels.moe_params_fp8 import MoEFp8Plan
        if self.precision == "bf16":
            raise AssertionError("a bf16 plan has no FP8 part")
        if self.kind == "backward":
            from mok_rt.kernels.moe_params_fp8_bwd import MoEFp8BackwardPlan
            s = MoEFp8BackwardPlan()
            for name in ("token_prep", "widen"):
                ph = self.phase(name)
                getattr(s, name).begin, getattr(s, name).count = ph.begin, ph.count
            for w in self.waits:
                if w.field in _FP8_BWD_EXTRA:
                    setattr(s, w.field, w.target)
            for name in ("token_ld", "token_rows", "ip_blocks", "ips_blocks"):
                setattr(s, name, self.tiles[name])
            return s
        ph = self.phase("quant_x")
        s = MoEFp8Plan()
        s.quant_x.begin, s.quant_x.count = ph.begin, ph.count
        s.wait_token_xq_ready = next(w.target for w in self.waits if w.field == "wait_token_xq_ready")
        s.token_ld = self.tiles["token_ld"]
        return s


# The FP8 plans' names that live in MoEFp8Plan / MoEFp8BackwardPlan, not in the bf16 plan structs.
_FP8_BWD_EXTRA = ("token_prep", "widen", "wait_token_dq_ready", "wait_expert_widen_ready_per_block",
                  "wait_prep_done", "token_ld", "token_rows", "ip_blocks", "ips_blocks")
_FP8_EXTRA = ("quant_x", "wait_token_xq_ready", "token_ld") + _FP8_BWD_EXTRA


def fp8_push_tasks(dims) -> int:
    """The FP8 forward's push tasks with expert parallelism: one per token block (each quantises
    its block once, tasks/ep_fp8.cuh), at least one (every rank pushes and notifies, T = 0 too)."""
    return max(1, dims.token_blocks)


def _layout(sizes) -> tuple[Counter, ...]:
    out, at = [], 0
    for name, words in sizes:
        out.append(Counter(name, at, words))
        at += words
    return tuple(out)


def _phases(entries) -> tuple[Phase, ...]:
    out, at = [], 0
    for name, count in entries:
        out.append(Phase(name, at, count))
        at += count
    return tuple(out)


@functools.lru_cache(maxsize=256)   # plans are immutable and rebuilt for every launch otherwise
def forward_plan(dims, *, context_only: bool = False, push_tasks: int = 0, precision: str = "bf16") -> Plan:
    """The forward's plan; ``push_tasks`` > 0 with expert parallelism (then the shared expert's
    gate|up runs while the rows travel, before the dispatch).

    ``precision="fp8_block"``: the FP8 forward's plan (cuda_src/moe/tasks/forward_fp8.cuh).  Its
    down tiles are 256 columns wide (``h_tiles``, as bf16), and a ``quant_x`` phase (x quantised in
    token order, one task per token block, only with a shared expert) comes before the dispatch:
    the shared gate|up tiles of token block tb wait for it (``token_xq_ready``).  With expert
    parallelism (tasks/ep_fp8.cuh) the push tasks are one per token block (``fp8_push_tasks``):
    each quantises its block in token order as ``quant_x`` would (which is then empty) and signals
    ``token_xq_ready``, then pushes the E4M3 rows."""
    d = dims
    fp8 = precision != "bf16"
    if fp8 and (precision != "fp8_block" or push_tasks not in (0, fp8_push_tasks(d))):
        raise AssertionError(f"no FP8 plan for precision={precision!r}, push_tasks={push_tasks}")
    tb, mb = d.token_blocks, d.max_blocks
    gu, sgu = _ceil_div(d.intermediate, P.GATE_UP_COLS), _ceil_div(d.shared_intermediate, P.GATE_UP_COLS)
    h_t = _ceil_div(d.hidden, FP8_TILE_N if fp8 else P.TILE_N)
    shared, ep = d.shared_intermediate > 0, push_tasks > 0
    cparts = combine_parts(tb)
    if ep:
        lead = [("push", push_tasks), ("push_notify", 1), ("shared_gu", tb * sgu), ("dispatch", mb)]
    else:
        lead = [("push", 0), ("push_notify", 0), ("dispatch", mb), ("shared_gu", tb * sgu)]
    if fp8:
        lead.insert(2, ("quant_x", tb if shared and not ep else 0))
    phases = _phases(lead + [
        ("routed_gu", mb * gu),
        ("shared_down", tb * h_t if shared and not context_only else 0),
        ("routed_down", mb * h_t),
        ("down_notify", 1 if ep else 0),
        # With EP a context-only launch still collects its routes' outputs (y_slot is context).
        ("combine", 0 if context_only and not ep else tb * cparts),
    ])
    waits = (
        Wait("wait_block_ready", "block_ready", 1, "dispatch", mb, ("routed_gu",)),
        Wait("wait_block_act_ready", "block_act_ready", gu, "routed_gu", mb, ("routed_down",)),
        Wait("wait_token_sact_ready", "token_sact_ready", sgu, "shared_gu", tb, ("shared_down",)),
        Wait("wait_token_shared_done", "token_shared_done", h_t, "shared_down", tb, ("combine",)),
        Wait("wait_down_done_per_block", "down_done", h_t, "routed_down", mb, ("down_notify", "combine"),
             per_block=True),
        Wait("wait_push_done", "push_done", push_tasks, "push", 1, ("push_notify",)),
    )
    sizes = [("task_next", 1), ("down_done", 1), ("block_ready", mb), ("block_act_ready", mb),
             ("token_sact_ready", tb), ("token_shared_done", tb), ("push_done", 1), ("ctas_done", 1)]
    tiles = {"token_blocks": tb, "gu_tiles": gu, "sgu_tiles": sgu, "h_tiles": h_t, "combine_parts": cparts}
    if fp8:
        # With EP the push tasks signal it (one per token block, and one at T = 0: fp8_push_tasks);
        # they do so with or without a shared expert, but only the shared gate|up waits on it.
        xq_units = fp8_push_tasks(d) if ep else tb
        waits += (Wait("wait_token_xq_ready", "token_xq_ready", 1 if shared else 0,
                       "push" if ep and shared else "quant_x", xq_units, ("shared_gu",)),)
        sizes.append(("token_xq_ready", xq_units))
        tiles["token_ld"] = token_ld(d)
    return Plan("forward", phases, tiles, waits, _layout(sizes), precision)


@functools.lru_cache(maxsize=256)
def backward_plan(dims, *, push_tasks: int = 0, precision: str = "bf16") -> Plan:
    """The backward's plan; ``push_tasks`` > 0 with expert parallelism (then the local work, d
    weights and shared dA, runs while the rows travel).

    ``precision="fp8_block"`` (docs/FP8_BACKWARD.md; moe_backward_fp8):
    the same phases and tile counts (FP8 dA and dX tiles are 128 x 256 too), plus ``token_prep`` (one
    task per token block with a shared expert, before the dispatch: dq in token order and the
    token-order bf16 wgrad operands; shared dA waits on ``token_dq_ready``, the shared wgrads on
    ``prep_done``) and ``widen`` (one task per row block, after routed dX: bf16 x_routed and act for
    the routed wgrads, which wait on ``expert_widen_ready``).  With expert parallelism
    (tasks/ep_fp8.cuh) the push tasks are one per token block (``fp8_push_tasks``): each quantises
    its block of d_out in token order (dq, dq_bf: token_prep's first half), sends the E4M3 rows
    with their scales and routing weights, then does token_prep's second half (``token_prep`` is
    empty; ``prep_done`` comes from the push tasks)."""
    d = dims
    fp8 = precision != "bf16"
    if fp8 and (precision != "fp8_block" or push_tasks not in (0, fp8_push_tasks(d))):
        raise AssertionError(f"no FP8 plan for precision={precision!r}, push_tasks={push_tasks}")
    tb, mb, E = d.token_blocks, d.max_blocks, d.local_experts
    i_t, si_t, h_t = (_ceil_div(v, P.TILE_N) for v in (d.intermediate, d.shared_intermediate, d.hidden))
    h_r, i_r, si_r = (_ceil_div(v, P.BLOCK_M) for v in (d.hidden, d.intermediate, d.shared_intermediate))
    shared, ep = d.shared_intermediate > 0, push_tasks > 0
    cparts = combine_parts(tb)
    local = [("d_weights", tb), ("shared_da", tb * si_t if shared else 0)]
    lead = ([("push", push_tasks), ("push_notify", 1), *local, ("dispatch", mb)] if ep
            else [("push", 0), ("push_notify", 0), ("dispatch", mb), *local])
    if fp8:
        lead.insert(2, ("token_prep", tb if shared and not ep else 0))
    phases = _phases(lead + [
        ("routed_da", mb * i_t),
        ("shared_dx", tb * h_t if shared else 0),
        ("routed_dx", mb * h_t),
        ("dx_notify", 1 if ep else 0),
        *([("widen", mb)] if fp8 else []),
        ("wgrad_down", E * h_r * i_t),
        ("wgrad_gate_up", E * 2 * i_r * h_t),
        ("shared_wgrad", h_r * si_t + 2 * si_r * h_t if shared else 0),
        ("combine", tb * cparts),
    ])
    waits = (
        Wait("wait_block_dy_ready", "block_dy_ready", 1, "dispatch", mb, ("routed_da",)),
        Wait("wait_block_dgu_ready", "block_dgu_ready", i_t, "routed_da", mb, ("routed_dx",)),
        Wait("wait_expert_dy_ready_per_block", "expert_dy_ready", 1, "dispatch", mb, ("wgrad_down",),
             per_block=True),
        Wait("wait_expert_dgu_ready_per_block", "expert_dgu_ready", i_t, "routed_da", mb, ("wgrad_gate_up",),
             per_block=True),
        Wait("wait_token_dsgu_ready", "token_dsgu_ready", si_t if shared else 0, "shared_da", tb, ("shared_dx",)),
        Wait("wait_token_dxs_ready", "token_dxs_ready", h_t if shared else 0, "shared_dx", tb, ("combine",)),
        Wait("wait_dsgu_done", "dsgu_done", tb * si_t if shared else 0, "shared_da", 1, ("shared_wgrad",)),
        Wait("wait_dx_done_per_block", "dx_done", h_t, "routed_dx", mb, ("dx_notify", "combine"), per_block=True),
        Wait("wait_push_done", "push_done", push_tasks, "push", 1, ("push_notify",)),
    )
    counters = _layout([("task_next", 1), ("dx_done", 1), ("dsgu_done", 1), ("block_dy_ready", mb),
                        ("block_dgu_ready", mb), ("expert_dy_ready", E), ("expert_dgu_ready", E),
                        ("token_dsgu_ready", tb), ("token_dxs_ready", tb), ("push_done", 1), ("ctas_done", 1)])
    tiles = {"token_blocks": tb, "i_tiles": i_t, "si_tiles": si_t, "h_tiles": h_t, "h_rows": h_r, "i_rows": i_r,
             "si_rows": si_r, "combine_parts": cparts}
    if fp8:
        from mok_rt.kernels.moe_params_fp8_bwd import token_rows
        # With EP the push tasks do token_prep's work (one per token block, and one at T = 0, which
        # signals token_dq_ready but has no block to widen: prep_done's target stays tb).
        dq_units = fp8_push_tasks(d) if ep else tb
        prep = "push" if ep and shared else "token_prep"
        waits += (
            Wait("wait_token_dq_ready", "token_dq_ready", 1 if shared else 0, prep, dq_units, ("shared_da",)),
            Wait("wait_expert_widen_ready_per_block", "expert_widen_ready", 1, "widen", mb,
                 ("wgrad_down", "wgrad_gate_up"), per_block=True),
            Wait("wait_prep_done", "prep_done", tb if shared else 0, prep, 1, ("shared_wgrad",)),
        )
        counters = _layout([(c.name, c.length) for c in counters] +
                           [("token_dq_ready", dq_units), ("expert_widen_ready", E), ("prep_done", 1)])
        tiles.update(token_ld=token_ld(d), token_rows=token_rows(d), ip_blocks=_ceil_div(d.intermediate, 128),
                     ips_blocks=_ceil_div(d.shared_intermediate, 128))
    return Plan("backward", phases, tiles, waits, counters, precision)
