"""Verified restore: the newest step every process can load and verify, across steps and tiers.

Resume order, as implemented by `Restorer.restore` (the checkpointer first waits for this
process's in-flight saves):
  1. Each process lists what it could restore: local-tier steps whose pieces cover every shard it
     needs on the new mesh (manifests only; with `peers`, pieces on peer hosts' RAM disks count:
     a replaced host's empty disk does not cost the newest local step) and committed persistent
     steps.
  2. The processes agree (coordination-service all-gather with a timeout) on the steps every one
     of them can restore; candidates go newest first, the local tier first at equal steps.
  3. Every process loads the candidate (local: the missing pieces fetched from peers first, then
     CRC of each piece; persistent: Orbax restore onto
     the target shardings) and they agree whether all succeeded; a persistent candidate is then
     verified against the per-array digests in its `meta` (a collective, so the verdict is the
     same everywhere). A failure is a `checkpoint_invalid` event and the next candidate is tried.
  4. Newer steps than the one restored belong to an abandoned timeline (`quarantine`). A
     `restore` event is written.
  5. Nothing restorable: with persistent steps present that is an error (they all failed); with
     `checkpoint.init_from` set, parameters come from that directory; otherwise None (fresh start).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from resilient_jax.agreement import Agreement
from resilient_jax.checkpoint import checksum, manifest
from resilient_jax.checkpoint.errors import CheckpointError, ForeignCheckpoint, InvalidCheckpoint
from resilient_jax.checkpoint.local import LocalTier, StepFiles
from resilient_jax.checkpoint.peer_fetch import PeerCopy, PeerFetcher
from resilient_jax.checkpoint.persistent import PersistentTier
from resilient_jax.checkpoint.quarantine import retire_after
from resilient_jax.checkpoint.tier import Tier
from resilient_jax.contracts.event_types import EventType
from resilient_jax.data.position import DataPosition
from resilient_jax.events import EventLog
from resilient_jax.train.context import RunContext
from resilient_jax.train.state import TrainState, init_state

LeafSpecs = dict[str, dict[str, Any]]  # leaf path -> shape and dtype (`manifest.leaf_specs`)


@dataclasses.dataclass
class Restored:
    state: TrainState  # on the restoring run's shardings
    data_position: DataPosition  # where the data stream stood (the beginning for init_from)
    step: int  # optimizer steps already applied
    tier: Tier


# A loaded candidate and the digests to verify it against (None: verified while it was read).
_Loaded = tuple[Restored, dict[str, str] | None]


@dataclasses.dataclass(frozen=True)
class _Candidate:
    step: int
    tier: Tier
    key: str  # what processes agree on: the step plus, for the local tier, its timeline


def _local_key(step: int, timeline: str) -> str:
    return f"{step}@{timeline}"


# Waits before reading a persistent step again: a read that fails may be the store's passing
# error (a dropped connection, a slow answer), and a committed step taken for invalid is passed by
# and quarantined, so the run would resume from an older one. A damaged step fails every time.
READ_RETRY_DELAYS_S = (0.5, 1.0)


def _read_retrying(read: Callable[[], Any], step: int) -> Any:
    for delay in READ_RETRY_DELAYS_S:
        try:
            return read()
        except InvalidCheckpoint as e:
            logging.warning("persistent step %d: %s; reading it again in %.1fs", step, e, delay)
            time.sleep(delay)
    return read()


def _persistent_key(step: int) -> str:
    return f"{step}@p"


def _parse_key(key: str) -> _Candidate:
    step, where = key.split("@", 1)
    return _Candidate(int(step), Tier.PERSISTENT if where == "p" else Tier.LOCAL, key)


def check_persistent_dir(
    persistent: PersistentTier,
    fingerprint: str,
    wanted: LeafSpecs,
    where: str,
    accept_other_config: bool,
) -> None:
    """Refuses a directory whose newest readable step was written by another model/config."""
    for step in reversed(persistent.steps()):
        try:
            meta = persistent.read_meta(step)
        except InvalidCheckpoint:
            continue
        manifest.check_compatible(
            meta, fingerprint, wanted, f"{where} (step {step})", accept_other_config, where
        )
        return


@dataclasses.dataclass
class Restorer:
    """Finds, loads and verifies the newest restorable step of a checkpointer's tiers.

    `on_new_timeline(step, timeline)` is called (on every process) once a restore has retired
    the steps after `step` (None: nothing restored), before the `restore` event.
    """

    persistent: PersistentTier | None  # None: unreachable since the start (local tier only)
    persistent_dir: str  # as the user gave it, for messages
    local: LocalTier | None
    sync: Agreement
    events: EventLog
    fingerprint: str  # of this run's config: local copies of other configs are not candidates
    run_id: str  # of the persistent directory: local copies of earlier runs are not candidates
    accept_other_config: bool  # init_from names the persistent directory itself
    on_new_timeline: Callable[[int | None, str], None]
    # A reader outside the run (sampling, export) leaves the run's steps as it found them: the run
    # may still be training and committing the steps a restore would otherwise retire.
    read_only: bool = False
    peers: PeerFetcher | None = None  # None: this host's own pieces only
    # Candidate key -> the peers' copies of its step, for the candidates that need them.
    _remote: dict[str, list[PeerCopy]] = dataclasses.field(init=False, default_factory=dict)
    # The copy the candidate being loaded fetched from peers (held in memory until kept).
    _fetched: StepFiles | None = dataclasses.field(init=False, default=None)

    def restore(
        self, ctx: RunContext, started: float, max_step: int | None, exact: bool
    ) -> Restored | None:
        """The newest valid step (exactly `max_step` if `exact`, else at most) or None.

        `started` (a `time.perf_counter()` reading) is when the restore began, for its event.
        Raises `CheckpointError` if persistent steps exist and none of them is valid.
        """
        wanted = manifest.leaf_specs(ctx.abstract_state)

        def fits(step: int) -> bool:
            return max_step is None or (step == max_step if exact else step <= max_step)

        local_copies = self._local_candidates(ctx, wanted, fits)
        listed = self.persistent.steps() if self.persistent is not None else []
        persistent_steps = [s for s in listed if fits(s)]
        mine = [*local_copies, *(_persistent_key(s) for s in persistent_steps)]
        views = self.sync.all_gather("restore_candidates", mine)
        agreed = set(views[0]).intersection(*views[1:])
        candidates = sorted(
            (_parse_key(key) for key in agreed),
            key=lambda c: (-c.step, c.tier != Tier.LOCAL, c.key),
        )
        for candidate in candidates:
            if candidate.tier == Tier.LOCAL:
                copies, remote = local_copies[candidate.key], self._remote.get(candidate.key)
                load = lambda copies=copies, remote=remote: self._load_local(
                    ctx, copies, wanted, remote
                )
            else:
                load = lambda step=candidate.step: self._load_persistent(ctx, step, wanted)
            restored = self._try_candidate(candidate, load)
            if restored is not None:
                self._retire_after(candidate.step)
                if self._fetched is not None and self.local is not None:
                    # Written only now: retiring clears the tier's temp dirs.
                    self.local.keep_fetched(self._fetched)
                    self._fetched = None
                self.events.emit(
                    EventType.RESTORE,
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
        self._retire_after(None)
        if ctx.config.checkpoint.init_from and not self.accept_other_config:
            return self._restore_init_from(ctx, started)
        return None

    def _retire_after(self, step: int | None) -> None:
        if self.read_only:
            return
        timeline = retire_after(step, self.persistent, self.local, self.sync, self.events)
        self.on_new_timeline(step, timeline)

    def _local_candidates(
        self, ctx: RunContext, wanted: LeafSpecs, fits: Callable[[int], bool]
    ) -> dict[str, list[StepFiles]]:
        """Local copies this process can assemble completely, by candidate key (step and
        timeline: the copies of one step assemble only within one timeline)."""
        self._remote = {}
        if self.local is None:
            return {}
        found, unusable = self.local.scan(self.fingerprint, self.run_id)
        for step, why in unusable:
            if fits(step):
                self._invalid(Tier.LOCAL, step, why)
        by_timeline: dict[str, list[StepFiles]] = {}
        for step, copies in found.items():
            if not fits(step):
                continue
            for copy in copies:
                by_timeline.setdefault(_local_key(step, copy.timeline), []).append(copy)
        remote = self._peer_copies(fits)
        usable = {}
        for key in sorted(set(by_timeline) | set(remote)):
            copies = by_timeline.get(key, [])
            why = self.local.completable(copies, ctx.abstract_state, wanted) if copies else ""
            if why is not None and key in remote:
                peer_files = [copy.files for copy in remote[key]]
                if self.local.completable(copies + peer_files, ctx.abstract_state, wanted) is None:
                    usable[key], self._remote[key] = copies, remote[key]
                    continue
            if why is None:
                usable[key] = copies
            elif copies:  # a step only peers hold that does not cover us is no candidate
                self._invalid(Tier.LOCAL, _parse_key(key).step, why)
        return usable

    def _peer_copies(self, fits: Callable[[int], bool]) -> dict[str, list[PeerCopy]]:
        """The peers' copies of this run, by candidate key (empty without peers)."""
        if self.peers is None:
            return {}
        copies, problems = self.peers.copies(self.fingerprint, self.run_id)
        for problem in problems:  # a dead peer: skipped, its pieces come from others or nowhere
            self.events.emit(EventType.LOCAL_FETCH_FAILED, cause=problem)
        remote: dict[str, list[PeerCopy]] = {}
        for copy in copies:
            if fits(copy.files.step):
                key = _local_key(copy.files.step, copy.files.timeline)
                remote.setdefault(key, []).append(copy)
        return remote

    def _try_candidate(self, candidate: _Candidate, load: Callable[[], _Loaded]) -> Restored | None:
        """Loads a candidate on every process; returns it only if all succeeded and verified."""
        restored, expected, cause = None, None, None
        try:
            restored, expected = load()
        except InvalidCheckpoint as e:
            cause = str(e)
        causes = self.sync.all_gather("restore_result", cause)
        failed = [(i, c) for i, c in enumerate(causes) if c is not None]
        if not failed and expected is not None:
            assert restored is not None
            # On the host and through the key-value store: no digest program to compile here.
            share = checksum.process_partial_sums(restored.state)
            digests = checksum.combine_sums(self.sync.all_gather("restore_digests", share))
            cause = _digest_mismatch(digests, expected)
            if cause is not None:
                failed = [(self.sync.process_index, cause)]
        if failed:
            process, why = failed[0]
            self._invalid(candidate.tier, candidate.step, f"process {process}: {why}")
            return None
        return restored

    def _invalid(self, tier: Tier, step: int, cause: str) -> None:
        self.events.emit(EventType.CHECKPOINT_INVALID, tier=tier, step=step, cause=cause)

    def _load_local(
        self,
        ctx: RunContext,
        copies: list[StepFiles],
        wanted: LeafSpecs,
        remote: list[PeerCopy] | None,
    ) -> _Loaded:
        assert self.local is not None
        self._fetched = None
        if remote:  # the pieces this host lacks, from the peers (InvalidCheckpoint: none intact)
            assert self.peers is not None
            self._fetched = self.peers.fetch(copies, remote, ctx.abstract_state, wanted)
            copies = [*copies, self._fetched]
        state = self.local.restore(copies, ctx.abstract_state, wanted)
        first = copies[0].manifest
        position = DataPosition.from_json(first.get("data_position"))
        return Restored(state, position, int(first["step"]), Tier.LOCAL), None

    def _load_persistent(self, ctx: RunContext, step: int, wanted: LeafSpecs) -> _Loaded:
        assert self.persistent is not None
        persistent = self.persistent
        meta = _read_retrying(lambda: persistent.read_meta(step), step)
        manifest.check_compatible(
            meta,
            self.fingerprint,
            wanted,
            f"{self.persistent_dir} (step {step})",
            self.accept_other_config,
            self.persistent_dir,
        )
        state = _read_retrying(lambda: persistent.restore_state(step, ctx.abstract_state), step)
        position = DataPosition.from_json(
            _read_retrying(lambda: persistent.read_data_position(step), step)
        )
        return Restored(state, position, step, Tier.PERSISTENT), meta.get("checksums", {})

    def _restore_init_from(self, ctx: RunContext, started: float) -> Restored | None:
        source_dir = ctx.config.checkpoint.init_from
        source = PersistentTier(source_dir, keep=1, keep_period=0, read_only=True)
        wanted = manifest.leaf_specs(ctx.abstract_state)
        params_only = {k: v for k, v in wanted.items() if k.startswith(".params")}
        try:
            for step in reversed(source.steps()):
                candidate = _Candidate(step, Tier.INIT_FROM, f"{step}@init")
                restored = self._try_candidate(
                    candidate, lambda step=step: _load_params(ctx, source, step, params_only)
                )
                if restored is not None:
                    self.events.emit(
                        EventType.RESTORE,
                        tier=Tier.INIT_FROM,
                        step=step,
                        duration_s=time.perf_counter() - started,
                        source=source_dir,
                    )
                    return restored
        finally:
            source.close()
        raise CheckpointError(f"config.checkpoint.init_from={source_dir!r} has no valid step")


