"""When to save: the checkpointer's policies, as pure functions of the step and an injected clock.

Step-based rules (every N steps per tier, the final step) give the same answer on every process,
so they need no agreement. Wall-clock rules (every T minutes, the Young/Daly interval) read this
process's clock; the checkpointer makes process 0 decide them and share the decision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import ml_collections

from resilient_jax.contracts.names import Name
from resilient_jax.goodput.model import young_daly_interval_s


class SaveReason(Name):
    """Why a step is saved: the rule that asked for it (the `reason` of `save` events and metas).

    A `str`, so it compares equal to the name read back from a file and serialises as it.
    """

    EVERY_STEPS = "every_steps"  # checkpoint.every_steps
    EVERY_MINUTES = "every_minutes"  # checkpoint.every_minutes (a temporary save)
    AUTO = "auto_interval"  # the Young/Daly interval from the measured save cost
    FINAL = "final"  # the last step of the run
    LOCAL = "local_every_steps"  # the local tier's interval (no persistent save)
    PREEMPTION = "preemption"  # an agreed SIGTERM: save, then stop


# Weight of the newest measurement in the running estimate of the blocking save cost.
_COST_EMA = 0.3


def local_interval_steps(
    save_cost_s: float, mtbf_s: float, step_time_s: float, at_most: int
) -> int:
    """The Young/Daly local-tier interval in steps, between 1 and `at_most`."""
    steps = young_daly_interval_s(save_cost_s, mtbf_s) / max(step_time_s, 1e-9)
    return int(min(max(round(steps), 1), at_most))


@dataclasses.dataclass(frozen=True)
class Decision:
    local: bool = False
    persistent: bool = False
    temporary: bool = False  # a persistent save deleted once a newer step is committed
    reason: SaveReason | None = None  # why the persistent save (or, without one, the local save)

    def __bool__(self) -> bool:
        return self.local or self.persistent


class SavePolicy:
    """Decides, for each completed step, which tiers save it."""

    def __init__(
        self,
        checkpoint: ml_collections.ConfigDict,
        total_steps: int,
        clock: Callable[[], float],
        local_enabled: bool = True,
    ) -> None:
        self._c = checkpoint
        self._total_steps = total_steps
        self._clock = clock
        self._local_enabled = local_enabled and checkpoint.local_every_steps > 0
        self._last_persistent = clock()
        self._cost_s: float | None = None
        # Local saves every `local_every_steps`, or from `_local_from` on every `_local_every`.
        self._local_every = checkpoint.local_every_steps
        self._local_from = 0

    @property
    def uses_clock(self) -> bool:
        """Whether decisions depend on wall-clock time (and so need agreement across processes)."""
        return self._c.every_minutes > 0 or self._c.auto_interval

    def set_local_interval(self, every: int, from_step: int) -> None:
        """Local saves from `from_step` on every `every` steps (the same on every process)."""
        self._local_every, self._local_from = max(1, every), from_step

    def restart_clock(self) -> None:
        """Count wall-clock intervals from now (run start, restore)."""
        self._last_persistent = self._clock()

    def record_persistent_save(self, blocking_s: float) -> None:
        self._last_persistent = self._clock()
        if self._cost_s is None:
            self._cost_s = blocking_s
        else:
            self._cost_s += _COST_EMA * (blocking_s - self._cost_s)

    @property
    def save_cost_s(self) -> float | None:
        return self._cost_s

    def auto_interval_s(self) -> float | None:
        """The Young/Daly interval from the measured save cost; None before the first save."""
        if self._cost_s is None:
            return None
        return young_daly_interval_s(self._cost_s, self._c.mtbf_s)

    def clock_reason(self) -> SaveReason | None:
        """The wall-clock rule that asks for a persistent save now, if any."""
        elapsed = self._clock() - self._last_persistent
        if self._c.auto_interval:
            interval = self.auto_interval_s()
            # Before the first save the cost is unknown: save once to measure it.
            if interval is None or elapsed >= interval:
                return SaveReason.AUTO
        if self._c.every_minutes > 0 and elapsed >= self._c.every_minutes * 60.0:
            return SaveReason.EVERY_MINUTES
        return None

    def decide(self, step: int, clock_reason: SaveReason | None) -> Decision:
        """Combines the step rules for `step` with an (agreed) wall-clock reason."""
        local = self._local_enabled and (
            (step - self._local_from) % self._local_every == 0
            if step >= self._local_from
            else step % self._c.local_every_steps == 0
        )
        every = self._c.every_steps
        periodic = not self._c.auto_interval and every > 0 and step % every == 0
        if step >= self._total_steps:
            return Decision(local=local, persistent=True, reason=SaveReason.FINAL)
        if periodic:
            return Decision(local=local, persistent=True, reason=SaveReason.EVERY_STEPS)
        if clock_reason is not None:
            temporary = clock_reason == SaveReason.EVERY_MINUTES
            return Decision(local=local, persistent=True, temporary=temporary, reason=clock_reason)
        return Decision(local=local, reason=SaveReason.LOCAL if local else None)
