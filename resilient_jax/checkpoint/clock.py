"""Wall-clock save decisions that every process takes at the same step.

A time-based persistent save is collective, but the processes' clocks and step times differ: only
process 0 consults the policy's clock, and publishes its answer for `step + _CLOCK_LAG` through the
key-value store, so peers read the decision for their current step without waiting on it in the
common case. Decisions are keyed by the restore epoch: a restored timeline never reads a decision
published by the one it abandoned.
"""

from __future__ import annotations

from resilient_jax.agreement import Agreement
from resilient_jax.checkpoint.save_policy import SavePolicy, SaveReason

# Process 0 decides wall-clock saves this many steps ahead.
_CLOCK_LAG = 2
# Published decisions older than this many steps are deleted from the key-value store.
_CLOCK_KEY_RETENTION = 1000


class ClockDecisions:
    def __init__(self, policy: SavePolicy, sync: Agreement) -> None:
        self._policy = policy
        self._sync = sync
        self._epoch = 0  # restores so far
        self._start_step = 0
        self._pending_until = -1  # process 0: a save decided for a step not reached yet

    def restart(self, start_step: int, new_timeline: bool) -> None:
        """Decisions from `start_step` on; `new_timeline` after a restore."""
        self._start_step = start_step
        if new_timeline:
            self._epoch += 1
            self._pending_until = -1

    def reason(self, step: int) -> SaveReason | None:
        """The wall-clock save reason for `step`, identical on every process."""
        if not self._policy.uses_clock:
            return None
        if not self._sync.distributed:
            return self._policy.clock_reason()
        prefix = f"e{self._epoch}/clock"
        if self._sync.process_index == 0:
            ahead = step + _CLOCK_LAG
            reason = None
            if step >= self._pending_until:
                reason = self._policy.clock_reason()
                if reason is not None:
                    self._pending_until = ahead
            self._sync.publish(f"{prefix}/{ahead}", reason)
            if step - _CLOCK_KEY_RETENTION > self._start_step:
                self._sync.delete(f"{prefix}/{step - _CLOCK_KEY_RETENTION}")
        if step < self._start_step + 1 + _CLOCK_LAG:
            return None  # nobody decided for the first steps after a (re)start
        decided = self._sync.fetch(f"{prefix}/{step}")  # JSON: the reason's plain name
        return None if decided is None else SaveReason(decided)
