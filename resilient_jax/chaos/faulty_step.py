"""The train step as chaos sees it: `wrap_step` turns the compiled step, which takes a loss scale,
into the two-argument step the loop calls, passing the scale of a nan or spike fault due at the
step being taken (1.0 otherwise). The trainer itself knows nothing of faults."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from resilient_jax.chaos.hook import ChaosHook

if TYPE_CHECKING:
    from resilient_jax.train.state import TrainState
    from resilient_jax.train.step import Metrics, ScaledStepFn, StepFn


class _FaultyStep:
    """Counts steps itself, so it never waits for the device to read a step number back."""

    def __init__(self, step_fn: ScaledStepFn, hook: ChaosHook) -> None:
        self._step_fn = step_fn
        self._hook = hook
        self._returned: TrainState | None = None  # the state the last call produced
        self._next_step = 0

    def __call__(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, Metrics]:
        if state is not self._returned:
            # The first step, or state the loop restored (a rollback): its step says where we are.
            self._next_step = int(jax.device_get(state.step)) + 1
        scale = self._hook.loss_scale(self._next_step)
        new_state, metrics = self._step_fn(state, batch, jnp.float32(scale))
        self._returned, self._next_step = new_state, self._next_step + 1
        return new_state, metrics


def wrap_step(step_fn: ScaledStepFn, hook: ChaosHook) -> StepFn:
    """The step `step_fn(state, batch, loss_scale)` as `step(state, batch)`, its loss scaled by the
    faults of `hook` due at the step being taken. `hook` must also be one of the loop's hooks (its
    `on_start` gives it the run's context)."""
    return _FaultyStep(step_fn, hook)
