"""Killing the elastic supervisor does not stop the slices: 2 single-process slices of the real
trainer (SMALL tiny_cpu) under `launch/local_cluster.py`; its process is SIGKILLed mid-run. The
slices train on with their last quorum while it is away; the same command started again takes
them over (same quorum address, no slice restarted), their quorum clients reconnect, and the run
ends with exit 0 and every step's parameters, on both slices, bitwise those of the undisturbed
run (the membership never changed)."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ELASTIC_SMALL, REPO, as_flags, slice_digests, slice_events

from resilient_jax.control import elastic_state
from resilient_jax.events import read_events

pytest.importorskip("torch")

STEPS = 1200
KILL_AT = 50
AWAY_S = 3.0  # the supervisor stays dead this long before it is started again
OVERRIDES = {**ELASTIC_SMALL, "total_steps": STEPS}


def _supervisor(workdir: str) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "launch/local_cluster.py",
        "--config=configs/tiny_cpu.py",
        f"--workdir={workdir}",
        "--devices_per_process=2",
        *as_flags(OVERRIDES),
    ]
    env = {**os.environ, "RJ_RUN_TOKEN": "k" * 32}
    with open(os.path.join(workdir, "supervisor.log"), "ab") as log:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen[bytes], workdir: str, timeout_s: float = 400) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        with open(os.path.join(workdir, "supervisor.log")) as f:
            pytest.fail(f"supervisor still running after {timeout_s} s:\n{f.read()[-3000:]}")


@pytest.mark.slow
def test_slices_train_on_while_the_supervisor_is_away_and_are_taken_over(tmp_path):
    undisturbed = str(tmp_path / "undisturbed")
    os.makedirs(undisturbed)
    assert _wait(_supervisor(undisturbed), undisturbed) == 0
    workdir = str(tmp_path / "killed")
    os.makedirs(workdir)
    first = _supervisor(workdir)
    deadline = time.monotonic() + 300
    while max(slice_digests(workdir, 0), default=0) < KILL_AT:
        assert first.poll() is None and time.monotonic() < deadline, "no step in time"
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    killed_at = time.time()
    step_at_kill = max(slice_digests(workdir, 0))
    time.sleep(AWAY_S)
    step_at_return = max(slice_digests(workdir, 0))
    assert step_at_return < STEPS, "the run ended before the supervisor came back"
    second = _supervisor(workdir)
    assert _wait(second, workdir) == 0

    # The slices trained on meanwhile, and were never restarted: one process each, all along.
    assert step_at_return - step_at_kill >= 10, (step_at_kill, step_at_return)
    supervisor_events = list(read_events(workdir))
    kinds = [(e["type"], e.get("slice")) for e in supervisor_events if "slice" in e]
    started = [("elastic_slice_start", 0), ("elastic_slice_start", 1)]
    adopted = [("elastic_slice_adopted", 0), ("elastic_slice_adopted", 1)]
    assert sorted(kinds) == sorted(started + adopted), kinds
    for slice_id in (0, 1):
        assert len({e["pid"] for e in slice_events(workdir, slice_id)}) == 1
        assert not slice_events(workdir, slice_id, "elastic_exchange_failed")
    # The warm standby the first supervisor started was adopted by the second (it registered
    # again on the same address), never used, and ended by its pid when the run finished.
    standbys = [e for e in supervisor_events if e["type"] == "elastic_standby_start"]
    assert [e.get("adopted") for e in standbys] == [None, True], standbys
    assert standbys[0]["pid"] == standbys[1]["pid"]
    assert elastic_state.start_time(standbys[0]["pid"]) is None
    # Back in their own quorum: no group re-formed, the membership never changed.
    (back,) = [e for e in supervisor_events if e["type"] == "elastic_reconnected"]
    assert back["carried_over"] and back["slices"] == [0, 1], back
    for slice_id in (0, 1):
        assert len({e["quorum_id"] for e in slice_events(workdir, slice_id, "elastic_step")}) == 1
    # Every step, on both slices, bitwise the undisturbed run's.
    expected = slice_digests(undisturbed, 0)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert slice_digests(workdir, 0) == expected
    assert slice_digests(workdir, 1) == expected
    # What it cost: steps trained while the supervisor was away, time to be back in a quorum.
    steps = slice_events(workdir, 0, "elastic_step")
    away = [e for e in steps if killed_at <= e["time"] <= back["time"] - back["after_s"]]
    after = [e["time"] for e in steps if e["time"] >= killed_at]
    calm = [e["time"] for e in slice_events(undisturbed, 0, "elastic_step")]
    print(
        f"\nsupervisor away {back['time'] - back['after_s'] - killed_at:.2f} s: "
        f"{len(away)} steps trained meanwhile; slices back in their quorum "
        f"{back['after_s']:.3f} s after it listened again; longest time between two steps "
        f"from the kill on {max(b - a for a, b in itertools.pairwise(after)):.3f} s "
        f"(undisturbed run: {max(b - a for a, b in itertools.pairwise(calm)):.3f} s)"
    )
