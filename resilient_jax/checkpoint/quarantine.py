"""Retiring an abandoned timeline after a restore.

Steps newer than the one restored were written by a timeline the run has left (a crash after
them, a rollback past them, copies that failed to verify). Saving the same step numbers again
must not mix the two timelines, so they leave the step lists: persistent ones are renamed into
`quarantine/` (never deleted: they may be all that is left of a diverged run someone wants to
study), local ones are dropped (the RAM disk is too small to keep history).
"""

from __future__ import annotations

import uuid

from resilient_jax.agreement import Agreement
from resilient_jax.checkpoint.local import LocalTier
from resilient_jax.checkpoint.persistent import PersistentTier
from resilient_jax.checkpoint.tier import Tier
from resilient_jax.contracts.event_types import EventType
from resilient_jax.events import EventLog


def retire_after(
    step: int | None,
    persistent: PersistentTier | None,
    local: LocalTier | None,
    sync: Agreement,
    events: EventLog,
) -> str:
    """Quarantines persistent steps newer than `step` and drops newer local copies (with `step`
    None: every local copy; persistent steps stay, since restore refused to pass them by).

    Every process must call it at the same point; returns the new timeline's id, the same on
    every process. With `persistent` None (unreachable since the start) only local copies are
    dropped; the checkpointer quarantines its newer steps once it reaches it again.
    """
    moved = persistent.quarantine_after(step) if persistent and step is not None else []
    # Also the barrier after which every process sees the moves of process 0.
    tokens = sync.all_gather("timeline", uuid.uuid4().hex[:12])
    if persistent is not None:
        persistent.reload()
    if moved:
        events.emit(
            EventType.CHECKPOINT_QUARANTINED,
            tier=Tier.PERSISTENT,
            step=step,
            steps=moved,
            cause=f"newer than the restored step {step}",
        )
    if local is not None:
        local.drop_after(step)
    return tokens[0]
