"""What the train loop calls out to. Checkpointing, health, events, chaos and the coordinator
client all plug in here, so the loop itself has no mode branches.

The loop calls, in order: `on_start` once state exists (fresh or restored); for every step,
`after_step` with the new state as device arrays still in flight (do not pull them to the host
unless you must: pulling waits for the step); `on_metrics` one step later, when that step's metrics
have reached the host; and `on_end` after the last step. A hook stops the run by raising
`StopTraining` (clean stop, exit code given), asks for `Rollback`, or raises any other exception (a
failure). What a step computes is not a hook's business: a fault injector wraps the step function
instead.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.data.position import DataPosition

if TYPE_CHECKING:
    from resilient_jax.train.context import RunContext
    from resilient_jax.train.state import TrainState


class StopTraining(Exception):
    """Raised by a hook to end the run: exit code 0 for done, other codes for a deliberate stop."""

    def __init__(self, reason: str, exit_code: int = ExitCode.FINISHED) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code


@dataclasses.dataclass
class StepInfo:
    step: int  # optimizer steps completed, counting this one
    batch_index: int  # which global batch this step consumed
    data_position: DataPosition  # independent of the process count; restores the loader
    step_time_s: float  # host wall time since the previous step was dispatched


class Hook:
    """Base class with no-op methods; override what you need."""

    def on_start(self, ctx: RunContext, state: TrainState) -> None:
        pass

    def after_step(self, ctx: RunContext, state: TrainState, info: StepInfo) -> None:
        pass

    def on_metrics(self, ctx: RunContext, step: int, metrics: dict[str, float]) -> None:
        pass

    def on_end(self, ctx: RunContext, state: TrainState, info: StepInfo | None) -> None:
        pass

    def close(self) -> None:
        pass


class Rollback(Exception):
    """Raised by a hook to restore the last good checkpoint and skip the data window after it."""

    def __init__(self, reason: str, skip_batches: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.skip_batches = skip_batches
