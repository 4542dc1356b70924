"""A recorded run replayed through the goodput model: its costs, save intervals and interruptions
read from its events (`goodput.replay`), run through the discrete-event model
(`goodput.simulation`), and the predicted goodput set beside the measured one
(`goodput.accounting`). `experiments/goodput_sim.py --validate` does this for chaos runs.

A run's `given` settings (from a results file) win over what its events show:

    costs            seconds: step_s, productive_fraction, startup_s, init_s, tail_s, detection_s,
                     restart_s, compile_s, and per tier ({"local": s, "persistent": s}) save_s
                     (blocking), commit_s, restore_s
    intervals_steps  {"local": N, "persistent": N}; no local: no local tier
    total_steps      replay to this step (else for the run's wall time)
    failure_trace    replaces the trace: a list of {"kind": K, "time_s": T} (T seconds from the
                     run's start) or {"kind": K, "step": N} (just before step N is taken, once), K
                     an `Interruption` kind; optional "local_lost": true when the local tier is gone
    trace            a timed trace ({"at_s": T, "kind": K, ...}), used only without events

A run that reached its `total_steps` is replayed to them; one cut by a time limit, for its wall
time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from resilient_jax.contracts.event_types import EventType
from resilient_jax.goodput import replay
from resilient_jax.goodput.model import LOCAL, PERSISTENT, Cluster, Intervals, Strategy, Tier
from resilient_jax.goodput.simulation import FAILURE, PLANNED, Interruption, simulate

TARGET_POINTS = 3.0  # a prediction within this many points of goodput is on target


def _tier(costs: dict[str, Any], name: str) -> Tier | None:
    if name not in costs.get("save_s", {}):
        return None
    return Tier(
        save_s=costs["save_s"][name],
        commit_s=costs.get("commit_s", {}).get(name, 0.0),
        restore_s=costs.get("restore_s", {}).get(name, 0.0),
    )


def _merge(derived: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """`given` wins; per-tier dictionaries are merged key by key."""
    out = dict(derived)
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _trace(entries: Sequence[dict[str, Any]]) -> list[Interruption]:
    return [
        Interruption(
            kind=str(e["kind"]),
            time_s=None if e.get("time_s") is None else float(e["time_s"]),
            step=None if e.get("step") is None else int(e["step"]),
            local_lost=bool(e.get("local_lost", False)),
        )
        for e in entries
    ]


def _timed_trace(entries: Sequence[dict[str, Any]]) -> list[Interruption]:
    """A trace as chaos_goodput.py writes it: {"at_s": T, "kind": K, ...}."""
    out = []
    for e in entries:
        at = e.get("time_s", e.get("at_s"))
        if at is None:
            continue
        kind = str(e["kind"])
        out.append(Interruption(kind, time_s=float(at), local_lost=bool(e.get("local_lost"))))
    return out


@dataclasses.dataclass
class RecordedRun:
    """One measured run to replay: what its results file says about it, and its events if found."""

    name: str
    measured: dict[str, Any]
    given: dict[str, Any]  # costs, intervals_steps, total_steps, failure_trace, trace
    events: list[dict[str, Any]]
    events_source: str
    config: dict[str, Any]


def _trace_of(run: RecordedRun) -> tuple[list[Interruption], str]:
    if "failure_trace" in run.given:
        return _trace(run.given["failure_trace"]), "failure_trace in the JSON"
    if run.events:
        return replay.trace_from_events(run.events), "events"
    return _timed_trace(run.given.get("trace", [])), "trace in the JSON (timed)"


def _end(run: RecordedRun) -> dict[str, float]:
    """Replay to the run's total steps when it completed them, else for its wall time."""
    steps = [int(e["step"]) for e in run.events if e["type"] == EventType.STEP]
    total = run.given.get("total_steps") or run.config.get("total_steps")
    if total and (not steps or max(steps) >= int(total)):
        return {"total_steps": int(total)}
    wall = run.measured.get("wall_s")
    if wall is None and run.events:
        wall = max(e["time"] for e in run.events) - replay.run_start(run.events)
    if wall is None:
        raise ValueError("neither total_steps nor wall_s known")
    return {"horizon_s": float(wall)}


