"""Elastic mode against the single-runtime mode: what a lost slice costs the survivors.

    python experiments/elastic.py [--total_steps=40] [--fault_step=15]

Runs the real trainer (`launch/train.py`, configs/tiny_cpu.py: the 3.7M-parameter model, batch
16 x 128 tokens) on 2 slices x 1 process x 2 CPU devices, three ways, one after the other:

- `single_runtime`: today's default, the supervisor and one JAX runtime over both slices,
  undisturbed: the step time the elastic mode is compared with.
- `elastic`: `elastic.enabled`, undisturbed: its step time (gradient sums through the gloo
  exchange on the host) and its per-step parameter digests.
- `elastic_kill`: as `elastic`, slice 1's worker SIGKILLed once slice 0 has logged `fault_step`;
  the elastic supervisor starts a replacement 1 s later, which compiles, heals from slice 0 and
  joins. Measured from slice 0's events: the survivor's stall (from the kill to its next step;
  and that step interval less the median one), the steps redone (exchanges that failed), the
  replacement's time from its start to the heal and the heal's own transfer time, the survivor's
  pause at the join (the interval of the join step less the median), and whether every step's
  parameters equal the undisturbed run's bit for bit.

Writes experiments/results/elastic.json and .png and prints a table. Times are wall clock on a
shared 2-core machine: compare the scenarios of one run, not absolute numbers across runs.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from resilient_jax.control import ClusterSpec, Supervisor  # noqa: E402
from resilient_jax.control.elastic import ElasticSupervisor  # noqa: E402

_STEPS = flags.DEFINE_integer("total_steps", 40, "Steps per run.")
_FAULT = flags.DEFINE_integer("fault_step", 15, "Slice 1 is killed once slice 0 logged this step.")
_ANALYZE = flags.DEFINE_string(
    "analyze", "", "Only read the runs in this directory (a previous run's root) again."
)

RESULTS = os.path.join(REPO, "experiments", "results")


def overrides() -> dict[str, Any]:
    return {
        "total_steps": _STEPS.value,
        "log.every_steps": 1,
        "log.progress_bar": False,
        "log.tensorboard": False,
        "eval.every_steps": 0,
        "checkpoint.every_steps": 0,
        "checkpoint.local_every_steps": 0,
        "coordinator.compilation_cache_dir": "",
    }


def load_config(extra: dict[str, Any]):
    import runpy

    config = runpy.run_path(os.path.join(REPO, "configs", "tiny_cpu.py"))["get_config"]()
    config.update_from_flattened_dict({**overrides(), **extra})
    return config


def argv(workdir: str, extra: dict[str, Any]) -> list[str]:
    flat = {**overrides(), **extra}
    return [
        sys.executable,
        "launch/train.py",
        "--config=configs/tiny_cpu.py",
        f"--workdir={workdir}",
        *(f"--config.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in flat.items()),
    ]


def read(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def step_times(rows: list[dict[str, Any]]) -> list[float]:
    """step_time_s of every metrics row after the first two (compile, first exchange)."""
    return [r["step_time_s"] for r in rows if r.get("step", 0) > 2 and "step_time_s" in r]


def single_runtime(root: str) -> dict[str, Any]:
    workdir = os.path.join(root, "single_runtime")
    supervisor = Supervisor(
        load_config({}),
        ClusterSpec(2, 1, 2),
        argv(workdir, {}),
        workdir,
        out=io.StringIO(),
        cwd=REPO,
    )
    result = supervisor.run(time_limit_s=900)
    return single_runtime_result(workdir, result.exit_code)


def single_runtime_result(workdir: str, exit_code: int) -> dict[str, Any]:
    times = step_times(read(os.path.join(workdir, "metrics.jsonl")))
    return {"exit_code": exit_code, "median_step_s": statistics.median(times)}


ELASTIC = {"elastic.enabled": True, "elastic.check_every_steps": 1}


def run_elastic(workdir: str, during=None) -> Any:
    supervisor = ElasticSupervisor(
        load_config(ELASTIC),
        lambda slice_id, slice_dir: argv(slice_dir, ELASTIC),
        workdir,
        devices_per_process=2,
        out=io.StringIO(),
        cwd=REPO,
    )
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(r=supervisor.run(900)))
    thread.start()
    while thread.is_alive():
        if during is not None and during(supervisor):
            during = None
        time.sleep(0.01)
    thread.join()
    return result["r"]


def slice_events(workdir: str, slice_id: int, kind: str) -> list[dict[str, Any]]:
    rows = read(os.path.join(workdir, "slices", str(slice_id), "events.jsonl"))
    return [e for e in rows if e["type"] == kind]


def elastic(root: str) -> dict[str, Any]:
    workdir = os.path.join(root, "elastic")
    return elastic_result(workdir, run_elastic(workdir).exit_code)


def elastic_result(workdir: str, exit_code: int) -> dict[str, Any]:
    times = step_times(read(os.path.join(workdir, "slices", "0", "metrics.jsonl")))
    digests = [
        {e["step"]: e["digest"] for e in slice_events(workdir, s, "elastic_step")} for s in (0, 1)
    ]
    return {
        "exit_code": exit_code,
        "median_step_s": statistics.median(times),
        "replicas_bitwise_equal": digests[0] == digests[1],
        "digests": digests[0],
    }


def elastic_kill(root: str, reference: dict[int, str]) -> dict[str, Any]:
    workdir = os.path.join(root, "elastic_kill")
    killed: dict[str, float] = {}

    def kill(supervisor) -> bool:
        steps = slice_events(workdir, 0, "elastic_step")
        if not steps or steps[-1]["step"] < _FAULT.value:
            return False
        os.kill(supervisor.workers[1].pid, signal.SIGKILL)
        killed["time"] = time.time()
        with open(os.path.join(workdir, "kill_time.json"), "w") as f:
            json.dump(killed, f)
        return True

    result = run_elastic(workdir, during=kill)
    return {"exit_code": result.exit_code, **analyze_kill(workdir, reference)}


def analyze_kill(workdir: str, reference: dict[int, str]) -> dict[str, Any]:
    """The kill run's numbers from its events. The fault time is the kill's (`kill_time.json`),
    or else the survivor's first failed exchange (a killed peer resets its connections at once)."""
    survivor = slice_events(workdir, 0, "elastic_step")
    failed = slice_events(workdir, 0, "elastic_exchange_failed")
    kill_file = os.path.join(workdir, "kill_time.json")
    if os.path.exists(kill_file):
        with open(kill_file) as f:
            t_kill, fault_source = json.load(f)["time"], "kill"
    else:
        t_kill, fault_source = failed[0]["time"], "first failed exchange"
    before = [e for e in survivor if e["time"] < t_kill]
    after = [e for e in survivor if e["time"] >= t_kill]
    intervals = [b["time"] - a["time"] for a, b in itertools.pairwise(survivor[2:])]
    median = statistics.median(intervals[: _FAULT.value - 3])
    alone = [e for e in survivor if e["slices"] == [0]]
    alone_intervals = [b["time"] - a["time"] for a, b in itertools.pairwise(alone)]
    quorums = slice_events(workdir, 0, "elastic_quorum")
    reformed = next(q for q in quorums if q["time"] >= t_kill)
    digests = {e["step"]: e["digest"] for e in survivor}
    replacement = {e["step"]: e["digest"] for e in slice_events(workdir, 1, "elastic_step")}
    out: dict[str, Any] = {
        "fault_time_from": fault_source,
        "median_step_s": median,
        "median_step_alone_s": statistics.median(alone_intervals) if alone_intervals else None,
        "reform_s": reformed["time"] - t_kill,
        "stall_s": after[0]["time"] - t_kill,
        "gap_across_fault_s": after[0]["time"] - before[-1]["time"],
        "steps_redone": len(failed),
        "steps_alone": len(alone),
        "same_params_as_undisturbed": digests == reference
        and all(reference[s] == d for s, d in replacement.items()),
        "rejoined": any(e["slices"] == [0, 1] for e in after),
    }
    heals = slice_events(workdir, 1, "elastic_heal")
    if out["rejoined"] and heals:
        rejoin = next(e for e in after if e["slices"] == [0, 1])
        previous = survivor[survivor.index(rejoin) - 1]
        starts = read(os.path.join(workdir, "events.jsonl"))
        start = [e for e in starts if e["type"] == "elastic_slice_start"][-1]["time"]
        out["replacement_start_to_heal_s"] = heals[-1]["time"] - start
        out["heal_transfer_s"] = heals[-1]["duration_s"]
        out["heal_bytes"] = heals[-1]["bytes"]
        out["join_pause_s"] = rejoin["time"] - previous["time"] - median
    return out


