"""A recorded run's costs and interruptions, read from its `events.jsonl`, as inputs to the goodput
model (`goodput.model`, run by `goodput.simulation`): to predict the run's goodput and compare it
with what `goodput.accounting` measured (`goodput.validation`).

Costs (`costs_from_events`), each a mean or median over the run, lane of process 0:

    step_s              mean wall time between consecutive steps with nothing else in between
                        but saves, less the saves' blocking part (charged as save_s)
                        (a mean: slow stretches, such as a reshaped mesh, add up in the wall)
    productive_fraction the productive seconds `goodput.accounting` counts per counted step,
                        over step_s (data waits and stragglers are not productive there)
    save_s[tier]        mean `duration_s` of `save` events (the blocking part, as
                        `goodput.accounting` charges it)
    commit_s[tier]      mean `commit_s` of `save_committed` events, less one step: the loop
                        calls the checkpointer while the step being saved still computes (it
                        dispatches ahead), so a commit's clock starts about a step before the
                        model's, which starts it when the step has finished
    restore_s[tier]     mean `duration_s` of `restore` events
    init_s              mean `duration_s` of `init` events (state from the seed: nothing restored)
    detection_s         mean `latency_s` of `failure_detected` events
    restart_s           failure detected -> the next generation's restore (or init) begins
    compile_s           a later generation's restore ends -> its first step begins (compile,
                        waiting for the slowest process, first batch); `compile_sequence_s`
                        lists them in order (a mesh's first compiles, later ones load it)
    startup_s           the run's first moment -> its first step begins, or the first failure
                        if that came earlier (the replay meets that failure before step 1)
                        (a step begins one step_s before its event: the model's pace)
    tail_s              the last step -> the last event (final save, shutdown)

Interruptions (`trace_from_events`), each placed at the step before which it happened, so the
replay meets them where the run did, however fast the model's clock runs:

    chaos events        kill, lose_slice, hang -> failure; nan, spike -> anomaly when the health
                        check skipped that step (else the crash it caused is a failure below);
                        corrupt_checkpoint -> corrupt; at the event's `step`
    fault_injected      supervisor actions: kill, hang, lose_slice -> failure; preempt -> planned;
                        in the step under way at the event's time (the one after the last step
                        process 0 logged), as far into it as the event came after that log
    scale_up            planned (the workers save and stop, the job restarts bigger), likewise
    failure_detected    a failure no injected fault explains (a crash, a crash during recovery),
                        placed the same way at the moment it happened
    anomaly             a skipped step no chaos event explains
A failure during a recovery thus fires as the replay's recovery ends: the same extra restart.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.faults import FaultKind, SupervisorFaultKind
from resilient_jax.goodput.accounting import (
    DEFAULT_STRAGGLER_FACTOR,
    PRODUCTIVE,
    compute,
    event_interval,
    finite_number,
    on_reference_lane,
)
from resilient_jax.goodput.simulation import ANOMALY, FAILURE, Interruption

# Events of these types between two steps make the gap between them more than a step.
_INTERFERING = {
    EventType.SAVE,
    EventType.RESTORE,
    EventType.COMPILE,
    EventType.ANOMALY,
    EventType.ROLLBACK,
    EventType.CHAOS,
    EventType.PREEMPTION,
    EventType.INIT,
    EventType.EVAL,
    EventType.PROFILE,
}
_INJECTED_FAILURES = {FaultKind.KILL, FaultKind.LOSE_SLICE, FaultKind.HANG}
_ANOMALY_FAULTS = {FaultKind.NAN, FaultKind.SPIKE}
# Chaos faults a worker reports that interrupt the run (a slowdown does not).
_CHAOS_KINDS = {*_INJECTED_FAILURES, *_ANOMALY_FAULTS, FaultKind.CORRUPT_CHECKPOINT}
# The supervisor's fault actions (`fault_injected`); a preemption asks the workers to save and stop.
_SUPERVISOR_KINDS = {*_INJECTED_FAILURES, SupervisorFaultKind.PREEMPT}


def _start(event: dict[str, Any]) -> float:
    return event_interval(event)[0]


def run_start(events: Sequence[dict[str, Any]]) -> float:
    """The earliest moment any event covers (the start of `goodput.accounting`'s wall)."""
    return min(_start(e) for e in events)


def _step_start(event: dict[str, Any], step_s: float | None) -> float:
    return _start(event) if step_s is None else float(event["time"]) - step_s


def _failure_times(events: Sequence[dict[str, Any]]) -> list[float]:
    """When each detected failure happened (detection time less its latency)."""
    return [
        float(e["time"]) - max(0.0, finite_number(e.get("latency_s")))
        for e in events
        if e["type"] == EventType.FAILURE_DETECTED
    ]


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _by_tier(events: Sequence[dict[str, Any]], typ: str, field: str) -> dict[str, float]:
    tiers: dict[str, list[float]] = {}
    for e in events:
        if e["type"] == typ and on_reference_lane(e) and e.get("tier") and field in e:
            tiers.setdefault(str(e["tier"]), []).append(finite_number(e[field]))
    return {tier: sum(v) / len(v) for tier, v in tiers.items()}


def _less_a_step(by_tier: dict[str, float], step_s: float | None) -> dict[str, float]:
    return {tier: max(0.0, value - (step_s or 0.0)) for tier, value in by_tier.items()}


def _step_s(events: Sequence[dict[str, Any]]) -> float | None:
    """Mean wall time per step over consecutive steps with nothing else in between, less the
    blocking part of a save between them (the model charges that as `save_s`; a run whose cheap
    local saves come every step has no gap without one)."""
    gaps = []
    previous: dict[str, Any] | None = None
    saving_s = 0.0  # blocking time of the saves since `previous`
    for e in events:
        if not on_reference_lane(e):
            continue
        if e["type"] == EventType.SAVE:
            saving_s += float(e.get("duration_s") or 0.0)
        elif e["type"] in _INTERFERING:
            previous = None
        elif e["type"] == EventType.STEP:
            if previous is not None and int(e["step"]) == int(previous["step"]) + 1:
                gaps.append(float(e["time"]) - float(previous["time"]) - saving_s)
            previous, saving_s = e, 0.0
    return statistics.fmean(gaps) if gaps else None


def _productive_fraction(
    events: Sequence[dict[str, Any]], step_s: float | None, straggler_factor: float
) -> float | None:
    counted = compute(events, straggler_factor)
    if step_s is None or not counted.steps_counted:
        return None
    per_step = counted.seconds[PRODUCTIVE] / counted.steps_counted
    return min(1.0, per_step / step_s)


def _recoveries(
    events: Sequence[dict[str, Any]], step_s: float | None
) -> tuple[list[float], list[float]]:
    """Per later generation of process 0: (failure detected -> its restore or init begins, when
    a failure started it; that ends -> its first step begins, when it trained). A step begins
    one typical step before its event (the pace the model runs steps at)."""
    lane = [e for e in events if on_reference_lane(e)]
    detected = [float(e["time"]) for e in events if e["type"] == EventType.FAILURE_DETECTED]
    generations: dict[int, list[dict[str, Any]]] = {}
    for e in lane:
        if finite_number(e.get("generation")) > 0:
            generations.setdefault(int(finite_number(e.get("generation"))), []).append(e)
    restarts, compiles = [], []
    previous_begun = -math.inf
    for generation in sorted(generations):
        mine = generations[generation]
        begun = next((e for e in mine if e["type"] in (EventType.RESTORE, EventType.INIT)), None)
        if begun is None:
            continue
        began = _start(begun)
        cause = [t for t in detected if previous_begun < t <= began]
        if cause:  # not a planned restart (scale-up, preemption)
            restarts.append(began - cause[-1])
        step = next(
            (
                e
                for e in mine
                if e["type"] == EventType.STEP and float(e["time"]) > float(begun["time"])
            ),
            None,
        )
        if step is not None:
            compiles.append(_step_start(step, step_s) - float(begun["time"]))
        previous_begun = began
    return restarts, compiles


def costs_from_events(
    events: Sequence[dict[str, Any]],
    straggler_factor: float = DEFAULT_STRAGGLER_FACTOR,
) -> dict[str, Any]:
    """The run's measured costs (see the module docstring); keys without data are left out."""
    events = sorted(events, key=lambda e: float(e["time"]))
    step_s = _step_s(events)
    fraction = _productive_fraction(events, step_s, straggler_factor)
    restarts, compiles = _recoveries(events, step_s)
    lane_steps = [e for e in events if e["type"] == EventType.STEP and on_reference_lane(e)]
    costs: dict[str, Any] = {
        "step_s": step_s,
        "productive_fraction": fraction,
        "save_s": _by_tier(events, EventType.SAVE, "duration_s"),
        "commit_s": _less_a_step(_by_tier(events, EventType.SAVE_COMMITTED, "commit_s"), step_s),
        "restore_s": _by_tier(events, EventType.RESTORE, "duration_s"),
        "init_s": _mean(
            finite_number(e.get("duration_s"))
            for e in events
            if e["type"] == EventType.INIT and on_reference_lane(e)
        ),
        "detection_s": _mean(
            finite_number(e.get("latency_s"))
            for e in events
            if e["type"] == EventType.FAILURE_DETECTED
        ),
        "restart_s": _mean(restarts),
        "compile_s": _mean(compiles),
        "compile_sequence_s": [round(c, 3) for c in compiles],
    }
    if lane_steps:
        first_failure = min(_failure_times(events), default=math.inf)
        first_step = _step_start(lane_steps[0], step_s)
        costs["startup_s"] = min(first_step, first_failure) - run_start(events)
        costs["tail_s"] = float(events[-1]["time"]) - float(lane_steps[-1]["time"])
    return {k: v for k, v in costs.items() if v is not None and v != {}}


class _StepClock:
    """Where something at a given time struck: the step under way then and how far into it.
    A step's event is logged once the next step is dispatched (the loop pulls metrics one step
    late), so the step after the last logged one was under way, from about that event on. Long
    after the last logged step (the run was restarting), it is the next step the replay takes
    there: a fault during a recovery fires on the replay's way back, as the restart did."""

    def __init__(self, events: Sequence[dict[str, Any]]) -> None:
        lane = [e for e in events if e["type"] == EventType.STEP and on_reference_lane(e)]
        self._times = [float(e["time"]) for e in lane]
        self._steps = [int(e["step"]) for e in lane]
        self._step_s = _step_s(events) or 0.0
        self._restarts = sorted(float(e["time"]) for e in events if e["type"] == EventType.RESTART)

    def at(self, time: float) -> tuple[int, float]:
        """(the step under way, seconds into it)."""
        index = bisect.bisect_right(self._times, time)
        if not index:
            return 1, 0.0
        logged = self._times[index - 1]
        if bisect.bisect_right(self._restarts, time) > bisect.bisect_right(self._restarts, logged):
            return self._steps[index - 1] + 1, 0.0  # restarting since: no step under way
        # A step that took longer than usual (a save at its end) was still under way.
        return self._steps[index - 1] + 1, min(time - logged, 0.999 * self._step_s)

    def next_step(self, time: float) -> int:
        return self.at(time)[0]

    def failure(self, kind: str, time: float) -> Interruption:
        step, into = self.at(time)
        return Interruption(kind, step=step, into_step_s=round(into, 4))


def _chaos_entries(events: Sequence[dict[str, Any]], clock: _StepClock) -> list[Interruption]:
    out, seen = [], set()
    for e in events:
        kind = str(e.get("kind"))
        text = str(e.get("fault", ""))
        if e["type"] != EventType.CHAOS or kind not in _CHAOS_KINDS or (text, kind) in seen:
            continue  # a fault fires once per run, though several processes may report it
        seen.add((text, kind))
        step = int(e["step"]) if "step" in e else clock.next_step(float(e["time"]))
        out.append(Interruption(kind, step=step))
    return out


def _supervisor_entries(events: Sequence[dict[str, Any]], clock: _StepClock) -> list[Interruption]:
    out = []
    for e in events:
        if e["type"] == EventType.FAULT_INJECTED and str(e.get("kind")) in _SUPERVISOR_KINDS:
            out.append(clock.failure(str(e["kind"]), float(e["time"])))
        elif e["type"] == EventType.SCALE_UP:
            out.append(Interruption(EventType.SCALE_UP, step=clock.next_step(float(e["time"]))))
    return out


def _unexplained_failures(
    events: Sequence[dict[str, Any]], injected_at: list[float], clock: _StepClock
) -> list[Interruption]:
    out = []
    for e in events:
        if e["type"] != EventType.FAILURE_DETECTED:
            continue
        happened = float(e["time"]) - max(0.0, finite_number(e.get("latency_s")))
        # Allow for the second that passes between a fault's event and its effect.
        if not any(happened - 1.0 <= t <= float(e["time"]) for t in injected_at):
            out.append(clock.failure(FAILURE, happened))
    return out


def trace_from_events(events: Sequence[dict[str, Any]]) -> list[Interruption]:
    """The interruptions of a recorded run (see the module docstring)."""
    events = sorted(events, key=lambda e: float(e["time"]))
    clock = _StepClock(events)
    chaos = _chaos_entries(events, clock)
    supervisor = _supervisor_entries(events, clock)
    injected_at = [
        float(e["time"])
        for e in events
        if (e["type"] == EventType.CHAOS and e.get("kind") in _INJECTED_FAILURES)
        or e["type"] == EventType.FAULT_INJECTED
    ]
    skipped = {
        int(e["step"]) for e in events if e["type"] == EventType.ANOMALY and on_reference_lane(e)
    }
    # A NaN the health check did not skip (it was off) crashed the run: a failure, found below.
    chaos = [i for i in chaos if i.kind not in _ANOMALY_FAULTS or i.step in skipped]
    anomaly_steps = {i.step for i in chaos if i.kind in _ANOMALY_FAULTS}
    natural = [
        Interruption(ANOMALY, step=int(e["step"]))
        for e in events
        if e["type"] == EventType.ANOMALY
        and on_reference_lane(e)
        and int(e["step"]) not in anomaly_steps
    ]
    unexplained = _unexplained_failures(events, injected_at, clock)
    return [*chaos, *supervisor, *unexplained, *natural]


def checkpoint_intervals(
    config: dict[str, Any], events: Sequence[dict[str, Any]] = ()
) -> dict[str, int]:
    """Save intervals in steps per tier (0: tier off): from a run's config.json where it saves by
    a fixed number of steps, else the median distance between the steps the run saved."""
    checkpoint = config.get("checkpoint", {})
    intervals = {
        "local": int(checkpoint.get("local_every_steps", 0)) if checkpoint.get("local_dir") else 0,
        "persistent": int(checkpoint.get("every_steps", 0)),
    }
    if checkpoint.get("auto_interval") or checkpoint.get("every_minutes"):
        intervals["persistent"] = 0  # saved by the clock: read it off the events
    if checkpoint.get("local_auto_interval"):
        intervals["local"] = 0  # the interval each generation agreed on: read it off the events
    for tier, every in intervals.items():
        if not every:
            intervals[tier] = _saved_every(events, tier)
    return intervals


def _saved_every(events: Sequence[dict[str, Any]], tier: str) -> int:
    steps = sorted(
        {int(e["step"]) for e in events if e["type"] == EventType.SAVE and e.get("tier") == tier}
    )
    gaps = [b - a for a, b in itertools.pairwise(steps) if b > a]
    return int(statistics.median(gaps)) if gaps else 0
