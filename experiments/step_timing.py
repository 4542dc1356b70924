"""Step time of a compiled train step, in the framework's loop and in a bare loop, and the MFU of
a step time: shared by `bench_step.py` and `gpu_measure.py` (no flags of its own, so either can
import it)."""

from __future__ import annotations

import time
from typing import Any


def interleaved_blocks(
    ctx: Any,
    step_fn: Any,
    loader: Any,
    hooks: list[Any],
    state: Any,
    bare_state: Any,
    blocks: int,
    steps: int,
) -> tuple[list[float], list[float]]:
    """Seconds per step of the framework's `Loop` (with `hooks`, fed by `loader`) and of a bare
    loop calling `step_fn` (the compiled step, `(state, batch, fault scale)`) on one fixed batch,
    interleaved in `blocks` blocks of `steps` steps each after one warm-up block of 2 steps."""
    import jax

    from resilient_jax.train.compile import without_fault_scale
    from resilient_jax.train.loop import Loop

    config = ctx.config
    loop_step = without_fault_scale(step_fn)  # the loop's step, as a run without faults has it
    _, fixed_batch = loader.next()

    def framework_block(state, steps):
        config.total_steps = int(jax.device_get(state.step)) + steps
        start = time.perf_counter()
        state, _ = Loop(ctx, loop_step, loader, hooks, restore=lambda max_step: None).run(state)
        jax.block_until_ready(state)
        return state, (time.perf_counter() - start) / steps

    state, _ = framework_block(state, 2)  # warm both paths
    bare_state, _ = bare_block(step_fn, bare_state, fixed_batch, 2)
    framework, bare = [], []
    for _ in range(blocks):
        state, t = framework_block(state, steps)
        framework.append(t)
        bare_state, t = bare_block(step_fn, bare_state, fixed_batch, steps)
        bare.append(t)
    return framework, bare


def bare_block(step_fn: Any, state: Any, batch: Any, steps: int) -> tuple[Any, float]:
    """`steps` calls of the compiled step on one batch, nothing pulled until the last is done:
    the new state and the seconds per step."""
    import jax
    import jax.numpy as jnp

    one = jnp.float32(1.0)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step_fn(state, batch, one)
    jax.block_until_ready((state, metrics))
    return state, (time.perf_counter() - start) / steps


def model_flops_utilization(ctx: Any, step_s: float) -> float | None:
    """Model FLOPs per second of a step of `step_s` over the devices' peak bf16 FLOP/s (None when
    the device's peak is not known: CPUs)."""
    from resilient_jax.model import ModelConfig
    from resilient_jax.train.metrics import peak_flops_per_device

    config = ctx.config
    peak = peak_flops_per_device(config.log.peak_flops_per_device) * len(ctx.topology.devices)
    if not peak:
        return None
    tokens = config.global_batch_size * config.data.seq_len
    model = ModelConfig.from_config(config.model)
    return model.flops_per_token(config.data.seq_len) * tokens / step_s / peak
