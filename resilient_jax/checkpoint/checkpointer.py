"""The checkpointer: a train-loop hook that decides when to save, saves to two tiers, and restores
(waiting for its own saves first; the resume order is in `restore`).

Save order per step (`after_step`): preemption sync point -> wall-clock decision (made by process
0, shared two steps ahead) -> policy -> one snapshot (the state the next step keeps, else a copy)
-> local save -> persistent save. A save blocks training only for that: one due while its tier's
previous write still runs is skipped on every process (`local_cadence`, `persistent_commits`);
both tiers write from the snapshot in background threads (`snapshot`), and each commit is
reported by `save_committed`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax

from resilient_jax import config as config_lib
from resilient_jax.checkpoint import manifest
from resilient_jax.checkpoint.clock import ClockDecisions
from resilient_jax.checkpoint.errors import CheckpointError
from resilient_jax.checkpoint.local import LocalTier, run_dir
from resilient_jax.checkpoint.local_cadence import LocalCadence
from resilient_jax.checkpoint.peer_fetch import peer_fetcher
from resilient_jax.checkpoint.persistent import PersistentTier, persistent_dir
from resilient_jax.checkpoint.persistent_commits import PersistentCommits
from resilient_jax.checkpoint.preemption import PreemptionNotice
from resilient_jax.checkpoint.restore import Restored, Restorer, check_persistent_dir
from resilient_jax.checkpoint.save_method import SaveMethod, choose
from resilient_jax.checkpoint.save_policy import Decision, SavePolicy, SaveReason
from resilient_jax.checkpoint.snapshot import PersistentWriter, saved_state
from resilient_jax.checkpoint.store_outage import (
    Outage,
    StoreProbe,
    cache_run_id,
    read_cached_run_id,
)
from resilient_jax.checkpoint.sync import process_sync
from resilient_jax.checkpoint.tier import Tier
from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.contracts.generation_file import Fenced
from resilient_jax.train.context import RunContext
from resilient_jax.train.hooks import Hook, StepInfo, StopTraining
from resilient_jax.train.state import TrainState

_instance_counter = itertools.count()


def _same_dir(a: str, b: str) -> bool:
    if not a or not b:
        return False
    if a.startswith("gs://") or b.startswith("gs://"):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


class Checkpointer(Hook):
    """Saves to the local and persistent tiers by policy; restores the newest valid step.

    Construct one per generation (after `jax.distributed` is up and the mesh is planned), `open()`
    it (or enter it: `with Checkpointer(ctx) as checkpointer:`) and `close()` it before
    re-initialising JAX. Constructing touches nothing; `open` raises `CheckpointError` if the
    persistent directory belongs to another model or config.
    """

    def __init__(
        self,
        ctx: RunContext,
        clock: Callable[[], float] = time.monotonic,
        handle_sigterm: bool = True,
    ) -> None:
        self._ctx, self._clock_fn = ctx, clock
        self._events = ctx.events
        self._fingerprint = config_lib.fingerprint(ctx.config)
        self.persistent_dir = persistent_dir(ctx.config, ctx.workdir)
        c = ctx.config.checkpoint
        self._outage = Outage(self._events, self.persistent_dir)
        self._probe = StoreProbe(self.persistent_dir)
        self._commits = PersistentCommits(
            self._events, self._outage, self._probe, c.persistent_timeout_s
        )
        self._preemption = PreemptionNotice(handle_sigterm)
        # Opened by `open` (a failed open closes what it opened). Both tiers stay None while
        # unusable: the local one when off; the persistent one while unreachable since the start
        # (restore then uses the local tier, and the first scheduled save that reaches the store
        # opens it).
        self._local: LocalTier | None = None
        self._persistent: PersistentTier | None = None
        self._deferred_error: CheckpointError | None = None
        self._last_local_step: int | None = None
        self._last_persistent_step: int | None = None  # saved by this checkpointer (maybe pending)
        self._start_step = 0
        self._timeline = uuid.uuid4().hex[:12]
        # The state's leaf shapes and dtypes, the same at every save of this generation.
        self._specs: dict[str, dict[str, Any]] | None = None
        self._outage_limit_s = c.persistent_outage_limit_s
        self._opened = self._ready = self._closed = False

    def open(self) -> Checkpointer:
        """Probes the persistent tier (every process agrees whether it answers), opens both tiers,
        agrees on the run id and installs the SIGTERM handler. Returns self; on a failure closes
        what it opened and raises (`CheckpointError`: another model's directory, or no tier to
        resume from)."""
        if not self._opened:
            self._opened = True
            try:
                self._open(self._ctx)
            except BaseException:
                self.close()
                raise
        return self

    def __enter__(self) -> Checkpointer:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open(self, ctx: RunContext) -> None:
        c = ctx.config.checkpoint
        self._sync = process_sync(
            f"resilient_jax/checkpoint/g{ctx.generation}/i{next(_instance_counter)}",
            c.sync_timeout_s,
        )
        self._accept_other_config = _same_dir(c.init_from, self.persistent_dir)
        self._writer_sync = process_sync(f"{self._sync.namespace}/writer", c.sync_timeout_s)
        self._run_id = self._open_store(ctx)
        if c.local_dir and c.local_every_steps > 0:
            self._local = LocalTier(
                run_dir(c.local_dir, ctx.workdir),
                jax.process_index(),
                c.local_keep,
                on_commit=self._on_local_commit,
                fence=ctx.events.fence,
            )
        self._policy = SavePolicy(
            c, ctx.config.total_steps, self._clock_fn, self._local is not None
        )
        self._cadence = (
            LocalCadence(self._local, self._policy, self._sync, self._events, c)
            if self._local is not None
            else None
        )
        self._clock = ClockDecisions(self._policy, self._sync)
        method = choose(ctx.config, ctx.plan)
        self._keep_state = method.method == SaveMethod.KEEP
        self._events.emit(EventType.SAVE_METHOD, **dataclasses.asdict(method))
        self._preemption.install()
        self._restorer = Restorer(
            persistent=self._persistent,
            persistent_dir=self.persistent_dir,
            local=self._local,
            sync=self._sync,
            events=self._events,
            fingerprint=self._fingerprint,
            run_id=self._run_id or "",
            accept_other_config=self._accept_other_config,
            on_new_timeline=self._start_timeline,
            peers=peer_fetcher(c, self._local, self._events, os.environ),
        )
        self._ready = True

    def _open_store(self, ctx: RunContext) -> str | None:
        """Opens the persistent tier if every process reaches it, and returns the run id every
        process agrees on (process 0's: the store's, else the one cached in the workdir)."""
        c = ctx.config.checkpoint
        unreachable = self._agreed_cause(self._probe.unreachable(c.persistent_timeout_s))
        if unreachable is None:
            self._persistent = self._open_persistent(ctx)
            self._commits.writer = PersistentWriter(self._persistent, self._writer_sync)
            run_id = self._persistent.run_id(create=True) if self._sync.process_index == 0 else None
        else:
            self._outage.begin(None, unreachable)
            run_id = read_cached_run_id(ctx.workdir) if self._sync.process_index == 0 else None
        agreed: str | None = self._sync.all_gather("run_id", run_id)[0]
        if unreachable is None and self._sync.process_index == 0:
            cache_run_id(ctx.workdir, agreed)
        elif unreachable is not None and (agreed is None or not c.local_dir):
            raise CheckpointError(
                f"persistent tier {self.persistent_dir} unreachable at start ({unreachable}) and "
                "no local tier of this run to resume from: not starting over what it may hold"
            )
        return agreed

    # ------------------------------------------------------------------------------ hook methods

    def on_start(self, ctx: RunContext, state: TrainState) -> None:
        self._start_step = int(jax.device_get(state.step))
        self._clock.restart(self._start_step, new_timeline=False)
        self._policy.restart_clock()

    def after_step(self, ctx: RunContext, state: TrainState, info: StepInfo) -> None:
        step = info.step
        if self._cadence is not None:
            self._cadence.record_step(info.step_time_s)
        self._commits.poll()
        if self._preemption.reached(step):
            self._stop_for_preemption(ctx, state, info)
        decision = self._policy.decide(step, self._clock.reason(step))
        self._save(ctx, state, info, decision)

    def on_end(self, ctx: RunContext, state: TrainState, info: StepInfo | None) -> None:
        """Saves the final step if no save has it yet and waits until it is committed.

        Raises `CheckpointError` if any save failed, so the run does not exit 0. A run that
        reached `total_steps` then deletes its local-tier copies (`LocalTier.release`).
        """
        final = Decision(persistent=True, reason=SaveReason.FINAL)
        if info is not None and info.step != self._last_persistent_step:
            self._save(ctx, state, info, final)
        refused = info is not None and self._commits.final_failed(info.step)
        if any(self._sync.all_gather("final_refused", refused)):
            self._last_persistent_step = None
            self._save(ctx, state, info, final)  # once more: a store's refusal may be passing
        self.wait_until_finished()
        if info is not None and info.step != self._last_persistent_step:
            raise CheckpointError(
                f"final step {info.step} is not on the persistent tier {self.persistent_dir} "
                "(unreachable; the local tier holds it): restart to save it"
            )
        if self._local is not None and info is not None and info.step >= ctx.config.total_steps:
            # Finished and committed: the RAM-disk copies can only cost memory from here on.
            self._local.release(ctx.topology.num_processes)

    def close(self) -> None:
        """Waits for in-flight saves (reporting failures as events) and releases what `open`
        opened (nothing if it never ran)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._ready:
                self.wait_until_finished()
        except (CheckpointError, Fenced):
            # Already reported as a save_failed event, or this generation was given up (its
            # event log takes nothing more): close() must not mask the cause.
            pass
        finally:
            if self._local is not None:
                self._local.close()
            writer = self._writer
            if writer is not None:
                if not writer.save_in_progress():
                    writer.tier.close()  # Orbax's close waits for a save still retrying
                writer.stop()
            elif self._persistent is not None:  # opened, then the open failed
                self._persistent.close()
            self._probe.close()
            self._preemption.close()

    # ------------------------------------------------------------------------------ public API

    def latest_step(self, max_step: int | None = None) -> int | None:
        """Newest step committed on either tier (as this process sees it), at most `max_step`.

        What a rollback can aim for; `restore_latest(ctx, max_step=...)` still verifies it and
        falls back further if a copy proves bad.
        """
        steps = list(self._committed_persistent_steps())
        if self._local is not None:
            steps += list(self._local.scan(self._fingerprint, self._run_id or "")[0])
        steps = [s for s in steps if max_step is None or s <= max_step]
        return max(steps) if steps else None

    def wait_until_finished(self) -> None:
        """Blocks until every in-flight save is committed; raises `CheckpointError` on a failure."""
        errors: list[CheckpointError] = []
        if self._deferred_error is not None:
            errors.append(self._deferred_error)
            self._deferred_error = None
        if self._local is not None:
            try:
                self._local.finish()
            except CheckpointError as e:
                self._report_failure(Tier.LOCAL, e)
                errors.append(e)
        persistent_error = self._commits.finish()
        if persistent_error is not None:
            errors.append(persistent_error)
        if errors:
            raise errors[0]

    def restore_latest(self, ctx: RunContext, max_step: int | None = None) -> Restored | None:
        """The newest valid checkpoint (at most `max_step`) on `ctx`'s mesh, or None.

        Every process must call it. Raises `CheckpointError` if persistent steps exist and none
        of them is valid, or the processes cannot agree in time.
        """
        return self._restore(ctx, max_step=max_step, exact=False)

    def restore_step(self, ctx: RunContext, step: int) -> Restored:
        """Exactly `step` (rollback to a known-good step); raises `CheckpointError` if unusable."""
        restored = self._restore(ctx, max_step=step, exact=True)
        if restored is None:
            raise CheckpointError(f"checkpoint step {step} is not restorable on either tier")
        return restored

    # ------------------------------------------------------------------------------- restoring

    def _restore(self, ctx: RunContext, max_step: int | None, exact: bool) -> Restored | None:
        started = time.perf_counter()
        try:
            self.wait_until_finished()
        except CheckpointError as e:
            self._deferred_error = e  # reported already; the next save raises it
        restored = self._restorer.restore(ctx, started, max_step=max_step, exact=exact)
        if self._persistent is None and max_step is None:
            if restored is None:
                raise CheckpointError(
                    f"persistent tier {self.persistent_dir} unreachable and no valid local-tier "
                    "step of this run: not starting over what it may hold"
                )
            logging.warning(
                "resumed step %d from the local tier: persistent tier %s unreachable",
                restored.step,
                self.persistent_dir,
            )
        return restored

    def _start_timeline(self, step: int | None, timeline: str) -> None:
        """Saves from here on continue the timeline restored at `step` (None: a fresh start)."""
        self._timeline = timeline
        self._start_step = step or 0
        self._clock.restart(self._start_step, new_timeline=True)
        persistent_steps = self._persistent.steps() if self._persistent is not None else []
        self._last_persistent_step = step if step in persistent_steps else None
        self._policy.restart_clock()

    # --------------------------------------------------------------------------------- saving

    def _save(self, ctx: RunContext, state: TrainState, info: StepInfo, d: Decision) -> None:
        if not d:
            return
        if self._deferred_error is not None:
            error, self._deferred_error = self._deferred_error, None
            raise error
        # A local save never waits for the previous write: skipped (on every process) while
        # it runs, before anything is copied or kept.
        local = d.local and self._cadence is not None and self._cadence.writer_free()
        if not (local or d.persistent):
            return
        if self._events.fence is not None:  # a superseded generation commits nothing
            self._events.fence.check()
        position = info.data_position.to_json()
        started = time.perf_counter()
        # One snapshot for both tiers, which the loop's next step leaves valid; each tier's
        # `save` event counts it in its blocking time.
        snapshot = saved_state(state, ctx.keeper, keep=self._keep_state)
        snapshot_s = time.perf_counter() - started
        if local:
            self._save_local(ctx, snapshot, info.step, position, snapshot_s)
        if d.persistent:
            self._save_persistent(ctx, snapshot, info.step, position, d, snapshot_s)

    def _save_local(
        self,
        ctx: RunContext,
        snapshot: TrainState,
        step: int,
        position: dict[str, Any],
        snapshot_s: float = 0.0,
    ) -> None:
        assert self._local is not None and self._cadence is not None
        local_manifest = {
            "fingerprint": self._fingerprint,
            "run_id": self._run_id,
            "timeline": self._timeline,
            "time": time.time(),
            "data_position": position,
            "process_index": jax.process_index(),
            "num_processes": jax.process_count(),
            "topology": ctx.topology.describe(),
            "mesh": ctx.plan.describe(),
            "generation": ctx.generation,
            "leaves": self._leaf_specs(snapshot),
        }
        try:
            blocking = snapshot_s + self._local.save(step, snapshot, local_manifest)
        except CheckpointError as e:
            self._report_failure(Tier.LOCAL, e)
            raise
        self._last_local_step = step
        self._events.emit(
            EventType.SAVE,
            tier=Tier.LOCAL,
            step=step,
            duration_s=blocking,
            reason=SaveReason.LOCAL,
            skipped=self._cadence.saved(step) or None,
        )

    def _save_persistent(
        self,
        ctx: RunContext,
        snapshot: TrainState,
        step: int,
        position: dict[str, Any],
        d: Decision,
        snapshot_s: float,
    ) -> None:
        """Starts the persistent save of `snapshot` in the writer thread (digests, manifest and
        the Orbax save), unless the store or the previous save stands in the way."""
        started = time.perf_counter()  # real cost, whatever clock the policies run on
        started_mono = time.monotonic()
        # The final save and a preemption's wait for the save in flight; any other is skipped
        # while it commits (on every process alike), and counted in the next save event.
        must = d.reason in (SaveReason.FINAL, SaveReason.PREEMPTION)
        mine = self._commits.blocker(step, wait=must)
        views = self._sync.all_gather(
            "persistent_ready",
            [mine and mine.cause, bool(mine and mine.busy), self._outage.duration_s()],
        )
        causes = [(cause, busy) for cause, busy, _ in views if cause]
        if causes and all(busy for _, busy in causes):
            self._commits.skipped += 1
            return
        blocked = next((cause for cause, busy in causes if not busy), None)
        if blocked is None and self._persistent is None:
            blocked = self._reconnect(ctx)  # every process reaches this together
        if blocked is not None:
            outage_s = max(t for *_, t in views)
            self._skip_persistent(ctx, snapshot, step, position, blocked, outage_s)
            return
        assert self._persistent is not None and self._writer is not None
        self._last_persistent_step = step
        if step in self._persistent.steps():
            return  # committed before (the same step replayed after a restore)
        specs = self._leaf_specs(snapshot)

        def meta_of(digests: dict[str, str]) -> dict[str, Any]:
            return manifest.build_meta(ctx, step, digests, specs, position, d.reason, d.temporary)

        self._report_persistent_save(ctx, step, d, snapshot_s + time.perf_counter() - started)
        # Handed to the writer thread last (a queue put): once it runs, digests and Orbax's
        # main-thread part compete with this thread for the interpreter for as long as the
        # state takes, so nothing of the save is left to do here by then. A store that went
        # away since the probe fails the save in the writer thread: reported by
        # `PersistentCommits.poll` as an outage, like a failed commit.
        self._writer.start(step, snapshot, position, meta_of, d.temporary, started_mono)

    def _report_persistent_save(
        self, ctx: RunContext, step: int, d: Decision, blocking: float
    ) -> None:
        """Reports a persistent save that starts: its blocking time (`blocking`, seconds) to the
        policy, and its `save` event, which counts the saves skipped since the last one."""
        self._policy.record_persistent_save(blocking)
        interval = self._policy.auto_interval_s() if ctx.config.checkpoint.auto_interval else None
        self._events.emit(
            EventType.SAVE,
            tier=Tier.PERSISTENT,
            step=step,
            duration_s=blocking,
            reason=d.reason,
            temporary=d.temporary or None,
            interval_s=interval,
            skipped=self._commits.skipped or None,
        )
        self._commits.skipped = 0

    def _skip_persistent(
        self,
        ctx: RunContext,
        snapshot: TrainState,
        step: int,
        position: dict[str, Any],
        cause: str,
        outage_s: float,
    ) -> None:
        """A persistent save the store cannot take: the step goes to the local tier instead, and
        an outage past its limit stops the run (the same step on every process: `outage_s` is
        the longest any of them has seen)."""
        self._outage.begin(step, cause)
        self._events.emit(
            EventType.SAVE_FAILED, tier=Tier.PERSISTENT, step=step, cause=f"skipped: {cause}"
        )
        if self._local is not None and self._last_local_step != step:
            self._save_local(ctx, snapshot, step, position)
        if outage_s > self._outage_limit_s:
            if self._local is not None:
                self._local.finish()
            raise StopTraining(
                f"persistent tier {self.persistent_dir} unreachable for {outage_s:.0f}s "
                f"(checkpoint.persistent_outage_limit_s={self._outage_limit_s:g}): {cause}; "
                f"step {step} is on the local tier",
                ExitCode.STORAGE_UNREACHABLE,
            )

    def _open_persistent(self, ctx: RunContext) -> PersistentTier:
        c = ctx.config.checkpoint
        # A superseded generation's save in flight fails at its commit instead of committing.
        persistent = PersistentTier(
            self.persistent_dir, c.keep, c.keep_period, fence=ctx.events.fence
        )
        try:
            check_persistent_dir(
                persistent,
                self._fingerprint,
                manifest.leaf_specs(ctx.abstract_state),
                self.persistent_dir,
                self._accept_other_config,
            )
        except BaseException:
            persistent.close()
            raise
        return persistent

    def _reconnect(self, ctx: RunContext) -> str | None:
        """Opens the persistent tier that was unreachable at the start; None once it is open.

        Its steps newer than the one this timeline started from were left by the timeline the
        run abandoned when it resumed from the local tier: they move into quarantine, as a
        restore would have moved them."""
        try:
            persistent = self._open_persistent(ctx)
        except CheckpointError as e:
            return str(e)
        their_run = persistent.run_id(create=False)
        if their_run is not None and self._run_id is not None and their_run != self._run_id:
            raise CheckpointError(
                f"persistent tier {self.persistent_dir} now holds run {their_run}, not this "
                f"run's {self._run_id} that the local tier resumed"
            )
        moved = persistent.quarantine_after(self._start_step)
        self._sync.all_gather("reconnected", None)  # process 0 has moved them
        persistent.reload()
        if moved:
            self._events.emit(
                EventType.CHECKPOINT_QUARANTINED,
                tier=Tier.PERSISTENT,
                step=self._start_step,
                steps=moved,
                cause=f"newer than step {self._start_step}, resumed from the local tier",
            )
        self._persistent = self._restorer.persistent = persistent
        self._commits.writer = PersistentWriter(persistent, self._writer_sync)
        return None

    def _agreed_cause(self, cause: str | None) -> str | None:
        """The first process's cause, if any process has one (the same answer everywhere)."""
        return next((c for c in self._sync.all_gather("cause", cause) if c), None)

    def _stop_for_preemption(self, ctx: RunContext, state: TrainState, info: StepInfo) -> None:
        self._events.emit(EventType.PREEMPTION, step=info.step)
        if info.step != self._last_persistent_step:
            self._save(ctx, state, info, Decision(persistent=True, reason=SaveReason.PREEMPTION))
        self.wait_until_finished()
        raise StopTraining(
            f"preempted: saved step {info.step}, restart to continue", ExitCode.PREEMPTED
        )

    def _on_local_commit(self, step: int, commit_s: float, nbytes: int) -> None:
        if self._cadence is not None:
            self._cadence.record_commit(commit_s)
        self._events.emit(
            EventType.SAVE_COMMITTED, tier=Tier.LOCAL, step=step, commit_s=commit_s, bytes=nbytes
        )

    def _leaf_specs(self, state: TrainState) -> dict[str, dict[str, Any]]:
        if self._specs is None:
            self._specs = manifest.leaf_specs(state)
        return self._specs

    def _report_failure(self, tier: Tier, error: Exception, step: int | None = None) -> None:
        self._events.emit(EventType.SAVE_FAILED, tier=tier, step=step, cause=str(error))

    @property
    def _writer(self) -> PersistentWriter | None:
        return self._commits.writer

    def _committed_persistent_steps(self) -> list[int]:
        if self._persistent is None or self._writer is None:
            return []
        pending = self._writer.pending
        return [s for s in self._persistent.steps() if pending is None or s != pending.step]
