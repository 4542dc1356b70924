"""Goodput against cluster size, with the best checkpoint intervals, for the framework and for the
common baseline; and a check of the model against a real chaos run.

    python experiments/goodput_sim.py                  # costs at 405B scale, about a minute
        -> experiments/results/goodput_sim.json, goodput_sim.png
    python experiments/goodput_sim.py --costs=measured # this machine's measured costs
        -> experiments/results/goodput_sim_measured.json, goodput_sim_measured.png
    python experiments/goodput_sim.py --validate=experiments/results/chaos_goodput.json
        -> experiments/results/goodput_sim_validation.json
    python experiments/goodput_sim.py --check          # the scenario's claims, a few seconds
        -> "all claims hold", exit 0

Model: `resilient_jax.goodput.model` (analytic renewal model, numeric optimisation of the two
checkpoint intervals) and `resilient_jax.goodput.simulation` (seeded discrete-event Monte Carlo).
For each cluster size and strategy the intervals are optimised on the analytic model, then the Monte
Carlo simulates about `--mc_failures` failures at those intervals; `goodput` in the JSON is the
Monte Carlo mean, `goodput_analytic` the model's. Young/Daly's intervals and first-order waste are
reported beside.

Strategies: `framework` (local RAM-disk tier + async persistent tier, detection in seconds, a
restart of the workers on allocated hosts, in-band anomaly skip), `baseline` (persistent
checkpoints only, saved synchronously, detection by JAX's 100 s heartbeat timeout, the whole job
resubmitted and re-initialised, rollback on anomalies), and `baseline_async` (the baseline with
async saves: what the framework adds beyond async checkpointing).

Costs. `--costs=scale` (default): a 405B model on H100-class chips from published figures and stated
assumptions (`goodput_scenarios.AtScale`; every number's source is in the JSON under `assumptions`);
the sweep first checks the claims its figures rest on (`--check`). `--costs=measured`: save, commit
and restore times from bench_checkpoint.json, step time from bench_step.json, detection, restart and
compile from bench_recovery.json (FIELD_NOTES figures where that file is missing), on the same
failure model: what this 2-core CPU machine's costs would give on a real cluster's failure rate.

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
(seconds: step_s, productive_fraction, startup_s, init_s, tail_s, detection_s, restart_s, compile_s,
and per tier {"local": s, "persistent": s}: save_s (blocking), commit_s, restore_s), and
`intervals_steps` ({"local": N, "persistent": N}; no local: no local tier), `total_steps`, and
`failure_trace` replaces the trace: a list of {"kind": K, "time_s": T} (T seconds from the run's
start) or {"kind": K, "step": N} (just before step N is taken, once), K one of kill, lose_slice,
hang, failure (a failure), nan, spike, anomaly (a skipped step), scale_up, preempt, planned (save,
stop and restart), corrupt_checkpoint; optional "local_lost": true when the local tier is gone.

From the events (`resilient_jax.goodput.replay`, `resilient_jax.goodput.validation`): the costs, the
save intervals (config.json, or the steps saved), and the trace, each interruption at the step
before which it happened. A run that reached its `total_steps` is replayed to them; one cut by a
time limit, for its wall time. Writes goodput_sim_validation.json: per run the measured and
predicted goodput and badput, the difference in points, the inputs and where each came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import report  # noqa: E402
from goodput_scenarios import HOUR, AtScale  # noqa: E402

from resilient_jax.events import read_events  # noqa: E402
from resilient_jax.goodput import model as gm  # noqa: E402
from resilient_jax.goodput import replay as goodput_replay  # noqa: E402
from resilient_jax.goodput import simulation  # noqa: E402
from resilient_jax.goodput import validation as goodput_validation  # noqa: E402

RESULTS = os.path.join(REPO, "experiments", "results")
MC_CHIPS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 100_000)
CURVE_POINTS = 25
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
    mc = simulation.monte_carlo(
        strategy, cluster, optimum.intervals, failures=mc_failures, seed=seed
    )
    return {
        "chips": cluster.chips,
        "strategy": strategy.name,
        "job_mtbf_h": cluster.job_mtbf_s / HOUR,
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
    plt = report.pyplot()
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
    report.save_figure(fig, path, dpi=110)


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
    # The default path: the reshaped step compiled ahead of the fault; else a cache warm from an
    # earlier run (what the framework met before candidates were compiled ahead).
    ours = _recovery_phases(recovery, "ram_precompiled") or _recovery_phases(recovery, "ram")
    ours = ours or fallback
    theirs = _recovery_phases(recovery, "baseline") or {
        **fallback,
        "detection_s": _NOTES_ABORT_AT_100_S,
    }
    scale = AtScale()
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
        "bench_recovery.json (scenarios ram_precompiled, else ram, and baseline: detection; "
        "stopping + restart + process_start + jax_init; compile + first_step)"
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


_SHARED = ("costs", "intervals_steps", "total_steps", "failure_trace")


def _read_config(workdir: str) -> dict[str, Any]:
    path = os.path.join(workdir, "config.json")
    if not workdir or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _events(path: str) -> list[dict[str, Any]]:
    return list(read_events(path)) if path and os.path.exists(path) else []


def recorded_runs(data: dict[str, Any]) -> list[goodput_validation.RecordedRun]:
    """The runs in a chaos result: chaos_goodput.py's `variants` (events under `logs`, or each
    variant's `events` path; the shared timed `trace` for variants that saw failures), or a
    single run (`goodput` and `workdir` at the top level)."""
    measured_keys = ("goodput", "wall_s", "failures", "steps_lost", "badput", "final_step")
    if "variants" not in data:
        workdir = data.get("workdir") or ""
        return [
            goodput_validation.RecordedRun(
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
            goodput_validation.RecordedRun(
                name=name,
                measured={k: variant[k] for k in measured_keys if k in variant},
                given=given,
                events=_events(path),
                events_source=path,
                config={},
            )
        )
    return runs


def _shown(path: str) -> str:
    """A path relative to the repository when it is inside it."""
    absolute = os.path.abspath(path)
    inside = absolute.startswith(REPO + os.sep)
    return os.path.relpath(absolute, REPO) if inside else absolute


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
    compared = {run.name: goodput_validation.predict(run, donor) for run in runs}
    result = {
        "what": "goodput of recorded chaos runs: measured vs replayed through the goodput model",
        "source": _shown(path),
        "target_points": goodput_validation.TARGET_POINTS,
        "within_target": all(c["within_target"] for c in compared.values()),
        "runs": compared,
    }
    report.write_json(out, result)
    for name, c in compared.items():
        if "error" in c:
            print(f"{name}: not replayed: {c['error']}")
            continue
        print(
            f"{name}: measured {100 * c['measured']['goodput']:.1f}%, predicted "
            f"{100 * c['predicted']['goodput']:.1f}% ({c['difference_points']:+.1f} points; "
            f"target within {goodput_validation.TARGET_POINTS:g})"
        )
    return result


# ------------------------------------------------------------------ checks of the scenario


def check_scenario(scale: AtScale) -> list[str]:
    """The claims the sweep's figures rest on, checked on the at-scale data; returns what fails.
    The model itself is tested in tests/test_goodput_sim.py, on small data of its own."""
    failed: list[str] = []

    def expect(holds: bool, claim: str) -> None:
        print(f"  {'ok  ' if holds else 'FAIL'} {claim}", flush=True)
        if not holds:
            failed.append(claim)

    cluster = scale.cluster(16384)
    framework = scale.strategies(16384)["framework"]
    optimum = gm.optimise(framework, cluster)
    expect(math.isfinite(optimum.intervals.local_s), "two tiers pay at 16,384 chips")
    mc = simulation.monte_carlo(framework, cluster, optimum.intervals, failures=300, seed=2)
    expect(
        abs(optimum.goodput - mc.goodput) < 0.01,
        f"two tiers at 16,384 chips: analytic {optimum.goodput:.4f} within 0.01 of "
        f"Monte Carlo {mc.goodput:.4f}",
    )
    for name in ("framework", "baseline"):
        strategy = scale.strategies(16384)[name]
        goodputs = [
            gm.optimise(
                strategy,
                gm.Cluster(16384, factor * scale.chip_mtbf_s, replicas=scale.replicas(16384)),
            ).goodput
            for factor in (0.25, 0.5, 1.0, 2.0, 4.0)
        ]
        expect(
            goodputs == sorted(goodputs) and goodputs[0] < goodputs[-1],
            f"{name}: goodput grows with the MTBF",
        )
    for chips in (16384, 100_000):
        cluster = scale.cluster(chips)
        strategies = scale.strategies(chips)
        ours = gm.optimise(strategies["framework"], cluster)
        theirs = gm.optimise(strategies["baseline"], cluster)
        expect(
            ours.goodput > theirs.goodput + 0.05,
            f"{chips:,} chips: framework {ours.goodput:.3f} beats baseline {theirs.goodput:.3f} "
            "by more than 5 points (analytic)",
        )
    ours_mc = simulation.monte_carlo(strategies["framework"], cluster, ours.intervals, failures=200)
    theirs_mc = simulation.monte_carlo(
        strategies["baseline"], cluster, theirs.intervals, failures=200
    )
    expect(
        ours_mc.goodput > theirs_mc.goodput + 0.1,
        f"100,000 chips: framework {ours_mc.goodput:.3f} beats baseline "
        f"{theirs_mc.goodput:.3f} by more than 10 points (Monte Carlo)",
    )
    intervals = gm.Intervals(persistent_s=600.0, local_s=60.0)
    for host_loss, tier in ((0.0, gm.LOCAL), (1.0, gm.PERSISTENT)):
        one_replica = gm.Cluster(16384, scale.chip_mtbf_s, host_loss_fraction=host_loss, replicas=1)
        result = simulation.simulate(framework, one_replica, intervals, seed=0, horizon_s=50 * HOUR)
        expect(
            set(result.restores) == {tier},
            f"one replica, host-loss share {host_loss:g}: every restore from the {tier} tier",
        )
    return failed


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
    scale = AtScale()
    if costs == "scale":
        print("checking the scenario's claims", flush=True)
        if check_scenario(scale):
            raise SystemExit("goodput_sim: the at-scale scenario fails its checks (above)")
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
        "machine": report.host_line(" (simulation)"),
        "assumptions": {
            **{k: v for k, v in dataclasses.asdict(scale).items()},
            "sources": sources,
        },
        "monte_carlo": {"failures_per_point": mc_failures, "seed": seed, "replicas": 4},
        "summary": summary(swept["points"]),
        **swept,
    }
    report.write_json(os.path.join(out_dir, f"{stem}.json"), result)
    plot(result, os.path.join(out_dir, f"{stem}.png"))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--costs", choices=("scale", "measured"), default="scale")
    parser.add_argument("--validate", default="", help="a chaos_goodput.json to check against")
    parser.add_argument(
        "--check", action="store_true", help="only check the at-scale scenario's claims"
    )
    parser.add_argument("--mc_failures", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out_dir", default=RESULTS)
    args = parser.parse_args(argv)
    if args.check:
        failed = check_scenario(AtScale())
        print(f"{len(failed)} claim(s) failed" if failed else "all claims hold")
        return 1 if failed else 0
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
