"""End to end with the real trainer: 2 slices x 1 process x 2 CPU devices.

The slice-1 worker SIGKILLed mid-run: the supervisor evicts the slice, the job finishes on one
slice (a reshaped mesh restoring the last checkpoint), and the final loss equals an undisturbed
run's. A preempted job restarts on the same mesh, its step loaded from the compilation cache, and
ends bitwise equal to the undisturbed run."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import SMALL, plain_orbax_state, supervise_tiny_cpu

from resilient_jax.control import SupervisorAction

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OVERRIDES = {
    **SMALL,  # the small model; the keys below override its steps
    # A fault fires when the supervisor hears of its step, one heartbeat (0.5 s) or more after
    # the step: at 50 ms a step, 10 steps or more. The steps after the faults below leave room
    # for that (with 30, a kill aimed at step 25 once landed after the last step).
    "total_steps": 60,
    "global_batch_size": 8,
    "checkpoint.every_steps": 10,
    "checkpoint.local_dir": "",
    "log.progress_bar": False,
    "log.tensorboard": False,
    # The workers' heartbeat timeouts are the defaults: a kill is seen at its exit and a lost
    # host by its agent's silence, and a compile on a loaded 2-core host can hold a worker's
    # heartbeats for over 2 s (a slice was taken for lost in its first compile at load 44).
    "coordinator.agent_timeout_s": 2.0,
    "coordinator.startup_timeout_s": 120.0,
    "coordinator.kill_grace_s": 0.5,
    "coordinator.readmit_after_s": -1.0,
}


pytestmark = pytest.mark.slow


def run_trainer(workdir, actions=(), out=None) -> tuple[int, list[dict]]:
    return supervise_tiny_cpu(workdir, OVERRIDES, actions, out, time_limit_s=400)


TOTAL = OVERRIDES["total_steps"]


def final_loss(events: list[dict]) -> float:
    return [e for e in events if e["type"] == "step" and e["step"] == TOTAL][-1]["loss"]


def final_state(workdir) -> dict[str, np.ndarray]:
    """The final step's `state`, read with plain Orbax."""
    return plain_orbax_state(workdir, TOTAL)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """An undisturbed run: its workdir and events."""
    workdir = tmp_path_factory.mktemp("clean") / "run"
    code, events = run_trainer(workdir)
    assert code == 0
    return workdir, events


@pytest.mark.timeout(900)
def test_killed_slice_reshapes_and_matches_the_undisturbed_loss(tmp_path, clean):
    # At step 25: the persistent save of step 10 (local tier off) has had 15 steps to commit; at
    # step 15 a loaded host could still be committing it, and the restart then starts over.
    kill = SupervisorAction("kill", slice=1, at_step=25)
    code, events = run_trainer(tmp_path / "faulty", actions=[kill])
    assert code == 0
    sup = [e for e in events if e.get("source") == "supervisor"]
    (fault,) = [e for e in sup if e["type"] == "fault_injected"]
    (failure,) = [e for e in sup if e["type"] == "failure_detected"]
    assert (failure["cause"], failure["slice"], failure["exit_code"]) == ("exit", 1, -9)
    (restart,) = [e for e in sup if e["type"] == "restart"]
    assert restart["slices"] == [0]
    assert (restart["mesh"]["replica"], restart["mesh"]["fsdp"]) == (1, 2)
    # A checkpoint from before the fault, and steps left to train again on the new mesh.
    restore = [e for e in events if e["type"] == "restore" and e["time"] > restart["time"]]
    assert restore and restore[0]["step"] % 10 == 0, restore
    assert 10 <= restore[0]["step"] <= fault["step"] < TOTAL, (restore[0], fault)

    assert final_loss(events) == pytest.approx(final_loss(clean[1]), rel=1e-5)


@pytest.mark.timeout(900)
def test_lost_host_reshapes_and_matches_the_undisturbed_loss(tmp_path, clean):
    # The agent of slice 1 and its worker SIGKILLed: the host, not only the process, is gone.
    lose = SupervisorAction("lose_host", slice=1, at_step=15)
    code, events = run_trainer(tmp_path / "host_lost", actions=[lose])
    assert code == 0
    sup = [e for e in events if e.get("source") == "supervisor"]
    (fault,) = [e for e in sup if e["type"] == "fault_injected"]
    (lost,) = [e for e in sup if e["type"] == "host_lost"]
    assert (
        lost["host"] == "host1"
        and lost["time"] - fault["time"] <= OVERRIDES["coordinator.agent_timeout_s"] + 1.0
    )
    (restart,) = [e for e in sup if e["type"] == "restart"]
    assert restart["slices"] == [0]
    assert final_loss(events) == pytest.approx(final_loss(clean[1]), rel=1e-5)


@pytest.mark.timeout(900)
def test_restart_from_the_compilation_cache_is_bitwise_exact(tmp_path, clean, own_compile_cache):
    # Early in the run: the processes agree on the step to save at a few steps after the
    # notice, and a notice too close to the end lets the run finish first (no restart to test).
    preempt = SupervisorAction("preempt", slice=1, at_step=8)
    code, events = run_trainer(tmp_path / "preempted", actions=[preempt])
    assert code == 0
    sup = [e for e in events if e.get("source") == "supervisor"]
    (restart,) = [e for e in sup if e["type"] == "restart"]
    assert (restart["reason"], restart["slices"]) == ("preemption", [0, 1])
    # Every process loads the step it compiled before, not only JAX's process 0.
    compiles = {
        (e["generation"], e["process"]): e["cache"] for e in events if e["type"] == "compile"
    }
    assert compiles == {(0, 0): "miss", (0, 1): "miss", (1, 0): "hit", (1, 1): "hit"}
    expected, resumed = final_state(clean[0]), final_state(tmp_path / "preempted")
    assert expected.keys() == resumed.keys()
    for key, value in expected.items():
        assert np.array_equal(value, resumed[key]), key
