"""The supervisor of `launch/local_cluster.py` dies (kill -9 of its own pid, not its agents'):
its host agents and their workers train on; the same command started again adopts them (no
worker restarted) and the run ends bitwise as an undisturbed one would; with no supervisor
within `coordinator.orphan_timeout_s` the agents have their workers save and stop, and exit 6.

The test process is made a child subreaper while a run is on, so the agents, orphaned by the
kill, become its children: their exit codes are read, and nothing of the run outlives the test.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.events import read_events

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 8
_PR_SET_CHILD_SUBREAPER = 36

CONFIG = {
    "global_batch_size": BATCH,
    "checkpoint.every_steps": 5,
    "coordinator.heartbeat_interval_s": 0.2,
    "coordinator.heartbeat_timeout_s": 3.0,
    "coordinator.jax_heartbeat_timeout_s": 10,
    "coordinator.startup_timeout_s": 30.0,
    "coordinator.kill_grace_s": 0.5,
    "coordinator.save_grace_s": 10.0,
    "coordinator.probe_jax": False,
}


def expected_value(total_steps: int) -> float:
    """The simulated worker's state after `total_steps` (`resilient_jax.testing.sim_worker`)."""
    value = 0.0
    for step in range(total_steps):
        value += float(sum(range(step * BATCH, (step + 1) * BATCH))) * 1e-6
    return value


def write_config(path, overrides: dict) -> str:
    lines = [f"    c.{key} = {value!r}" for key, value in {**CONFIG, **overrides}.items()]
    path.write_text(
        "from resilient_jax.config import default_config\n\n\n"
        "def get_config():\n    c = default_config()\n" + "\n".join(lines) + "\n    return c\n"
    )
    return str(path)


def start_supervisor(config_path: str, workdir, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            os.path.join(REPO, "launch", "local_cluster.py"),
            f"--config={config_path}",
            f"--workdir={workdir}",
            "--num_slices=2",
            "--worker=-m resilient_jax.testing.sim_worker --sim_step_time_s=0.1",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def saved_step(workdir) -> int:
    path = workdir / "sim_state.json"
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())["step"]
    return 0


def wait_for_step(workdir, step: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while saved_step(workdir) < step:
        assert time.monotonic() < deadline, f"no save of step {step} within {timeout_s}s"
        time.sleep(0.05)


def agent_pids(workdir) -> list[int]:
    return [e["pid"] for e in read_events(str(workdir)) if e["type"] == "agent_start"]


def run_pids(workdir) -> list[int]:
    """Every agent and worker of the run."""
    workers = [
        e["pid"]
        for e in read_events(str(workdir))
        if e["type"] == "process_start" and e.get("source") == "supervisor"
    ]
    return agent_pids(workdir) + workers


def reap(pid: int, timeout_s: float) -> int | None:
    """The exit code of an orphaned agent (our child as subreaper); None if it runs on."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return None


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def subreaper(tmp_path):
    """A run directory and environment; the test process adopts orphans while it runs, and
    afterwards nothing of the run may be left (ended and reported if something is)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    workdir = tmp_path / "run"
    env = {**os.environ, "RJ_RUN_TOKEN": "test-token-0123", "PYTHONPATH": REPO}
    started: list[subprocess.Popen] = []
    try:
        yield workdir, env, started
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        left = [pid for pid in run_pids(workdir) if running(pid)]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        for pid in agent_pids(workdir):
            reap(pid, 1.0)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        assert not left, f"processes of the run left behind: {left}"


@pytest.mark.timeout(240)
def test_restarted_supervisor_adopts_agents_and_workers_of_a_killed_one(subreaper):
    workdir, env, started = subreaper
    total = 80
    config_path = write_config(workdir.parent / "config.py", {"total_steps": total})
    first = start_supervisor(config_path, workdir, env)
    started.append(first)
    wait_for_step(workdir, 20)
    os.kill(first.pid, signal.SIGKILL)  # the supervisor's own pid: its agents are not touched
    first.wait()
    killed_at, step_at_kill = time.time(), saved_step(workdir)
    wait_for_step(workdir, step_at_kill + 10, timeout_s=30)  # steps go on without a supervisor
    second = start_supervisor(config_path, workdir, env)
    started.append(second)
    assert second.wait(timeout=120) == 0, second.stderr.read() if second.stderr else ""
    # The first supervisor's agents, adopted, left with the run's end.
    assert [reap(pid, 10.0) for pid in agent_pids(workdir)] == [0, 0]
    events = list(read_events(str(workdir)))
    starts = [e for e in events if e["type"] == "process_start" and e.get("source") == "supervisor"]
    assert sorted((e["process"], e["generation"]) for e in starts) == [(0, 0), (1, 0)]
    assert len([e for e in events if e["type"] == "agent_start"]) == 2  # no agent started again
    reattached = [e for e in events if e["type"] == "supervisor_attach" and e["time"] > killed_at]
    assert sorted((e["host"], e["workers"]) for e in reattached) == [
        ("host0", [[0, 0]]),
        ("host1", [[0, 1]]),
    ]
    assert not [e for e in events if e["type"] in ("failure_detected", "restart")]
    assert json.loads((workdir / "sim_state.json").read_text()) == {
        "step": total,
        "value": expected_value(total),  # bitwise: the same sums in the same order
    }
    # The agents' output reached the second supervisor through their logs.
    log = (workdir / "logs" / "host0" / "workers.log").read_text()
    assert "lost the supervisor's connection; workers train on" in log


@pytest.mark.timeout(240)
def test_without_a_supervisor_local_agents_save_and_exit_6(subreaper):
    workdir, env, started = subreaper
    orphan_timeout_s = 4.0
    config_path = write_config(
        workdir.parent / "config.py",
        {"total_steps": 2000, "coordinator.orphan_timeout_s": orphan_timeout_s},
    )
    supervisor = start_supervisor(config_path, workdir, env)
    started.append(supervisor)
    wait_for_step(workdir, 20)
    os.kill(supervisor.pid, signal.SIGKILL)
    supervisor.wait()
    step_at_kill = saved_step(workdir)
    codes = [reap(pid, orphan_timeout_s + 30.0) for pid in agent_pids(workdir)]
    assert codes == [ExitCode.SUPERVISOR_LOST] * 2
    events = list(read_events(str(workdir)))
    assert len([e for e in events if e["type"] == "agent_orphaned"]) == 2
    saved = [e for e in events if e["type"] == "stop" and e.get("reason") == "preempted"]
    assert {e["process"] for e in saved} == {0, 1}  # both saved at the step they agreed on
    assert len({e["step"] for e in saved}) == 1
    assert saved_step(workdir) == saved[0]["step"] > step_at_kill  # trained on while orphaned
    for host in ("host0", "host1"):
        lines = (workdir / "logs" / host / "workers.log").read_text().splitlines()
        assert [line for line in lines if line.startswith("error: ")] == [
            next(line for line in lines if line.startswith("error: no supervisor for"))
        ]