def main(argv_: list[str]) -> None:
    del argv_
    root = _ANALYZE.value or tempfile.mkdtemp(prefix="elastic_")
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "config": "configs/tiny_cpu.py (3.7M params), 2 slices x 1 process x 2 CPU devices",
        "total_steps": _STEPS.value,
        "fault_step": _FAULT.value,
    }
    if _ANALYZE.value:
        results["single_runtime"] = single_runtime_result(os.path.join(root, "single_runtime"), 0)
        results["elastic"] = elastic_result(os.path.join(root, "elastic"), 0)
        reference = results["elastic"].pop("digests")
        kill_dir = os.path.join(root, "elastic_kill")
        results["elastic_kill"] = {"exit_code": 0, **analyze_kill(kill_dir, reference)}
    else:
        results["single_runtime"] = single_runtime(root)
        results["elastic"] = elastic(root)
        results["elastic_kill"] = elastic_kill(root, results["elastic"].pop("digests"))
    single, plain = results["single_runtime"], results["elastic"]
    results["step_time_ratio_elastic_to_single"] = plain["median_step_s"] / single["median_step_s"]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "elastic.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"{'scenario':<16} {'median step s':>14}")
    for name in ("single_runtime", "elastic", "elastic_kill"):
        print(f"{name:<16} {results[name]['median_step_s']:>14.3f}")
    print(f"elastic / single-runtime step time: {results['step_time_ratio_elastic_to_single']:.2f}")
    for key, value in results["elastic_kill"].items():
        print(f"  {key:<28} {value if not isinstance(value, float) else round(value, 4)}")
    plot(results)


def plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = results["elastic_kill"]
    labels = [
        "step (2 slices)",
        "step alone\n(both parts)",
        "fault -> quorum\nre-formed",
        "fault -> next step",
    ]
    values = [k["median_step_s"], k["median_step_alone_s"] or 0.0, k["reform_s"], k["stall_s"]]
    colors = ["grey", "grey", "tab:green", "tab:red"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(labels, values, color=colors)
    ax.axhline(0.5, color="black", linestyle="--", linewidth=1, label="target 0.5 s")
    ax.set_ylabel("seconds")
    ax.set_title("Elastic mode: slice 1 SIGKILLed, slice 0 trains on (tiny_cpu, 2 slices)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "elastic.png"), dpi=120)


if __name__ == "__main__":
    app.run(main)
