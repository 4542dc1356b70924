"""Compiling the train step ahead of time, so compile time is measured and reported on its own,
through the per-process executable cache (`resilient_jax.executables`): a restarted worker loads
the step it compiled before for the same mesh."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp

from resilient_jax import executables
from resilient_jax import mesh as mesh_lib
from resilient_jax.train.context import RunContext
from resilient_jax.train.step import make_train_step


def compile_step(ctx: RunContext, cache_dir: str | None = None) -> Any:
    """The compiled train step for the context's mesh; emits a `compile` event with its duration
    and, with a cache, whether it came from it. `cache_dir`: where executables are kept (default:
    `executables.default_dir()`, none when JAX's compilation cache is off)."""
    start = time.perf_counter()
    step_fn = make_train_step(ctx.config, ctx.mesh)
    rows = ctx.config.global_batch_size // ctx.plan.microbatches
    batch = jax.ShapeDtypeStruct(
        (ctx.plan.microbatches, rows, ctx.config.data.seq_len + 1),
        jnp.int32,
        sharding=mesh_lib.batch_sharding(ctx.mesh),
    )
    scale = jax.ShapeDtypeStruct((), jnp.float32, sharding=mesh_lib.replicated(ctx.mesh))
    lowered = step_fn.lower(ctx.abstract_state, batch, scale)
    directory = cache_dir or executables.default_dir()
    compiled, hit = executables.compile_cached(
        lowered, ctx.mesh.devices.flat, directory, ctx.events
    )
    fields: dict[str, Any] = {"duration_s": time.perf_counter() - start}
    if directory:
        fields["cache"] = "hit" if hit else "miss"
    ctx.events.emit("compile", **fields)
    return compiled
