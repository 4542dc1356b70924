"""The persistent save in flight, seen from the training thread: its commit reported once, its
failure an outage, and whether the next save can start.

A persistent save commits in the background (digests and the Orbax save in the writer thread,
then Orbax's own commit). A save due while the previous one still commits is skipped, not waited
for (the state is one interval older on the persistent tier meanwhile; the local tier has it), and
counted in the next `save` event of the tier (`skipped`): so the effective interval is what the
store's bandwidth allows. Only the final save and a preemption's wait for the save in flight (up
to `checkpoint.persistent_timeout_s`): nothing is left to train meanwhile. A save still running
after `checkpoint.persistent_timeout_s` is an outage (`checkpoint.store_outage`).
"""

from __future__ import annotations

import dataclasses
import time

from resilient_jax.checkpoint.errors import CheckpointError
from resilient_jax.checkpoint.persistent import PendingSave
from resilient_jax.checkpoint.snapshot import PersistentWriter
from resilient_jax.checkpoint.store_outage import PROBE_WAIT_S, Outage, StoreProbe
from resilient_jax.checkpoint.tier import Tier
from resilient_jax.contracts.event_types import EventType
from resilient_jax.events import EventLog


@dataclasses.dataclass(frozen=True)
class Blocked:
    """Why a persistent save cannot start now. `busy`: the previous save still commits (the save
    is skipped); else the store is unreachable or failed (an outage)."""

    cause: str
    busy: bool = False


class PersistentCommits:
    def __init__(
        self, events: EventLog, outage: Outage, probe: StoreProbe, timeout_s: float
    ) -> None:
        self._events, self._outage, self._probe = events, outage, probe
        self._timeout_s = timeout_s
        # None while the persistent tier has been unreachable since the start.
        self.writer: PersistentWriter | None = None
        self.skipped = 0  # saves skipped while the previous one committed, since the last save

    def blocker(self, step: int, wait: bool = False) -> Blocked | None:
        """Why this process cannot start the persistent save of `step` now (None: it can). The
        save in flight is not waited for, unless `wait` (the final save, a preemption's), up to
        `checkpoint.persistent_timeout_s`; the store is probed for at most `PROBE_WAIT_S`, also
        while a save is in flight (a store gone away is an outage at once)."""
        probe_s = min(PROBE_WAIT_S, self._timeout_s)
        if self.writer is None:
            cause = self._probe.unreachable(probe_s)
            return Blocked(cause) if cause else None
        pending = self.writer.pending
        if pending is not None:
            try:
                self.report(self.writer.finish(self._timeout_s if wait else 0.0))
            except CheckpointError as e:
                if self.writer.save_in_progress():
                    age = time.monotonic() - pending.started
                    cause = f"the save of step {pending.step} is still in flight after {age:.1f}s"
                    if wait or self._outage.since is not None:
                        return Blocked(cause)
                    # Busy, unless the store has gone away meanwhile: that is an outage now,
                    # not once the save in flight times out.
                    unreachable = self._probe.unreachable(probe_s)
                    return Blocked(unreachable) if unreachable else Blocked(cause, busy=True)
                self.report_failure(e, pending.step)
                self._outage.begin(step, str(e))  # a new save may still work: probe
        cause = self._probe.unreachable(probe_s)
        return Blocked(cause) if cause else None

    def poll(self) -> None:
        """Reports a save that finished since the last step, without waiting. A failed one, or
        one running past `checkpoint.persistent_timeout_s`, is an outage: the run goes on with
        the local tier and tries the next save on schedule."""
        pending = self.writer.pending if self.writer is not None else None
        if pending is None:
            return
        assert self.writer is not None
        if self.writer.save_in_progress():
            age = time.monotonic() - pending.started
            if age > self._timeout_s:
                self._outage.begin(
                    pending.step,
                    f"the save of step {pending.step} is not committed after "
                    f"{age:.0f}s (checkpoint.persistent_timeout_s={self._timeout_s:g})",
                )
            return
        try:
            self.report(self.writer.poll())
        except CheckpointError as e:
            self.report_failure(e, pending.step)
            self._outage.begin(pending.step, str(e))

    def finish(self) -> CheckpointError | None:
        """Waits (bounded: a store that stopped answering keeps Orbax waiting for many minutes)
        for the save in flight; its error, reported, if it failed."""
        if self.writer is None:
            return None
        pending = self.writer.pending
        try:
            done = self.writer.finish(self._timeout_s)
        except CheckpointError as e:
            self.report_failure(e, pending.step if pending else None)
            self._outage.begin(pending.step if pending else None, str(e))
            return e
        self.report(done)
        return None

    def final_failed(self, step: int) -> bool:
        """Waits (up to `checkpoint.persistent_timeout_s`) for the save of the final `step`;
        whether it failed (reported as a failure and an outage)."""
        pending = self.writer.pending if self.writer is not None else None
        if pending is None or pending.step != step:
            return False
        assert self.writer is not None
        try:
            self.report(self.writer.finish(self._timeout_s))
        except CheckpointError as e:
            if not self.writer.save_in_progress():  # still running: waited for at the end
                self.report_failure(e, step)
                self._outage.begin(step, str(e))
                return True
        return False

    def report(self, pending: PendingSave | None) -> None:
        if pending is not None:
            self._outage.end(pending.step)
            self._events.emit(
                EventType.SAVE_COMMITTED,
                tier=Tier.PERSISTENT,
                step=pending.step,
                commit_s=time.monotonic() - pending.started,
            )

    def report_failure(self, error: Exception, step: int | None) -> None:
        self._events.emit(EventType.SAVE_FAILED, tier=Tier.PERSISTENT, step=step, cause=str(error))
