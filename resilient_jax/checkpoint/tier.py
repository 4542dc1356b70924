"""Where a checkpoint lives, or a restore came from, as events and manifests name it."""

from __future__ import annotations

from resilient_jax.contracts.names import Name


class Tier(Name):
    """A `str`: compares equal to the name read back from `events.jsonl` and serialises as it."""

    LOCAL = "local"  # each process's own shards on a RAM disk, saved often
    PERSISTENT = "persistent"  # the Orbax directory every process shares, saved less often
    # Not a tier of this run: the persistent directory of another run, named by
    # `checkpoint.init_from`, whose parameters start a fresh run.
    INIT_FROM = "init_from"
