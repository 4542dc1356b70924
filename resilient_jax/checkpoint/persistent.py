"""The persistent tier: an ordinary Orbax `CheckpointManager` directory (local path or gs://).

Each step holds three items: `state` (the TrainState pytree, `StandardSave`, readable by plain
Orbax), `data` (the JSON data position) and `meta` (see `manifest`). Saves are asynchronous: the
caller blocks only while arrays are copied off the devices; Orbax writes and commits (temp dir,
then rename or `commit_success.txt`) in the background.

Fencing: a tier given the worker's `GenerationFence` checks it right before Orbax makes a step
visible (Orbax's `post_finalization_callback`, called in its commit thread after every item is
written and before the temp dir's rename or the `commit_success.txt` marker): a save started by a
generation the supervisor has given up since then fails with the `Fenced` reason instead of
committing, however long ago it started. The directory stays a plain Orbax one.

Restore reads items with Orbax's handlers directly instead of `CheckpointManager.restore`, whose
closing barrier would leave healthy processes waiting when one process fails to read its shards;
the checkpointer agrees on success across processes itself, with a timeout.

On the CPU backend a shard is written whole by the process holding replica 0 of it
(`_whole_shards_on_cpu`), not split among its replicas.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

# Where Orbax's own default array handler gets its metadata store (not re-exported).
from orbax.checkpoint._src.metadata import array_metadata_store

from resilient_jax.checkpoint.errors import CheckpointError, InvalidCheckpoint
from resilient_jax.contracts.generation_file import Fenced, GenerationFence

ITEMS = ("state", "data", "meta")
QUARANTINE_DIR = "quarantine"
# Identifies this directory's history; local-tier copies carry it, so copies left on a RAM disk
# by an earlier run in a workdir that was since deleted and recreated are never restored.
RUN_ID_FILE = "resilient_jax_run_id"
DEFAULT_DIR = "checkpoints"  # under the workdir, unless `checkpoint.dir` names another place
_NAME_FORMAT = ocp.step.standard_name_format()


def persistent_dir(config: Any, workdir: str) -> str:
    """The persistent tier of a run: `checkpoint.dir`, or `<workdir>/checkpoints`."""
    return config.checkpoint.dir or os.path.join(workdir, DEFAULT_DIR)


def read_run_id(directory: str | epath.Path) -> str | None:
    """The run id of a persistent directory (None before its first run wrote one)."""
    path = epath.Path(directory) / RUN_ID_FILE
    return path.read_text().strip() if path.exists() else None


class _Manager(ocp.CheckpointManager):
    """Orbax's manager, minus its own look at JAX's preemption sync point.

    JAX's preemption sync manager keeps one call counter per process, set by every call to
    `reached_preemption_sync_point`, and agrees on the sync point as the largest counter + 1.
    Orbax calls it from its save and finalize threads with the step being saved, which moves the
    counter back while the train loop is further on: the agreed step could then lie in the past,
    no process ever reached it, and a preemption notice went unheeded for the rest of the run.
    The train loop (`checkpoint.preemption`) is the only caller, once per step.
    """

    def reached_preemption(self, step: int) -> bool:
        return False


_REGISTERING = threading.Lock()  # the first tiers of a process may be built by two threads


@functools.cache
def _whole_shards_on_cpu() -> None:
    """Orbax splits a shard held by several replicas among them ("replica-parallel") by slicing
    it on the device, in the thread that starts the save: here the persistent writer's thread,
    beside the train step. On the CPU client, device work dispatched from another thread while
    the step's collectives run can deadlock both (2 processes x 2 devices, one async save every
    4 steps: the first save hung with it; 50 saves in 200 steps ran without it; BUILD.md). So
    on CPU each shard is written whole by its replica 0, a transfer with no device computation;
    Orbax already defaults to that on GPU. Otherwise the handler is Orbax's default one (with
    its per-array metadata store). Process-wide (Orbax's handler registry is global), once,
    without the warning Orbax logs for the override (bad input must end in one line)."""
    if jax.default_backend() != "cpu":
        return
    handler = ocp.type_handlers.ArrayHandler(
        use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()
    )
    absl_logger = logging.getLogger("absl")
    with _REGISTERING:
        level = absl_logger.level
        absl_logger.setLevel(logging.ERROR)
        try:
            ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
        finally:
            absl_logger.setLevel(level)


@dataclasses.dataclass
class PendingSave:
    step: int
    started: float  # time.monotonic() when the save call began
    blocking_s: float


class _KeepPolicy:
    """Which steps survive a save (an Orbax `PreservationPolicy`).

    Kept: the newest `keep` permanent steps, every `keep_period`-th step, the step being saved,
    and the newest step known to be committed. The last matters because Orbax decides deletions
    before the new step commits and deletes them even if that save then fails: without it, a
    failed save could take the only good checkpoint with it. Temporary steps (wall-clock saves)
    are therefore deleted only once a newer step has committed.
    """

    def __init__(
        self,
        keep: int,
        keep_period: int,
        is_temporary: Callable[[int], bool],
        last_committed: Callable[[], int | None],
    ) -> None:
        self._keep = keep
        self._keep_period = keep_period
        self._is_temporary = is_temporary
        self._last_committed = last_committed

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        steps = [c.step for c in checkpoints]
        if not steps:
            return []
        permanent = sorted(s for s in steps if not self._is_temporary(s))
        keep = set(permanent[-self._keep :]) | {max(steps)}
        committed = self._last_committed()
        if committed is not None:
            keep.add(committed)
        if self._keep_period > 0:
            keep |= {s for s in steps if s % self._keep_period == 0}
        return [s in keep for s in steps]


class PersistentTier:
    def __init__(
        self,
        directory: str,
        keep: int,
        keep_period: int,
        read_only: bool = False,
        fence: GenerationFence | None = None,  # checked before each save and at its commit
    ) -> None:
        _whole_shards_on_cpu()
        self.directory = epath.Path(directory)
        self._fence = fence
        self._temporary: set[int] = set()
        self._last_committed: int | None = None
        self.pending: PendingSave | None = None
        n = jax.process_count()
        policy = _KeepPolicy(
            keep, keep_period, self._temporary.__contains__, lambda: self._last_committed
        )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=None if read_only else policy,
            read_only=read_only,  # another run's directory: never clean, create or delete
            cleanup_tmp_directories=not read_only,  # a crash mid-save leaves an Orbax temp dir
            create=False,  # made below: Orbax refuses to create it when processes are named
            # Orbax's asynchronous directory creation leaves a thread waiting 300 s for a signal
            # when creation fails, which would hold a failed run at exit; mkdir is cheap.
            async_options=ocp.AsyncOptions(
                create_directories_asynchronously=False,
                post_finalization_callback=self._check_fence if fence is not None else None,
            ),
            enable_async_checkpointing=True,
            # Naming the processes makes Orbax use the coordination service's barriers, which
            # time out, instead of a device collective that waits forever for a dead peer.
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                active_processes=set(range(n)) if n > 1 else None
            ),
        )
        try:
            if not read_only:
                self.directory.mkdir(parents=True, exist_ok=True)
            self._manager = _Manager(self.directory, item_names=ITEMS, options=options)
        except Exception as e:
            raise CheckpointError(
                f"checkpoint dir {self.directory} cannot be used: {_one_line(e)}"
            ) from e
        steps = self.steps()
        self._last_committed = steps[-1] if steps else None
        for step in steps:
            try:
                if self.read_meta(step).get("temporary"):
                    self._temporary.add(step)
            except InvalidCheckpoint:
                continue

    def run_id(self, create: bool) -> str | None:
        """The directory's run id; with `create`, made now if the directory has none yet."""
        run_id = read_run_id(self.directory)
        if run_id is not None or not create:
            return run_id
        run_id = uuid.uuid4().hex
        (self.directory / RUN_ID_FILE).write_text(run_id)
        return run_id

    # ---------------------------------------------------------------------------------- reading

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def step_dir(self, step: int) -> epath.Path:
        return self.directory / _NAME_FORMAT.build_name(step)

    def read_meta(self, step: int) -> dict[str, Any]:
        return self._read_json(step, "meta")

    def read_data_position(self, step: int) -> dict[str, Any]:
        return self._read_json(step, "data")

    def _read_json(self, step: int, item: str) -> dict[str, Any]:
        path = self.step_dir(step) / item
        try:
            return dict(ocp.JsonCheckpointHandler().restore(path))
        except Exception as e:
            raise InvalidCheckpoint(f"{item} unreadable: {_one_line(e)}") from e

    def restore_state(self, step: int, abstract_state: Any) -> Any:
        """The `state` item placed on `abstract_state`'s shardings (any mesh)."""
        step_dir = self.step_dir(step)
        if not ocp.utils.is_checkpoint_finalized(step_dir):
            raise InvalidCheckpoint("not committed")
        try:
            return ocp.StandardCheckpointHandler().restore(
                step_dir / "state", args=ocp.args.StandardRestore(abstract_state)
            )
        except Exception as e:
            raise InvalidCheckpoint(f"state unreadable: {_one_line(e)}") from e

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only `params` of the `state` item (initialising another run from this one)."""
        item = {"params": abstract_params}
        try:
            restored = ocp.PyTreeCheckpointHandler().restore(
                self.step_dir(step) / "state",
                args=ocp.args.PyTreeRestore(
                    item=item,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                    partial_restore=True,
                ),
            )
        except Exception as e:
            raise InvalidCheckpoint(f"params unreadable: {_one_line(e)}") from e
        return restored["params"]

    # ---------------------------------------------------------------------------------- writing

    def save(
        self,
        step: int,
        state: Any,
        data_position: dict[str, Any],
        meta: dict[str, Any],
        temporary: bool,
    ) -> PendingSave | None:
        """Starts an async save; returns what was started, or None if the step already exists.

        The caller must have called `finish()` first, so that a failed previous save surfaces.
        """
        if step in self._manager.all_steps():
            return None  # committed before (the same step replayed after a restore)
        try:
            self._check_fence()
        except Fenced as e:
            raise CheckpointError(f"persistent save of step {step} not started: {e}") from e
        if temporary:
            self._temporary.add(step)
        started = time.monotonic()
        self._disarm_reported_error()
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=ocp.args.JsonSave(data_position),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )
        except Exception as e:
            raise CheckpointError(
                f"persistent save of step {step} to {self.directory} failed: {_one_line(e)}"
            ) from e
        self.pending = PendingSave(step, started, time.monotonic() - started)
        return self.pending

    def _check_fence(self) -> None:
        """Raises `Fenced` once a newer generation started. Also Orbax's last call before a step
        becomes visible (on the process that commits it), in its commit thread: raising there
        leaves the step uncommitted (a temp dir, or no `commit_success.txt`, which Orbax lists
        as no step and cleans up) and fails the save with this reason at `finish()`."""
        if self._fence is not None:
            self._fence.check()

    def _disarm_reported_error(self) -> None:
        """Orbax 0.12 keeps a failed save's error in its finalize thread and re-raises it once
        per calling thread, at that thread's next `save()` or `wait_until_finished()`. Saves may
        start on one thread (the persistent writer's) while `finish()` collects their outcome on
        another, so the starting thread would fail its next save at once with an error already
        reported, and a store that refused one save would lose the next one too. With no save
        pending, any error left is such an old one: this thread's copy is taken here (and the
        async checkpointer's own, should `finish()` have stopped at the first)."""
        if self.pending is not None:
            return
        for collect in (self._manager.wait_until_finished, self._manager.check_for_errors):
            with contextlib.suppress(Exception):
                collect()

    def poll(self) -> PendingSave | None:
        """The pending save if it has finished since the last call (without waiting)."""
        if self.pending is None or self.save_in_progress():
            return None
        return self.finish()

    def save_in_progress(self) -> bool:
        return self.pending is not None and self._manager.is_saving_in_progress()

    def finish(self, timeout_s: float | None = None) -> PendingSave | None:
        """Waits for the pending save; returns it once committed, raises if it failed.

        With `timeout_s`, a save still running after it raises and stays pending (an object
        store that stopped answering holds Orbax's wait for as long as its retries last).
        """
        if timeout_s is not None and self.pending is not None:
            deadline = time.monotonic() + timeout_s
            while self._manager.is_saving_in_progress():
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"persistent save of step {self.pending.step} to {self.directory} did "
                        f"not commit within {timeout_s:g}s"
                    )
                time.sleep(0.05)
        pending, self.pending = self.pending, None
        error: BaseException | None = None
        # Both, whatever the first says: each keeps an error of its own until it is asked.
        for collect in (self._manager.wait_until_finished, self._manager.check_for_errors):
            try:
                collect()
            except Exception as e:
                error = error or e
        if pending is None:
            if error is not None:
                raise CheckpointError(f"persistent save failed: {_one_line(error)}") from error
            return None
        # Orbax can log a background failure and carry on; only a finalized directory counts.
        if error is None and not ocp.utils.is_checkpoint_finalized(self.step_dir(pending.step)):
            error = RuntimeError("the step directory was never committed")
        if error is not None:
            raise CheckpointError(
                f"persistent save of step {pending.step} to {self.directory} failed: "
                f"{_one_line(error)}"
            ) from error
        self._last_committed = pending.step
        return pending

    @property
    def last_committed(self) -> int | None:
        return self._last_committed

    def quarantine_after(self, step: int | None) -> list[int]:
        """Moves steps newer than `step` (an abandoned timeline) out of the step list.

        They are renamed into `quarantine/`, never deleted. Only process 0 moves; every process
        must call `reload()` after all have passed this point.
        """
        newer = [s for s in self.steps() if step is None or s > step]
        if newer and jax.process_index() == 0:
            target_root = self.directory / QUARANTINE_DIR
            target_root.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for s in newer:
                _move_dir(self.step_dir(s), target_root / f"{_NAME_FORMAT.build_name(s)}-{stamp}")
        return newer

    def reload(self) -> None:
        self._manager.reload()
        steps = self.steps()
        self._last_committed = steps[-1] if steps else None

    def close(self) -> None:
        self._manager.close()


def _move_dir(source: epath.Path, target: epath.Path) -> None:
    """Renames a directory. An object store (gs://) has no directories and no rename: each object
    is read and written under the new name, then the old ones are deleted (a quarantine is rare;
    the server-side copy gcsfs would use is not served by the emulator the tests run against)."""
    if "://" not in os.fspath(source):
        source.rename(target)
        return
    _copy_objects(source, target)
    source.rmtree()


def _copy_objects(source: epath.Path, target: epath.Path) -> None:
    for path in source.iterdir():
        if path.is_dir():
            _copy_objects(path, target / path.name)
        else:
            (target / path.name).write_bytes(path.read_bytes())


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
