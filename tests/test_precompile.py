"""Compiling ahead of a fault: the candidate job's environment, the deferred evaluation step, and
(slow) a reshape after a killed slice that loads the step compiled before the fault."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from conftest import SMALL, supervise_tiny_cpu

from resilient_jax.contracts import env_vars
from resilient_jax.events import read_events
from resilient_jax.train.deferred import DeferredProgram
from resilient_jax.worker.candidates import candidate_env
from resilient_jax.worker.distributed import WorkerEnv


def _env(process: int, slices: int = 3, per_slice: int = 2) -> WorkerEnv:
    return WorkerEnv(
        num_processes=slices * per_slice,
        process_id=process,
        num_slices=slices,
        generation=4,
        slice=process // per_slice,
        coordinator_address="10.0.0.1:1234",
    )


def test_the_candidate_job_is_the_first_slices_renumbered_as_a_restart_would():
    environ = {
        env_vars.SUPERVISOR_ADDRESS: "10.0.0.9:1",
        env_vars.RUN_TOKEN: "secret",
        env_vars.XLA_FLAGS: "--xla_force_host_platform_device_count=2",
    }
    child = candidate_env(_env(3), 5555, environ)
    assert child is not None
    assert child[env_vars.COORDINATOR_ADDRESS] == "10.0.0.1:5555"  # process 0's host, new port
    assert (child[env_vars.NUM_PROCESSES], child[env_vars.PROCESS_ID]) == ("4", "3")
    assert (child[env_vars.NUM_SLICES], child[env_vars.GENERATION]) == ("2", "5")
    assert child[env_vars.XLA_FLAGS] == environ[env_vars.XLA_FLAGS]  # same devices per process
    assert env_vars.SUPERVISOR_ADDRESS not in child and env_vars.RUN_TOKEN not in child
    # The last slice's processes have no place in it; neither has a one-slice job.
    assert candidate_env(_env(4), 5555, environ) is None
    assert candidate_env(_env(0, slices=1), 5555, environ) is None


def test_a_deferred_program_compiles_once_in_a_thread_and_raises_its_error_at_the_call():
    threads: list[str] = []

    def compile_fn():
        threads.append(threading.current_thread().name)
        return lambda x: x + 1

    program = DeferredProgram(compile_fn)
    program.start()
    program.start()
    assert program(1) == 2 and program(2) == 3
    assert threads == ["rj-deferred-compile"]

    def failing():
        raise ValueError("no such mesh")

    with pytest.raises(ValueError, match="no such mesh"):
        DeferredProgram(failing)(1)


OVERRIDES = {
    **SMALL,
    "total_steps": 400,  # long enough for the helper to finish on a busy host
    "global_batch_size": 8,
    "checkpoint.every_steps": 10,
    "log.progress_bar": False,
    "log.tensorboard": False,
    # The default heartbeat timeouts: the fault is a killed process, seen at its exit, and on a
    # busy host a 2 s timeout had taken a slow heartbeat for a lost worker before the fault.
    "coordinator.startup_timeout_s": 120.0,
    "coordinator.kill_grace_s": 0.5,
    "coordinator.readmit_after_s": -1.0,
}


def _kill_slice_1_once_compiled_ahead(workdir, done: threading.Event) -> None:
    """SIGKILLs slice 1's worker as soon as the helper has stored the one-slice step: the fault
    comes after the compile ahead however busy the host is."""
    while not done.wait(0.2):
        if any(e["type"] == "compile" for e in read_events(str(workdir / "precompile"))):
            starts = [e for e in read_events(str(workdir)) if e["type"] == "process_start"]
            (pid,) = [e["pid"] for e in starts if e.get("source") and e["slice"] == 1]
            os.kill(pid, signal.SIGKILL)
            return


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_reshape_loads_the_step_compiled_before_the_fault(tmp_path, own_compile_cache):
    workdir = tmp_path / "run"
    done = threading.Event()
    killer = threading.Thread(target=_kill_slice_1_once_compiled_ahead, args=(workdir, done))
    killer.start()
    try:
        code, events = supervise_tiny_cpu(workdir, OVERRIDES, time_limit_s=700)
    finally:
        done.set()
        killer.join()
    assert code == 0
    ahead = [
        e
        for e in read_events(str(workdir / "precompile"))
        if e["type"] == "compile" and e["program"] == "train"
    ]
    assert [e["cache"] for e in ahead] == ["ahead"]
    (failure,) = [e for e in events if e["type"] == "failure_detected"]
    assert failure["slice"] == 1 and failure["time"] > ahead[0]["time"]
    (restart,) = [e for e in events if e["type"] == "restart"]
    assert restart["slices"] == [0]
    compiles = [e for e in events if e["type"] == "compile" and e.get("program") == "train"]
    assert [(e["generation"], e["cache"]) for e in compiles] == [
        (0, "miss"),
        (0, "miss"),
        (1, "hit"),  # the one-slice step, never compiled by the run itself
    ]
