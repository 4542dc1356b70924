"""Goodput: the share of a run's wall-clock time spent on steps that count, and where the rest went.

    python -m resilient_jax.goodput WORKDIR    # table on stdout, WORKDIR/goodput.json, timeline.png

(the command is `goodput.report`; the picture is drawn by `goodput.timeline`).

Input is `WORKDIR/events.jsonl` (`resilient_jax.events`). Every event has `time` (unix seconds, at
the *end* of the phase it reports) and `type` (`contracts.event_types.EventType`). What this
module reads, by type:

    process_start    generation            a process began; the first one is the run's start
    jax_init, init   duration_s,           joining the JAX job; initialising state from the seed
                     generation            (in a generation > 0 both count as restart)
    compile          duration_s            compiling the step
    restore          duration_s, step      restoring a checkpoint (any tier)
    save             duration_s, step      saving: the time the loop was *blocked*, not the
                                           background write
    eval             duration_s, step      held-out evaluation: training paused for it (its
                                           interval lies inside a step's host interval, and
                                           takes that part of it)
    profile          duration_s            starting or stopping (writing) a profiler trace
    step             step, duration_s,     one training step: `step` its number, `duration_s` the
                     data_wait_s           host time it took (its interval ends at `time`),
                                           `data_wait_s` the part spent waiting for the batch.
                                           Without a finite `duration_s` the step is taken to
                                           start at the lane's previous event.
    anomaly          step, action          that step was skipped by the health check;
                                           `action: "rollback"` also marks a rollback
    rollback                               the loop restored a checkpoint after anomalies
    failure_detected latency_s             a failure was noticed `latency_s` after it happened
    restart          generation            the supervisor (re)started the job
    evict, scale_up                        the job is being reshaped
    stop             exit_code             the process ended (non-zero: a failure)

Lanes and the wall clock. All processes append to one file; an event's lane is its `process`
field. Time is accounted on one lane, process 0's (which lives as long as the job does: when it
dies, everyone restarts), joined by events without `process` or with `process: "supervisor"`
(the supervisor's, and single-process runs that set none). Failures and restarts count from any
lane. The wall clock runs from the earliest moment any event covers to the last event.

Accounting. Each event with a duration covers an interval; where intervals overlap, the higher
category in `PRIORITY` wins (a blocking save inside a step's host time is save time, not step
time). A step whose number occurs again later was lost: its first run counts as `lost_progress`,
or as `anomaly` when a rollback came in between; a skipped step counts as `anomaly`. A counted
step's data wait is `data_loading`; when its compute time exceeds `straggler_factor` times the
generation's typical (25th percentile) step, the excess over the typical step is `stragglers` (a
slowdown present for a whole generation is invisible to this). Uncovered time is classified by
what surrounds it: before the first step, `initialisation` (or `restart` in a later generation);
after a failure until the next step, `restart`; between a last step and a failure,
`lost_progress`; before a rollback, `anomaly`; otherwise `idle`.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.events import read_events

DEFAULT_STRAGGLER_FACTOR = 1.5
_MIN_STEPS_FOR_REFERENCE = 4

PRODUCTIVE = "productive"
# Highest first: where intervals overlap, the earlier category in this list takes the time.
PRIORITY = (
    "failure_detection",
    "checkpoint_restore",
    "checkpoint_save",
    "compilation",
    "initialisation",
    "restart",
    "evaluation",
    "profiling",
    "anomaly",
    "lost_progress",
    "data_loading",
    "stragglers",
    PRODUCTIVE,
)
# Reading order for reports: the life of a run, roughly.
BADPUT = (
    "initialisation",
    "compilation",
    "data_loading",
    "evaluation",
    "profiling",
    "checkpoint_save",
    "checkpoint_restore",
    "lost_progress",
    "failure_detection",
    "restart",
    "anomaly",
    "stragglers",
    "idle",
)
LABELS = {
    PRODUCTIVE: "productive steps",
    "initialisation": "initialisation",
    "compilation": "compilation",
    "data_loading": "data loading",
    "evaluation": "evaluation (held-out)",
    "profiling": "profiler trace",
    "checkpoint_save": "checkpoint save (blocking)",
    "checkpoint_restore": "checkpoint restore",
    "lost_progress": "progress lost, recomputed",
    "failure_detection": "failure detection",
    "restart": "restart / re-initialisation",
    "anomaly": "anomalies (skips, rollbacks)",
    "stragglers": "stragglers",
    "idle": "idle",
}
_RANK = {c: len(PRIORITY) - i for i, c in enumerate(PRIORITY)}
_PHASES = {
    EventType.COMPILE: "compilation",
    EventType.RESTORE: "checkpoint_restore",
    EventType.SAVE: "checkpoint_save",
    EventType.EVAL: "evaluation",
    EventType.PROFILE: "profiling",
}
_INIT_TYPES = (EventType.JAX_INIT, EventType.INIT)
_RESHAPE_TYPES = (EventType.EVICT, EventType.SCALE_UP)


@dataclasses.dataclass
class Goodput:
    wall_s: float
    seconds: dict[str, float]  # every category of PRIORITY and "idle"; they sum to wall_s
    steps_counted: int  # step runs whose time counts as productive
    steps_lost: int  # step runs recomputed later (after a failure or a rollback)
    steps_skipped: int  # step runs whose update the health check refused
    generations: int
    failures: int
    segments: list[tuple[float, float, str]]  # (start, end, category) tiling the wall clock
    # Per tier, on process 0's lane: saves made, and saves skipped because the tier's writer
    # was still busy with the previous one (the `skipped` field of `save` events).
    saves: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.seconds[PRODUCTIVE] / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        badput = {c: self.seconds[c] for c in BADPUT}
        return {
            "goodput": self.goodput,
            "wall_s": self.wall_s,
            "productive_s": self.seconds[PRODUCTIVE],
            "badput_s": badput,
            "badput": {c: s / self.wall_s if self.wall_s else 0.0 for c, s in badput.items()},
            "steps": {
                "counted": self.steps_counted,
                "lost": self.steps_lost,
                "skipped": self.steps_skipped,
            },
            "saves": self.saves,
            "generations": self.generations,
            "failures": self.failures,
            "wall_clock_lane": "process 0 (with supervisor events)",
        }


# Reading events: shared with `timeline` and `replay`, which must see the same lanes and times.


def event_lane(event: dict[str, Any]) -> str:
    """The process that wrote an event; "supervisor" for events without one."""
    process = event.get("process")
    return "supervisor" if process is None else str(process)


def on_reference_lane(event: dict[str, Any]) -> bool:
    """Whether the event is on the lane the wall clock is accounted on (process 0, supervisor)."""
    return event_lane(event) in ("0", "supervisor")


def finite_number(value: Any, default: float = 0.0) -> float:
    """An event field as a finite float; `default` when it is missing, not a number or infinite."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return number if math.isfinite(number) else default


