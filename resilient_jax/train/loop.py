"""The train loop. Everything else (checkpoints, health, chaos, metrics, the coordinator) is a hook.

Per step: take the next batch, dispatch the step, hand the new state to the hooks, and only then
pull the *previous* step's metrics to the host, so the device always has the next step queued while
the host logs. The first step of a run is the exception: its metrics are pulled as soon as it has
run, so its `step` event marks when training was productive again after a (re)start. A hook may
raise `Rollback` (restore the last good state and skip a data window) or `StopTraining` (end the
run with an exit code). A step function may replace the state by a newer one instead of stepping
it (elastic mode's heal, `train.step.HEALED`): the step count then jumps to that state's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from resilient_jax.contracts.event_types import EventType
from resilient_jax.data import BatchLoader
from resilient_jax.data.position import DataPosition
from resilient_jax.train.context import RunContext
from resilient_jax.train.hooks import Hook, Rollback, StepInfo, StopTraining
from resilient_jax.train.state import TrainState, init_state
from resilient_jax.train.step import HEALED, StepFn

# Returns the newest good (state, data position) at or before `max_step` (None: any step), or None
# to start again from the seed.
RestoreFn = Callable[[int | None], tuple[TrainState, DataPosition] | None]


@dataclasses.dataclass
class _Pending:
    info: StepInfo
    metrics: dict[str, jax.Array]
    data_wait_s: float


class Loop:
    def __init__(
        self,
        ctx: RunContext,
        step_fn: StepFn,
        loader: BatchLoader,
        hooks: Sequence[Hook],
        restore: RestoreFn,
    ) -> None:
        self.ctx, self.step_fn, self.loader, self.hooks = ctx, step_fn, loader, list(hooks)
        self._restore = restore

    def run(self, state: TrainState) -> tuple[TrainState, StepInfo | None]:
        """Trains from `state` (whose data position the loader already holds) to total_steps."""
        total = self.ctx.config.total_steps
        step = int(jax.device_get(state.step))
        pending: _Pending | None = None  # dispatched, metrics not yet on the host
        last_info: StepInfo | None = None
        first_of_process = True
        for hook in self.hooks:
            hook.on_start(self.ctx, state)
        dispatched = time.perf_counter()
        while True:
            previous: _Pending | None = None
            try:
                if step >= total:
                    if pending is not None:
                        pending, previous = None, pending
                        self._publish(previous)
                    break
                state, current, dispatched = self._dispatch(state, step, dispatched)
                info = current.info
                step = info.step
                # Step s+1 is queued on the device; now pull step s's metrics.
                pending, previous = current, pending
                if previous is not None:
                    self._publish(previous)
                last_info = info
                for hook in self.hooks:
                    hook.after_step(self.ctx, state, info)
                # The first step of a (re)started process is logged when it completes, not when
                # the next is dispatched: its `step` event times the recovery honestly.
                if first_of_process:
                    jax.block_until_ready(pending.metrics)
                    first_of_process = False
                # A hook that waited for step s (a save copies it to the host) leaves its metrics
                # ready: publish them now, not after the next step, so that no checkpoint commits
                # a step whose metrics a crash in between would lose.
                if all(v.is_ready() for v in pending.metrics.values()):
                    pending, previous = None, pending
                    self._publish(previous)
            except Rollback as rollback:
                bad = previous.info if previous is not None else last_info
                state, step = self._roll_back(rollback, bad)
                pending = previous = None
            except StopTraining:
                if pending is not None:  # the last step ran: its metrics still belong in the log
                    with contextlib.suppress(Rollback, StopTraining):
                        self._publish(pending)
                raise
        for hook in self.hooks:
            hook.on_end(self.ctx, state, last_info)
        return state, last_info

    def _dispatch(
        self, state: TrainState, step: int, dispatched: float
    ) -> tuple[TrainState, _Pending, float]:
        """Takes the next batch and dispatches the step after `step` on it. Returns the new state,
        the step (its metrics not yet on the host) and the time of this dispatch; `dispatched` is
        the previous one's, which the step's time is measured from."""
        batch_index, batch = self.loader.next()
        data_wait_s = self.loader.last_wait_s
        state, metrics = self.step_fn(state, batch)
        if HEALED in metrics:
            # The state was replaced by a newer one (elastic mode: a heal from a live slice, any
            # number of steps ahead) and the loader sought to its data: the hooks see the step
            # and the batch that state ends at.
            step = int(jax.device_get(state.step))
            batch_index = self.loader.position.next_batch - 1
        else:
            step += 1
        now = time.perf_counter()
        info = StepInfo(step, batch_index, self.loader.position, now - dispatched)
        return state, _Pending(info, metrics, data_wait_s), now

    def _publish(self, pending: _Pending) -> None:
        # Scalars as floats; a per-expert table (`moe_expert_load`) as nested lists.
        metrics = {
            k: float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()
            for k, v in jax.device_get(pending.metrics).items()
        }
        metrics["data_wait_s"] = pending.data_wait_s
        for hook in self.hooks:
            hook.on_metrics(self.ctx, pending.info.step, metrics)

    def _roll_back(self, rollback: Rollback, bad: StepInfo | None) -> tuple[TrainState, int]:
        """Restore the newest good state and never use the offending batches again."""
        # A save may have run at the bad step itself before its metrics showed the anomaly.
        restored = self._restore(bad.step - 1 if bad is not None else None)
        if restored is None:
            state, position = init_state(self.ctx.config, self.ctx.mesh), DataPosition()
        else:
            state, position = restored
        # Skips the loader already knows outlive the restore: those batches stay unused.
        position = dataclasses.replace(position, skips=self.loader.position.skips)
        if bad is not None:
            position = position.skipping(bad.batch_index, bad.batch_index + rollback.skip_batches)
        self.loader.seek(position)
        step = int(jax.device_get(state.step))
        self.ctx.events.emit(
            EventType.ROLLBACK,
            step=step,
            cause=rollback.reason,
            skips=position.to_json()["skips"],
            from_step=bad and bad.step,
        )
        return state, step
