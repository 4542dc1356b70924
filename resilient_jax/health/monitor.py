"""Host-side escalation for anomalous steps: skip, then roll back, then stop.

The step already refused the anomalous update (see `in_band`); this hook reads the flags one step
late from the metrics and decides what happens next, from `config.health`:

1. every skipped step is an `anomaly` event (cause `nonfinite`, `loss_spike` or `grad_spike`);
2. `max_skips` skipped steps in a row raise `Rollback`: the loop restores the last good checkpoint
   and skips `rollback_skip_batches` batches, on the theory that the data window was bad;
3. when `max_rollbacks` rollbacks have not helped, the next escalation raises
   `StopTraining(exit_code=ExitCode.HEALTH_GAVE_UP)` (`max_rollbacks=0`: stop at the first
   escalation).

With `health.enabled` off nothing is skipped, so a non-finite loss has already reached the
parameters: the run stops at once rather than train on garbage.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.train.hooks import Hook, Rollback, StopTraining

if TYPE_CHECKING:
    from resilient_jax.train.context import RunContext
    from resilient_jax.train.state import TrainState

_REPORTED = ("loss", "grad_norm", "loss_z", "grad_z", "lr_scale")


def anomaly_cause(metrics: dict[str, float]) -> str:
    """The most severe reason a step was flagged, in the order nonfinite > loss > grad."""
    for cause in ("nonfinite", "loss_spike", "grad_spike"):
        if metrics.get(cause, 0.0) > 0.5:
            return cause
    return "unknown"


def _json_number(value: float) -> float | str:
    # NaN and Inf are not JSON; keep them readable as strings.
    return value if math.isfinite(value) else str(value)


class HealthMonitor(Hook):
    def __init__(self) -> None:
        self.consecutive = 0
        self.rollbacks = 0

    def on_start(self, ctx: RunContext, state: TrainState) -> None:
        # A (re)start or a rollback restored state from before the anomalies.
        self.consecutive = 0

    def on_metrics(self, ctx: RunContext, step: int, metrics: dict[str, float]) -> None:
        cfg = ctx.config.health
        if not cfg.enabled:
            if metrics.get("nonfinite", 0.0) > 0.5:
                self._stop(ctx, step, "non-finite loss or gradient with health.enabled=False")
            return
        if metrics.get("skipped", 0.0) < 0.5:
            self.consecutive = 0
            return
        self.consecutive += 1
        cause = anomaly_cause(metrics)
        escalate = self.consecutive >= cfg.max_skips
        if not escalate:
            action = "skip"
        elif self.rollbacks < cfg.max_rollbacks:
            action = "rollback"
        else:
            action = "stop"
        ctx.events.emit(
            EventType.ANOMALY,
            step=step,
            cause=cause,
            action=action,
            consecutive=self.consecutive,
            rollbacks=self.rollbacks,
            **{k: _json_number(float(metrics[k])) for k in _REPORTED if k in metrics},
        )
        if action == "rollback":
            self.rollbacks += 1
            self.consecutive = 0
            raise Rollback(
                f"{cfg.max_skips} anomalous steps in a row up to step {step} ({cause}); "
                f"rollback {self.rollbacks} of {cfg.max_rollbacks}",
                skip_batches=cfg.rollback_skip_batches,
            )
        if action == "stop":
            self._stop(
                ctx,
                step,
                f"{self.consecutive} anomalous steps in a row ({cause}) after "
                f"{self.rollbacks} rollbacks",
            )

    def _stop(self, ctx: RunContext, step: int, why: str) -> None:
        raise StopTraining(f"health: step {step}: {why}", exit_code=ExitCode.HEALTH_GAVE_UP)
