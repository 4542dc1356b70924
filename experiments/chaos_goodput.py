"""Goodput under a seeded failure trace: the framework's defaults against the common baseline.

    python experiments/chaos_goodput.py [--minutes=10] [--seed=1] [--mtbf_s=60]

A local cluster of 2 slices x 2 processes x 1 CPU device trains configs/tiny_cpu.py (unchanged
model, total_steps large: each run is cut at `--minutes` by a save-and-stop) three times:

- `undisturbed`: the framework's defaults, no faults. Its losses are the reference, and its step
  rate places the NaN of the trace.
- `framework`: the framework's defaults (`resilient_jax.config.default_config()`: RAM tier every
  10 steps, persistent every 100, supervisor detection, in-band NaN skip, compilation cache,
  slices evicted and re-admitted after 60 s) under the trace.
- `baseline`: the common practice, realised as follows: persistent checkpoints only (local tier
  off, same persistent interval); no supervisor: `baseline_launcher.BaselineLauncher` starts the
  same workers and notices a failure only when the JAX job has died, that is when JAX's own
  coordination service aborted the survivors after its default 100 s heartbeat timeout
  (`coordinator.jax_heartbeat_timeout_s=100`); then every worker restarts, on 2 slices (waiting
  for a lost slice to come back), from the last persistent checkpoint; no in-band skip
  (`health.enabled=False`: a NaN stops every worker, and the launcher restarts them like after
  any crash); JAX's compilation cache off (its default).

The trace (`make_trace`): failures at exponential gaps of mean `--mtbf_s` over the run, seeded:
one host hang (SIGSTOP of a worker: heartbeats stop), one slice lost for `--lost_for_s` and
then back, one NaN step, the rest worker kills (SIGKILL); targets drawn from the same seed. Kills,
the hang and the slice loss are timed from the start of the run and injected by the supervisor
(or the baseline launcher); the NaN is a `--chaos=nan:step=K` fault of the workers, K the step
the undisturbed run reached at the NaN's time.

Reported per variant (`goodput.accounting` on the run's events): goodput (productive time over
the run's wall clock, at least `--minutes`: a run that gave up earlier is idle to the end of the
window), badput by category, steps lost (recomputed), failures, mean time to recover (fault to
the first step after the restart), the mean restart phases, steps reached and the loss there
against the undisturbed run's loss at the same step.
Writes experiments/results/chaos_goodput.json (key `goodput` per variant) and .png, and keeps
each variant's events in experiments/results/chaos_goodput_events/ (`logs` in the JSON).
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from typing import Any

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import report  # noqa: E402
from baseline_launcher import BaselineLauncher  # noqa: E402
from cluster_runs import load_config, trainer_argv  # noqa: E402

from resilient_jax.contracts.faults import FaultKind  # noqa: E402
from resilient_jax.control import ClusterSpec, Supervisor, SupervisorAction  # noqa: E402
from resilient_jax.events import read_events  # noqa: E402
from resilient_jax.goodput import accounting as goodput  # noqa: E402
from resilient_jax.goodput.timeline import CATEGORY_COLOURS  # noqa: E402

_MINUTES = flags.DEFINE_float("minutes", 10.0, "Wall-clock length of each run.")
_SEED = flags.DEFINE_integer("seed", 1, "Seed of the failure trace.")
_MTBF = flags.DEFINE_float("mtbf_s", 60.0, "Mean time between failures (seconds).")
_LOST_FOR = flags.DEFINE_float("lost_for_s", 30.0, "How long the lost slice stays out.")
_VARIANTS = flags.DEFINE_list(
    "variants", ["undisturbed", "framework", "baseline"], "Runs to make (undisturbed first)."
)
_REUSE = flags.DEFINE_string(
    "reuse",
    "",
    "Log directory of an earlier run of the same setup: variants whose NAME.events.jsonl is there "
    "are read back instead of run again (to report again, or to rerun only some variants).",
)
_OUT = flags.DEFINE_string(
    "out", os.path.join(REPO, "experiments", "results", "chaos_goodput.json"), "Result file."
)

CONFIG_FILE = "configs/tiny_cpu.py"
CLUSTER = ClusterSpec(num_slices=2, processes_per_slice=2, devices_per_process=1)
COMMON = {
    "total_steps": 1_000_000,  # the run is cut by the time limit
    "log.progress_bar": False,
    "log.tensorboard": False,
}
BASELINE = {
    "checkpoint.local_dir": "",
    "health.enabled": False,
    "coordinator.jax_heartbeat_timeout_s": 100,
    "coordinator.heartbeat_timeout_s": 50.0,  # unused without a supervisor; must be < JAX's
}


@dataclasses.dataclass(frozen=True)
class Trace:
    actions: list[SupervisorAction]  # kills, the hang and the slice loss, timed
    nan_at_s: float | None  # the NaN's time; placed at a step by `nan_step`

    def describe(self) -> list[dict[str, Any]]:
        rows = [
            {"at_s": a.at_s, "kind": a.kind, "slice": a.slice, "process": a.process}
            | ({"for_s": a.duration_s} if a.duration_s else {})
            for a in self.actions
        ]
        if self.nan_at_s is not None:
            rows.append({"at_s": self.nan_at_s, "kind": FaultKind.NAN})
        return sorted(rows, key=lambda r: r["at_s"])


def make_trace(seed: int, mtbf_s: float, length_s: float, lost_for_s: float) -> Trace:
    rng = random.Random(seed)
    times, t = [], rng.expovariate(1.0 / mtbf_s)
    while t < length_s:
        times.append(round(t, 1))
        t += rng.expovariate(1.0 / mtbf_s)
    kinds = [FaultKind.KILL] * len(times)
    special = (FaultKind.HANG, FaultKind.NAN, FaultKind.LOSE_SLICE)[: len(times)]
    for index, kind in zip(rng.sample(range(len(times)), len(special)), special, strict=True):
        kinds[index] = kind
    actions, nan_at_s = [], None
    for at_s, kind in zip(times, kinds, strict=True):
        slice_id, process = (
            rng.randrange(CLUSTER.num_slices),
            rng.randrange(CLUSTER.processes_per_slice),
        )
        if kind == FaultKind.NAN:
            nan_at_s = at_s
        elif kind == FaultKind.LOSE_SLICE:
            actions.append(SupervisorAction(kind, slice_id, at_s=at_s, duration_s=lost_for_s))
        else:
            actions.append(SupervisorAction(kind, slice_id, process=process, at_s=at_s))
    return Trace(actions, nan_at_s)


def run_variant(
    name: str, trace: Trace | None, nan_step: int | None, log_dir: str, shm: str
) -> list[dict[str, Any]]:
    """Runs one variant for --minutes; returns its events."""
    workdir = tempfile.mkdtemp(prefix=f"rj_chaos_{name}_")
    overrides = {**COMMON, "checkpoint.local_dir": shm}
    if name == "baseline":
        overrides.update(BASELINE)
    chaos = f"nan:step={nan_step}" if nan_step is not None else ""
    argv = trainer_argv("launch/train.py", CONFIG_FILE, workdir, overrides, chaos)
    actions = trace.actions if trace is not None else []
    limit_s = 60.0 * _MINUTES.value
    with open(os.path.join(log_dir, f"{name}.log"), "w") as log:
        if name == "baseline":
            launcher = BaselineLauncher(CLUSTER, argv, workdir, actions, out=log, cwd=REPO)
            code = launcher.run(time_limit_s=limit_s)
        else:
            config = load_config(CONFIG_FILE, overrides)
            supervisor = Supervisor(config, CLUSTER, argv, workdir, actions, out=log, cwd=REPO)
            code = supervisor.run(time_limit_s=limit_s).exit_code
    events = list(read_events(workdir))
    shutil.copy(
        os.path.join(workdir, "events.jsonl"), os.path.join(log_dir, f"{name}.events.jsonl")
    )
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    if code not in (0, 124):  # a run that gave up is a result too: its events say why
        print(f"{name}: exit {code} (see {log_dir}/{name}.log)", flush=True)
    return events


def lane0_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "step" and e.get("process") == 0]


def recovery_times(events: list[dict[str, Any]]) -> list[float]:
    """Per detected failure: fault (detection minus its latency) to the first step after it."""
    sup = [e for e in events if e["type"] == "failure_detected" and "source" in e]
    steps = lane0_steps(events)
    out = []
    for failure in sup:
        restarted = [
            e["time"] for e in events if e["type"] == "restart" and e["time"] >= failure["time"]
        ]
        if not restarted:
            continue
        after = [s["time"] for s in steps if s["time"] > min(restarted)]
        if after:
            out.append(min(after) - (failure["time"] - failure.get("latency_s", 0.0)))
    return out


def restart_phases(events: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per restarted generation (process 0): from its workers' spawn to JAX init,
    JAX init, restore, compile, and compile end to the first step."""
    spawns = {
        e["generation"]: e["time"]
        for e in events
        if e["type"] == "process_start" and "source" in e and e.get("process") == 0
    }
    mine = [e for e in events if e.get("process") == 0 and "source" not in e]
    totals: dict[str, list[float]] = {}
    for generation, spawned in spawns.items():
        if generation == 0:
            continue
        own = {}
        for e in mine:
            if e.get("generation") == generation and e["type"] not in own:
                own[e["type"]] = e
        if not {"jax_init", "compile", "step"} <= set(own):
            continue
        init = own["jax_init"]
        phases = {
            "process_start": init["time"] - init["duration_s"] - spawned,
            "jax_init": init["duration_s"],
            "restore": own["restore"]["duration_s"] if "restore" in own else 0.0,
            "compile": own["compile"]["duration_s"],
            "first_step": own["step"]["time"] - own["compile"]["time"],
            "spawn_to_first_step": own["step"]["time"] - spawned,
        }
        for k, v in phases.items():
            totals.setdefault(k, []).append(v)
    return {k: round(sum(v) / len(v), 2) for k, v in totals.items()}