def validation_inputs(
    run: RecordedRun, donor: tuple[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Costs, intervals, the end and the trace of a recorded run, with where each came from.
    `donor`: (name, costs) of another run of the same setup, whose persistent-tier costs fill in
    those this run never measured (every strategy has that tier; a run that never saved still
    needs its cost to be replayed)."""
    derived = replay.costs_from_events(run.events) if run.events else {}
    given_costs = run.given.get("costs", {})
    borrowed: dict[str, Any] = {}
    if donor is not None:
        for key in ("save_s", "commit_s", "restore_s"):
            missing = {
                tier: cost
                for tier, cost in donor[1].get(key, {}).items()
                if tier == PERSISTENT and tier not in derived.get(key, {})
            }
            if missing:
                borrowed[key] = missing
    costs = _merge(_merge(borrowed, derived), given_costs)
    intervals = run.given.get("intervals_steps") or replay.checkpoint_intervals(
        run.config, run.events
    )
    trace, trace_source = _trace_of(run)
    return {
        "costs": costs,
        "intervals_steps": intervals,
        "end": _end(run),
        "trace": trace,
        "sources": {
            "events": run.events_source if run.events else "not found",
            "costs": {
                k: "JSON costs"
                if k in given_costs
                else f"events; {', '.join(borrowed[k])} from {donor[0]}"
                if k in borrowed and donor is not None
                else "events"
                for k in costs
            },
            "intervals_steps": "JSON" if run.given.get("intervals_steps") else "config/events",
            "trace": trace_source,
        },
    }


def replay_strategy(costs: dict[str, Any], restarts: bool = True) -> Strategy:
    """The recorded run as a model strategy; `restarts`: whether its trace restarts the job (a
    run without restarts needs no restart cost)."""
    needed = ("step_s", "restart_s") if restarts else ("step_s",)
    missing = [k for k in needed if k not in costs]
    persistent = _tier(costs, PERSISTENT)
    if missing or persistent is None:
        raise ValueError(
            f"no measured {', '.join(missing) or 'persistent save_s'} "
            "(no usable events and no such `costs` in the JSON)"
        )
    return Strategy(
        name="recorded run",
        step_s=costs["step_s"],
        persistent=persistent,
        local=_tier(costs, LOCAL),
        detection_s=costs.get("detection_s", 0.0),
        restart_s=costs.get("restart_s", 0.0),
        compile_s=costs.get("compile_s", 0.0),
        compile_sequence_s=tuple(costs.get("compile_sequence_s", ())),
        anomaly_skip=True,
        productive_fraction=costs.get("productive_fraction", 1.0),
        startup_s=costs.get("startup_s", 0.0),
        init_s=costs.get("init_s", 0.0),
        tail_s=costs.get("tail_s", 0.0),
    )


def predict(run: RecordedRun, donor: tuple[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Replays one recorded run through the discrete-event model and compares; a run without
    the data to replay it gets the reason instead."""
    try:
        inputs = validation_inputs(run, donor)
        restarts = any(i.category in (FAILURE, PLANNED) for i in inputs["trace"])
        strategy = replay_strategy(inputs["costs"], restarts)
    except ValueError as e:
        return {"measured": run.measured, "error": str(e), "within_target": False}
    every = inputs["intervals_steps"]
    # No interval known (no periodic save seen): the tier saves only at the end.
    intervals = Intervals(
        persistent_s=every["persistent"] * strategy.step_s if every.get("persistent") else math.inf,
        local_s=every["local"] * strategy.step_s if every.get("local") else math.inf,
    )
    cluster = Cluster(chips=1, chip_mtbf_s=math.inf)  # failures come from the trace alone
    predicted = simulate(strategy, cluster, intervals, trace=inputs["trace"], **inputs["end"])
    difference = 100 * (predicted.goodput - float(run.measured["goodput"]))
    return {
        "measured": run.measured,
        "predicted": predicted.to_json(),
        "difference_points": difference,
        "within_target": abs(difference) <= TARGET_POINTS,
        "inputs": {
            **{k: v for k, v in inputs.items() if k != "trace"},
            "trace": [dataclasses.asdict(i) for i in inputs["trace"]],
        },
    }
