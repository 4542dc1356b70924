"""Goodput against cluster size, with the best checkpoint intervals, for the framework and for the
common baseline; and a check of the model against a real chaos run.

    python experiments/goodput_sim.py                  # costs at 405B scale, about a minute
        -> experiments/results/goodput_sim.json, goodput_sim.png
    python experiments/goodput_sim.py --costs=measured # this machine's measured costs
        -> experiments/results/goodput_sim_measured.json, goodput_sim_measured.png
    python experiments/goodput_sim.py --validate=experiments/results/chaos_goodput.json
        -> experiments/results/goodput_sim_validation.json

Model: `resilient_jax.goodput.model` (analytic renewal model, seeded discrete-event Monte Carlo,
numeric optimisation of the two checkpoint intervals). For each cluster size and strategy the
intervals are optimised on the analytic model, then the Monte Carlo simulates about
`--mc_failures` failures at those intervals; `goodput` in the JSON is the Monte Carlo mean,
`goodput_analytic` the model's. Young/Daly's intervals and first-order waste are reported beside.

Strategies: `framework` (local RAM-disk tier + async persistent tier, detection in seconds, a
restart of the workers on allocated hosts, in-band anomaly skip), `baseline` (persistent
checkpoints only, saved synchronously, detection by JAX's 100 s heartbeat timeout, the whole job
resubmitted and re-initialised, rollback on anomalies), and `baseline_async` (the baseline with
async saves: what the framework adds beyond async checkpointing).

Costs. `--costs=scale` (default): a 405B model on H100-class chips from published figures and
stated assumptions (`resilient_jax.goodput.model.AtScale`; every number's source is in the JSON
under `assumptions`). `--costs=measured`: save, commit and restore times from
bench_checkpoint.json, step time from bench_step.json, detection, restart and compile from
bench_recovery.json (FIELD_NOTES figures where that file is missing), on the same failure model:
what this 2-core CPU machine's costs would give on a real cluster's failure rate.

Validation. `--validate=FILE` replays recorded chaos runs through the discrete-event model with
the costs measured in each run and the failure trace it met, and compares the predicted goodput
with the measured one (target: within 3 points). FILE is a JSON object in one of two layouts.

chaos_goodput.py's: `variants` maps a name to a run's summary, `logs` is a directory holding
`<name>.events.jsonl` for each (or a variant gives its own `events` path), `trace` is the shared
timed trace ({"at_s": T, "kind": K, ...}), used only where a variant's events are missing and
only for variants that report failures. Per variant: `goodput` (required), `wall_s`,
`failures`, `steps_lost`, `badput`, `final_step`.

A single run's: `goodput` (required) and `workdir` (its events.jsonl and config.json) at the
top level, with the optional fields below.

Either layout, optional, per variant or at the top level: `costs` overrides what the events give
(seconds: step_s, productive_fraction, startup_s, init_s, tail_s, detection_s, restart_s,
compile_s, and
per tier {"local": s, "persistent": s}: save_s (blocking), commit_s, restore_s), and
`intervals_steps` ({"local": N, "persistent": N}; no local: no local tier), `total_steps`, and
`failure_trace` replaces the trace: a list of {"kind": K, "time_s": T} (T seconds from the run's
start) or {"kind": K, "step": N} (just before step N is taken, once), K one of kill, lose_slice,
hang, failure (a failure), nan, spike, anomaly (a skipped step), scale_up, preempt, planned (save,
stop and restart), corrupt_checkpoint; optional "local_lost": true when the local tier is gone.

From the events (`resilient_jax.goodput.replay`): the costs, the save intervals (config.json, or
the steps saved), and the trace, each interruption at the step before which it happened. A run
that reached its `total_steps` is replayed to them; one cut by a time limit, for its wall time.
Writes goodput_sim_validation.json: per run the measured and predicted goodput and badput, the
difference in points, the inputs and where each came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from resilient_jax.events import read_events  # noqa: E402
from resilient_jax.goodput import model as gm  # noqa: E402
from resilient_jax.goodput import replay as goodput_replay  # noqa: E402

RESULTS = os.path.join(REPO, "experiments", "results")
MC_CHIPS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 100_000)
CURVE_POINTS = 25
TARGET_POINTS = 3.0
STRATEGY_STYLE = {
    "framework": ("#2ca02c", "framework: 2 tiers, fast detection, in-band skip"),
    "baseline": ("#d62728", "baseline: sync persistent only, 100 s heartbeat, full restart"),
    "baseline_async": ("#ff7f0e", "baseline with async saves"),
}


# ----------------------------------------------------------------------------- the sweep


def describe_costs(strategy: gm.Strategy) -> dict[str, Any]:
    tiers = {"persistent": dataclasses.asdict(strategy.persistent)}
    if strategy.local is not None:
        tiers["local"] = dataclasses.asdict(strategy.local)
    return {
        "step_s": strategy.step_s,
        "tiers": tiers,
        "detection_s": strategy.detection_s,
        "restart_s": strategy.restart_s,
        "compile_s": strategy.compile_s,
        "anomaly": "skip in-band"
        if strategy.anomaly_skip
        else f"rollback after {strategy.anomaly_detection_s:g} s",
    }


def describe_intervals(intervals: gm.Intervals, step_s: float) -> dict[str, Any]:
    local, persistent = intervals.steps(step_s)
    return {
        "local_s": None if math.isinf(intervals.local_s) else intervals.local_s,
        "persistent_s": intervals.persistent_s,
        "local_steps": local or None,
        "persistent_steps": persistent,
    }


def young_daly(strategy: gm.Strategy, cluster: gm.Cluster) -> dict[str, Any]:
    """Young/Daly's intervals, the model's goodput at them (snapped to steps), and the
    first-order waste C/tau + tau/(2M) + R/M summed over the tiers, each tier's tau/(2M) + R/M
    weighted by the share of failures restored from it."""
    raw = gm.young_daly_intervals(strategy, cluster)
    m = cluster.job_mtbf_s

    def snap(seconds: float) -> float:
        return max(1, round(seconds / strategy.step_s)) * strategy.step_s

    tiers = [(strategy.persistent, raw.persistent_s, 1.0)]
    if strategy.local is not None:
        p = cluster.local_loss_probability
        tiers = [(strategy.persistent, raw.persistent_s, p), (strategy.local, raw.local_s, 1 - p)]
    waste = sum(
        tier.save_s / tau + share * (tau / (2 * m) + strategy.recovery_s(tier.restore_s) / m)
        for tier, tau, share in tiers
    )
    snapped = gm.Intervals(
        persistent_s=snap(raw.persistent_s),
        local_s=raw.local_s if math.isinf(raw.local_s) else snap(raw.local_s),
    )
    return {
        "local_s": None if math.isinf(raw.local_s) else raw.local_s,
        "persistent_s": raw.persistent_s,
        "goodput_analytic": gm.analytic(strategy, cluster, snapped).goodput,
        "goodput_first_order": 1.0 - waste,
    }


def point(
    strategy: gm.Strategy, cluster: gm.Cluster, mc_failures: int, seed: int
) -> dict[str, Any]:
    optimum = gm.optimise(strategy, cluster)
    mc = gm.monte_carlo(strategy, cluster, optimum.intervals, failures=mc_failures, seed=seed)
    return {
        "chips": cluster.chips,
        "strategy": strategy.name,
        "job_mtbf_h": cluster.job_mtbf_s / gm.HOUR,
        "replicas": cluster.replicas,
        "local_loss_probability": cluster.local_loss_probability,
        "goodput": mc.goodput,
        "goodput_mc_stderr": mc.stderr,
        "mc_failures": mc.failures,
        "goodput_analytic": optimum.goodput,
        "intervals": describe_intervals(optimum.intervals, strategy.step_s),
        "young_daly": young_daly(strategy, cluster),
        "badput_analytic": {c: v for c, v in optimum.breakdown.shares.items() if c != "productive"},
        "costs": describe_costs(strategy),
    }


def curve(
    strategies_for: Callable[[int], dict[str, gm.Strategy]],
    cluster_for: Callable[[int], gm.Cluster],
) -> dict[str, dict[str, list[Any]]]:
    """The analytic optimum on a dense log grid of cluster sizes, for the plot's lines."""
    chips = sorted(
        {round(1024 * (100_000 / 1024) ** (i / (CURVE_POINTS - 1))) for i in range(CURVE_POINTS)}
    )
    out: dict[str, dict[str, list[Any]]] = {}
    for n in chips:
        cluster = cluster_for(n)
        for name, strategy in strategies_for(n).items():
            optimum = gm.optimise(strategy, cluster)
            row = out.setdefault(
                name, {"chips": [], "goodput": [], "local_s": [], "persistent_s": []}
            )
            row["chips"].append(n)
            row["goodput"].append(optimum.goodput)
            local = optimum.intervals.local_s
            row["local_s"].append(None if math.isinf(local) else local)
            row["persistent_s"].append(optimum.intervals.persistent_s)
    return out