def event_interval(event: dict[str, Any], previous_end: float | None = None) -> tuple[float, float]:
    """The time an event covers; without a duration, from `previous_end` (when given)."""
    end = float(event["time"])
    duration = finite_number(event.get("duration_s"), -1.0)
    if duration < 0:
        return (end if previous_end is None else previous_end), end
    return end - duration, end


# ----------------------------------------------------------------------- markers & gaps


@dataclasses.dataclass(frozen=True)
class _Marker:
    time: float
    kind: str  # start | restart | progress | fail | rollback


def _markers(events: Sequence[dict[str, Any]]) -> list[_Marker]:
    out = []
    first_start = True
    for e in events:
        kind = None
        t = float(e["time"])
        typ = e["type"]
        if (typ == EventType.PROCESS_START and on_reference_lane(e)) or typ == EventType.RESTART:
            later = finite_number(e.get("generation")) > 0 or not first_start
            kind, first_start = ("restart" if later else "start"), False
        elif typ == EventType.STEP and on_reference_lane(e):
            kind = "progress"
        elif typ == EventType.FAILURE_DETECTED:
            kind, t = "fail", t - max(0.0, finite_number(e.get("latency_s")))
        elif typ in _RESHAPE_TYPES or (
            typ == EventType.STOP and finite_number(e.get("exit_code")) != ExitCode.FINISHED
        ):
            kind = "fail"
        elif typ == EventType.ROLLBACK or (
            typ == EventType.ANOMALY and e.get("action") == "rollback"
        ):
            kind = "rollback"
        if kind:
            out.append(_Marker(t, kind))
    out.sort(key=lambda m: m.time)
    return out


_STATE_AFTER = {
    "start": "init",
    "restart": "restarting",
    "fail": "restarting",
    "progress": "running",
    "rollback": "running",
}


class _Gaps:
    """Classifies time no event covers from the markers around it."""

    def __init__(self, markers: list[_Marker]) -> None:
        self._times = [m.time for m in markers]
        self._kinds = [m.kind for m in markers]

    def category(self, start: float, end: float) -> str:
        before = bisect.bisect_right(self._times, start)
        state = _STATE_AFTER[self._kinds[before - 1]] if before else "init"
        if state == "init":
            return "initialisation"
        if state == "restarting":
            return "restart"
        after = bisect.bisect_left(self._times, end)
        upcoming = self._kinds[after] if after < len(self._kinds) else None
        return {"fail": "lost_progress", "rollback": "anomaly", "restart": "restart"}.get(
            upcoming or "", "idle"
        )


