"""Training: the loss falls on the bundled text; the split into microbatches and devices does not
change the result; the launcher writes the run files."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from conftest import run_python, tiny_config

from resilient_jax import mesh, topology
from resilient_jax.data import BatchLoader, make_source
from resilient_jax.train.state import init_state
from resilient_jax.train.step import make_train_step


def train_losses(config, num_devices: int, steps: int):
    topo = mesh.discover(jax.devices()[:num_devices])
    plan = topology.plan_mesh(config, topo)
    device_mesh = mesh.make_mesh(plan, topo)
    loader = BatchLoader(config, device_mesh, plan, make_source(config))
    state = init_state(config, device_mesh)
    step = make_train_step(config, device_mesh)
    losses = []
    for _ in range(steps):
        _, batch = loader.next()
        state, metrics = step(state, batch, jnp.float32(1.0))
        losses.append(float(metrics["loss"]))
    return plan, losses, jax.device_get(state.params)


def test_devices_times_microbatches_does_not_change_training():
    config = tiny_config(per_device_batch_size=2)
    plan8, losses8, params8 = train_losses(config, 8, 4)
    plan4, losses4, params4 = train_losses(config, 4, 4)
    assert (plan8.microbatches, plan4.microbatches) == (1, 2)
    np.testing.assert_allclose(losses8, losses4, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params8), jax.tree.leaves(params4), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_tensor_parallel_mesh_matches_fsdp():
    config = tiny_config()
    _, fsdp, _ = train_losses(config, 8, 3)
    tensor_config = tiny_config(**{"mesh.tensor": 2})
    _, tensor, _ = train_losses(tensor_config, 8, 3)
    np.testing.assert_allclose(fsdp, tensor, rtol=1e-5)


def test_same_mesh_is_bitwise_deterministic():
    config = tiny_config()
    _, losses_a, params_a = train_losses(config, 8, 3)
    _, losses_b, params_b = train_losses(config, 8, 3)
    assert losses_a == losses_b
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        assert np.array_equal(a, b)


def strict_json_lines(path) -> list[dict]:
    """Every line of a .jsonl file, parsed as strict JSON (NaN or Infinity fail the test)."""

    def refuse(constant: str):
        raise ValueError(f"{path}: {constant} is no JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_strict_json_writes_a_missing_number_as_null(tmp_path):
    from resilient_jax.events import EventLog, strict_json

    value = {"a": float("nan"), "b": [np.float32(1.5), float("inf")], "c": np.int64(3)}
    assert strict_json(value) == '{"a": null, "b": [1.5, null], "c": 3}'
    EventLog(str(tmp_path), clock=lambda: 1.0).emit("step", duration_s=float("nan"), step=1)
    (event,) = strict_json_lines(tmp_path / "events.jsonl")
    assert event == {"time": 1.0, "type": "step", "duration_s": None, "step": 1}


def test_a_small_training_run_loss_falls_and_writes_run_files(tmp_path):
    result = run_python(
        [
            "launch/train.py",
            # The tests' small model (the train step other launcher tests compile, too).
            "--config=configs/small_cpu.py",
            f"--workdir={tmp_path}",
            "--config.total_steps=40",  # as the launcher tests' runs: the same programs
            "--config.log.every_steps=1",
            "--config.checkpoint.local_dir=",
        ],
        timeout=400,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = strict_json_lines(tmp_path / "metrics.jsonl")
    assert rows[-1]["step"] == 40 and all("loss" in r for r in rows)
    # From ln V (6.93): about 5.99 at step 40 (0.95 lower; an untrained step would not move it).
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.6, [r["loss"] for r in rows]
    # The first step has no step time (nothing before it to measure from): null, not NaN.
    assert rows[0]["step"] == 1 and rows[0]["step_time_s"] is None
    assert rows[1]["step_time_s"] > 0
    assert json.loads((tmp_path / "config.json").read_text())["total_steps"] == 40
    events = strict_json_lines(tmp_path / "events.jsonl")
    assert next(e for e in events if e["type"] == "step")["duration_s"] is None
    types = {e["type"] for e in events}
    assert {"process_start", "compile", "step", "stop"} <= types
    assert list((tmp_path / "tensorboard").iterdir())


def test_compiled_step_is_cached_per_process_and_a_damaged_entry_is_recompiled(tmp_path):
    from resilient_jax.events import EventLog, read_events
    from resilient_jax.run import prepare
    from resilient_jax.train.compile import compile_step, without_fault_scale

    config = tiny_config()
    events = EventLog(str(tmp_path / "run"), pid=0)
    ctx = prepare(config, str(tmp_path / "run"), events)
    cache = str(tmp_path / "cache")

    def one_step(compiled):
        loader = BatchLoader(config, ctx.mesh, ctx.plan, make_source(config))
        state = init_state(config, ctx.mesh)
        state, metrics = without_fault_scale(compiled)(state, loader.next()[1])
        loader.close()
        return float(metrics["loss"]), jax.device_get(state.params)

    fresh = one_step(compile_step(ctx, cache))
    (entry,) = list((tmp_path / "cache").iterdir())
    assert entry.name.endswith(f"-p{jax.process_index()}.bin")
    cached = one_step(compile_step(ctx, cache))
    entry.write_bytes(entry.read_bytes()[:100])  # torn write from an older crash
    recompiled = one_step(compile_step(ctx, cache))

    for other in (cached, recompiled):
        assert other[0] == fresh[0]
        for a, b in zip(jax.tree.leaves(fresh[1]), jax.tree.leaves(other[1]), strict=True):
            assert np.array_equal(a, b)
    log = list(read_events(str(tmp_path / "run")))
    assert [e["cache"] for e in log if e["type"] == "compile"] == ["miss", "hit", "miss"]
    assert [e["type"] for e in log].count("compile_cache_invalid") == 1
    assert entry.stat().st_size > 100  # rewritten whole
