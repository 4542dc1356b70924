"""The elastic supervisor's warm standby slice, with stand-in processes for the slices and the
standby (no JAX): a lost slice's identity goes to the waiting standby, a new standby is started,
a standby that dies is started again (bounded), a restarted supervisor adopts the standby, and the
standby is ended (through its agent) when the run finishes. The real trainer's standby path is
`test_elastic_multiprocess.py::test_a_slice_that_loses_one_process_is_replaced_by_the_standby`
(slow)."""

from __future__ import annotations

import io
import os
import sys
import time

import pytest
from conftest import REPO, elastic_stand_in_process, stand_in_elastic_config, wait_for_events

from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.control import elastic, elastic_state
from resilient_jax.control.elastic import ElasticSupervisor
from resilient_jax.control.local_hosts import process_gone
from resilient_jax.events import read_events

TOKEN = "s" * 32

# A slice stand-in: argv[1] its workdir, argv[2] seconds to run, argv[3] its exit code; one that
# exits 0 writes the `stop` event a finished worker writes.
_SLICE = (
    "import json, os, sys, time; time.sleep(float(sys.argv[2])); code = int(sys.argv[3])\n"
    "if code == 0:\n"
    "    f = open(os.path.join(sys.argv[1], 'events.jsonl'), 'a')\n"
    "    f.write(json.dumps({'type': 'stop', 'pid': os.getpid(), 'exit_code': 0}) + '\\n')\n"
    "sys.exit(code)\n"
)
# A standby stand-in: waits like the real one (`control.standby`), then as the slice it was given
# runs argv[1] seconds and finishes (exit 0, `stop` event in the slice's workdir). argv[2]: an exit
# code to end with before waiting (a standby that fails), -1 for none.
_STANDBY = (
    "import json, os, sys, time\n"
    "from resilient_jax.control.standby import wait_on_quorum\n"
    "if int(sys.argv[2]) >= 0:\n"
    "    sys.exit(int(sys.argv[2]))\n"
    "a = wait_on_quorum(os.environ['RJ_QUORUM_ADDRESS'], os.environ['RJ_RUN_TOKEN'], 30)\n"
    "time.sleep(float(sys.argv[1]))\n"
    "f = open(os.path.join(a.workdir, 'events.jsonl'), 'a')\n"
    "f.write(json.dumps({'type': 'stop', 'pid': os.getpid(), 'exit_code': 0}) + '\\n')\n"
)


def _supervisor(workdir, slices: dict, standby_exit: int = -1, max_restarts: int = 5):
    """slices: slice id -> (seconds, exit code) of its stand-in."""
    config = stand_in_elastic_config(len(slices), standby=True)
    # At normal priority: under SCHED_IDLE a stand-in could wait for idle CPU on a busy host and
    # fail these tests' timing (the priority itself: test_standby_cpu.py).
    config.elastic.standby_idle_cpu = False

    def argv(slice_id: int, slice_dir: str) -> list[str]:
        if slice_id < 0:
            return [sys.executable, "-c", _STANDBY, "0.5", str(standby_exit)]
        seconds, code = slices[slice_id]
        return [sys.executable, "-c", _SLICE, slice_dir, str(seconds), str(code)]

    return ElasticSupervisor(
        config,
        argv,
        str(workdir),
        devices_per_process=1,
        out=io.StringIO(),
        restart_delay_s=0.2,
        max_restarts=max_restarts,
        token=TOKEN,
        cwd=REPO,
    )


def _events(workdir, kind: str) -> list[dict]:
    return [e for e in read_events(str(workdir)) if e["type"] == kind]


def _running(pid: int) -> bool:
    return not process_gone(pid)


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    """The stand-ins import this checkout's package; they join no quorum, so the next standby
    starts soon after the last one was given a slice."""
    monkeypatch.setenv("PYTHONPATH", REPO)
    monkeypatch.setattr(elastic, "STANDBY_AFTER_S", 0.5)