# ---------------------------------------------------------------------------- the steps


@dataclasses.dataclass
class _Step:
    number: int
    start: float
    end: float
    data_wait: float
    generation: int
    fate: str = PRODUCTIVE  # or lost_progress / anomaly
    rerun: bool = False  # the same step number ran again later
    skipped: bool = False  # the health check refused its update


def _steps(events: Sequence[dict[str, Any]], markers: list[_Marker]) -> list[_Step]:
    steps: list[_Step] = []
    starts = [m.time for m in markers if m.kind in ("start", "restart")]
    previous_end: float | None = None
    for e in events:
        if not on_reference_lane(e):
            continue
        if e["type"] == EventType.STEP:
            start, end = event_interval(e, previous_end)
            wait = min(max(0.0, finite_number(e.get("data_wait_s"))), end - start)
            generation = bisect.bisect_right(starts, start)
            steps.append(_Step(int(e["step"]), start, end, wait, generation))
        previous_end = float(e["time"])
    return steps


def _mark_fates(
    steps: list[_Step], events: Sequence[dict[str, Any]], markers: list[_Marker]
) -> None:
    rollbacks = [m.time for m in markers if m.kind == "rollback"]
    by_number: dict[int, list[_Step]] = collections.defaultdict(list)
    for s in steps:
        by_number[s.number].append(s)
    for runs in by_number.values():
        for first, again in itertools.pairwise(runs):
            between = bisect.bisect_right(rollbacks, first.end) < bisect.bisect_left(
                rollbacks, again.end
            )
            first.fate = "anomaly" if between else "lost_progress"
            first.rerun = True
    for e in events:
        if e["type"] != EventType.ANOMALY or "step" not in e:
            continue
        runs = by_number.get(int(e["step"]), [])
        if runs:
            nearest = min(runs, key=lambda s: abs(s.end - float(e["time"])))
            nearest.fate, nearest.skipped = "anomaly", True


