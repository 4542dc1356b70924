"""Checkpoint engine: local RAM-disk and persistent Orbax tiers, save policies, verified restore.

The train loop constructs `Checkpointer(ctx)`, calls `restore_latest(ctx)` before the first step,
and adds the checkpointer to its hooks; see `checkpointer` for the resume and save order.
"""

from resilient_jax.checkpoint.checkpointer import (
    INIT_FROM,
    LOCAL,
    PERSISTENT,
    Checkpointer,
    Restored,
    persistent_dir,
)
from resilient_jax.checkpoint.errors import CheckpointError
from resilient_jax.checkpoint.policy import Decision, SavePolicy, young_daly_interval_s

__all__ = [
    "INIT_FROM",
    "LOCAL",
    "PERSISTENT",
    "CheckpointError",
    "Checkpointer",
    "Decision",
    "Restored",
    "SavePolicy",
    "persistent_dir",
    "young_daly_interval_s",
]
