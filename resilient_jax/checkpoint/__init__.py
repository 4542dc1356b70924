"""Checkpoint engine: local RAM-disk and persistent Orbax tiers, save policies, verified restore.

The train loop enters `Checkpointer(ctx)` (which opens the tiers), calls `restore_latest(ctx)`
before the first step, and adds the checkpointer to its hooks; see `checkpointer` for the save
order and `restore` for the resume order.
"""

from resilient_jax.checkpoint.checkpointer import Checkpointer
from resilient_jax.checkpoint.errors import CheckpointError
from resilient_jax.checkpoint.persistent import persistent_dir
from resilient_jax.checkpoint.restore import Restored
from resilient_jax.checkpoint.save_policy import Decision, SavePolicy, SaveReason
from resilient_jax.checkpoint.tier import Tier

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "Decision",
    "Restored",
    "SavePolicy",
    "SaveReason",
    "Tier",
    "persistent_dir",
]