def sweep(
    strategies_for: Callable[[int], dict[str, gm.Strategy]],
    cluster_for: Callable[[int], gm.Cluster],
    mc_failures: int,
    seed: int,
) -> dict[str, Any]:
    points = []
    for n in MC_CHIPS:
        cluster = cluster_for(n)
        for strategy in strategies_for(n).values():
            points.append(point(strategy, cluster, mc_failures, seed))
            p = points[-1]
            print(
                f"{n:>7} chips {p['strategy']:<15} goodput {100 * p['goodput']:5.1f}% "
                f"(analytic {100 * p['goodput_analytic']:5.1f}%)  intervals "
                f"local {_fmt_s(p['intervals']['local_s'])} persistent "
                f"{_fmt_s(p['intervals']['persistent_s'])}",
                flush=True,
            )
    return {"points": points, "curves": curve(strategies_for, cluster_for)}


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "off"
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.0f} s"


# --------------------------------------------------------------------------- the plot


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, line in result["curves"].items():
        colour, label = STRATEGY_STYLE[name]
        left.plot(line["chips"], [100 * g for g in line["goodput"]], color=colour, label=label)
        mc = [p for p in result["points"] if p["strategy"] == name]
        left.errorbar(
            [p["chips"] for p in mc],
            [100 * p["goodput"] for p in mc],
            yerr=[200 * p["goodput_mc_stderr"] for p in mc],
            fmt="o",
            color=colour,
            ms=4,
        )
        right.plot(line["chips"], line["persistent_s"], color=colour, label=f"{name}: persistent")
        if any(x is not None for x in line["local_s"]):
            local = [math.nan if x is None else x for x in line["local_s"]]
            right.plot(line["chips"], local, color=colour, ls=":", label=f"{name}: local")
        yd = [p["young_daly"]["persistent_s"] for p in mc]
        right.plot([p["chips"] for p in mc], yd, "x", color=colour, ms=6)
        yd_local = [
            (p["chips"], p["young_daly"]["local_s"]) for p in mc if p["intervals"]["local_s"]
        ]
        if yd_local:
            right.plot(*zip(*yd_local, strict=True), "+", color=colour, ms=7)
    left.set_xscale("log")
    left.set_xlabel("chips")
    left.set_ylabel("goodput, % of wall clock")
    left.set_title("goodput at the optimal intervals (lines: analytic; dots: Monte Carlo, 2 s.e.)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8, loc="lower left")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("chips")
    right.set_ylabel("seconds of training between saves")
    right.set_title("optimal intervals (Young/Daly: x persistent, + local)")
    right.grid(alpha=0.3, which="both")
    right.legend(fontsize=8)
    fig.suptitle(result["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------- measured costs


def _load(name: str) -> dict[str, Any] | None:
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# FIELD_NOTES (2-core CPU): a start costs 1.5-2.5 s; survivors abort 2.5 s after a peer's SIGKILL
# with a 3 s JAX heartbeat timeout and 7.7 s with 10 s, so about 0.27 + 0.743 * timeout.
_NOTES_START_S = 2.0
_NOTES_ABORT_AT_100_S = 0.271 + 0.743 * 100
_FRAMEWORK_HEARTBEAT_TIMEOUT_S = 5.0  # config default coordinator.heartbeat_timeout_s


def _recovery_phases(recovery: dict[str, Any] | None, scenario: str) -> dict[str, float] | None:
    if not recovery or scenario not in recovery.get("scenarios", {}):
        return None
    phases = recovery["scenarios"][scenario]["phases_s"]
    return {
        "detection_s": phases["detection"],
        "restart_s": sum(phases[k] for k in ("stopping", "restart", "process_start", "jax_init")),
        "compile_s": phases["compile"] + phases["first_step"],
        "restore_s": phases["restore"],
    }


def measured_strategies() -> tuple[Callable[[int], dict[str, gm.Strategy]], dict[str, str]]:
    """Strategies with this machine's measured costs; sources name the file of each number."""
    checkpoint, step = _load("bench_checkpoint.json"), _load("bench_step.json")
    if checkpoint is None or step is None:
        raise SystemExit("--costs=measured needs bench_checkpoint.json and bench_step.json")
    recovery = _load("bench_recovery.json")
    med = statistics.median
    saves, commits = checkpoint["save_event_duration_s"], checkpoint["save_commit_s"]
    restores = checkpoint["restore_s"]
    local = gm.Tier(med(saves["local"]), med(commits["local"]), med(restores["local -> same mesh"]))
    persistent_restore = med(restores["persistent -> same mesh"])
    persistent = gm.Tier(med(saves["persistent"]), med(commits["persistent"]), persistent_restore)
    fallback = {
        "detection_s": _FRAMEWORK_HEARTBEAT_TIMEOUT_S,
        "restart_s": _NOTES_START_S,
        "compile_s": 0.0,
    }
    ours = _recovery_phases(recovery, "ram") or fallback
    theirs = _recovery_phases(recovery, "baseline") or {
        **fallback,
        "detection_s": _NOTES_ABORT_AT_100_S,
    }
    scale = gm.AtScale()
    framework = gm.Strategy(
        name="framework",
        step_s=step["framework_median_step_s"],
        persistent=persistent,
        local=local,
        detection_s=ours["detection_s"],
        restart_s=ours["restart_s"],
        compile_s=ours["compile_s"],
        anomaly_skip=True,
    )
    baseline = dataclasses.replace(
        framework,
        name="baseline",
        persistent=gm.Tier(med(checkpoint["save_hook_s"]["orbax_sync"]), 0.0, persistent_restore),
        local=None,
        detection_s=theirs["detection_s"],
        restart_s=theirs["restart_s"],
        compile_s=theirs["compile_s"],
        anomaly_skip=False,
        anomaly_detection_s=scale.baseline_anomaly_detection_s,
    )
    orbax_async = gm.Tier(
        med(checkpoint["save_hook_s"]["orbax_async"]),
        med(commits["orbax_async"]),
        persistent_restore,
    )
    baseline_async = dataclasses.replace(baseline, name="baseline_async", persistent=orbax_async)
    recovery_source = (
        "bench_recovery.json (scenarios ram and baseline: detection; stopping + restart + "
        "process_start + jax_init; compile + first_step)"
        if recovery
        else "FIELD_NOTES.md (bench_recovery.json not yet produced): framework detection = the "
        "5 s coordinator heartbeat timeout, restart = the 1.5-2.5 s measured start, compile "
        "inside it; baseline detection = the survivors' abort delay extrapolated to 100 s"
    )
    sources = {
        "step_s": "bench_step.json framework_median_step_s (tiny_cpu, 2-core CPU)",
        "tiers": "bench_checkpoint.json medians: save_event_duration_s (blocking), "
        "save_commit_s, restore_s '-> same mesh'; baseline: save_hook_s.orbax_sync; "
        "baseline_async: save_hook_s.orbax_async and save_commit_s.orbax_async",
        "detection, restart, compile": recovery_source,
        "failures": "as --costs=scale: Llama 3 per-chip MTBF, host-loss and replica model",
        "anomalies": "as --costs=scale (PaLM rate; baseline rollback after 600 s)",
    }
    strategies = {s.name: s for s in (framework, baseline, baseline_async)}
    return (lambda chips: strategies), sources


# ------------------------------------------------------------------------- validation


def _tier(costs: dict[str, Any], name: str) -> gm.Tier | None:
    if name not in costs.get("save_s", {}):
        return None
    return gm.Tier(
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


def _trace(entries: Sequence[dict[str, Any]]) -> list[gm.Interruption]:
    return [
        gm.Interruption(
            kind=str(e["kind"]),
            time_s=None if e.get("time_s") is None else float(e["time_s"]),
            step=None if e.get("step") is None else int(e["step"]),
            local_lost=bool(e.get("local_lost", False)),
        )
        for e in entries
    ]


def _timed_trace(entries: Sequence[dict[str, Any]]) -> list[gm.Interruption]:
    """A trace as chaos_goodput.py writes it: {"at_s": T, "kind": K, ...}."""
    out = []
    for e in entries:
        at = e.get("time_s", e.get("at_s"))
        if at is None:
            continue
        kind = str(e["kind"])
        out.append(gm.Interruption(kind, time_s=float(at), local_lost=bool(e.get("local_lost"))))
    return out


# Fields of a chaos result that apply to each of its variants unless a variant has its own.
_SHARED = ("costs", "intervals_steps", "total_steps", "failure_trace")


@dataclasses.dataclass
class RecordedRun:
    """One measured run to replay: what the JSON says about it, and its events if found."""

    name: str
    measured: dict[str, Any]
    given: dict[str, Any]  # costs, intervals_steps, total_steps, failure_trace, trace
    events: list[dict[str, Any]]
    events_source: str
    config: dict[str, Any]


def _read_config(workdir: str) -> dict[str, Any]:
    path = os.path.join(workdir, "config.json")
    if not workdir or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _events(path: str) -> list[dict[str, Any]]:
    return list(read_events(path)) if path and os.path.exists(path) else []


def recorded_runs(data: dict[str, Any]) -> list[RecordedRun]:
    """The runs in a chaos result: chaos_goodput.py's `variants` (events under `logs`, or each
    variant's `events` path; the shared timed `trace` for variants that saw failures), or a
    single run (`goodput` and `workdir` at the top level)."""
    measured_keys = ("goodput", "wall_s", "failures", "steps_lost", "badput", "final_step")
    if "variants" not in data:
        workdir = data.get("workdir") or ""
        return [
            RecordedRun(
                name="run",
                measured={k: data[k] for k in measured_keys if k in data},
                given=data,
                events=_events(workdir),
                events_source=os.path.join(workdir, "events.jsonl") if workdir else "",
                config=_read_config(workdir),
            )
        ]
    runs = []
    for name, variant in data["variants"].items():
        logs = data.get("logs") or ""
        if logs and not os.path.isabs(logs):
            logs = os.path.join(REPO, logs)  # chaos_goodput.py keeps them in the repository
        path = variant.get("events") or os.path.join(logs, f"{name}.events.jsonl")
        shared = {k: data[k] for k in _SHARED if k in data}
        given = {**shared, **variant}
        if variant.get("failures") and "trace" in data:
            given.setdefault("trace", data["trace"])
        runs.append(
            RecordedRun(
                name=name,
                measured={k: variant[k] for k in measured_keys if k in variant},
                given=given,
                events=_events(path),
                events_source=path,
                config={},
            )
        )
    return runs


def _trace_of(run: RecordedRun) -> tuple[list[gm.Interruption], str]:
    if "failure_trace" in run.given:
        return _trace(run.given["failure_trace"]), "failure_trace in the JSON"
    if run.events:
        return goodput_replay.trace_from_events(run.events), "events"
    return _timed_trace(run.given.get("trace", [])), "trace in the JSON (timed)"


def _end(run: RecordedRun) -> dict[str, float]:
    """Replay to the run's total steps when it completed them, else for its wall time."""
    steps = [int(e["step"]) for e in run.events if e["type"] == "step"]
    total = run.given.get("total_steps") or run.config.get("total_steps")
    if total and (not steps or max(steps) >= int(total)):
        return {"total_steps": int(total)}
    wall = run.measured.get("wall_s")
    if wall is None and run.events:
        wall = max(e["time"] for e in run.events) - goodput_replay.run_start(run.events)
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
    derived = goodput_replay.costs_from_events(run.events) if run.events else {}
    given_costs = run.given.get("costs", {})
    borrowed: dict[str, Any] = {}
    if donor is not None:
        for key in ("save_s", "commit_s", "restore_s"):
            missing = {
                tier: cost
                for tier, cost in donor[1].get(key, {}).items()
                if tier == gm.PERSISTENT and tier not in derived.get(key, {})
            }
            if missing:
                borrowed[key] = missing
    costs = _merge(_merge(borrowed, derived), given_costs)
    intervals = run.given.get("intervals_steps") or goodput_replay.checkpoint_intervals(
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


def replay_strategy(costs: dict[str, Any], restarts: bool = True) -> gm.Strategy:
    """The recorded run as a model strategy; `restarts`: whether its trace restarts the job (a
    run without restarts needs no restart cost)."""
    needed = ("step_s", "restart_s") if restarts else ("step_s",)
    missing = [k for k in needed if k not in costs]
    persistent = _tier(costs, gm.PERSISTENT)
    if missing or persistent is None:
        raise ValueError(
            f"no measured {', '.join(missing) or 'persistent save_s'} "
            "(no usable events and no such `costs` in the JSON)"
        )
    return gm.Strategy(
        name="recorded run",
        step_s=costs["step_s"],
        persistent=persistent,
        local=_tier(costs, gm.LOCAL),
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


def _shown(path: str) -> str:
    """A path relative to the repository when it is inside it."""
    absolute = os.path.abspath(path)
    inside = absolute.startswith(REPO + os.sep)
    return os.path.relpath(absolute, REPO) if inside else absolute


def predict(run: RecordedRun, donor: tuple[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Replays one recorded run through the discrete-event model and compares; a run without
    the data to replay it gets the reason instead."""
    try:
        inputs = validation_inputs(run, donor)
        restarts = any(i.category in (gm.FAILURE, gm.PLANNED) for i in inputs["trace"])
        strategy = replay_strategy(inputs["costs"], restarts)
    except ValueError as e:
        return {"measured": run.measured, "error": str(e), "within_target": False}
    every = inputs["intervals_steps"]
    # No interval known (no periodic save seen): the tier saves only at the end.
    intervals = gm.Intervals(
        persistent_s=every["persistent"] * strategy.step_s if every.get("persistent") else math.inf,
        local_s=every["local"] * strategy.step_s if every.get("local") else math.inf,
    )
    cluster = gm.Cluster(chips=1, chip_mtbf_s=math.inf)  # failures come from the trace alone
    predicted = gm.simulate(strategy, cluster, intervals, trace=inputs["trace"], **inputs["end"])
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


def validate(path: str, out: str) -> dict[str, Any]:
    with open(path) as f:
        data = json.load(f)
    runs = recorded_runs(data)
    if not runs or any("goodput" not in r.measured for r in runs):
        raise SystemExit(f"{path}: no measured 'goodput'")
    donor = None
    for run in runs:
        costs = goodput_replay.costs_from_events(run.events) if run.events else {}
        if gm.PERSISTENT in costs.get("save_s", {}):
            donor = (run.name, costs)
            break
    compared = {run.name: predict(run, donor) for run in runs}
    result = {
        "what": "goodput of recorded chaos runs: measured vs replayed through the goodput model",
        "source": _shown(path),
        "target_points": TARGET_POINTS,
        "within_target": all(c["within_target"] for c in compared.values()),
        "runs": compared,
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    for name, c in compared.items():
        if "error" in c:
            print(f"{name}: not replayed: {c['error']}")
            continue
        print(
            f"{name}: measured {100 * c['measured']['goodput']:.1f}%, predicted "
            f"{100 * c['predicted']['goodput']:.1f}% ({c['difference_points']:+.1f} points; "
            f"target within {TARGET_POINTS:g})"
        )
    print(f"wrote {out}")
    return result


# ------------------------------------------------------------------------------- main


def summary(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = (1024, 16384, 100_000)
    return [
        {
            "chips": p["chips"],
            "strategy": p["strategy"],
            "goodput": round(p["goodput"], 4),
            "local_s": p["intervals"]["local_s"],
            "persistent_s": p["intervals"]["persistent_s"],
        }
        for p in points
        if p["chips"] in keep
    ]


def run_sweep(costs: str, mc_failures: int, seed: int, out_dir: str) -> dict[str, Any]:
    scale = gm.AtScale()
    if costs == "scale":
        strategies_for, sources = scale.strategies, scale.sources()
        stem, title = "goodput_sim", "405B-scale costs (published figures + stated assumptions)"
    else:
        strategies_for, sources = measured_strategies()
        stem, title = "goodput_sim_measured", "costs measured on a 2-core CPU (tiny model)"
    title += "; failures: Llama 3 405B rate per chip (419 in 54 days on 16,384 GPUs)"
    swept = sweep(strategies_for, scale.cluster, mc_failures, seed)
    result = {
        "what": "goodput vs cluster size at the optimal checkpoint intervals",
        "title": title,
        "costs_mode": costs,
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs (simulation)",
        "assumptions": {
            **{k: v for k, v in dataclasses.asdict(scale).items()},
            "sources": sources,
        },
        "monte_carlo": {"failures_per_point": mc_failures, "seed": seed, "replicas": 4},
        "summary": summary(swept["points"]),
        **swept,
    }
    json_path = os.path.join(out_dir, f"{stem}.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(out_dir, f"{stem}.png"))
    print(f"wrote {json_path} and {stem}.png")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--costs", choices=("scale", "measured"), default="scale")
    parser.add_argument("--validate", default="", help="a chaos_goodput.json to check against")
    parser.add_argument("--mc_failures", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out_dir", default=RESULTS)
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.validate:
        if not os.path.exists(args.validate):
            print(f"goodput_sim: {args.validate} does not exist", file=sys.stderr)
            return 2
        validate(args.validate, os.path.join(args.out_dir, "goodput_sim_validation.json"))
        return 0
    run_sweep(args.costs, args.mc_failures, args.seed, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
