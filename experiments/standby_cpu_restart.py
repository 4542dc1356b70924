"""The restart path's standby workers under SCHED_IDLE or at normal priority: what their start-up
costs the generation that a restart starts beside them.

    python experiments/standby_cpu_restart.py [--pairs=3] [--total_steps=70] [--fault_step=25]

Runs the real trainer (configs/tiny_cpu.py made smaller, as in the tests) under the supervisor as
2 slices x 1 process x 2 CPU devices, with standby workers (`coordinator.standby_workers`) and the
RAM-disk tier, and SIGKILLs the slice-1 worker at `fault_step`. The restart takes the standby
waiting on slice 0's host; that host's agent then starts a new standby at once, whose imports
(about 2 CPU-s) run beside the new generation's start and first steps. The two settings of
`coordinator.standby_idle_cpu`, run after one another in alternating order (`--pairs` of each,
after one warm-up run that fills the compilation cache):

- `idle`: the standby under SCHED_IDLE (and its session's group at nice 19) until it is given a
  place: it takes only CPU the workers leave idle;
- `normal`: the standby at the agent's priority, as before.

Per run, from the events: fault -> the new generation's first step, fault -> the first step past
the last one before the fault (progress regained), and the median duration of the new
generation's first `--window` steps. Ratios are idle / normal of the medians over the pairs.
Writes experiments/results/standby_cpu_restart.json and prints a table; the load average before
and after is in the JSON.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import report  # noqa: E402
from cluster_runs import (  # noqa: E402
    SUPERVISED_SMALL,
    extra_overrides,
    load_config,
    trainer_argv,
)

from resilient_jax.control import ClusterSpec, Supervisor, SupervisorAction  # noqa: E402
from resilient_jax.events import read_events  # noqa: E402

_PAIRS = flags.DEFINE_integer("pairs", 3, "Runs of each setting (alternating order).")
_TOTAL = flags.DEFINE_integer("total_steps", 70, "Steps of each run.")
_FAULT = flags.DEFINE_integer("fault_step", 25, "The slice-1 worker is killed at this step.")
_WINDOW = flags.DEFINE_integer("window", 20, "New-generation steps whose durations are compared.")
_OUT = flags.DEFINE_string(
    "out", os.path.join(REPO, "experiments", "results", "standby_cpu_restart.json"), "Result file."
)

CONFIG_FILE = "configs/tiny_cpu.py"
SETTINGS = {"idle": True, "normal": False}
BASE_OVERRIDES = {
    **SUPERVISED_SMALL,
    "checkpoint.every_steps": 20,
    "checkpoint.local_every_steps": 5,
    "coordinator.precompile_candidates": False,
    "coordinator.standby_workers": True,
}


def run_once(name: str, idle: bool, cache_dir: str, log_dir: str) -> dict[str, Any]:
    """One run with `coordinator.standby_idle_cpu=idle`; its measures."""
    workdir = tempfile.mkdtemp(prefix=f"rj_standby_cpu_{name}_")
    shm = report.ram_disk_dir("rj_standby_cpu")
    overrides = {
        **BASE_OVERRIDES,
        **extra_overrides(),
        "total_steps": _TOTAL.value,
        "checkpoint.local_dir": shm,
        "coordinator.compilation_cache_dir": cache_dir,
        "coordinator.standby_idle_cpu": idle,
    }
    argv = trainer_argv("launch/train.py", CONFIG_FILE, workdir, overrides)
    kill = SupervisorAction("kill", slice=1, at_step=_FAULT.value)
    try:
        with open(os.path.join(log_dir, f"{name}.log"), "w") as log:
            supervisor = Supervisor(
                load_config(CONFIG_FILE, overrides),
                ClusterSpec(2, 1, 2),
                argv,
                workdir,
                actions=[kill],
                out=log,
                cwd=REPO,
            )
            result = supervisor.run(time_limit_s=600)
        events = list(read_events(workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    if result.exit_code:
        raise SystemExit(f"run {name} failed: {result.reason} (see {log_dir}/{name}.log)")
    return measures(events)


def measures(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Fault -> first step and -> progress regained, and the new generation's step durations."""
    sup = [e for e in events if e.get("source") == "supervisor"]
    fault = next(e for e in sup if e["type"] == "fault_injected")
    restart = next(e for e in sup if e["type"] == "restart")
    steps = [e for e in events if e["type"] == "step" and e.get("source") != "supervisor"]
    before = max(e["step"] for e in steps if e["time"] <= fault["time"])
    after = sorted(
        (e for e in steps if e["generation"] == restart["generation"]), key=lambda e: e["time"]
    )
    regained = min(e["time"] for e in after if e["step"] > before)
    window = [e["duration_s"] for e in after[1 : 1 + _WINDOW.value]]  # the first one compiles
    return {
        "fault_to_first_step_s": round(after[0]["time"] - fault["time"], 3),
        "fault_to_regained_progress_s": round(regained - fault["time"], 3),
        "median_step_s": round(statistics.median(window), 4),
        "window_steps": len(window),
    }


def main(argv: list[str]) -> None:
    del argv
    log_dir = tempfile.mkdtemp(prefix="rj_standby_cpu_logs_")
    cache_dir = tempfile.mkdtemp(prefix="rj_standby_cpu_cache_")
    load_before = os.getloadavg()
    started = time.time()
    print("warm-up run (fills the compilation cache; not counted)")
    run_once("warmup", True, cache_dir, log_dir)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    for pair in range(_PAIRS.value):
        order = list(SETTINGS) if pair % 2 == 0 else list(reversed(SETTINGS))
        for name in order:
            measured = run_once(f"{name}_{pair}", SETTINGS[name], cache_dir, log_dir)
            runs[name].append(measured)
            print(f"pair {pair} {name:6s} {measured}")
    shutil.rmtree(cache_dir, ignore_errors=True)
    keys = ("fault_to_first_step_s", "fault_to_regained_progress_s", "median_step_s")
    medians = {
        name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()
    }
    ratios = {k: round(medians["idle"][k] / medians["normal"][k], 3) for k in keys}
    print(f"\n{'measure':32s} {'idle':>9s} {'normal':>9s} {'idle/normal':>12s}")
    for k in keys:
        print(f"{k:32s} {medians['idle'][k]:9.3f} {medians['normal'][k]:9.3f} {ratios[k]:12.3f}")
    report.write_json(
        _OUT.value,
        {
            "what": "restart-path standby workers under SCHED_IDLE (idle) or at normal priority, "
            "beside the generation a restart starts; medians over the pairs",
            "machine": report.host_line(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "ran": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
            "setup": {
                "cluster": "2 slices x 1 process x 2 CPU devices",
                "total_steps": _TOTAL.value,
                "fault_step": _FAULT.value,
                "pairs": _PAIRS.value,
                "window_steps": _WINDOW.value,
            },
            "runs": runs,
            "medians": medians,
            "idle_over_normal": ratios,
            "logs": log_dir,
        },
    )


if __name__ == "__main__":
    app.run(main)