def _load_params(ctx: RunContext, source: PersistentTier, step: int, wanted: LeafSpecs) -> _Loaded:
    """Parameters from another run's step, on a freshly initialised state (step 0)."""
    meta = source.read_meta(step)
    if manifest.stores_layers_separately(meta.get("leaves", {}), wanted):
        where = f"{source.directory} (step {step})"
        raise ForeignCheckpoint(manifest.per_layer_refusal(where, str(source.directory)))
    problems = manifest.shape_mismatches(meta.get("leaves", {}), wanted, only=".params")
    if problems:
        raise CheckpointError(
            f"config.checkpoint.init_from={source.directory} holds a different model: "
            + "; ".join(problems[:3])
        )
    params = source.restore_params(step, ctx.abstract_state.params)
    state = init_state(ctx.config, ctx.mesh).replace(params=params)
    expected = {k: v for k, v in meta.get("checksums", {}).items() if k.startswith(".params")}
    return Restored(state, DataPosition(), 0, Tier.INIT_FROM), expected


def _digest_mismatch(actual: dict[str, str], expected: dict[str, str]) -> str | None:
    bad = [path for path, digest in expected.items() if actual.get(path) != digest]
    if not bad:
        return None
    return f"checksum mismatch in {len(bad)} array(s): {', '.join(bad[:3])}"