def test_a_lost_slice_is_given_to_the_standby_and_a_new_standby_is_started(tmp_path):
    supervisor = _supervisor(tmp_path, {0: (6.0, 0), 1: (2.0, 1)})
    result = supervisor.run(time_limit_s=30)
    assert (result.exit_code, result.replacements) == (0, 1), result
    standbys = [e["pid"] for e in _events(tmp_path, "elastic_standby_start")]
    starts = _events(tmp_path, "elastic_slice_start")
    # Slice 1's second worker is the first standby, given the slice at once (no restart delay).
    assert [(e["slice"], e.get("standby")) for e in starts] == [(0, None), (1, None), (1, True)]
    assert starts[2]["pid"] == standbys[0]
    failed = _events(tmp_path, "elastic_slice_exit")[0]
    assert starts[2]["time"] - failed["time"] < 0.5
    # The standby finished as slice 1 (its stop event there); the second one, never used, was
    # ended through its agent when the run finished.
    assert len(standbys) == 2
    assert [e["pid"] for e in _events(tmp_path, "elastic_standby_exit")] == [standbys[1]]
    assert not any(_running(pid) for pid in standbys)
    assert elastic_state.read_state(str(tmp_path)).standby is None


@pytest.mark.parametrize(
    ("standby_exit", "expected"),
    [(1, (1, "slice failures")), (ExitCode.BAD_INPUT, (ExitCode.BAD_INPUT, "standby: "))],
)
def test_a_standby_that_dies_is_started_again_within_the_restart_budget(
    tmp_path, standby_exit, expected
):
    supervisor = _supervisor(tmp_path, {0: (20.0, 0), 1: (20.0, 0)}, standby_exit, max_restarts=2)
    result = supervisor.run(time_limit_s=30)
    code, reason = expected
    assert result.exit_code == code and reason in result.reason, result
    exits = _events(tmp_path, "elastic_standby_exit")
    assert [e["exit_code"] for e in exits] == [standby_exit] * (3 if code == 1 else 1)
    assert not any(_running(w.pid) for w in supervisor.workers.values())


def test_a_restarted_supervisor_adopts_the_standby_and_gives_it_a_lost_slice(tmp_path):
    """The supervisor dies (SIGKILL) with its slices and standby running under their agents;
    slice 1 fails while none is there. The next supervisor adopts the standby and gives it
    slice 1 at once."""
    slices = {0: (6.0, 0), 1: (2.5, 1)}
    argv = {
        s: [sys.executable, "-c", _SLICE, "{workdir}", str(t), str(c)]
        for s, (t, c) in slices.items()
    }
    argv[-1] = [sys.executable, "-c", _STANDBY, "0.5", "-1"]
    first = elastic_stand_in_process(str(tmp_path), argv, TOKEN, standby=True)
    try:
        (started,) = wait_for_events(str(tmp_path), "elastic_standby_start", 1)
    finally:
        first.kill()  # SIGKILL: its agents, slices and standby stay behind
        first.wait(timeout=10)
    standby = started["pid"]
    (failing,) = [e["pid"] for e in _events(tmp_path, "elastic_slice_start") if e["slice"] == 1]
    deadline = time.monotonic() + 30
    while _running(failing):  # slice 1 fails while no supervisor is there
        assert time.monotonic() < deadline, "slice 1 did not end"
        time.sleep(0.05)
    second = _supervisor(tmp_path, slices)
    result = second.run(time_limit_s=30)
    assert (result.exit_code, result.replacements) == (0, 1), result
    adopted = _events(tmp_path, "elastic_standby_start")
    assert [(e["pid"], e.get("adopted")) for e in adopted[:2]] == [(standby, None), (standby, True)]
    given = [e for e in _events(tmp_path, "elastic_slice_start") if e.get("standby")]
    assert [(e["slice"], e["pid"]) for e in given] == [(1, standby)]
    stop = [e for e in read_events(os.path.join(tmp_path, "slices", "1")) if e["type"] == "stop"]
    assert [e["pid"] for e in stop] == [standby]  # it reached the new server and finished
