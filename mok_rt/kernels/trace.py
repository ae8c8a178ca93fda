"""Per-task timelines of the MoE megakernels (``Workspace(trace=True)``; cuda_src/moe/tasks/trace.cuh).

Every launch of a traced workspace gets one 32-byte record per task of its plan, zeroed before
the launch: when the task was grabbed, when its waits were done, when its work was done, and
(plan task << 32 | SM id).  :class:`LaunchTrace` decodes them with the plan's phase table
(``_moe_plan.Plan.phase_table()``) into :class:`TaskSpan` s, answers the
questions a profile needs (busy and waiting time per phase, how long SMs sat idle at the end)
and writes Chrome trace events (chrome://tracing, https://ui.perfetto.dev), one row per SM.

"ready" is when the task's work starts: when the workers take it (the producer grabbed it earlier
and did its dependency waits, while the workers still ran the task before).
Busy intervals [ready, end] of one SM never overlap; waits [grab, ready] overlap
the previous task's busy interval (the producer runs ahead), so the Chrome trace draws them on a
separate row per SM.
"end" is stamped by worker 0 after the task's body: for tasks that signal counters that is after
a barrier of all workers (the FP8 forward's GEMM tasks hand the release itself to a signaler
thread, so their counters move a little later); the weight-gradient tiles signal nothing, so
their "end" is when worker 0's warpgroup finished its stores (the other warpgroup may still be
storing).
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["TaskSpan", "PhaseStats", "IdleStretch", "LaunchTrace", "write_chrome_trace", "PUSH_PHASES", "GEMM_PHASES",
           "ROUTED_GEMM_PHASES", "union_us", "overlap_us"]

RECORD_BYTES = 32

# Phase names (mok_rt/kernels/moe_plan.py) by what their tasks do: the expert-parallel push, and
# the GEMM tiles (routed: on the rows that the push delivers).
PUSH_PHASES = frozenset({"push"})
ROUTED_GEMM_PHASES = frozenset({"routed_gu", "routed_down", "routed_da", "routed_dx", "wgrad_down", "wgrad_gate_up"})
GEMM_PHASES = ROUTED_GEMM_PHASES | {"shared_gu", "shared_down", "shared_da", "shared_dx", "shared_wgrad"}


def _merged(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return [(a, b) for a, b in out]


def union_us(intervals) -> float:
    """Length of the union of [a, b) intervals."""
    return sum(b - a for a, b in _merged(intervals))


def overlap_us(xs, ys) -> float:
    """Length of (union of xs) intersected with (union of ys)."""
    mx, my = _merged(xs), _merged(ys)
    i = j = 0
    total = 0.0
    while i < len(mx) and j < len(my):
        lo, hi = max(mx[i][0], my[j][0]), min(mx[i][1], my[j][1])
        total += max(0.0, hi - lo)
        if mx[i][1] < my[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True)
class TaskSpan:
    """One task of one launch; times in microseconds from the launch's first grab."""
    task: int        # plan index
    phase: str
    sm: int
    grab_us: float
    ready_us: float
    end_us: float


@dataclass(frozen=True)
class PhaseStats:
    phase: str
    tasks: int
    wait_us: float     # sum over tasks of ready - grab (the task held its SM but could not start)
    busy_us: float     # sum over tasks of end - ready
    first_us: float    # first grab
    last_us: float     # last end


@dataclass(frozen=True)
class IdleStretch:
    """An SM with nothing running between two of its tasks: ``after`` ended at ``from_us``, ``next``
    started at ``to_us`` (``next_grab_us``: when it was grabbed; ``to_us - next_grab_us`` of the
    stretch is the next task's own dependency wait)."""
    sm: int
    from_us: float
    to_us: float
    after: str          # the phase of the SM's task before
    next: str           # the phase of the task after
    next_task: int
    next_grab_us: float


