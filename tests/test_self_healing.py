"""In-band anomalies through the launcher: an injected NaN is skipped and never reaches the
parameters; a spike triggers a rollback that skips its data window, and the steps it replays give
the same losses bit for bit."""

from __future__ import annotations

import json

import numpy as np


def events_of(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]


def test_injected_nan_is_skipped_and_parameters_stay_finite(tmp_path, launcher):
    workdir = tmp_path / "run"
    assert launcher.finish(launcher.start(workdir, devices=2, extra=["--chaos=nan:step=15"])) == 0
    (anomaly,) = [e for e in events_of(workdir) if e["type"] == "anomaly"]
    assert (anomaly["step"], anomaly["cause"], anomaly["action"]) == (15, "nonfinite", "skip")
    state = launcher.plain_orbax_state(workdir, launcher.total_steps)
    assert all(np.isfinite(v).all() for v in state.values() if v.dtype.kind == "f")
    losses = launcher.step_losses(workdir)
    # The NaN loss is logged as JSON's null (events are strict JSON); every other step's is finite.
    assert losses[15] is None and np.isfinite([losses[s] for s in losses if s != 15]).all()


def test_spike_rolls_back_skips_its_data_and_replays_identically(tmp_path, launcher):
    workdir = tmp_path / "run"
    # Local saves every 5 steps: the newest before the spike is at most step 20, so the rollback
    # always has steps to replay (a save every 3 steps could land on step 24 or be skipped).
    spike = [
        "--chaos=spike:step=25,factor=1000",
        "--config.health.max_skips=1",
        "--config.checkpoint.local_every_steps=5",
    ]
    assert launcher.finish(launcher.start(workdir, devices=2, extra=spike)) == 0
    events = events_of(workdir)
    (anomaly,) = [e for e in events if e["type"] == "anomaly"]
    assert (anomaly["step"], anomaly["action"]) == (25, "rollback")
    (rollback,) = [e for e in events if e["type"] == "rollback"]
    assert rollback["step"] < 25 and rollback["skips"] == [[24, 28]]  # batch 24 fed step 25
    restore = [e for e in events if e["type"] == "restore"]
    assert restore and restore[-1]["step"] == rollback["step"]
    # The steps between the restored one and the spike ran twice, on the same batches from the
    # same state: bit-identical losses (a rollback replays; it does not drift).
    losses: dict[int, list] = {}
    for e in events:
        if e["type"] == "step":
            losses.setdefault(e["step"], []).append(e["loss"])
    replayed = range(rollback["step"] + 1, 25)
    assert list(replayed), "the rollback replayed no step"
    assert all(len(losses[s]) == 2 and losses[s][0] == losses[s][1] for s in replayed), losses
    assert sorted(losses) == list(range(1, launcher.total_steps + 1))
    state = launcher.plain_orbax_state(workdir, launcher.total_steps)
    assert all(np.isfinite(v).all() for v in state.values() if v.dtype.kind == "f")
