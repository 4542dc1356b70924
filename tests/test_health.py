"""In-band verdicts, the escalation policy, the learning-rate controller, stragglers, watchdog."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resilient_jax import config as config_lib
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.control.stragglers import StragglerDetector
from resilient_jax.data.position import DataPosition
from resilient_jax.events import EventLog, read_events
from resilient_jax.health import HealthMonitor, Watchdog
from resilient_jax.train.hooks import Rollback, StepInfo, StopTraining
from resilient_jax.train.in_band import HealthStats, assess, scale_updates, where_ok


def health_config(**overrides):
    h = config_lib.default_config().health
    h.update(overrides)
    return h


def make_step(cfg):
    """A toy jitted step shaped like the real one: assess, then apply the update only if ok."""

    @jax.jit
    def step(stats, params, loss, grad_norm):
        ok, stats, flags = assess(stats, loss, grad_norm, cfg)
        updates = scale_updates({"w": -0.1 * jnp.ones_like(params["w"])}, flags["lr_scale"])
        new_params = jax.tree.map(jnp.add, params, updates)
        return where_ok(ok, new_params, params), stats, flags

    return step


def run_steps(cfg, losses, grad_norms):
    step = make_step(cfg)
    stats, params = HealthStats.init(), {"w": jnp.ones(3, jnp.float32)}
    history = []
    for loss, grad in zip(losses, grad_norms, strict=True):
        params, stats, flags = step(stats, params, jnp.float32(loss), jnp.float32(grad))
        history.append({k: float(v) for k, v in flags.items()})
    return params, stats, history


def calm(n, seed=0):
    rng = np.random.default_rng(seed)
    return list(3.0 + 0.05 * rng.standard_normal(n)), list(1.0 + 0.05 * rng.standard_normal(n))


def test_nan_step_is_skipped_and_leaves_state_unchanged():
    cfg = health_config()
    step = make_step(cfg)
    stats, params = HealthStats.init(), {"w": jnp.ones(3, jnp.float32)}
    params, stats, _ = step(stats, params, jnp.float32(3.0), jnp.float32(1.0))
    before_params, before_stats = params, stats
    params, stats, flags = step(stats, params, jnp.float32(math.nan), jnp.float32(math.nan))
    assert float(flags["nonfinite"]) == 1.0 and float(flags["skipped"]) == 1.0
    assert float(flags["loss_z"]) == 0.0  # no NaN leaks into the metrics
    np.testing.assert_array_equal(params["w"], before_params["w"])
    for name in ("count", "loss_mean", "loss_var", "log_grad_mean", "log_grad_var"):
        assert float(getattr(stats, name)) == float(getattr(before_stats, name)), name


def test_healthy_steps_apply_and_learn_exact_early_statistics():
    params, stats, history = run_steps(health_config(), [2.0, 4.0], [1.0, math.e])
    np.testing.assert_allclose(params["w"], 0.8)
    assert all(h["skipped"] == 0.0 for h in history)
    assert float(stats.count) == 2.0
    np.testing.assert_allclose(float(stats.loss_mean), 3.0)
    np.testing.assert_allclose(float(stats.loss_var), 1.0)  # population variance of {2, 4}
    np.testing.assert_allclose(float(stats.log_grad_mean), 0.5, rtol=1e-6)


def test_loss_spike_is_flagged_only_after_warmup():
    cfg = health_config(warmup_steps=10)
    losses, grads = calm(30)
    losses[5] = 30.0  # before the statistics settle: no verdict
    _, _, history = run_steps(cfg, losses[:10], grads[:10])
    assert history[5]["loss_spike"] == 0.0 and history[5]["skipped"] == 0.0
    losses[5], losses[25] = losses[4], 30.0
    _, _, history = run_steps(cfg, losses, grads)
    assert history[25]["loss_spike"] == 1.0 and history[25]["skipped"] == 1.0
    assert history[25]["loss_z"] > cfg.zscore
    assert sum(h["skipped"] for h in history) == 1.0


def test_no_warmup_still_learns_from_the_first_steps():
    losses, grads = calm(5)
    _, stats, history = run_steps(health_config(warmup_steps=0), losses, grads)
    assert sum(h["skipped"] for h in history) == 0.0 and float(stats.count) == 5.0


def test_grad_norm_spike_is_flagged():
    losses, grads = calm(30)
    grads[28] = 50.0
    _, _, history = run_steps(health_config(warmup_steps=10), losses, grads)
    assert history[28]["grad_spike"] == 1.0 and history[28]["loss_spike"] == 0.0
    assert history[28]["skipped"] == 1.0
    assert sum(h["skipped"] for h in history) == 1.0


def test_disabled_health_never_skips_but_reports():
    _, stats, history = run_steps(health_config(enabled=False), [3.0, math.nan], [1.0, 1.0])
    assert history[1]["nonfinite"] == 1.0 and history[1]["skipped"] == 0.0
    assert float(stats.count) == 1.0  # but NaN never enters the statistics


def test_pid_damps_the_learning_rate_after_a_spike_and_recovers():
    losses, grads = calm(40)
    grads[25] = 4.0  # a jump below the skip threshold only the controller acts on
    cfg = health_config(warmup_steps=10, zscore=1e6, pid_enabled=True)
    _, _, history = run_steps(cfg, losses, grads)
    scales = [h["lr_scale"] for h in history]
    assert min(scales[:25]) > 0.8  # noise barely moves it
    assert scales[25] < 0.2
    assert max(scales[26:29]) < 0.7  # the integral remembers the spike for a few steps
    assert np.mean(scales[32:]) > 0.95
    _, _, off = run_steps(health_config(warmup_steps=10, zscore=1e6), losses, grads)
    assert all(h["lr_scale"] == 1.0 for h in off)


def test_scale_updates_keeps_dtype():
    out = scale_updates({"a": jnp.ones(2, jnp.bfloat16)}, jnp.float32(0.5))
    assert out["a"].dtype == jnp.bfloat16 and float(out["a"][0]) == 0.5


# --------------------------------------------------------------------- host-side policy


def fake_ctx(tmp_path, **health):
    config = config_lib.default_config()
    config.health.update(health)
    return types.SimpleNamespace(config=config, events=EventLog(str(tmp_path), process=0))


def skipped(cause="nonfinite"):
    return {"skipped": 1.0, cause: 1.0, "loss": math.nan, "grad_norm": 2.0}


def test_monitor_escalates_skip_rollback_stop(tmp_path):
    ctx = fake_ctx(tmp_path, max_skips=2, max_rollbacks=1, rollback_skip_batches=5)
    monitor = HealthMonitor()
    monitor.on_metrics(ctx, 1, skipped())
    monitor.on_metrics(ctx, 2, {"skipped": 0.0, "loss": 3.0})  # a healthy step resets the count
    monitor.on_metrics(ctx, 3, skipped("loss_spike"))
    with pytest.raises(Rollback) as rollback:
        monitor.on_metrics(ctx, 4, skipped("grad_spike"))
    assert rollback.value.skip_batches == 5
    monitor.on_metrics(ctx, 3, skipped())
    with pytest.raises(StopTraining) as stop:
        monitor.on_metrics(ctx, 4, skipped())
    assert stop.value.exit_code == ExitCode.HEALTH_GAVE_UP == 3
    events = [e for e in read_events(str(tmp_path)) if e["type"] == "anomaly"]
    assert [(e["step"], e["cause"], e["action"]) for e in events] == [
        (1, "nonfinite", "skip"),
        (3, "loss_spike", "skip"),
        (4, "grad_spike", "rollback"),
        (3, "nonfinite", "skip"),
        (4, "nonfinite", "stop"),
    ]
    assert events[0]["loss"] == "nan"  # NaN is not JSON: written as a string
    json.loads((tmp_path / "events.jsonl").read_text().splitlines()[0])


def test_monitor_stops_on_nan_when_health_is_disabled(tmp_path):
    ctx = fake_ctx(tmp_path, enabled=False)
    HealthMonitor().on_metrics(ctx, 1, {"nonfinite": 0.0, "loss": 3.0})
    with pytest.raises(StopTraining, match=r"health\.enabled=False"):
        HealthMonitor().on_metrics(ctx, 2, {"nonfinite": 1.0, "skipped": 0.0})


def test_health_config_is_validated():
    config = config_lib.default_config()
    config_lib.validate(config)
    config.health.pid_min_scale = 0.0
    with pytest.raises(config_lib.ConfigError, match=r"health\.pid_min_scale"):
        config_lib.validate(config)


# ------------------------------------------------------------------------- stragglers


def test_straggler_detector_flags_the_slow_process_after_a_full_window():
    detector = StragglerDetector(factor=1.5, window=3)
    for t in range(3):
        detector.observe(0, 1.0)
        detector.observe(1, 1.1)
        detector.observe(2, 3.0 if t else 0.9)
        assert detector.stragglers() == ([2] if t == 2 else [])
    assert detector.medians() == {0: 1.0, 1: 1.1, 2: 3.0}
    detector.forget(2)
    assert detector.stragglers() == []


def test_straggler_detector_with_two_processes_and_a_single_slow_step():
    detector = StragglerDetector(factor=1.5, window=4)
    for t in range(4):
        detector.observe(0, 1.0)
        detector.observe(1, 10.0 if t == 0 else 1.0)  # one slow step (a save) is no straggler
    assert detector.stragglers() == []
    for _ in range(4):
        detector.observe(1, 2.0)
    assert detector.stragglers() == [1]
    with pytest.raises(ValueError):
        StragglerDetector(factor=1.0, window=3)


# --------------------------------------------------------------------------- watchdog


def test_watchdog_is_kept_alive_by_steps_and_fires_when_they_stop(tmp_path):
    exits = []
    dog = Watchdog(EventLog(str(tmp_path)), 0.3, 0.6, exit_fn=exits.append)
    dog.start()
    time.sleep(0.4)  # inside the startup budget
    for step in range(1, 6):
        dog.after_step(None, None, StepInfo(step, step, DataPosition(step), 0.1))
        time.sleep(0.1)
    assert exits == []
    deadline = time.monotonic() + 5
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [ExitCode.HUNG]
    (event,) = [e for e in read_events(str(tmp_path)) if e["type"] == "failure_detected"]
    assert event["cause"] == "hang" and event["step"] == 5 and event["phase"] == "step"
    assert event["latency_s"] >= 0.3


def test_watchdog_off_when_timeout_is_zero(tmp_path):
    dog = Watchdog(EventLog(str(tmp_path)), 0.0, 0.0, exit_fn=pytest.fail)
    dog.start()
    assert not dog.enabled and dog._thread is None


WATCHED_LOOP = """
import threading
from resilient_jax.events import EventLog
from resilient_jax.data.position import DataPosition
from resilient_jax.health import Watchdog
from resilient_jax.train.hooks import StepInfo
dog = Watchdog(EventLog({workdir!r}, process=0), timeout_s=0.5, startup_timeout_s=2.0)
dog.start()
for step in range(1, 4):
    dog.after_step(None, None, StepInfo(step, step, DataPosition(step), 0.0))
print("stuck", flush=True)
threading.Event().wait()  # the main thread never comes back, like a hung collective
"""


def test_watchdog_exits_a_stuck_process(tmp_path):
    script = textwrap.dedent(WATCHED_LOOP.format(workdir=str(tmp_path)))
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == ExitCode.HUNG, err
    assert "stuck" in out and "watchdog: no step completed" in err
    (event,) = [e for e in read_events(str(tmp_path)) if e["type"] == "failure_detected"]
    assert event["cause"] == "hang" and event["step"] == 3 and event["process"] == 0
