"""Elastic mode with slices of two processes each (each slice its own JAX runtime of 2 processes x
1 device) under the elastic supervisor, the real trainer on the SMALL model. Undisturbed, it trains
the same function bit for bit as slices of one process with the same 2 devices; a slice that loses
one of its processes is lost as a whole, replaced by the warm standby (two processes too), which
heals from the survivor process by process while the survivor trains on, never restarted: every
step of every slice bitwise the undisturbed run's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import (
    ELASTIC_SMALL,
    REPO,
    as_flags,
    plain_orbax_state,
    slice_digests,
    slice_events,
    supervise_elastic,
)

from resilient_jax.control.local_hosts import process_gone
from resilient_jax.events import read_events

pytest.importorskip("torch")

# Long enough for the standby's two processes to be ready and the one that replaces slice 1 to
# join well before the end (a step takes about 0.15 s with 6 processes on a busy 2-core host).
STEPS = 400
KILL_AT = 5
# A final save (the run's last step): the final parameters, read back with plain Orbax. The
# standby at normal priority: under SCHED_IDLE (the default) beside the slices and other jobs on 2
# cores it may be ready too late for this run (the priority itself: test_standby_cpu.py).
OVERRIDES = {**ELASTIC_SMALL, "total_steps": STEPS, "elastic.standby_idle_cpu": False}


def _supervise(workdir: str, processes: int, during=None):
    return supervise_elastic(
        workdir,
        OVERRIDES,
        during=during,
        processes_per_slice=processes,
        devices_per_process=2 // processes,
    )


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("undisturbed"))
    result = _supervise(workdir, processes=2)
    assert result.exit_code == 0, result.reason
    return workdir


def _final_params(workdir: str, slice_id: int) -> dict:
    state = plain_orbax_state(os.path.join(workdir, "slices", str(slice_id)), STEPS)
    return {k: v for k, v in state.items() if k.startswith("['params']")}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    assert all(np.array_equal(a[k], b[k]) for k in a), [
        k for k in a if not np.array_equal(a[k], b[k])
    ]


@pytest.mark.slow
def test_slices_of_two_processes_train_what_slices_of_one_train(undisturbed, tmp_path):
    # Both processes of both slices trained every step once, on one quorum, with no failure; the
    # two slices' pieces are bitwise equal process by process.
    for process in (0, 1):
        digests = [slice_digests(undisturbed, s, process) for s in (0, 1)]
        assert sorted(digests[0]) == list(range(1, STEPS + 1))
        assert digests[0] == digests[1]
    assert slice_digests(undisturbed, 0, 0) != slice_digests(undisturbed, 0, 1)  # own pieces
    assert len({e["quorum_id"] for e in slice_events(undisturbed, 0, "elastic_step")}) == 1
    assert not slice_events(undisturbed, 0, "elastic_exchange_failed")
    assert {e["process"] for e in slice_events(undisturbed, 1, "process_start")} == {0, 1}

    # The same function as slices of one process with the same 2 devices, bit for bit.
    single = str(tmp_path)
    result = _supervise(single, processes=1)
    assert result.exit_code == 0, result.reason
    reference = _final_params(single, 0)
    for slice_id in (0, 1):
        _assert_same(_final_params(undisturbed, slice_id), reference)


def _pids(workdir: str, slice_id: int) -> set[int]:
    return {e["pid"] for e in slice_events(workdir, slice_id)}


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]


@pytest.mark.slow
def test_a_slice_that_loses_one_process_is_replaced_by_the_standby(undisturbed, tmp_path):
    workdir = str(tmp_path)
    killed = {}

    def kill_a_process_of_slice_1(supervisor) -> bool:
        ready = read_events(os.path.join(workdir, "standby"))
        if len({e["pid"] for e in ready if e["type"] == "elastic_standby_ready"}) < 2:
            return False
        step = max(slice_digests(workdir, 1), default=0)
        if step < KILL_AT:
            return False
        killed.update(pids=supervisor.workers[1].pids, step=step)
        killed["standby"] = supervisor.standby.pids
        os.kill(killed["pids"][1], signal.SIGKILL)  # its process 1 only
        return True

    result = _supervise(workdir, processes=2, during=kill_a_process_of_slice_1)
    assert result.exit_code == 0, result.reason
    assert killed and result.replacements == 1
    assert killed["step"] < STEPS - 100, "the standby was ready too late to test anything"
    # The slice's other process was ended with it.
    assert not any(_alive(pid) for pid in killed["pids"])

    # The survivor's two processes were never restarted: every step once and in order, at most
    # the step in flight at the kill redone, nothing restored.
    assert len(_pids(workdir, 0)) == 2
    for process in (0, 1):
        steps = [e for e in slice_events(workdir, 0, "elastic_step") if e["process"] == process]
        assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
        failed = slice_events(workdir, 0, "elastic_exchange_failed")
        assert len([e for e in failed if e["process"] == process]) <= 1
    for slice_id in (0, 1):
        assert not slice_events(workdir, slice_id, "restore")

    # Both processes of the standby became slice 1 and healed from the survivor's counterpart.
    standby = killed["standby"]
    assert _pids(workdir, 1) == set(killed["pids"]) | set(standby)
    heals = [e for e in slice_events(workdir, 1, "elastic_heal") if e["pid"] in standby]
    assert sorted((e["process"], e["role"], e["source_slice"]) for e in heals) == [
        (0, "received", 0),
        (1, "received", 0),
    ]
    assert len({e["step"] for e in heals}) == 1
    joined_at = heals[0]["step"]
    # Warm: it compiled (loaded) its steps while waiting as the standby, and as slice 1 it
    # neither compiled, restored nor initialised anything; it became slice 1 at once.
    standby_events = read_events(os.path.join(workdir, "standby"))
    assert [e for e in standby_events if e["type"] == "compile"]
    for kind in ("compile", "init", "restore"):
        assert not [e for e in slice_events(workdir, 1, kind) if e["pid"] in standby], kind
    starts = [e for e in read_events(workdir) if e["type"] == "elastic_slice_start"]
    assert [(e["slice"], e.get("standby")) for e in starts[2:]] == [(1, True)]
    assert sorted(starts[2]["pids"]) == sorted(standby)
    assert [e["slice"] for e in slice_events(workdir, 1, "elastic_standby_assigned")] == [1, 1]

    # Every step of every process bitwise the undisturbed run's, and the final parameters too.
    for process in (0, 1):
        reference = slice_digests(undisturbed, 0, process)
        assert slice_digests(workdir, 0, process) == reference
        replacement = [
            e
            for e in slice_events(workdir, 1, "elastic_step")
            if e["pid"] in standby and e["process"] == process
        ]
        assert [e["step"] for e in replacement] == list(range(joined_at + 1, STEPS + 1))
        assert {e["step"]: e["digest"] for e in replacement} == {
            s: reference[s] for s in range(joined_at + 1, STEPS + 1)
        }
    for slice_id in (0, 1):
        _assert_same(_final_params(workdir, slice_id), _final_params(undisturbed, 0))

    # A new standby was started after the first was used, and ended at the end (by its agent).
    supervisor_events = list(read_events(workdir))
    standbys = [e for e in supervisor_events if e["type"] == "elastic_standby_start"]
    assert sorted(standbys[0]["pids"]) == sorted(standby) and len(standbys) == 2
    exits = [e["pid"] for e in supervisor_events if e["type"] == "elastic_standby_exit"]
    assert exits == [standbys[1]["pid"]]
    assert not any(_alive(pid) for e in standbys for pid in e["pids"])


@pytest.mark.slow
def test_slices_of_two_processes_are_taken_over_by_a_restarted_supervisor(undisturbed, tmp_path):
    workdir = str(tmp_path)
    argv = [
        sys.executable,
        "launch/local_cluster.py",
        "--config=configs/tiny_cpu.py",
        f"--workdir={workdir}",
        "--processes_per_slice=2",
        "--devices_per_process=1",
        *as_flags(OVERRIDES),
    ]
    env = {**os.environ, "RJ_RUN_TOKEN": "k" * 32}

    def supervisor() -> subprocess.Popen[bytes]:
        with open(os.path.join(workdir, "supervisor.log"), "ab") as log:
            return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    first = supervisor()
    deadline = time.monotonic() + 300
    while max(slice_digests(workdir, 0), default=0) < 50:
        assert first.poll() is None and time.monotonic() < deadline, "no step in time"
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    step_at_kill = max(slice_digests(workdir, 0))
    time.sleep(3.0)
    step_at_return = max(slice_digests(workdir, 0))
    assert step_at_return < STEPS, "the run ended before the supervisor came back"
    # The slices trained on while the supervisor was away.
    assert step_at_return > step_at_kill, (step_at_kill, step_at_return)
    second = supervisor()
    try:
        assert second.wait(timeout=400) == 0
    finally:
        second.kill()

    # Every process of both slices adopted, none restarted, the membership never changed.
    events = list(read_events(workdir))
    adopted = [e for e in events if e["type"] == "elastic_slice_adopted"]
    started = {e["slice"]: e["pids"] for e in events if e["type"] == "elastic_slice_start"}
    assert sorted((e["slice"], tuple(e["pids"])) for e in adopted) == [
        (s, tuple(started[s])) for s in (0, 1)
    ]
    for slice_id in (0, 1):
        assert _pids(workdir, slice_id) == set(started[slice_id])
        assert not slice_events(workdir, slice_id, "elastic_exchange_failed")
    (back,) = [e for e in events if e["type"] == "elastic_reconnected"]
    assert back["carried_over"] and back["slices"] == [0, 1], back
    for slice_id in (0, 1):  # back in their own quorum: no group re-formed
        assert len({e["quorum_id"] for e in slice_events(workdir, slice_id, "elastic_step")}) == 1
    # The standby's two processes were adopted too, and ended at the end.
    standbys = [e for e in events if e["type"] == "elastic_standby_start"]
    assert [e.get("adopted") for e in standbys] == [None, True]
    assert standbys[0]["pids"] == standbys[1]["pids"]
    assert all(process_gone(pid) for pid in standbys[0]["pids"])
    # Every step of every process bitwise the undisturbed run's.
    for process in (0, 1):
        for slice_id in (0, 1):
            assert slice_digests(workdir, slice_id, process) == slice_digests(
                undisturbed, 0, process
            )