def summarise(
    events: list[dict[str, Any]], reference: dict[int, float] | None, window_s: float
) -> dict[str, Any]:
    """`window_s`: the run's time budget; a run that gave up earlier produced nothing after."""
    result = goodput.compute(events)
    steps = lane0_steps(events)
    final = steps[-1] if steps else {}
    mttr = recovery_times(events)
    loss = final.get("loss")
    ref = reference.get(final.get("step")) if reference else None
    stop = [e for e in events if e["type"] == "stop" and "source" in e]
    return {
        "goodput": round(result.seconds[goodput.PRODUCTIVE] / max(result.wall_s, window_s), 4),
        "stop": {k: stop[-1].get(k) for k in ("exit_code", "reason")} if stop else None,
        "wall_s": round(result.wall_s, 1),
        "badput": {k: round(v, 4) for k, v in result.to_json()["badput"].items()},
        "steps_lost": result.steps_lost,
        "steps_skipped": result.steps_skipped,
        "failures": result.failures,
        "generations": result.generations,
        "restart_phases_s": restart_phases(events),
        "mttr_s": round(sum(mttr) / len(mttr), 2) if mttr else None,
        "recoveries_s": [round(t, 2) for t in mttr],
        "final_step": final.get("step"),
        "final_loss": loss if loss is None or math.isfinite(loss) else str(loss),
        "undisturbed_loss_at_final_step": ref,
        "segments": [(round(a, 2), round(b, 2), c) for a, b, c in result.segments],
    }


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    categories = [goodput.PRODUCTIVE, *goodput.BADPUT]
    colours = CATEGORY_COLOURS
    names = list(results["variants"])
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.7 * len(names)))
    for row, name in enumerate(names):
        v = results["variants"][name]
        t0 = v["segments"][0][0] if v["segments"] else 0.0
        for start, end, category in v["segments"]:
            ax.broken_barh([(start - t0, end - start)], (row - 0.35, 0.7), color=colours[category])
        ax.text(v["wall_s"], row, f" {100 * v['goodput']:.1f}%", va="center", fontsize=9)
    for fault in results["trace"]:
        ax.axvline(fault["at_s"], color="black", lw=0.6, ls=":")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.08 * max(v["wall_s"] for v in results["variants"].values()))
    ax.set_xlabel("seconds since the run began (dotted: the trace's faults; right: goodput)")
    used = {c for v in results["variants"].values() for _, _, c in v["segments"]}
    ax.legend(
        handles=[Patch(color=colours[c], label=goodput.LABELS[c]) for c in categories if c in used],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def keep_events(log_dir: str, keep_dir: str) -> str:
    """Copies each variant's events next to the results (the simulator's validation replays
    them); returns that directory, relative to the repository when inside it."""
    os.makedirs(keep_dir, exist_ok=True)
    for name in os.listdir(log_dir):
        if name.endswith(".events.jsonl"):
            shutil.copy(os.path.join(log_dir, name), keep_dir)
    absolute = os.path.abspath(keep_dir)
    return os.path.relpath(absolute, REPO) if absolute.startswith(REPO + os.sep) else absolute


def main(argv: list[str]) -> None:
    del argv
    log_dir = tempfile.mkdtemp(prefix="rj_chaos_logs_")
    shm = report.ram_disk_dir("rj_chaos")
    length_s = 60.0 * _MINUTES.value
    trace = make_trace(_SEED.value, _MTBF.value, length_s, _LOST_FOR.value)
    runs: dict[str, list[dict[str, Any]]] = {}
    nan_step = None
    for name in _VARIANTS.value:
        started = time.monotonic()
        earlier = os.path.join(_REUSE.value, f"{name}.events.jsonl") if _REUSE.value else ""
        if earlier and os.path.exists(earlier):
            runs[name] = list(read_events(earlier))
            shutil.copy(earlier, log_dir)
        elif name == "undisturbed":
            runs[name] = run_variant(name, None, None, log_dir, shm)
        else:
            runs[name] = run_variant(name, trace, nan_step, log_dir, shm)
        if name == "undisturbed":
            steps = lane0_steps(runs[name])
            if trace.nan_at_s is not None and steps:
                t0 = min(e["time"] for e in runs[name])
                nan_step = max([1] + [s["step"] for s in steps if s["time"] - t0 <= trace.nan_at_s])
        print(f"{name}: {time.monotonic() - started:.0f} s", flush=True)
    reference = None
    if "undisturbed" in runs:
        reference = {s["step"]: s["loss"] for s in lane0_steps(runs["undisturbed"])}
    variants = {name: summarise(events, reference, length_s) for name, events in runs.items()}
    if "undisturbed" in variants:
        # Goodput counts a step on fewer slices as fully productive; progress shows the rest.
        done = variants["undisturbed"]["final_step"] or 1
        for v in variants.values():
            v["progress_vs_undisturbed"] = round((v["final_step"] or 0) / done, 4)
    results = {
        "what": "goodput of a 2 x 2-process local cluster under a seeded failure trace",
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "setup": {
            "cluster": "2 slices x 2 processes x 1 CPU device (simulated slices)",
            "config": CONFIG_FILE,
            "common_overrides": COMMON,
            "baseline_overrides": BASELINE,
            "minutes": _MINUTES.value,
            "mtbf_s": _MTBF.value,
            "seed": _SEED.value,
            "nan_step": nan_step,
        },
        "trace": trace.describe(),
        "variants": variants,
        "logs": keep_events(log_dir, os.path.splitext(_OUT.value)[0] + "_events"),
    }
    report.write_json(_OUT.value, results, indent=1)
    plot(results, os.path.splitext(_OUT.value)[0] + ".png")
    header = (
        f"{'variant':<12}{'goodput':>9}{'progress':>10}{'failures':>10}{'lost':>6}{'MTTR s':>8}"
    )
    header += f"{'step':>7}"
    print(header + "  loss (undisturbed at that step)")
    for name, v in variants.items():
        mttr = "-" if v["mttr_s"] is None else f"{v['mttr_s']:.1f}"
        print(
            f"{name:<12}{v['goodput']:>9.3f}{v.get('progress_vs_undisturbed', 0):>10.3f}"
            f"{v['failures']:>10}{v['steps_lost']:>6}{mttr:>8}"
            f"{v['final_step'] or 0:>7}  {v['final_loss']} ({v['undisturbed_loss_at_final_step']})"
        )


if __name__ == "__main__":
    app.run(main)
