"""Exact resume through the launcher: SIGKILL at a random moment (maybe mid-save), the same
command again, and the final `state`, read with plain Orbax, is bitwise equal to an uninterrupted
run's. A run preempted on 8 devices continues on 4 with the same examples and loss."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import REPO, SMALL, as_flags

from resilient_jax.contracts.exit_codes import ExitCode

TOTAL_STEPS = 40
LAUNCH_FLAGS = as_flags(
    {
        **SMALL,
        "total_steps": TOTAL_STEPS,
        "checkpoint.every_steps": 10,
        "checkpoint.local_every_steps": 3,
    }
)


def start(workdir, devices: int, extra=()) -> subprocess.Popen:
    argv = [
        sys.executable,
        "launch/train.py",
        "--config=configs/tiny_cpu.py",
        f"--workdir={workdir}",
        f"--config.checkpoint.local_dir={workdir}-shm",
        *LAUNCH_FLAGS,
        *extra,
    ]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> int:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"training did not finish within {timeout}s")
    assert proc.returncode in (0, ExitCode.PREEMPTED), err[-3000:]
    return proc.returncode


def wait_for_step(workdir, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Blocks until the run has logged `step` (polls its event log)."""
    path = os.path.join(workdir, "events.jsonl")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before step {step}"
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if '"type": "step"' in line and json.loads(line)["step"] >= step:
                        return
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no step {step} within {timeout}s")


def plain_orbax_state(workdir, step: int) -> dict[str, np.ndarray]:
    path = os.path.join(workdir, "checkpoints", str(step), "state")
    checkpointer = ocp.PyTreeCheckpointer()
    meta = checkpointer.metadata(path).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    tree = checkpointer.restore(path, restore_args=args)
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def step_losses(workdir) -> dict[int, float]:
    """The loss of each step, the last one logged for a step that was run twice."""
    losses = {}
    with open(os.path.join(workdir, "events.jsonl")) as f:
        for line in f:
            event = json.loads(line)
            if event["type"] == "step":
                losses[event["step"]] = event["loss"]
    return losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert finish(start(workdir, devices=4)) == 0
    return workdir


@pytest.mark.parametrize("seed", [0])
def test_sigkill_at_a_random_moment_then_same_command_is_bitwise_exact(
    tmp_path, uninterrupted, seed
):
    rng = random.Random(seed)
    workdir = tmp_path / "run"
    proc = start(workdir, devices=4)
    wait_for_step(workdir, rng.randrange(2, TOTAL_STEPS - 5), proc)
    time.sleep(rng.uniform(0.0, 0.5))  # land anywhere: in a step, a save or its commit
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert finish(start(workdir, devices=4)) == 0
    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    assert any(e["type"] == "restore" for e in events) or not any(
        e["type"] == "save_committed" for e in events
    )
    expected = plain_orbax_state(uninterrupted, TOTAL_STEPS)
    resumed = plain_orbax_state(workdir, TOTAL_STEPS)
    assert expected.keys() == resumed.keys()
    for key, value in expected.items():
        assert np.array_equal(value, resumed[key]), key
    assert step_losses(workdir) == step_losses(uninterrupted)


def test_preempted_on_8_devices_continues_on_4(tmp_path, uninterrupted):
    workdir = tmp_path / "run"
    proc = start(workdir, devices=8, extra=["--config.per_device_batch_size=2"])
    wait_for_step(workdir, 12, proc)
    proc.send_signal(signal.SIGTERM)  # preemption notice: save, wait for commit, exit 42
    assert finish(proc) == ExitCode.PREEMPTED
    assert finish(start(workdir, devices=4, extra=["--config.per_device_batch_size=2"])) == 0
    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["type"] == "process_start"]
    assert [s["mesh"]["fsdp"] for s in starts] == [8, 4]
    assert [s["mesh"]["microbatches"] for s in starts] == [1, 2]
    (restore,) = [e for e in events if e["type"] == "restore"]
    assert restore["step"] >= 12
    # Same examples in every step: losses match the uninterrupted 4-device run within fp noise.
    got, want = step_losses(workdir), step_losses(uninterrupted)
    assert sorted(got) == sorted(want) == list(range(1, TOTAL_STEPS + 1))
    np.testing.assert_allclose(
        [got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=2e-4
    )
