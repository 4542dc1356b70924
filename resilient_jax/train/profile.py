"""A `jax.profiler` trace of the steps `profile.steps` names ("START:STOP": steps START..STOP-1),
written under `<workdir>/profile/process_<i>/` for each process: the TensorBoard profile plugin
reads `plugins/profile/<run>/*.xplane.pb` (`tensorboard --logdir <workdir>/profile`), and
Perfetto (ui.perfetto.dev) opens the `perfetto_trace.json.gz` beside it.

Tracing observes the device work without changing it: the steps traced compute the same numbers
as untraced ones. The trace starts before step START is dispatched and stops once step STOP-1 has
finished on the device; starting it and stopping it (writing the files) are `profile` events with
their durations, which goodput accounts as profiling. A run that resumes past START traces what is
left of the window; one that ends inside it writes what it traced.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import jax

from resilient_jax.config import profile_steps
from resilient_jax.contracts.event_types import EventType
from resilient_jax.train.hooks import Hook, StepInfo

if TYPE_CHECKING:
    from resilient_jax.train.context import RunContext
    from resilient_jax.train.state import TrainState

PROFILE_DIR = "profile"


def trace_dir(workdir: str, process: int) -> str:
    return os.path.join(workdir, PROFILE_DIR, f"process_{process}")


class Profiler(Hook):
    def __init__(self, steps: range) -> None:
        self._steps = steps
        self._first_traced: int | None = None  # the first step of a trace in progress

    @classmethod
    def from_config(cls, config) -> Profiler | None:
        """The profiler `profile.steps` asks for; None when it is off."""
        steps = profile_steps(config.profile.steps)
        return cls(steps) if steps is not None else None

    def on_start(self, ctx: RunContext, state: TrainState) -> None:
        self._start_if_next(ctx, int(jax.device_get(state.step)))

    def after_step(self, ctx: RunContext, state: TrainState, info: StepInfo) -> None:
        if self._first_traced is not None and info.step >= self._steps[-1]:
            self._stop(ctx, state, info.step)
        else:
            self._start_if_next(ctx, info.step)

    def on_end(self, ctx: RunContext, state: TrainState, info: StepInfo | None) -> None:
        if self._first_traced is not None:
            self._stop(ctx, state, info.step if info is not None else self._first_traced)

    def close(self) -> None:
        # A run ending in an exception still leaves the trace it had, and no profiler running.
        if self._first_traced is not None:
            self._first_traced = None
            jax.profiler.stop_trace()

    def _start_if_next(self, ctx: RunContext, done: int) -> None:
        """Starts the trace when the next step (`done + 1`) is one to trace."""
        if self._first_traced is None and done + 1 in self._steps:
            start = time.perf_counter()
            jax.profiler.start_trace(
                trace_dir(ctx.workdir, jax.process_index()), create_perfetto_trace=True
            )
            self._first_traced = done + 1
            ctx.events.emit(
                EventType.PROFILE, action="start", duration_s=time.perf_counter() - start
            )

    def _stop(self, ctx: RunContext, state: TrainState, last: int) -> None:
        jax.block_until_ready(state)  # the trace ends with the last traced step's device work
        start = time.perf_counter()
        first, self._first_traced = self._first_traced, None
        jax.profiler.stop_trace()
        ctx.events.emit(
            EventType.PROFILE,
            action="stop",
            first_step=first,
            last_step=last,
            path=trace_dir(ctx.workdir, jax.process_index()),
            duration_s=time.perf_counter() - start,
        )
