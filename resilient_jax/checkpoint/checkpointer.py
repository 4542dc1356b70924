"""The checkpointer: a train-loop hook that decides when to save, saves to two tiers, and restores.

Resume order, as implemented by `restore_latest`:
  1. Wait for this process's in-flight saves.
  2. Each process lists what it could restore: local-tier steps whose pieces cover every shard it
     needs on the new mesh (manifests only) and committed persistent steps.
  3. The processes agree (coordination-service all-gather with a timeout) on the steps every one
     of them can restore; candidates go newest first, the local tier first at equal steps.
  4. Every process loads the candidate (local: CRC of each piece; persistent: Orbax restore onto
     the target shardings) and they agree whether all succeeded; a persistent candidate is then
     verified against the per-array digests in its `meta` (a collective, so the verdict is the
     same everywhere). A failure is a `checkpoint_invalid` event and the next candidate is tried.
  5. Newer steps than the one restored belong to an abandoned timeline: persistent ones move to
     `quarantine/` (never deleted), local ones are dropped. A `restore` event is written.
  6. Nothing restorable: with persistent steps present that is an error (they all failed); with
     `checkpoint.init_from` set, parameters come from that directory; otherwise None (fresh start).

Save order per step (`after_step`): preemption sync point -> wall-clock decision (made by process
0, shared two steps ahead) -> policy -> local save -> persistent save. Each save blocks only for
the device-to-host copy; commit happens in the background and is reported by `save_committed`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax

from resilient_jax import config as config_lib
from resilient_jax import executables
from resilient_jax.checkpoint import checksum, manifest
from resilient_jax.checkpoint.errors import CheckpointError, InvalidCheckpoint
from resilient_jax.checkpoint.local import LocalTier, StepFiles, run_dir
from resilient_jax.checkpoint.persistent import PersistentTier
from resilient_jax.checkpoint.policy import (
    FINAL,
    PREEMPTION,
    Decision,
    SavePolicy,
    local_interval_steps,
)
from resilient_jax.checkpoint.policy import LOCAL as LOCAL_RULE
from resilient_jax.checkpoint.preemption import PreemptionNotice
from resilient_jax.checkpoint.sync import ProcessSync
from resilient_jax.contracts import env_vars
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.train.context import RunContext
from resilient_jax.train.hooks import Hook, StepInfo, StopTraining
from resilient_jax.train.state import TrainState, init_state

LOCAL = "local"
PERSISTENT = "persistent"
INIT_FROM = "init_from"

# Process 0 decides wall-clock saves this many steps ahead, so peers read the decision without
# waiting on it in the common case.
_CLOCK_LAG = 2
_STEP_TIMES_KEPT = 64  # step times behind the local interval (only the first ones are used)
# Published decisions older than this many steps are deleted from the key-value store.
_CLOCK_KEY_RETENTION = 1000

_instance_counter = itertools.count()


@dataclasses.dataclass
class Restored:
    state: TrainState  # on the restoring run's shardings
    data_position: dict[str, Any] | None  # None: start the data from the beginning
    step: int  # optimizer steps already applied
    tier: str  # "local" | "persistent" | "init_from"


def persistent_dir(config: Any, workdir: str) -> str:
    return config.checkpoint.dir or os.path.join(workdir, "checkpoints")


def _same_dir(a: str, b: str) -> bool:
    if not a or not b:
        return False
    if a.startswith("gs://") or b.startswith("gs://"):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


@dataclasses.dataclass(frozen=True)
class _Candidate:
    step: int
    tier: str
    key: str  # what processes agree on: the step plus, for the local tier, its timeline


class Checkpointer(Hook):
    """Saves to the local and persistent tiers by policy; restores the newest valid step.

    Construct one per generation (after `jax.distributed` is up and the mesh is planned) and
    `close()` it before re-initialising JAX. Raises `CheckpointError` if the persistent directory
    belongs to another model or config.
    """

    def __init__(
        self,
        ctx: RunContext,
        clock: Callable[[], float] = time.monotonic,
        handle_sigterm: bool = True,
    ) -> None:
        c = ctx.config.checkpoint
        self._events = ctx.events
        self._fingerprint = config_lib.fingerprint(ctx.config)
        self._wanted = manifest.leaf_specs(ctx.abstract_state)
        self._sync = ProcessSync(
            f"resilient_jax/checkpoint/g{ctx.generation}/i{next(_instance_counter)}",
            c.sync_timeout_s,
        )
        self.persistent_dir = persistent_dir(ctx.config, ctx.workdir)
        self._accept_other_config = _same_dir(c.init_from, self.persistent_dir)
        self._persistent = PersistentTier(self.persistent_dir, c.keep, c.keep_period)
        self._check_persistent_dir()
        is_primary = jax.process_index() == 0
        run_id = self._persistent.run_id(create=True) if is_primary else None
        self._run_id: str = self._sync.all_gather("run_id", run_id)[0]
        self._local: LocalTier | None = None
        if c.local_dir and c.local_every_steps > 0:
            self._local = LocalTier(
                run_dir(c.local_dir, ctx.workdir),
                jax.process_index(),
                c.local_keep,
                on_commit=self._on_local_commit,
            )
        self._policy = SavePolicy(c, ctx.config.total_steps, clock, self._local is not None)
        self._preemption = PreemptionNotice(handle_sigterm)
        self._deferred_error: CheckpointError | None = None
        self._last_persistent_step: int | None = None  # saved by this checkpointer (maybe pending)
        self._start_step = 0
        self._epoch = 0  # restores so far; keys wall-clock decisions to the current timeline
        self._clock_pending_until = -1
        self._timeline = uuid.uuid4().hex[:12]
        self._warmup: threading.Thread | None = None
        self._closed = False
        # Young/Daly for the local tier: measured over this process's first local saves.
        self._local_auto = bool(c.local_auto_interval) and self._local is not None
        self._local_saves = 0
        self._last_local_commit_s: float | None = None
        self._step_times: list[float] = []

    # ------------------------------------------------------------------------------ hook methods

    def on_start(self, ctx: RunContext, state: TrainState) -> None:
        self._start_step = int(jax.device_get(state.step))
        self._policy.restart_clock()
        # Compile the checksum pass while training starts, not inside the first save.
        self._warmup = threading.Thread(
            target=_compile_quietly, args=(ctx.abstract_state,), name="digest-compile", daemon=True
        )
        self._warmup.start()

    def after_step(self, ctx: RunContext, state: TrainState, info: StepInfo) -> None:
        step = info.step
        if self._local_auto and len(self._step_times) < _STEP_TIMES_KEPT:
            self._step_times.append(info.step_time_s)
        self._poll_commit()
        if self._preemption.reached(step):
            self._stop_for_preemption(ctx, state, info)
        decision = self._policy.decide(step, self._clock_decision(step))
        self._save(ctx, state, info, decision)

    def on_end(self, ctx: RunContext, state: TrainState, info: StepInfo | None) -> None:
        """Saves the final step if no save has it yet and waits until it is committed.

        Raises `CheckpointError` if any save failed, so the run does not exit 0. A run that
        reached `total_steps` then deletes its local-tier copies (`LocalTier.release`).
        """
        if info is not None and info.step != self._last_persistent_step:
            self._save(ctx, state, info, Decision(persistent=True, reason=FINAL))
        self.wait_until_finished()
        if self._local is not None and info is not None and info.step >= ctx.config.total_steps:
            # Finished and committed: the RAM-disk copies can only cost memory from here on.
            self._local.release(ctx.topology.num_processes)

    def close(self) -> None:
        """Waits for in-flight saves (reporting failures as events) and releases resources."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_until_finished()
        except CheckpointError:
            pass  # already reported as a save_failed event; close() must not mask the cause
        finally:
            # A daemon thread still compiling at interpreter exit aborts the process.
            if self._warmup is not None:
                self._warmup.join()
                self._warmup = None
            self._persistent.close()
            self._preemption.close()

    # ------------------------------------------------------------------------------ public API

    def latest_step(self, max_step: int | None = None) -> int | None:
        """Newest step committed on either tier (as this process sees it), at most `max_step`.

        What a rollback can aim for; `restore_latest(ctx, max_step=...)` still verifies it and
        falls back further if a copy proves bad.
        """
        steps = list(self._committed_persistent_steps())
        if self._local is not None:
            steps += list(self._local.scan(self._fingerprint, self._run_id)[0])
        steps = [s for s in steps if max_step is None or s <= max_step]
        return max(steps) if steps else None

    def request_preemption(self) -> None:
        """Save and stop at the next step, as SIGTERM does (single process only)."""
        self._preemption.request()

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
                self._report_failure(LOCAL, e)
                errors.append(e)
        pending = self._persistent.pending
        try:
            done = self._persistent.finish()
        except CheckpointError as e:
            self._report_failure(PERSISTENT, e, pending.step if pending else None)
            errors.append(e)
        else:
            self._report_commit(done)
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

    # --------------------------------------------------------------------------------- saving

    def _save(self, ctx: RunContext, state: TrainState, info: StepInfo, d: Decision) -> None:
        if not d:
            return
        if self._deferred_error is not None:
            error, self._deferred_error = self._deferred_error, None
            raise error
        # Written by background threads later: a copy, in case the loader mutates its dict.
        info = dataclasses.replace(info, data_position=json.loads(json.dumps(info.data_position)))
        if d.local and self._local is not None:
            self._save_local(ctx, state, info)
        if d.persistent:
            self._save_persistent(ctx, state, info, d)

    def _save_local(self, ctx: RunContext, state: TrainState, info: StepInfo) -> None:
        assert self._local is not None
        local_manifest = {
            "fingerprint": self._fingerprint,
            "run_id": self._run_id,
            "timeline": self._timeline,
            "time": time.time(),
            "data_position": info.data_position,
            "process_index": jax.process_index(),
            "num_processes": jax.process_count(),
            "topology": ctx.topology.describe(),
            "mesh": ctx.plan.describe(),
            "generation": ctx.generation,
            "leaves": manifest.leaf_specs(state),
        }
        try:
            blocking = self._local.save(info.step, state, local_manifest)
        except CheckpointError as e:
            self._report_failure(LOCAL, e)
            raise
        self._events.emit(
            "save", tier=LOCAL, step=info.step, duration_s=blocking, reason=LOCAL_RULE
        )
        if self._local_auto:
            self._local_saves += 1
            if self._local_saves == 3:
                self._agree_local_interval(ctx, info.step)

    def _agree_local_interval(self, ctx: RunContext, step: int) -> None:
        """Sets the local tier's Young/Daly interval, the same on every process, from the cost
        of a local save and the step time, the worst over processes, and the mean time between
        failures the supervisor observed (`checkpoint.mtbf_s` before the first).

        The cost is the second save's time to commit (the first one warms up), known by the
        third, which waited for its write: the blocking part plus the background write, which
        competes for the host and which the next save waits for, so saving more often than a
        write takes only turns writes into blocking."""
        times = sorted(self._step_times[1:]) or [0.0]  # the first step includes warm-up
        mine = [self._last_local_commit_s or 0.0, times[len(times) // 2]]
        views = self._sync.all_gather("local_interval", mine)
        cost_s, step_time_s = max(v[0] for v in views), max(v[1] for v in views)
        observed = os.environ.get(env_vars.OBSERVED_MTBF_S)
        mtbf_s = float(observed) if observed else float(ctx.config.checkpoint.mtbf_s)
        every = local_interval_steps(
            cost_s, mtbf_s, step_time_s, ctx.config.checkpoint.local_every_steps
        )
        self._policy.set_local_interval(every, step)
        self._events.emit(
            "checkpoint_interval",
            tier=LOCAL,
            step=step,
            every_steps=every,
            save_cost_s=round(cost_s, 4),
            step_time_s=round(step_time_s, 4),
            mtbf_s=mtbf_s,
            mtbf_source="observed" if observed else "checkpoint.mtbf_s",
        )

    def _save_persistent(
        self, ctx: RunContext, state: TrainState, info: StepInfo, d: Decision
    ) -> None:
        started = time.perf_counter()  # real cost, whatever clock the policies run on
        pending = self._persistent.pending
        try:
            self._report_commit(self._persistent.finish())
        except CheckpointError as e:
            self._report_failure(PERSISTENT, e, pending.step if pending else None)
            raise
        if self._warmup is not None:
            self._warmup.join()
            self._warmup = None
        digests = checksum.tree_digests(state)
        meta = manifest.build_meta(
            ctx,
            info.step,
            digests,
            manifest.leaf_specs(state),
            info.data_position,
            d.reason,
            d.temporary,
        )
        try:
            started_save = self._persistent.save(
                info.step, state, info.data_position, meta, d.temporary
            )
        except CheckpointError as e:
            self._report_failure(PERSISTENT, e, info.step)
            raise
        self._last_persistent_step = info.step
        if started_save is None:
            return  # this step is already committed
        blocking = time.perf_counter() - started
        self._policy.record_persistent_save(blocking)
        interval = self._policy.auto_interval_s() if ctx.config.checkpoint.auto_interval else None
        self._events.emit(
            "save",
            tier=PERSISTENT,
            step=info.step,
            duration_s=blocking,
            reason=d.reason,
            temporary=d.temporary or None,
            interval_s=interval,
        )

    def _stop_for_preemption(self, ctx: RunContext, state: TrainState, info: StepInfo) -> None:
        self._events.emit("preemption", step=info.step)
        if info.step != self._last_persistent_step:
            self._save(ctx, state, info, Decision(persistent=True, reason=PREEMPTION))
        self.wait_until_finished()
        raise StopTraining(
            f"preempted: saved step {info.step}, restart to continue", ExitCode.PREEMPTED
        )

    def _clock_decision(self, step: int) -> str | None:
        """The wall-clock save reason for `step`, identical on every process."""
        if not self._policy.uses_clock:
            return None
        if not self._sync.distributed:
            return self._policy.clock_reason()
        prefix = f"e{self._epoch}/clock"
        if self._sync.process_index == 0:
            ahead = step + _CLOCK_LAG
            reason = None
            if step >= self._clock_pending_until:
                reason = self._policy.clock_reason()
                if reason is not None:
                    self._clock_pending_until = ahead
            self._sync.publish(f"{prefix}/{ahead}", reason)
            if step - _CLOCK_KEY_RETENTION > self._start_step:
                self._sync.delete(f"{prefix}/{step - _CLOCK_KEY_RETENTION}")
        if step < self._start_step + 1 + _CLOCK_LAG:
            return None  # nobody decided for the first steps after a (re)start
        return self._sync.fetch(f"{prefix}/{step}")

    def _poll_commit(self) -> None:
        pending = self._persistent.pending
        try:
            self._report_commit(self._persistent.poll())
        except CheckpointError as e:
            self._report_failure(PERSISTENT, e, pending.step if pending else None)
            self._deferred_error = e  # raised at the next save, as every save failure is

    def _report_commit(self, pending: Any) -> None:
        if pending is not None:
            self._events.emit(
                "save_committed",
                tier=PERSISTENT,
                step=pending.step,
                commit_s=time.monotonic() - pending.started,
            )

    def _on_local_commit(self, step: int, commit_s: float, nbytes: int) -> None:
        self._last_local_commit_s = commit_s
        self._events.emit("save_committed", tier=LOCAL, step=step, commit_s=commit_s, bytes=nbytes)

    def _report_failure(self, tier: str, error: Exception, step: int | None = None) -> None:
        self._events.emit("save_failed", tier=tier, step=step, cause=str(error))

    def _committed_persistent_steps(self) -> list[int]:
        pending = self._persistent.pending
        return [s for s in self._persistent.steps() if pending is None or s != pending.step]

    # ------------------------------------------------------------------------------- restoring

    def _check_persistent_dir(self) -> None:
        """Refuses a directory whose newest readable step was written by another model/config."""
        for step in reversed(self._persistent.steps()):
            try:
                meta = self._persistent.read_meta(step)
            except InvalidCheckpoint:
                continue
            manifest.check_compatible(
                meta,
                self._fingerprint,
                self._wanted,
                f"{self.persistent_dir} (step {step})",
                self._accept_other_config,
            )
            return

    def _restore(self, ctx: RunContext, max_step: int | None, exact: bool) -> Restored | None:
        started = time.perf_counter()
        try:
            self.wait_until_finished()
        except CheckpointError as e:
            self._deferred_error = e  # reported already; the next save raises it
        wanted = manifest.leaf_specs(ctx.abstract_state)

        def fits(step: int) -> bool:
            return max_step is None or (step == max_step if exact else step <= max_step)

        local_copies = self._local_candidates(ctx, wanted, fits)
        persistent_steps = [s for s in self._persistent.steps() if fits(s)]
        mine = [f"{s}@{t}" for (s, t) in local_copies] + [f"{s}@p" for s in persistent_steps]
        views = self._sync.all_gather("restore_candidates", mine)
        agreed = set(views[0]).intersection(*views[1:])
        candidates = sorted(
            (
                _Candidate(int(k.split("@")[0]), PERSISTENT if k.endswith("@p") else LOCAL, k)
                for k in agreed
            ),
            key=lambda c: (-c.step, c.tier != LOCAL, c.key),
        )
        for candidate in candidates:
            if candidate.tier == LOCAL:
                copies = local_copies[self._split_local_key(candidate.key)]
                load = lambda copies=copies: self._load_local(ctx, copies, wanted)
            else:
                load = lambda step=candidate.step: self._load_persistent(ctx, step, wanted)
            restored = self._try_candidate(candidate, load)
            if restored is not None:
                self._after_restore(candidate.step)
                self._events.emit(
                    "restore",
                    tier=candidate.tier,
                    step=candidate.step,
                    duration_s=time.perf_counter() - started,
                )
                return restored
        if persistent_steps and not exact:
            raise CheckpointError(
                f"no valid checkpoint among persistent steps {persistent_steps} in "
                f"{self.persistent_dir} (see checkpoint_invalid events); move the directory "
                "away to start fresh"
            )
        if exact or max_step is not None:
            return None
        self._after_restore(None)
        if ctx.config.checkpoint.init_from and not self._accept_other_config:
            return self._restore_init_from(ctx, started)
        return None

    def _local_candidates(
        self, ctx: RunContext, wanted: dict[str, Any], fits: Callable[[int], bool]
    ) -> dict[tuple[int, str], list[StepFiles]]:
        """Local copies this process can assemble completely, keyed by (step, timeline)."""
        if self._local is None:
            return {}
        found, unusable = self._local.scan(self._fingerprint, self._run_id)
        for step, why in unusable:
            if fits(step):
                self._events.emit("checkpoint_invalid", tier=LOCAL, step=step, cause=why)
        by_timeline: dict[tuple[int, str], list[StepFiles]] = {}
        for step, copies in found.items():
            if not fits(step):
                continue
            for copy in copies:
                key = (step, str(copy.manifest.get("timeline", "")))
                by_timeline.setdefault(key, []).append(copy)
        usable = {}
        for key, copies in by_timeline.items():
            why = self._local.completable(copies, ctx.abstract_state, wanted)
            if why is None:
                usable[key] = copies
            else:
                self._events.emit("checkpoint_invalid", tier=LOCAL, step=key[0], cause=why)
        return usable

    @staticmethod
    def _split_local_key(key: str) -> tuple[int, str]:
        step, timeline = key.split("@", 1)
        return int(step), timeline

    def _try_candidate(
        self, candidate: _Candidate, load: Callable[[], tuple[Restored, dict[str, str] | None]]
    ) -> Restored | None:
        """Loads a candidate on every process; returns it only if all succeeded and verified."""
        restored, expected, cause = None, None, None
        try:
            restored, expected = load()
        except InvalidCheckpoint as e:
            cause = str(e)
        causes = self._sync.all_gather("restore_result", cause)
        failed = [(i, c) for i, c in enumerate(causes) if c is not None]
        if not failed and expected is not None:
            assert restored is not None
            cause = _digest_mismatch(checksum.tree_digests(restored.state), expected)
            if cause is not None:
                failed = [(self._sync.process_index, cause)]
        if failed:
            process, why = failed[0]
            self._events.emit(
                "checkpoint_invalid",
                tier=candidate.tier,
                step=candidate.step,
                cause=f"process {process}: {why}",
            )
            return None
        return restored

    def _load_local(
        self, ctx: RunContext, copies: list[StepFiles], wanted: dict[str, Any]
    ) -> tuple[Restored, None]:
        assert self._local is not None
        state = self._local.restore(copies, ctx.abstract_state, wanted)
        first = copies[0].manifest
        return Restored(state, first.get("data_position"), int(first["step"]), LOCAL), None

    def _load_persistent(
        self, ctx: RunContext, step: int, wanted: dict[str, Any]
    ) -> tuple[Restored, dict[str, str]]:
        meta = self._persistent.read_meta(step)
        manifest.check_compatible(
            meta,
            self._fingerprint,
            wanted,
            f"{self.persistent_dir} (step {step})",
            self._accept_other_config,
        )
        state = self._persistent.restore_state(step, ctx.abstract_state)
        data_position = self._persistent.read_data_position(step)
        return Restored(state, data_position, step, PERSISTENT), meta.get("checksums", {})

    def _after_restore(self, step: int | None) -> None:
        """Retires the timeline after `step` and starts a new one (all processes together)."""
        moved = self._persistent.quarantine_after(step) if step is not None else []
        tokens = self._sync.all_gather("timeline", uuid.uuid4().hex[:12])  # also a barrier
        self._persistent.reload()
        if moved:
            self._events.emit(
                "checkpoint_quarantined",
                tier=PERSISTENT,
                step=step,
                steps=moved,
                cause=f"newer than the restored step {step}",
            )
        if self._local is not None:
            self._local.drop_after(step)
        self._timeline = tokens[0]
        self._epoch += 1
        self._start_step = step or 0
        self._clock_pending_until = -1
        self._last_persistent_step = step if step in self._persistent.steps() else None
        self._policy.restart_clock()

    def _restore_init_from(self, ctx: RunContext, started: float) -> Restored | None:
        source_dir = ctx.config.checkpoint.init_from
        source = PersistentTier(source_dir, keep=1, keep_period=0, read_only=True)
        params_only = {k: v for k, v in self._wanted.items() if k.startswith(".params")}
        try:
            for step in reversed(source.steps()):
                candidate = _Candidate(step, INIT_FROM, f"{step}@init")
                restored = self._try_candidate(
                    candidate, lambda step=step: self._load_params(ctx, source, step, params_only)
                )
                if restored is not None:
                    self._events.emit(
                        "restore",
                        tier=INIT_FROM,
                        step=step,
                        duration_s=time.perf_counter() - started,
                        source=source_dir,
                    )
                    return restored
        finally:
            source.close()
        raise CheckpointError(f"config.checkpoint.init_from={source_dir!r} has no valid step")

    def _load_params(
        self, ctx: RunContext, source: PersistentTier, step: int, wanted: dict[str, Any]
    ) -> tuple[Restored, dict[str, str]]:
        meta = source.read_meta(step)
        problems = manifest.shape_mismatches(meta.get("leaves", {}), wanted, only=".params")
        if problems:
            raise CheckpointError(
                f"config.checkpoint.init_from={source.directory} holds a different model: "
                + "; ".join(problems[:3])
            )
        params = source.restore_params(step, ctx.abstract_state.params)
        state = init_state(ctx.config, ctx.mesh).replace(params=params)
        expected = {k: v for k, v in meta.get("checksums", {}).items() if k.startswith(".params")}
        return Restored(state, None, 0, INIT_FROM), expected


def _compile_quietly(abstract_state: Any) -> None:
    # On failure the first save compiles (and reports) it instead.
    with contextlib.suppress(Exception):
        checksum.compile_digests(abstract_state, executables.default_dir())


def _digest_mismatch(actual: dict[str, str], expected: dict[str, str]) -> str | None:
    bad = [path for path, digest in expected.items() if actual.get(path) != digest]
    if not bad:
        return None
    return f"checksum mismatch in {len(bad)} array(s): {', '.join(bad[:3])}"