@dataclass
class LaunchTrace:
    """The decoded records of one launch.  ``unfinished``: tasks without an end (the launch
    stopped on an error, or a skipped task of a rank that timed out)."""
    kind: str                       # "forward", "recompute" (context only) or "backward"
    rank: int
    device_id: int
    phases: tuple[tuple[str, int], ...]
    spans: list[TaskSpan] = field(default_factory=list)
    unfinished: int = 0
    t0_ns: int = 0                  # %globaltimer of the first grab: aligns launches of one GPU

    @classmethod
    def decode(cls, raw: np.ndarray, *, kind: str, phases, rank: int = 0,
               device_id: int = 0) -> "LaunchTrace":
        """``raw``: the launch's records, uint64 [num_tasks, 4] (or flat)."""
        phases = tuple((str(n), int(c)) for n, c in phases)
        total = sum(c for _, c in phases)
        rec = np.asarray(raw, dtype=np.uint64).reshape(-1, 4)
        if rec.shape[0] != total:
            raise ValueError(f"{rec.shape[0]} records for a plan of {total} tasks")
        starts, names, at = [], [], 0
        for name, count in phases:
            if count:
                starts.append(at)
                names.append(name)
            at += count
        out = cls(kind=kind, rank=rank, device_id=device_id, phases=phases)
        grabbed = rec[:, 0] != 0
        if not grabbed.any():
            return out
        t0 = int(rec[grabbed, 0].min())
        out.t0_ns = t0
        for g in np.flatnonzero(grabbed):
            grab, ready, end, info = (int(v) for v in rec[g])
            task, sm = info >> 32, info & 0xFFFFFFFF
            if task >= total:
                raise ValueError(f"record {g} names task {task} of a plan of {total}")
            if end == 0:
                out.unfinished += 1
                continue
            phase = names[bisect.bisect_right(starts, task) - 1]
            out.spans.append(TaskSpan(task=task, phase=phase, sm=sm, grab_us=(grab - t0) / 1e3,
                                      ready_us=(ready - t0) / 1e3, end_us=(end - t0) / 1e3))
        out.spans.sort(key=lambda s: (s.grab_us, s.task))
        return out

    # ---- questions --------------------------------------------------------------------------
    @property
    def span_us(self) -> float:
        """First grab to last end."""
        return max((s.end_us for s in self.spans), default=0.0)

    def phase_stats(self) -> list[PhaseStats]:
        by: dict[str, list[TaskSpan]] = {}
        for s in self.spans:
            by.setdefault(s.phase, []).append(s)
        out = []
        for name, _ in self.phases:
            ss = by.get(name)
            if not ss:
                continue
            out.append(PhaseStats(phase=name, tasks=len(ss), wait_us=sum(s.ready_us - s.grab_us for s in ss),
                                  busy_us=sum(s.end_us - s.ready_us for s in ss),
                                  first_us=min(s.grab_us for s in ss), last_us=max(s.end_us for s in ss)))
        return out

    def sm_busy_fraction(self) -> dict[int, float]:
        """Per SM: the share of the launch's span its tasks ran (sum of end - ready)."""
        span = self.span_us or 1.0
        busy: dict[int, float] = {}
        for s in self.spans:
            busy[s.sm] = busy.get(s.sm, 0.0) + (s.end_us - s.ready_us)
        return {sm: b / span for sm, b in sorted(busy.items())}

    def tail_idle_us(self) -> float:
        """SM-microseconds lost at the end: for each SM, launch end minus its last task's end."""
        last: dict[int, float] = {}
        for s in self.spans:
            last[s.sm] = max(last.get(s.sm, 0.0), s.end_us)
        span = self.span_us
        return sum(span - t for t in last.values())

    def idle_gaps(self, *, window_us: float = 0.0) -> dict:
        """Where the SMs sat idle between tasks: for each task, how long its SM had nothing running
        before it (its ``ready`` minus the end of that SM's previous task, or minus the launch's
        first grab for an SM's first task), summed by the task's phase, in plan order
        (``by_phase``: SM-us, tasks that waited).  ``window_us`` > 0 adds ``by_window``: the idle
        SM-us per window of the launch's time (each gap split over the windows it spans; the last
        window may be partial, ``last_window_us`` long), to tell a slow start from stalls spread
        over the run.  The tail (each SM's last end to the launch's end) is :meth:`tail_idle_us`,
        in neither."""
        acc: dict[str, list[float]] = {}
        span = self.span_us
        nwin = max(1, math.ceil(span / window_us)) if window_us > 0 else 0
        by_window = [0.0] * nwin
        for s, prev, _ in self._gaps():
            gap = s.ready_us - prev
            a = acc.setdefault(s.phase, [0.0, 0])
            a[0] += gap
            a[1] += 1
            if nwin:
                # Each window's share of [prev, ready): a bounded loop over window indices (stepping
                # by window edges can stall where (w + 1) * window_us rounds back into window w).
                first, last_w = (min(int(v // window_us), nwin - 1) for v in (prev, s.ready_us))
                for w in range(first, last_w + 1):
                    by_window[w] += max(0.0, min(s.ready_us, (w + 1) * window_us) - max(prev, w * window_us))
        order = [name for name, _ in self.phases if name in acc]
        return {"by_phase": {k: (acc[k][0], int(acc[k][1])) for k in order}, "by_window": by_window,
                "window_us": window_us, "last_window_us": span - (nwin - 1) * window_us if nwin else 0.0}

    def gaps_summary(self, *, window_us: float = 250.0) -> str:
        """:meth:`idle_gaps` as text: per phase the idle SM time before its tasks (share of the
        launch's SM time) and its tasks' median and p90 durations; the tail; the average number of
        idle SMs per window."""
        g = self.idle_gaps(window_us=window_us)
        sms = max(len(self.sm_busy_fraction()), 1)
        total = self.span_us * sms or 1.0
        lines = [f"{self.kind} (rank {self.rank}): idle SM-us before tasks, by the task's phase "
                 f"(share of {total:.0f} SM-us)"]
        for name, (us, n) in g["by_phase"].items():
            dur = np.array([s.end_us - s.ready_us for s in self.spans if s.phase == name])
            lines.append(f"  {name:<16}{us:>11.1f} ({100 * us / total:4.1f} %) over {n} tasks; task time "
                         f"median {np.median(dur):.1f} us, p90 {np.percentile(dur, 90):.1f} us")
        lines.append(f"  {'tail':<16}{self.tail_idle_us():>11.1f} ({100 * self.tail_idle_us() / total:4.1f} %)")
        widths = [window_us] * (len(g["by_window"]) - 1) + [g["last_window_us"]]
        lines.append(f"  idle SMs on average per {window_us:.0f} us window (the tail not counted): "
                     + " ".join(f"{w / max(d, 1e-9):.1f}" for w, d in zip(g["by_window"], widths)))
        return "\n".join(lines)

    def idle_stretches(self, *, min_us: float = 20.0) -> list[IdleStretch]:
        """Every gap of at least ``min_us`` between two tasks of one SM, by start time: who sat idle,
        after what, and for which task (a grabbed task that waits holds its SM meanwhile)."""
        out = [IdleStretch(sm=s.sm, from_us=prev, to_us=s.ready_us, after=before.phase, next=s.phase,
                           next_task=s.task, next_grab_us=s.grab_us)
               for s, prev, before in self._gaps() if before is not None and s.ready_us - prev >= min_us]
        return sorted(out, key=lambda g: (g.from_us, g.sm))

    def _gaps(self):
        """Per SM in ``ready`` order, each task that its SM reached idle: (task, when the SM's work
        before it ended -- 0 for an SM's first task --, the task that ended last before it or None)."""
        last: dict[int, TaskSpan] = {}
        for s in sorted(self.spans, key=lambda s: (s.sm, s.ready_us)):
            before = last.get(s.sm)
            prev = before.end_us if before is not None else 0.0
            if before is None or s.end_us > prev:
                last[s.sm] = s
            if s.ready_us > prev:
                yield s, prev, before

    def worst_window_summary(self, *, window_us: float = 250.0, min_us: float = 20.0, edge_us: float = 1000.0,
                             rows: int = 24) -> str:
        """The window of :meth:`idle_gaps` with the most idle SM time, leaving out the first and
        last ``edge_us`` (start-up and tail have their own lines), and the :meth:`idle_stretches`
        that touch it: what a window's idle SMs were doing around it."""
        g = self.idle_gaps(window_us=window_us)
        inner = [w for w in range(len(g["by_window"])) if edge_us <= w * window_us <= self.span_us - edge_us - window_us]
        if not inner:
            return f"{self.kind} (rank {self.rank}): no window {edge_us:.0f} us away from both ends"
        w = max(inner, key=lambda i: g["by_window"][i])
        lo, hi = w * window_us, (w + 1) * window_us
        lines = [f"{self.kind} (rank {self.rank}): most idle window [{lo:.0f}, {hi:.0f}) us, "
                 f"{g['by_window'][w] / window_us:.1f} SMs idle on average; stretches of >= {min_us:.0f} us in it:"]
        hits = [s for s in self.idle_stretches(min_us=min_us) if s.from_us < hi and s.to_us > lo]
        for s in hits[:rows]:
            lines.append(f"  SM {s.sm:>3} idle {s.from_us:9.1f} .. {s.to_us:9.1f} ({s.to_us - s.from_us:6.1f} us) "
                         f"after {s.after}, then {s.next} task {s.next_task} (grabbed at {s.next_grab_us:.1f})")
        if len(hits) > rows:
            lines.append(f"  ... {len(hits) - rows} more")
        return "\n".join(lines)

    def summary(self) -> str:
        lines = [f"{self.kind} (rank {self.rank}, device {self.device_id}): {len(self.spans)} tasks "
                 f"over {len(self.sm_busy_fraction())} SMs in {self.span_us:.1f} us"
                 + (f", {self.unfinished} unfinished" if self.unfinished else ""),
                 f"  {'phase':<16}{'tasks':>7}{'busy us':>11}{'wait us':>10}{'first':>9}{'last':>9}"]
        for p in self.phase_stats():
            lines.append(f"  {p.phase:<16}{p.tasks:>7}{p.busy_us:>11.1f}{p.wait_us:>10.1f}"
                         f"{p.first_us:>9.1f}{p.last_us:>9.1f}")
        frac = list(self.sm_busy_fraction().values())
        if frac:
            lines.append(f"  SM busy share: min {min(frac):.2f} median {float(np.median(frac)):.2f} "
                         f"max {max(frac):.2f}; idle after each SM's last task: "
                         f"{self.tail_idle_us() / max(len(frac), 1):.1f} us on average")
        return "\n".join(lines)

    def busy(self, phases) -> list[tuple[float, float]]:
        """[ready, end] of every task of the given phases."""
        return [(s.ready_us, s.end_us) for s in self.spans if s.phase in phases]

    def push_overlap(self) -> dict:
        """Expert parallelism: how far this rank's GEMM tiles ran under its own push.
        ``push_us``: union of the push tasks' work; ``gemm_under_push_us``: time during which a
        GEMM tile of this launch ran while one of its push tasks was still running;
        ``first_routed_gemm_us`` / ``last_push_end_us``: when the first routed GEMM tile started
        and when the last push task ended (from the launch's first grab; None without them)."""
        push, gemm = self.busy(PUSH_PHASES), self.busy(GEMM_PHASES)
        routed = self.busy(ROUTED_GEMM_PHASES)
        return {"push_us": union_us(push), "gemm_us": union_us(gemm), "gemm_under_push_us": overlap_us(gemm, push),
                "routed_gemm_under_push_us": overlap_us(routed, push),
                "first_routed_gemm_us": min((a for a, _ in routed), default=None),
                "last_push_end_us": max((b for _, b in push), default=None)}

    def overlap_summary(self) -> str:
        o = self.push_overlap()
        if o["last_push_end_us"] is None:
            return f"{self.kind} (rank {self.rank}): no push tasks"
        first = o["first_routed_gemm_us"]
        return (f"{self.kind} (rank {self.rank}): push {o['push_us']:.1f} us (last push ends at "
                f"{o['last_push_end_us']:.1f}), GEMM tiles {o['gemm_us']:.1f} us, of which under the push "
                f"{o['gemm_under_push_us']:.1f} us (routed {o['routed_gemm_under_push_us']:.1f}); first routed "
                f"GEMM tile at " + ("-" if first is None else f"{first:.1f}") + " us")

    WAIT_ROW = 100_000   # the Chrome row of SM n's waits: WAIT_ROW + n

    def chrome_events(self, *, pid: int = 0, offset_us: float = 0.0) -> list[dict]:
        """Complete ("X") events: one row per SM for the work, one more per SM for the waits."""
        ev = []
        for sm in sorted({s.sm for s in self.spans}):
            ev.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": sm, "args": {"name": f"SM {sm}"}})
            ev.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": self.WAIT_ROW + sm,
                       "args": {"name": f"SM {sm} waits"}})
        for s in self.spans:
            if s.ready_us > s.grab_us:
                ev.append({"name": f"wait {s.phase}", "cat": "wait", "ph": "X", "pid": pid,
                           "tid": self.WAIT_ROW + s.sm, "ts": offset_us + s.grab_us, "dur": s.ready_us - s.grab_us,
                           "args": {"task": s.task}})
            ev.append({"name": s.phase, "cat": self.kind, "ph": "X", "pid": pid, "tid": s.sm,
                       "ts": offset_us + s.ready_us, "dur": max(s.end_us - s.ready_us, 0.0),
                       "args": {"task": s.task}})
        return ev


def write_chrome_trace(path, traces: list[LaunchTrace], *, aligned: bool = False) -> None:
    """One file for several launches: each launch is a process row, laid end to end; or, with
    ``aligned``, at their own times (launches of one GPU, e.g. expert-parallel ranks sharing it:
    %globaltimer is one clock per GPU), so the ranks' rows show what ran side by side."""
    events, offset = [], 0.0
    base = min((t.t0_ns for t in traces if t.spans), default=0)
    for i, t in enumerate(traces):
        events.append({"name": "process_name", "ph": "M", "pid": i,
                       "args": {"name": f"{i}: {t.kind} (rank {t.rank})"}})
        events.extend(t.chrome_events(pid=i, offset_us=(t.t0_ns - base) / 1e3 if aligned else offset))
        offset += t.span_us + 10.0
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
