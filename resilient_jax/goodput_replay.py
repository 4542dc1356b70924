"""A recorded run's costs and interruptions, read from its `events.jsonl`, as inputs to the goodput
model (`resilient_jax.goodput_model`): to predict the run's goodput and compare with what
`resilient_jax.goodput` measured.

Costs (`costs_from_events`), each a mean or median over the run, lane of process 0:

    step_s              median wall time between consecutive steps with nothing else in between
    productive_fraction median (duration_s - data_wait_s) of those steps over their wall time
    save_s[tier]        mean `duration_s` of `save` events (the blocking part)
    commit_s[tier]      mean `commit_s` of `save_committed` events
    restore_s[tier]     mean `duration_s` of `restore` events
    detection_s         mean `latency_s` of `failure_detected` events
    restart_s           failure detected -> the next restore (or init) begins
    compile_s           that restore ends -> the first step begins (compile and first batch)
    startup_s           the run's first moment -> its first step begins
    tail_s              the last step -> the last event (final save, shutdown)

Interruptions (`trace_from_events`):

    chaos events        kill, lose_slice, hang -> failure; nan, spike -> anomaly;
                        corrupt_checkpoint -> corrupt. A fault of a `random:` schedule is timed
                        (seconds from the run's start); an explicit one fires at its step.
    fault_injected      supervisor actions: kill, hang, lose_slice -> failure; preempt -> planned
    scale_up            planned (the workers save and stop, the job restarts bigger)
    failure_detected    a failure no injected fault explains, at (time - latency_s)
    anomaly             a skipped step no chaos event explains
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from resilient_jax.goodput_model import Interruption

# Events of these types between two steps make the gap between them more than a step.
_INTERFERING = {"save", "restore", "compile", "anomaly", "rollback", "chaos", "preemption", "init"}
_INJECTED_FAILURES = {"kill", "lose_slice", "hang"}
_CHAOS_KINDS = {
    "kill": "kill",
    "lose_slice": "lose_slice",
    "hang": "hang",
    "nan": "nan",
    "spike": "spike",
    "corrupt_checkpoint": "corrupt_checkpoint",
}
_SUPERVISOR_KINDS = {
    "kill": "kill",
    "hang": "hang",
    "lose_slice": "lose_slice",
    "preempt": "preempt",
}


def _number(value: Any, default: float = 0.0) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return number if math.isfinite(number) else default


def _reference(event: dict[str, Any]) -> bool:
    """Process 0's lane with the supervisor's events, as `resilient_jax.goodput` accounts."""
    return str(event.get("process", "supervisor")) in ("0", "supervisor")


def _start(event: dict[str, Any]) -> float:
    return float(event["time"]) - max(0.0, _number(event.get("duration_s")))


def run_start(events: Sequence[dict[str, Any]]) -> float:
    """The earliest moment any event covers (the start of `resilient_jax.goodput`'s wall)."""
    return min(_start(e) for e in events)


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _by_tier(events: Sequence[dict[str, Any]], typ: str, field: str) -> dict[str, float]:
    tiers: dict[str, list[float]] = {}
    for e in events:
        if e["type"] == typ and _reference(e) and e.get("tier") and field in e:
            tiers.setdefault(str(e["tier"]), []).append(_number(e[field]))
    return {tier: sum(v) / len(v) for tier, v in tiers.items()}


def _steps(events: Sequence[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(median wall per step, median productive fraction) over clean consecutive steps."""
    gaps, fractions = [], []
    previous: dict[str, Any] | None = None
    for e in events:
        if not _reference(e):
            continue
        if e["type"] in _INTERFERING:
            previous = None
        elif e["type"] == "step":
            if previous is not None and int(e["step"]) == int(previous["step"]) + 1:
                gap = float(e["time"]) - float(previous["time"])
                compute = _number(e.get("duration_s"), gap) - _number(e.get("data_wait_s"))
                if gap > 0:
                    gaps.append(gap)
                    fractions.append(min(1.0, max(0.0, compute / gap)))
            previous = e
    if not gaps:
        return None, None
    return statistics.median(gaps), statistics.median(fractions)


def _recoveries(events: Sequence[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Per detected failure: (detected -> restore or init begins, that ends -> first step)."""
    restarts, compiles = [], []
    lane = [e for e in events if _reference(e)]
    for detected in (e for e in events if e["type"] == "failure_detected"):
        t = float(detected["time"])
        begun = next(
            (e for e in lane if e["type"] in ("restore", "init") and float(e["time"]) > t), None
        )
        if begun is None:
            continue
        step = next(
            (e for e in lane if e["type"] == "step" and float(e["time"]) > float(begun["time"])),
            None,
        )
        restarts.append(_start(begun) - t)
        if step is not None:
            compiles.append(_start(step) - float(begun["time"]))
    return restarts, compiles


def costs_from_events(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run's measured costs (see the module docstring); keys without data are left out."""
    events = sorted(events, key=lambda e: float(e["time"]))
    step_s, fraction = _steps(events)
    restarts, compiles = _recoveries(events)
    lane_steps = [e for e in events if e["type"] == "step" and _reference(e)]
    costs: dict[str, Any] = {
        "step_s": step_s,
        "productive_fraction": fraction,
        "save_s": _by_tier(events, "save", "duration_s"),
        "commit_s": _by_tier(events, "save_committed", "commit_s"),
        "restore_s": _by_tier(events, "restore", "duration_s"),
        "detection_s": _mean(
            _number(e.get("latency_s")) for e in events if e["type"] == "failure_detected"
        ),
        "restart_s": _mean(restarts),
        "compile_s": _mean(compiles),
    }
    if lane_steps:
        costs["startup_s"] = _start(lane_steps[0]) - run_start(events)
        costs["tail_s"] = float(events[-1]["time"]) - float(lane_steps[-1]["time"])
    return {k: v for k, v in costs.items() if v is not None and v != {}}


def _chaos_entries(events: Sequence[dict[str, Any]], t0: float) -> list[Interruption]:
    out, seen = [], set()
    for e in events:
        kind = str(e.get("kind"))
        text = str(e.get("fault", ""))
        if e["type"] != "chaos" or kind not in _CHAOS_KINDS or (text, kind) in seen:
            continue  # a fault fires once per run, though several processes may report it
        seen.add((text, kind))
        if "random" in text or "step" not in e:
            out.append(Interruption(kind, time_s=float(e["time"]) - t0))
        else:
            out.append(Interruption(kind, step=int(e["step"])))
    return out


def _supervisor_entries(events: Sequence[dict[str, Any]], t0: float) -> list[Interruption]:
    out = []
    for e in events:
        if e["type"] == "fault_injected" and str(e.get("kind")) in _SUPERVISOR_KINDS:
            out.append(Interruption(str(e["kind"]), time_s=float(e["time"]) - t0))
        elif e["type"] == "scale_up":
            out.append(Interruption("scale_up", time_s=float(e["time"]) - t0))
    return out


def _unexplained_failures(
    events: Sequence[dict[str, Any]], injected_at: list[float], t0: float
) -> list[Interruption]:
    out = []
    for e in events:
        if e["type"] != "failure_detected":
            continue
        happened = float(e["time"]) - max(0.0, _number(e.get("latency_s")))
        # Allow for the second that passes between a fault's event and its effect.
        if not any(happened - 1.0 <= t <= float(e["time"]) for t in injected_at):
            out.append(Interruption("failure", time_s=happened - t0))
    return out


def trace_from_events(events: Sequence[dict[str, Any]]) -> list[Interruption]:
    """The interruptions of a recorded run (see the module docstring)."""
    events = sorted(events, key=lambda e: float(e["time"]))
    t0 = run_start(events)
    chaos = _chaos_entries(events, t0)
    supervisor = _supervisor_entries(events, t0)
    injected_at = [
        float(e["time"])
        for e in events
        if (e["type"] == "chaos" and e.get("kind") in _INJECTED_FAILURES)
        or e["type"] == "fault_injected"
    ]
    anomaly_steps = {i.step for i in chaos if i.kind in ("nan", "spike")}
    natural = [
        Interruption("anomaly", step=int(e["step"]))
        for e in events
        if e["type"] == "anomaly" and _reference(e) and int(e["step"]) not in anomaly_steps
    ]
    unexplained = _unexplained_failures(events, injected_at, t0)
    return [*chaos, *supervisor, *unexplained, *natural]


def checkpoint_intervals(
    config: dict[str, Any], events: Sequence[dict[str, Any]] = ()
) -> dict[str, int]:
    """Save intervals in steps per tier (0: tier off): from a run's config.json where it saves by
    step, else the median distance between the steps the run saved."""
    checkpoint = config.get("checkpoint", {})
    intervals = {
        "local": int(checkpoint.get("local_every_steps", 0)) if checkpoint.get("local_dir") else 0,
        "persistent": int(checkpoint.get("every_steps", 0)),
    }
    if checkpoint.get("auto_interval") or checkpoint.get("every_minutes"):
        intervals["persistent"] = 0  # saved by the clock: read it off the events
    for tier, every in intervals.items():
        if not every:
            intervals[tier] = _saved_every(events, tier)
    return intervals


def _saved_every(events: Sequence[dict[str, Any]], tier: str) -> int:
    steps = sorted(
        {int(e["step"]) for e in events if e["type"] == "save" and e.get("tier") == tier}
    )
    gaps = [b - a for a, b in itertools.pairwise(steps) if b > a]
    return int(statistics.median(gaps)) if gaps else 0
