"""Compiling the train step, and held-out evaluation's loss-only step, ahead of time, so compile
time is measured and reported on its own (a `compile` event per program), through the per-process
executable cache (`resilient_jax.executables`): a restarted worker loads the steps it compiled
before for the same mesh, or that were compiled for that mesh before the fault
(`resilient_jax.train.precompile`). The cache key is built from the config, the mesh and the
runtime, so a hit traces and lowers nothing. `without_fault_scale` turns the compiled step into
the two-argument step the loop calls."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from resilient_jax import executables
from resilient_jax import mesh as mesh_lib
from resilient_jax.contracts.event_types import EventType
from resilient_jax.train.context import RunContext
from resilient_jax.train.deferred import DeferredProgram
from resilient_jax.train.eval import EvalStepFn, make_eval_step
from resilient_jax.train.keep import KEEP_PROGRAM, KeepingProgram
from resilient_jax.train.state import TrainState
from resilient_jax.train.step import Metrics, ScaledStepFn, StepFn, make_train_step


def compile_step(ctx: RunContext, cache_dir: str | None = None) -> KeepingProgram:
    """The compiled train step for the context's mesh; emits a `compile` event with its duration
    and, with a cache, whether it came from it. `cache_dir`: where executables are kept (default:
    `executables.default_dir()`, none when JAX's compilation cache is off).

    Its non-donating twin, for the step after a save (`train.keep`), is loaded or compiled in the
    background once a save asks `ctx.keeper` for it (a `compile_background` event)."""
    start = time.perf_counter()
    donating = _compile(ctx, train_lowering(ctx), start, cache_dir, "train")
    keeping = background_program(ctx, KEEP_PROGRAM, train_lowering(ctx, donate=False), cache_dir)
    return KeepingProgram(donating, keeping, ctx.keeper)


def background_program(
    ctx: RunContext,
    program: str,
    lower: Callable[[], jax.stages.Lowered],
    cache_dir: str | None = None,
) -> DeferredProgram:
    """`lower()` loaded from the executable cache or compiled in a background thread once the
    result is started or called (a `compile_background` event, which goodput does not count)."""
    return DeferredProgram(
        lambda: _compile(ctx, lower, time.perf_counter(), cache_dir, program, background=True)
    )


def compile_eval_step(
    ctx: RunContext, cache_dir: str | None = None, background: bool = False
) -> EvalStepFn:
    """The compiled loss-only step of held-out evaluation, like `compile_step`. `background`:
    compiled beside training (a `compile_background` event, which goodput does not count)."""
    start = time.perf_counter()
    return _compile(ctx, eval_lowering(ctx), start, cache_dir, "eval", background)


def train_lowering(ctx: RunContext, donate: bool = True) -> Callable[[], jax.stages.Lowered]:
    """Traces and lowers the train step for the context's mesh when called (only on a miss);
    `donate=False`: its non-donating twin (`train.keep`)."""

    def lower() -> jax.stages.Lowered:
        scale = jax.ShapeDtypeStruct((), jnp.float32, sharding=mesh_lib.replicated(ctx.mesh))
        return make_train_step(ctx.config, ctx.mesh, donate).lower(
            ctx.abstract_state, _abstract_batch(ctx), scale
        )

    return lower


def eval_lowering(ctx: RunContext) -> Callable[[], jax.stages.Lowered]:
    """Traces and lowers the loss-only step of evaluation when called (only on a miss)."""

    def lower() -> jax.stages.Lowered:
        step = make_eval_step(ctx.config, ctx.mesh)
        return step.lower(ctx.abstract_state.params, _abstract_batch(ctx))

    return lower


def _abstract_batch(ctx: RunContext) -> jax.ShapeDtypeStruct:
    rows = ctx.config.global_batch_size // ctx.plan.microbatches
    return jax.ShapeDtypeStruct(
        (ctx.plan.microbatches, rows, ctx.config.data.seq_len + 1),
        jnp.int32,
        sharding=mesh_lib.batch_sharding(ctx.mesh),
    )


def _compile(
    ctx: RunContext,
    lower: Callable[[], jax.stages.Lowered],
    start: float,
    cache_dir: str | None,
    program: str,
    background: bool = False,
) -> Any:
    directory = cache_dir or executables.default_dir()
    compiled, hit = load_or_compile_program(ctx, program, lower, directory)
    fields: dict[str, Any] = {"duration_s": time.perf_counter() - start, "program": program}
    if directory:
        fields["cache"] = "hit" if hit else "miss"
    ctx.events.emit(EventType.COMPILE_BACKGROUND if background else EventType.COMPILE, **fields)
    return compiled


def load_or_compile_program(
    ctx: RunContext,
    program: str,
    lower: Callable[[], jax.stages.Lowered],
    directory: str | None = None,
) -> tuple[Any, bool]:
    """`lower()` compiled for the context's mesh, or loaded from the executable cache in
    `directory` (default: `executables.default_dir()`) under the key `program` has there.
    Returns (compiled, hit)."""
    key = executables.program_key(program, ctx.config, ctx.mesh, ctx.plan.describe())
    directory = directory or executables.default_dir()
    return executables.load_or_compile(key, lower, ctx.mesh.devices.flat, directory, ctx.events)


def without_fault_scale(compiled: ScaledStepFn) -> StepFn:
    """The step at fault scale 1: the loop's step when no fault is injected. The scale is a float32
    scalar, as the step was compiled for, so the executable and its numerics are the same."""
    unit_scale = jnp.float32(1.0)

    def step(state: TrainState, batch: jax.Array) -> tuple[TrainState, Metrics]:
        return compiled(state, batch, unit_scale)

    return step
