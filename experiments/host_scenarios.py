"""Host-level scenarios of `bench_recovery.py`: a host lost, a host frozen, the supervisor killed
and restarted. What they measure, from the run's events:

- host faults (the trainer under the supervisor with one agent per slice, the fault acted out by
  the agent of slice 1): time to detect (fault -> the supervisor's `failure_detected`, and fault ->
  `host_lost`), then the same recovery phases as a process kill (`bench_recovery.breakdown`).
- supervisor restart (supervisor and agents as separate processes, `--host_agents=external`): the
  supervisor is SIGKILLed at the fault step and started again `downtime_s` later. Measured: the
  new supervisor's start -> every agent attached again, the fault -> the first step after it
  (training never stopped), workers restarted and steps lost (both 0 when adoption works).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from cluster_runs import REPO

from resilient_jax.events import read_events

_WAIT_S = 600.0


def host_detection(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Fault -> first `failure_detected` and fault -> `host_lost` (the supervisor's clock)."""
    sup = [e for e in events if e.get("source") == "supervisor"]
    fault = next(e for e in sup if e["type"] == "fault_injected")
    detected = next(e for e in sup if e["type"] == "failure_detected")
    lost = next((e for e in sup if e["type"] == "host_lost"), None)
    return {
        "time_to_detect_s": round(detected["time"] - fault["time"], 3),
        "detected_as": detected["cause"],
        "time_to_host_lost_s": None if lost is None else round(lost["time"] - fault["time"], 3),
        "host_lost_cause": None if lost is None else lost["cause"],
    }


def _steps(workdir: str) -> list[dict[str, Any]]:
    return [e for e in read_events(workdir) if e["type"] == "step"]


def _supervisor(argv: list[str], env: dict[str, str], log) -> subprocess.Popen:
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def supervisor_restart(
    config_file: str,
    overrides: dict[str, Any],
    fault_step: int,
    downtime_s: float,
    log_dir: str,
) -> dict[str, Any]:
    """Kills the supervisor at `fault_step`, starts it again `downtime_s` later; see the module
    docstring for what is measured."""
    workdir = tempfile.mkdtemp(prefix="rj_bench_supervisor_restart_")
    env = {**os.environ, "RJ_RUN_TOKEN": os.urandom(16).hex(), "PYTHONPATH": REPO}
    argv = [
        sys.executable,
        os.path.join(REPO, "launch", "local_cluster.py"),
        f"--config={config_file}",
        f"--workdir={workdir}",
        "--num_slices=2",
        "--devices_per_process=2",
        "--host_agents=external",
        *(f"--config.{k}={v}" for k, v in overrides.items()),
    ]
    agents_argv = [
        [
            sys.executable,
            "-m",
            "resilient_jax.control.agent",
            f"--workdir={workdir}",
            f"--host=h{s}",
            f"--slice={s}",
            "--devices=2",
        ]
        for s in (0, 1)
    ]
    started: list[subprocess.Popen] = []
    with open(os.path.join(log_dir, "supervisor_restart.log"), "w") as log:
        try:
            first = _supervisor(argv, env, log)
            started.append(first)
            for agent_argv in agents_argv:
                started.append(_supervisor(agent_argv, env, log))
            deadline = time.monotonic() + _WAIT_S
            while not [e for e in _steps(workdir) if e["step"] >= fault_step]:
                if time.monotonic() > deadline or first.poll() is not None:
                    raise RuntimeError(f"supervisor_restart: no step {fault_step} (see the log)")
                time.sleep(0.05)
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
            killed_at = time.time()
            time.sleep(downtime_s)
            restarted_at = time.time()
            second = _supervisor(argv, env, log)
            started.append(second)
            code = second.wait(timeout=_WAIT_S)
            if code:
                raise RuntimeError(f"supervisor_restart: the restarted supervisor exited {code}")
        finally:
            for proc in started:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    events = list(read_events(workdir))
    sup = [e for e in events if e.get("source") == "supervisor"]
    starts_after = [e for e in sup if e["type"] == "process_start" and e["time"] > killed_at]
    attached = [e for e in sup if e["type"] == "supervisor_attach" and e["time"] > restarted_at]
    steps = [e for e in events if e["type"] == "step" and e.get("process") == 0]
    before = max(e["step"] for e in steps if e["time"] <= killed_at)
    after = sorted((e for e in steps if e["time"] > killed_at), key=lambda e: e["time"])
    restores = [e for e in events if e["type"] == "restore" and e["time"] > killed_at]
    step_times = [e["duration_s"] for e in steps if e.get("duration_s")]
    with open(os.path.join(workdir, "supervisor.json")) as f:
        address = json.load(f)["address"]
    return {
        "what": "supervisor SIGKILLed at the fault step, restarted after the downtime; "
        "agents keep the workers training and re-attach",
        "downtime_s": downtime_s,
        "address_kept": address,
        "time_to_reattach_s": round(max(e["time"] for e in attached) - restarted_at, 3),
        "agents_reattached": len({e["host"] for e in attached}),
        "fault_to_first_step_s": round(after[0]["time"] - killed_at, 3),
        "median_step_time_s": round(sorted(step_times)[len(step_times) // 2], 3),
        "worker_restarts": len(starts_after),
        "last_step_before_fault": before,
        "steps_lost": before - min(e["step"] for e in restores) if restores else 0,
        "final_step": max(e["step"] for e in steps),
    }
