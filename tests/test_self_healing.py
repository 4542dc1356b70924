"""In-band anomalies through the launcher: an injected NaN is skipped and never reaches the
parameters; a spike triggers a rollback that skips its data window, and a rerun of the same command
sees exactly the same data order and losses."""

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


def test_spike_rolls_back_skips_its_data_and_reruns_identically(tmp_path, launcher):
    spike = ["--chaos=spike:step=25,factor=1000", "--config.health.max_skips=1"]
    runs = []
    for name in ("first", "rerun"):
        workdir = tmp_path / name
        assert launcher.finish(launcher.start(workdir, devices=2, extra=spike)) == 0
        runs.append(workdir)
    events = events_of(runs[0])
    (anomaly,) = [e for e in events if e["type"] == "anomaly"]
    assert (anomaly["step"], anomaly["action"]) == (25, "rollback")
    (rollback,) = [e for e in events if e["type"] == "rollback"]
    assert rollback["step"] < 25 and rollback["skips"] == [[24, 28]]  # batch 24 fed step 25
    restore = [e for e in events if e["type"] == "restore"]
    assert restore and restore[-1]["step"] == rollback["step"]
    assert launcher.step_losses(runs[0]) == launcher.step_losses(runs[1])
    first, rerun = (launcher.plain_orbax_state(run, launcher.total_steps) for run in runs)
    assert all(np.array_equal(first[k], rerun[k]) for k in first)
