"""When the local tier writes: never while its previous write still runs, at an interval agreed by
every process.

A local save blocks training only for its snapshot; the files are written by the tier's thread.
A save due while that thread still writes the previous one would have to wait for it (every step,
once a write takes longer than a step), so it is skipped instead: the effective interval becomes
what the write bandwidth allows, and the state is never more than one write behind. The skip is
agreed: a step's copy is restorable only when every process wrote its shards, so each process
says whether its writer is busy (one small all-gather through the coordination service, only with
several processes) and all skip if any is. Skips are counted in the next `save` event of the tier
(`skipped`), which the goodput report adds up.

On top of that the Young/Daly interval (`checkpoint.local_auto_interval`) spaces saves by the
measured cost of a write, the step time and the mean time between failures, never more than
`checkpoint.local_every_steps` apart.
"""

from __future__ import annotations

import os

import ml_collections

from resilient_jax.agreement import Agreement
from resilient_jax.checkpoint.local import LocalTier
from resilient_jax.checkpoint.save_policy import SavePolicy, local_interval_steps
from resilient_jax.checkpoint.tier import Tier
from resilient_jax.contracts import env_vars
from resilient_jax.contracts.event_types import EventType
from resilient_jax.events import EventLog

_STEP_TIMES_KEPT = 64  # step times behind the Young/Daly interval (only the first ones are used)
_SAVES_BEFORE_INTERVAL = 3  # the interval is agreed at this save (see `saved`)


class LocalCadence:
    def __init__(
        self,
        local: LocalTier,
        policy: SavePolicy,
        sync: Agreement,
        events: EventLog,
        checkpoint: ml_collections.ConfigDict,
    ) -> None:
        self._local, self._policy, self._sync, self._events = local, policy, sync, events
        self._auto = bool(checkpoint.local_auto_interval)
        self._every_at_most = int(checkpoint.local_every_steps)
        self._mtbf_s = float(checkpoint.mtbf_s)
        self._saves = 0
        self._skipped = 0  # since the last save
        self._last_commit_s: float | None = None
        self._step_times: list[float] = []

    def record_step(self, step_time_s: float) -> None:
        if self._auto and len(self._step_times) < _STEP_TIMES_KEPT:
            self._step_times.append(step_time_s)

    def record_commit(self, commit_s: float) -> None:
        """A write finished (called from the tier's thread)."""
        self._last_commit_s = commit_s

    def writer_free(self) -> bool:
        """Whether a save due now may start: every process's writer is idle. Every process must
        call it at the same steps (those the policy picks, the same everywhere)."""
        busy = self._local.writing()
        views = self._sync.all_gather("local_busy", busy) if self._sync.distributed else [busy]
        if all(v is None for v in views):
            return True
        self._skipped += 1
        return False

    def saved(self, step: int) -> int:
        """A save of `step` started: returns the saves skipped since the previous one (for its
        `save` event), and agrees the Young/Daly interval at the third save."""
        skipped, self._skipped = self._skipped, 0
        self._saves += 1
        if self._auto and self._saves == _SAVES_BEFORE_INTERVAL:
            self._agree_interval(step)
        return skipped

    def _agree_interval(self, step: int) -> None:
        """Sets the interval, the same on every process, from the cost of a write and the step
        time, the worst over processes, and the mean time between failures the supervisor
        observed (`checkpoint.mtbf_s` before the first).

        The cost is the second save's time to commit (the first one warms up), known by the
        third, which started only once every writer was idle: the blocking part plus the
        background write, which competes for the host."""
        times = sorted(self._step_times[1:]) or [0.0]  # the first step includes warm-up
        mine = [self._last_commit_s or 0.0, times[len(times) // 2]]
        views = self._sync.all_gather("local_interval", mine)
        cost_s, step_time_s = max(v[0] for v in views), max(v[1] for v in views)
        observed = os.environ.get(env_vars.OBSERVED_MTBF_S)
        mtbf_s = float(observed) if observed else self._mtbf_s
        every = local_interval_steps(cost_s, mtbf_s, step_time_s, self._every_at_most)
        self._policy.set_local_interval(every, step)
        self._events.emit(
            EventType.CHECKPOINT_INTERVAL,
            tier=Tier.LOCAL,
            step=step,
            every_steps=every,
            save_cost_s=round(cost_s, 4),
            step_time_s=round(step_time_s, 4),
            mtbf_s=mtbf_s,
            mtbf_source="observed" if observed else "checkpoint.mtbf_s",
        )