def _percentile25(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def _step_intervals(steps: list[_Step], straggler_factor: float) -> list[tuple[float, float, str]]:
    compute_by_gen: dict[int, list[float]] = collections.defaultdict(list)
    for s in steps:
        if s.fate == PRODUCTIVE:
            compute_by_gen[s.generation].append(s.end - s.start - s.data_wait)
    reference = {
        g: _percentile25(c) for g, c in compute_by_gen.items() if len(c) >= _MIN_STEPS_FOR_REFERENCE
    }
    out = []
    for s in steps:
        if s.fate != PRODUCTIVE:
            out.append((s.start, s.end, s.fate))
            continue
        compute_start = s.start + s.data_wait
        out.append((s.start, compute_start, "data_loading"))
        ref = reference.get(s.generation)
        if ref is not None and s.end - compute_start > straggler_factor * ref:
            out.append((compute_start, compute_start + ref, PRODUCTIVE))
            out.append((compute_start + ref, s.end, "stragglers"))
        else:
            out.append((compute_start, s.end, PRODUCTIVE))
    return out


# --------------------------------------------------------------------------- the sweep


def _phase_intervals(events: Sequence[dict[str, Any]]) -> list[tuple[float, float, str]]:
    out = []
    for e in events:
        typ = e["type"]
        if typ == EventType.FAILURE_DETECTED:
            t = float(e["time"])
            out.append((t - max(0.0, finite_number(e.get("latency_s"))), t, "failure_detection"))
        elif not on_reference_lane(e):
            continue
        elif typ in _PHASES:
            out.append((*event_interval(e), _PHASES[typ]))
        elif typ in _INIT_TYPES:
            later = finite_number(e.get("generation")) > 0
            out.append((*event_interval(e), "restart" if later else "initialisation"))
    return out


def _sweep(
    intervals: Iterable[tuple[float, float, str]], t0: float, t1: float
) -> list[tuple[float, float, str | None]]:
    """Tiles [t0, t1] with the highest-priority category covering each piece (None: nothing)."""
    edges: list[tuple[float, int, str]] = []
    for start, end, category in intervals:
        start, end = max(start, t0), min(end, t1)
        if end > start:
            edges += [(start, 1, category), (end, -1, category)]
    edges.sort(key=lambda e: e[0])
    active: collections.Counter[str] = collections.Counter()
    pieces: list[tuple[float, float, str | None]] = []
    cursor = t0
    for time, delta, category in [*edges, (t1, 0, "")]:
        if time > cursor:
            live = [c for c, n in active.items() if n > 0]
            top = max(live, key=_RANK.__getitem__) if live else None
            if pieces and pieces[-1][2] == top and pieces[-1][1] == cursor:
                pieces[-1] = (pieces[-1][0], time, top)
            else:
                pieces.append((cursor, time, top))
            cursor = time
        if delta:
            active[category] += delta
    return pieces


def _count_failures(events: Sequence[dict[str, Any]]) -> int:
    """Failure reports, counting overlapping reports of one failure (several observers) once."""
    spans = sorted(
        (float(e["time"]) - max(0.0, finite_number(e.get("latency_s"))), float(e["time"]))
        for e in events
        if e["type"] == EventType.FAILURE_DETECTED
    )
    count, reach = 0, -math.inf
    for start, end in spans:
        if start > reach:
            count += 1
        reach = max(reach, end)
    return count


def compute(
    events: Iterable[dict[str, Any]], straggler_factor: float = DEFAULT_STRAGGLER_FACTOR
) -> Goodput:
    """Goodput and badput breakdown of one run's events."""
    events = sorted((e for e in events if "time" in e and "type" in e), key=lambda e: e["time"])
    if not events:
        raise ValueError("no events: nothing to account")
    t0 = min(event_interval(e)[0] for e in events)
    t1 = max(float(e["time"]) for e in events)
    markers = _markers(events)
    steps = _steps(events, markers)
    _mark_fates(steps, events, markers)
    intervals = _phase_intervals(events) + _step_intervals(steps, straggler_factor)
    gaps = _Gaps(markers)
    seconds = dict.fromkeys((*PRIORITY, "idle"), 0.0)
    segments = []
    for start, end, category in _sweep(intervals, t0, t1):
        category = category or gaps.category(start, end)
        seconds[category] += end - start
        segments.append((start, end, category))
    generations = {finite_number(e.get("generation")) for e in events if on_reference_lane(e)}
    return Goodput(
        wall_s=t1 - t0,
        seconds=seconds,
        steps_counted=sum(s.fate == PRODUCTIVE for s in steps),
        steps_lost=sum(s.rerun for s in steps),
        steps_skipped=sum(s.skipped for s in steps),
        generations=max(1, len(generations)),
        failures=_count_failures(events),
        segments=segments,
        saves=_count_saves(events),
    )


def _count_saves(events: Sequence[dict[str, Any]]) -> dict[str, dict[str, int]]:
    saves: dict[str, dict[str, int]] = {}
    for e in events:
        if e["type"] == EventType.SAVE and on_reference_lane(e):
            tier = saves.setdefault(str(e.get("tier", "")), {"made": 0, "skipped": 0})
            tier["made"] += 1
            tier["skipped"] += int(finite_number(e.get("skipped")))
    return saves


# ------------------------------------------------------------------------------ reports


def format_table(result: Goodput) -> str:
    wall = result.wall_s or 1.0
    lines = [f"goodput {100 * result.goodput:.1f}% of {result.wall_s:.1f} s wall clock"]
    for category in (PRODUCTIVE, *BADPUT):
        seconds = result.seconds[category]
        lines.append(f"  {LABELS[category]:<30} {seconds:10.2f} s {100 * seconds / wall:6.1f}%")
    lines.append(
        f"steps: {result.steps_counted} counted, {result.steps_lost} lost, "
        f"{result.steps_skipped} skipped; {result.generations} generation(s), "
        f"{result.failures} failure(s)"
    )
    if result.saves:
        lines.append(
            "saves: "
            + "; ".join(
                f"{tier} {n['made']} made, {n['skipped']} skipped (writer busy)"
                for tier, n in sorted(result.saves.items())
            )
        )
    return "\n".join(lines)


def summary_line(result: Goodput, top: int = 3) -> str:
    """One line for the end of a run: goodput and the largest badput categories."""
    wall = result.wall_s or 1.0
    worst = sorted(((result.seconds[c], c) for c in BADPUT), reverse=True)[:top]
    parts = ", ".join(f"{LABELS[c]} {100 * s / wall:.1f}%" for s, c in worst if s > 0)
    return f"goodput {100 * result.goodput:.1f}% of {result.wall_s:.1f} s" + (
        f" (badput: {parts})" if parts else ""
    )


def print_summary(workdir: str, file: Any = None) -> Goodput | None:
    """For the loop's end: prints the one-line summary of the run so far, if it has events."""
    events = list(read_events(workdir))
    if not events:
        return None
    result = compute(events, straggler_factor(workdir))
    print(summary_line(result), file=file or sys.stderr, flush=True)
    return result


def straggler_factor(workdir: str) -> float:
    """The run's `health.straggler_factor` from its config.json, else the default."""
    try:
        with open(os.path.join(workdir, "config.json")) as f:
            return float(json.load(f)["health"]["straggler_factor"])
    except (OSError, KeyError, ValueError, TypeError):
        return DEFAULT_STRAGGLER_FACTOR
