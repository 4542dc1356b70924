"""What a save costs the training thread: one copy of the state, then everything in the background.

`saved_state` is what a save reads, by the run's save method (`save_method`): the state itself
when the loop's next step keeps it (runs without donating it, `train.keep`, elastic mode's update
too: no copy at all), else `device_snapshot`, a copy of the state into fresh buffers with the same
shardings (the loop's next step donates the state's buffers, so an unkept state must be copied
before that step runs; dispatching the copy returns before it is done); or, where device memory
has no room for a second state, `host_snapshot`: the state copied straight into pinned host
memory, same shardings, waited for. Every later stage reads that, not the live state.
One snapshot feeds both tiers when they save the same step: the local tier's writer thread and the
persistent tier's writer thread each read it from there.

`PersistentWriter` runs the persistent tier's save off the training thread: it computes this
process's share of the per-array digests on the host, adds up the shares of all processes through
the coordination service's key-value store (no device collective, so nothing on the training
thread has to take part), builds the manifest and starts the Orbax save of the snapshot, whose
main-thread part (directory creation, the copy to host, the coordination service's barriers) then
no longer blocks training either. Orbax's own background commit follows. One save is in flight at
a time, on every process in the same order. The writer answers like `PersistentTier` (`pending`,
`save_in_progress`, `poll`, `finish` with a bounded wait), so the outage handling treats a save
stuck in the writer thread (a store that stopped answering) like one stuck in Orbax's commit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from resilient_jax.agreement import Agreement
from resilient_jax.checkpoint import checksum
from resilient_jax.checkpoint.background import BackgroundThread, Job
from resilient_jax.checkpoint.errors import CheckpointError
from resilient_jax.checkpoint.persistent import PendingSave, PersistentTier
from resilient_jax.train.keep import StateKeeper
from resilient_jax.train.shard_list import list_shards

_STOP_WAIT_S = 10.0  # an idle writer thread ends within milliseconds

# A fresh buffer for every leaf (the input is not donated, so XLA must copy; `jnp.copy` is not
# forwarded like an identity would be), with the same shardings.
device_snapshot = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def host_memory_kind() -> str:
    """The host memory the devices can copy into directly (pinned where the backend has it)."""
    kinds = {m.kind for m in jax.local_devices()[0].addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else "unpinned_host"


def host_snapshot(state: Any) -> Any:
    """A copy of `state` in host memory with the same shardings, complete on return: every
    array's shards are transferred device-to-host at once, into host buffers only (no second
    device copy), and waited for, since the loop's next step donates the state's buffers."""
    kind = host_memory_kind()
    copy = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), state)
    return jax.block_until_ready(copy)


def saved_state(state: Any, keeper: StateKeeper, keep: bool = True) -> Any:
    """`state` for a save to read in the background. With `keep` (the save method keeps the
    state on the device): itself if the loop's next step keeps it (`keeper.keep`), else a
    `device_snapshot` of it. Without: a `host_snapshot`."""
    if not keep:
        return host_snapshot(state)
    return state if keeper.keep(state) else device_snapshot(state)


@dataclasses.dataclass
class _Save:
    pending: PendingSave
    written: Job  # the writer thread's call
    error: BaseException | None = None


class PersistentWriter:
    """Starts persistent saves in a thread; reports them like `PersistentTier` does."""

    def __init__(self, tier: PersistentTier, sync: Agreement) -> None:
        self.tier = tier
        self._sync = sync  # used by the writer thread only
        self._thread = BackgroundThread("persistent-ckpt")
        self._current: _Save | None = None

    @property
    def pending(self) -> PendingSave | None:
        """The save started last and not yet reported by `poll` or `finish`."""
        return self._current.pending if self._current is not None else None

    def start(
        self,
        step: int,
        snapshot: Any,
        data_position: dict[str, Any],
        meta_of: Callable[[dict[str, str]], dict[str, Any]],
        temporary: bool,
        started: float,
    ) -> PendingSave:
        """Saves `snapshot` as `step` in the background; `meta_of` turns the snapshot's digests
        into the step's manifest. `started`: `time.monotonic()` when the caller's save began
        (commit times and the outage timeout count from there). The previous save must have been
        finished, and the step must not be on the tier yet."""
        assert self._current is None, "finish() the previous persistent save first"

        def save() -> None:
            try:
                sums = checksum.process_partial_sums(list_shards(snapshot))
                shares = self._sync.all_gather("digests", sums)
                meta = meta_of(checksum.combine_sums(shares))
                self.tier.save(step, snapshot, data_position, meta, temporary)
            except BaseException as e:  # raised by finish() on the training thread
                record.error = e

        pending = PendingSave(step, started, time.monotonic() - started)
        record = _Save(pending, self._thread.submit(save))
        self._current = record
        return pending

    def stop(self) -> None:
        """Ends the writer thread: at once if idle; after the save in flight otherwise, without
        waiting for it (a store that stopped answering may hold it for many minutes)."""
        self._thread.stop(wait_s=0.0 if self.save_in_progress() else _STOP_WAIT_S)

    def save_in_progress(self) -> bool:
        """Whether the pending save is still being started or written."""
        current = self._current
        if current is None:
            return False
        return not current.written.done() or self.tier.save_in_progress()

    def poll(self) -> PendingSave | None:
        """The pending save if it has finished since the last call (without waiting); raises
        `CheckpointError` if it failed."""
        if self._current is None or self.save_in_progress():
            return None
        return self.finish()

    def finish(self, timeout_s: float | None = None) -> PendingSave | None:
        """Waits for the pending save; returns it once committed, raises `CheckpointError` if it
        failed (the previous tier-level error too, with no save pending).

        With `timeout_s`, a save still running after it (in the writer thread or in Orbax's
        commit) raises and stays pending."""
        current = self._current
        if current is None:
            return self.tier.finish(timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not current.written.wait(left):
            raise CheckpointError(
                f"persistent save of step {current.pending.step} to {self.tier.directory} was not "
                f"handed to Orbax within {timeout_s:g}s"
            )
        if current.error is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self.tier.finish(left)
            finally:
                # The tier keeps a save still committing past the wait pending; anything else
                # (committed or failed) is reported once, here.
                if self.tier.pending is None:
                    self._current = None
            return current.pending
        self._current = None
        if isinstance(current.error, CheckpointError):
            raise current.error
        raise CheckpointError(
            f"persistent save of step {current.pending.step} failed before it started: "
            f"{type(current.error).__name__}: {current.error}"
        ) from current.error
