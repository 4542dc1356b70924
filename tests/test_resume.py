"""Exact resume through the launcher: SIGKILL at a random moment (maybe mid-save), the same
command again, and the final `state`, read with plain Orbax, is bitwise equal to an uninterrupted
run's. A run preempted on 4 devices continues on 2 with the same examples and loss."""

from __future__ import annotations

import json
import random
import signal
import time

import numpy as np
import pytest

from resilient_jax.contracts.exit_codes import ExitCode


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, launcher):
    workdir = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert launcher.finish(launcher.start(workdir, devices=4)) == ExitCode.FINISHED
    return workdir


@pytest.mark.parametrize("seed", [0])
def test_sigkill_at_a_random_moment_then_same_command_is_bitwise_exact(
    tmp_path, launcher, uninterrupted, seed
):
    rng = random.Random(seed)
    total = launcher.total_steps
    workdir = tmp_path / "run"
    proc = launcher.start(workdir, devices=4)
    launcher.wait_for_step(workdir, rng.randrange(2, total - 5), proc)
    time.sleep(rng.uniform(0.0, 0.5))  # land anywhere: in a step, a save or its commit
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert launcher.finish(launcher.start(workdir, devices=4)) == ExitCode.FINISHED
    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    assert any(e["type"] == "restore" for e in events) or not any(
        e["type"] == "save_committed" for e in events
    )
    expected = launcher.plain_orbax_state(uninterrupted, total)
    resumed = launcher.plain_orbax_state(workdir, total)
    assert expected.keys() == resumed.keys()
    for key, value in expected.items():
        assert np.array_equal(value, resumed[key]), key
    assert launcher.step_losses(workdir) == launcher.step_losses(uninterrupted)


def test_preempted_on_4_devices_continues_on_2(tmp_path, launcher, uninterrupted):
    workdir = tmp_path / "run"
    # 4 rows a device: one microbatch on 4 devices (the uninterrupted run's program), two on 2.
    batch_of_4 = ["--config.per_device_batch_size=4"]
    proc = launcher.start(workdir, devices=4, extra=batch_of_4)
    launcher.wait_for_step(workdir, 12, proc)
    proc.send_signal(signal.SIGTERM)  # preemption notice: save, wait for commit, exit 42
    assert launcher.finish(proc) == ExitCode.PREEMPTED
    assert (
        launcher.finish(launcher.start(workdir, devices=2, extra=batch_of_4)) == ExitCode.FINISHED
    )
    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["type"] == "process_start"]
    assert [s["mesh"]["fsdp"] for s in starts] == [4, 2]
    assert [s["mesh"]["microbatches"] for s in starts] == [1, 2]
    (restore,) = [e for e in events if e["type"] == "restore"]
    assert restore["step"] >= 12
    # Same examples in every step: losses match the uninterrupted 4-device run within fp noise.
    got, want = launcher.step_losses(workdir), launcher.step_losses(uninterrupted)
    assert sorted(got) == sorted(want) == list(range(1, launcher.total_steps + 1))
    np.testing.assert_allclose(
        [got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=2e-4
    )
