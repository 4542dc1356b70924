"""Elastic mode with slices of two processes (each slice its own JAX runtime of 2 processes x 1
CPU device) against slices of one process with the same 2 devices, and a slice losing one of its
processes.

    python experiments/elastic_processes.py [--total_steps=200] [--fault_step=30]

Runs the real trainer (`launch/train.py`, configs/small_cpu.py) under the elastic supervisor on 2
slices, three runs one after the other:

- `one_process`: 2 slices x 1 process x 2 devices, undisturbed.
- `two_processes`: 2 slices x 2 processes x 1 device, undisturbed (the same devices per slice:
  the same function, bit for bit; `tests/test_elastic_multiprocess.py`).
- `two_processes_kill`: as `two_processes`, process 1 of slice 1 SIGKILLed once slice 0 has
  logged `fault_step` and both processes of the warm standby wait at the join point. The
  supervisor ends slice 1's other process and gives the standby slice 1's identity; it heals
  from slice 0, process by process.

Measured: the median step time of each run (the slices' own `step_time_s`, after step 2), and in
the kill run, from the events: the survivor's first step after the kill, its longest step
interval in the 2 s after the kill less its median one, the steps redone (failed exchanges), the
time from the kill to the replacement's heal (and the heal's own transfer time), and whether
every step's parameters, on every process, equal the undisturbed run's bit for bit.

Writes experiments/results/elastic_processes.json and prints a table. Times are wall clock on a
shared 2-core machine: compare the runs of one invocation, not absolute numbers across runs.
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
import time
from typing import Any

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import report  # noqa: E402
from cluster_runs import STEP_LOG_ONLY, supervise  # noqa: E402

from configs import small_cpu  # noqa: E402
from resilient_jax.control.elastic import ElasticSupervisor  # noqa: E402

_STEPS = flags.DEFINE_integer("total_steps", 200, "Steps per run.")
_FAULT = flags.DEFINE_integer("fault_step", 30, "Slice 1 loses a process once slice 0 is here.")


def overrides() -> dict[str, Any]:
    return {
        **STEP_LOG_ONLY,
        "total_steps": _STEPS.value,
        "elastic.enabled": True,
        "elastic.check_every_steps": 1,
        # The standby at normal priority, as measured (under SCHED_IDLE on a busy 2-core host its
        # two processes may be ready only late in the run).
        "elastic.standby_idle_cpu": False,
    }


def run(workdir: str, processes: int, during=None) -> int:
    config = small_cpu.get_config()
    config.update_from_flattened_dict(overrides())
    argv = [
        sys.executable,
        "launch/train.py",
        "--config=configs/small_cpu.py",
        *(
            f"--config.{k}={str(v).lower() if isinstance(v, bool) else v}"
            for k, v in overrides().items()
        ),
    ]
    supervisor = ElasticSupervisor(
        config,
        lambda slice_id, slice_dir: [*argv, f"--workdir={slice_dir}"],
        workdir,
        devices_per_process=2 // processes,
        out=io.StringIO(),
        cwd=REPO,
        processes_per_slice=processes,
    )
    return supervise(supervisor, 900, during).exit_code


def read(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def events(workdir: str, slice_id: int, kind: str, process: int | None = 0) -> list[dict]:
    rows = read(os.path.join(workdir, "slices", str(slice_id), "events.jsonl"))
    return [e for e in rows if e["type"] == kind and process in (None, e.get("process", 0))]


def median_step_s(workdir: str) -> float:
    rows = read(os.path.join(workdir, "slices", "0", "metrics.jsonl"))
    return statistics.median(
        r["step_time_s"] for r in rows if r.get("step", 0) > 2 and "step_time_s" in r
    )


def digests(workdir: str, slice_id: int, process: int) -> dict[int, str]:
    return {e["step"]: e["digest"] for e in events(workdir, slice_id, "elastic_step", process)}


def analyze_kill(workdir: str, kill_time: float, reference: list[dict[int, str]]) -> dict:
    steps = events(workdir, 0, "elastic_step")
    times = [e["time"] for e in steps]
    intervals = [b - a for a, b in itertools.pairwise(times)]
    after = [b - a for a, b in itertools.pairwise(times) if kill_time <= b <= kill_time + 2]
    heals = [e for e in events(workdir, 1, "elastic_heal", None) if e["role"] == "received"]
    same = all(
        all(reference[p].get(step) == d for step, d in digests(workdir, s, p).items())
        for s in (0, 1)
        for p in (0, 1)
    )
    return {
        "survivor_first_step_after_kill_s": min(t for t in times if t > kill_time) - kill_time,
        "survivor_stall_s": max(after) - statistics.median(intervals),
        "steps_redone": len(events(workdir, 0, "elastic_exchange_failed")),
        "kill_to_healed_s": max(e["time"] for e in heals) - kill_time,
        "heal_transfer_s": max(e["duration_s"] for e in heals),
        "healed_processes": sorted(e["process"] for e in heals),
        "joined_at_step": heals[0]["step"],
        "every_step_bitwise_undisturbed": same,
    }


def main(argv_: list[str]) -> None:
    del argv_
    root = tempfile.mkdtemp(prefix="elastic_processes_")
    results: dict[str, Any] = {"steps": _STEPS.value, "machine": platform.processor() or "cpu"}
    for name, processes in (("one_process", 1), ("two_processes", 2)):
        workdir = os.path.join(root, name)
        code = run(workdir, processes)
        results[name] = {"exit_code": code, "median_step_s": median_step_s(workdir)}
    reference = [digests(os.path.join(root, "two_processes"), 0, p) for p in (0, 1)]
    workdir = os.path.join(root, "two_processes_kill")
    killed: dict[str, float] = {}

    def kill(supervisor) -> bool:
        steps = events(workdir, 0, "elastic_step")
        ready = read(os.path.join(workdir, "standby", "events.jsonl"))
        if not steps or steps[-1]["step"] < _FAULT.value:
            return False
        if len({e["pid"] for e in ready if e["type"] == "elastic_standby_ready"}) < 2:
            return False
        os.kill(supervisor.workers[1].pids[1], signal.SIGKILL)
        killed["time"] = time.time()
        return True

    code = run(workdir, 2, during=kill)
    results["two_processes_kill"] = {
        "exit_code": code,
        "median_step_s": median_step_s(workdir),
        **analyze_kill(workdir, killed["time"], reference),
    }
    one, two = results["one_process"]["median_step_s"], results["two_processes"]["median_step_s"]
    results["step_time_ratio_two_over_one"] = two / one
    out = os.path.join(REPO, "experiments", "results", "elastic_processes.json")
    report.write_json(out, results)
    print(f"{'run':22}{'exit':>6}{'median step s':>15}")
    for name in ("one_process", "two_processes", "two_processes_kill"):
        r = results[name]
        print(f"{name:22}{r['exit_code']:>6}{r['median_step_s']:>15.4f}")
    ratio = results["step_time_ratio_two_over_one"]
    print(f"step time, 2 processes / 1 process per slice: {ratio:.2f}")
    for key, value in results["two_processes_kill"].items():
        if key not in ("exit_code", "median_step_s"):
            print(f"  {key}: {value}")


if __name__ == "__main__":
    app.run(main)
