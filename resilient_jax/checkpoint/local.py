"""The local tier: frequent saves of each process's own shards to a RAM disk (/dev/shm).

Layout, under `<local_dir>/<run key>/` (the run key is a hash of the absolute workdir):

    proc-<process index>-<token>/          one directory per process instance (token: random)
        step_0000000120/                   committed: renamed from a temp dir after it is complete
            shards.bin                     the process's shards back to back, raw C-order bytes
            manifest.json                  step, fingerprint, data position, every piece's array,
                                           index box, offset, size and CRC-32
        tmp-step_0000000130-<token>/       being written (or left by a crash)
        tmp-spare-<token>/                 the last step dropped: its data file is overwritten
                                           by the next write (see below)

A process writes one copy of each distinct shard it holds, so every slice (replica) holds a full
copy of the state. Restore assembles each shard the new sharding needs from any pieces this host
can read, whoever wrote them, so a surviving slice restores alone onto a smaller mesh; a host whose
RAM disk lacks pieces fetches them from peer hosts first (`peer_fetch`). The blocking part of a
save is the device-to-host copy; files are written by a background thread. The layout's names are
in `contracts.local_tier` (the host agent serves it, `control.tier_service`).

Bandwidth (`piece_io`): a new tmpfs file costs a page allocation (zeroed) per page, as much as the
copy into it, so the step the tier drops is kept as the next write's directory and its data file
overwritten in place. The RAM disk then holds `keep` + 1 copies between writes, what it held during
each write before. A peer still reading the recycled step's file gets pieces that fail their CRC
and takes them from another copy. Restore reads each piece straight into the array it assembles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from resilient_jax.checkpoint import piece_io
from resilient_jax.checkpoint.assembly import (
    Assembly,
    Box,
    StepFiles,
    box_of,
    named_leaves,
    needed_regions,
    restore_leaves,
    size_of,
)
from resilient_jax.checkpoint.background import BackgroundThread, Job
from resilient_jax.checkpoint.checksum import crc32
from resilient_jax.checkpoint.errors import CheckpointError
from resilient_jax.contracts.generation_file import GenerationFence
from resilient_jax.contracts.local_tier import (
    DATA_FILE,
    MANIFEST,
    PROC_PREFIX,
    STEP_PREFIX,
    TMP_PREFIX,
    run_key,
    step_name,
)
from resilient_jax.train.shard_list import list_shards

FORMAT_VERSION = 1

_CLOSE_WAIT_S = 10.0  # closing waits this long for the writer thread to end
_WRITER_NICE = 10  # the writer thread's nice value above the process's


def run_dir(local_root: str, workdir: str) -> str:
    """This run's directory on the local tier: the same path for every restart of the run."""
    return os.path.join(local_root, run_key(workdir))


def _host_pieces(snapshot: Any) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """One host copy of each distinct shard of `snapshot` this process holds, with its manifest
    entry. `snapshot` must stay valid while it is read (`snapshot.saved_state`)."""
    entries, arrays, pending = [], [], []
    for path, leaf in named_leaves(snapshot):
        seen: set[Box] = set()
        for shard in leaf.addressable_shards:
            box = box_of(shard.index, leaf.shape)
            if box in seen:
                continue
            seen.add(box)
            shard.data.copy_to_host_async()  # start every transfer before waiting on any
            pending.append((path, box, shard.data))
    for path, box, data in pending:
        # On CPU this is a view of the snapshot's buffer, which no step donates: written as is.
        host = np.asarray(data)
        if not host.flags.c_contiguous:
            host = np.ascontiguousarray(host)
        entries.append({"leaf": path, "box": [list(b) for b in box]})
        arrays.append(host)
    return entries, arrays


class LocalTier:
    def __init__(
        self,
        root: str,
        process_index: int,
        keep: int,
        on_commit: Callable[[int, float, int], None] | None = None,
        read_only: bool = False,  # only restores: creates nothing under `root`
        fence: GenerationFence | None = None,  # checked right before each commit (the rename)
    ) -> None:
        self.root = root
        self.process_index = process_index
        self.keep = keep
        self._token = uuid.uuid4().hex[:8]
        self.own_dir = os.path.join(root, f"{PROC_PREFIX}{process_index:05d}-{self._token}")
        self._on_commit = on_commit
        self._fence = fence
        self._writer: BackgroundThread | None = None  # writes the saves; None: read-only
        self._job: Job | None = None
        self._job_step: int | None = None  # the step `_job` writes
        self._error: BaseException | None = None
        self._error_step: int | None = None
        self._committed: list[int] = []
        self._lock = threading.Lock()  # guards _committed (the writer thread appends)
        self._spare: str | None = None  # a dropped step's directory, the next write's (writer)
        if read_only:
            return
        try:
            os.makedirs(self.own_dir, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"local checkpoint dir {root} is not writable: {e}") from e
        # Below the training thread: on a host whose cores the step keeps busy (a CPU backend) a
        # write takes what they leave idle, and a save due meanwhile is skipped, so writes slow
        # the step little and come as often as the idle CPU allows; on an accelerator's host the
        # cores are mostly idle and it changes nothing.
        self._writer = BackgroundThread(f"local-ckpt-{process_index}", nice=_WRITER_NICE)

    # ---------------------------------------------------------------------------------- writing

    def save(self, step: int, snapshot: Any, manifest: dict[str, Any]) -> float:
        """Copies this process's shards of `snapshot` to the host and writes them, in the
        background.

        `snapshot`: a state the loop's next step does not donate (`snapshot.saved_state`: kept
        by that step, or copied); the transfer to host and the files happen in a thread.
        Returns the seconds the caller waited (for the previous write to finish). Raises the
        error of a failed previous save.
        """
        started = time.monotonic()
        self.finish()
        blocking = time.monotonic() - started
        manifest = {**manifest, "format": FORMAT_VERSION, "step": step}
        assert self._writer is not None, "a read-only local tier does not save"
        self._job = self._writer.submit(lambda: self._write(step, manifest, snapshot, started))
        self._job_step = step
        return blocking

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Waits for the write in flight without collecting its outcome (`finish` does):
        whether the writer is idle."""
        job = self._job
        return job is None or job.wait(timeout_s)

    def writing(self) -> int | None:
        """The step whose write is still running, or None when the writer is idle (a save
        now would not wait)."""
        job = self._job
        return self._job_step if job is not None and not job.done() else None

    def finish(self, timeout_s: float | None = None) -> None:
        """Waits for the background write; raises `CheckpointError` if it failed."""
        if self._job is not None:
            if not self._job.wait(timeout_s):
                raise CheckpointError(
                    f"local save did not finish within {timeout_s:.0f}s ({self.own_dir})"
                )
            self._job = None
        if self._error is not None:
            error, step = self._error, self._error_step
            self._error = None
            raise CheckpointError(
                f"local save of step {step} to {self.own_dir} failed: "
                f"{type(error).__name__}: {error}"
            ) from error

    def close(self) -> None:
        """Ends the writer thread (after the write in flight, if any: waited for up to a few
        seconds, a RAM-disk write being far shorter)."""
        if self._writer is not None:
            self._writer.stop(wait_s=_CLOSE_WAIT_S)
            self._writer = None

    def _write(self, step: int, manifest: dict[str, Any], snapshot: Any, started: float) -> None:
        tmp = os.path.join(self.own_dir, f"{TMP_PREFIX}{step_name(step)}-{uuid.uuid4().hex[:8]}")
        try:
            entries, arrays = _host_pieces(list_shards(snapshot))
            self._take_spare(tmp)
            fd = os.open(os.path.join(tmp, DATA_FILE), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                offset = 0
                for entry, array in zip(entries, arrays, strict=True):
                    raw = piece_io.as_bytes(array)
                    piece_io.write_at(fd, raw, offset)
                    entry.update(offset=offset, nbytes=raw.nbytes, crc32=crc32(raw))
                    offset += raw.nbytes
                os.ftruncate(fd, offset)  # a recycled file may be longer
                os.fsync(fd)
            finally:
                os.close(fd)
            manifest = {**manifest, "pieces": entries, "bytes": offset}
            # The manifest is the commit marker inside the directory; the rename commits it.
            _write_manifest(tmp, manifest)
            final = os.path.join(self.own_dir, step_name(step))
            if self._fence is not None:
                self._fence.check()  # raises Fenced: the step stays uncommitted, tmp removed
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(tmp, final)
            with self._lock:
                self._committed.append(step)
            self._collect_garbage()
            if self._on_commit is not None:
                self._on_commit(step, time.monotonic() - started, offset)
        except BaseException as e:
            self._error, self._error_step = e, step
            shutil.rmtree(tmp, ignore_errors=True)

    def keep_fetched(self, files: StepFiles) -> None:
        """Writes a copy held in memory (`files.data`: pieces fetched from peers, which a restore
        has read) to `files.dir` on this host, in the background, so that this host serves those
        pieces in turn. The next save waits for it, or is skipped while it runs, like after a save.
        A write that fails costs only the copy (this host's next save is a full one): logged."""
        if self._writer is None or files.data is None:
            return  # read-only: nothing is created under `root`
        self._job = self._writer.submit(lambda: self._write_fetched(files))
        self._job_step = files.step

    def _write_fetched(self, files: StepFiles) -> None:
        assert files.data is not None
        tmp = os.path.join(os.path.dirname(files.dir), f"{TMP_PREFIX}{os.path.basename(files.dir)}")
        try:
            _makedirs(tmp)
            fd = os.open(os.path.join(tmp, DATA_FILE), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                piece_io.write_at(fd, files.data, 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            _write_manifest(tmp, files.manifest)
            if self._fence is not None:
                self._fence.check()
            os.rename(tmp, files.dir)
        except Exception as e:  # a full RAM disk, a fence, a clean-up that took the temp dir
            logging.warning("pieces fetched from peers not kept in %s: %s", files.dir, e)
            shutil.rmtree(os.path.dirname(files.dir), ignore_errors=True)

    def _take_spare(self, tmp: str) -> None:
        """Makes `tmp`, the directory of the write starting: the spare one if there is one."""
        spare, self._spare = self._spare, None
        if spare is not None:
            try:
                os.rename(spare, tmp)
                return
            except OSError:
                shutil.rmtree(spare, ignore_errors=True)
        _makedirs(tmp)

    def _collect_garbage(self) -> None:
        """Keeps the newest `keep` own steps (the first one dropped becomes the spare); drops
        older steps of any other process instance.

        Other instances' steps older than our oldest kept step are from an earlier generation
        or a dead process (a live peer drops them itself at the same point). Their temp dirs
        are left alone (a live peer may be writing); restore clears those when no one writes.
        """
        with self._lock:
            self._committed.sort()
            drop, self._committed = self._committed[: -self.keep], self._committed[-self.keep :]
            oldest = self._committed[0]
        for step in drop:
            path = os.path.join(self.own_dir, step_name(step))
            if self._spare is None:
                spare = os.path.join(self.own_dir, f"{TMP_PREFIX}spare-{uuid.uuid4().hex[:8]}")
                with contextlib.suppress(OSError):
                    os.rename(path, spare)  # uncommitted from here: never listed or served
                    self._spare = spare
                    continue
            shutil.rmtree(path, ignore_errors=True)
        for proc in _proc_dirs(self.root):
            if proc == self.own_dir:
                continue
            for step, path in _committed_dirs(proc):
                if step < oldest:
                    shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(proc)  # only if empty

    @property
    def committed_steps(self) -> list[int]:
        with self._lock:
            return sorted(self._committed)

    # ---------------------------------------------------------------------------------- reading

    def scan(
        self, fingerprint: str, run_id: str
    ) -> tuple[dict[int, list[StepFiles]], list[tuple[int, str]]]:
        """Committed copies of this run readable here, by step; plus (step, why) for others."""
        found: dict[int, list[StepFiles]] = {}
        unusable: list[tuple[int, str]] = []
        for listed in list_committed(self.root):
            path, copy = listed.dir, listed.files
            if copy is None:
                unusable.append((listed.step, f"{path}: manifest unreadable ({listed.problem})"))
                continue
            written_by = copy.manifest.get("fingerprint")
            if written_by != fingerprint:
                unusable.append((listed.step, f"{path}: written by config {written_by}"))
                continue
            if copy.manifest.get("run_id") != run_id:
                unusable.append((listed.step, f"{path}: left by an earlier run of this workdir"))
                continue
            found.setdefault(listed.step, []).append(copy)
        return found, unusable

    def completable(
        self, copies: list[StepFiles], abstract_state: Any, wanted: dict[str, dict[str, Any]]
    ) -> str | None:
        """Why this process cannot assemble its shards of `abstract_state` from `copies`, or None.

        Looks at manifests only; contents are checked when read.
        """
        assembly = Assembly(copies, wanted)
        for leaf, target in named_leaves(abstract_state):
            for region in needed_regions(target):
                if assembly.plan(leaf, region) is None:
                    return f"{leaf} region {list(region)} is in no readable copy"
        return None

    def restore(
        self, copies: list[StepFiles], abstract_state: Any, wanted: dict[str, dict[str, Any]]
    ) -> Any:
        """The state on `abstract_state`'s shardings, from the pieces in `copies`.

        Raises `InvalidCheckpoint` if a piece is missing, truncated or fails its CRC in every copy.
        """
        assembly = Assembly(copies, wanted)
        arrays = restore_leaves(assembly, named_leaves(abstract_state))
        return jax.tree.unflatten(jax.tree.structure(abstract_state), arrays)

    # ------------------------------------------------------------------------------ maintenance

    def drop_after(self, step: int | None) -> None:
        """Deletes every copy newer than `step` (an abandoned timeline) and every temp dir.

        Call only while no process writes to this tier (during restore, after agreement).
        """
        for proc in _proc_dirs(self.root):
            # Processes sharing this host's tier run this at the same time: a peer may remove an
            # emptied directory while we look at it.
            for name in _listdir(proc):
                if name.startswith(TMP_PREFIX):
                    shutil.rmtree(os.path.join(proc, name), ignore_errors=True)
            for s, path in _committed_dirs(proc):
                if step is None or s > step:
                    shutil.rmtree(path, ignore_errors=True)
            if proc != self.own_dir:
                with contextlib.suppress(OSError):
                    os.rmdir(proc)  # only if empty
        with self._lock:
            self._committed = [s for s in self._committed if step is not None and s <= step]
        self._spare = None  # a temp dir, removed above

    def release(self, num_processes: int) -> None:
        """Gives the RAM back once the run has finished (its final step committed in the
        persistent tier): deletes this process's copies and those of earlier instances that no
        process of the finished job uses (the same index, or an index the job no longer has),
        then the run's directory once it is empty. Peers on this host may do the same at once."""
        self.finish()
        for proc in _proc_dirs(self.root):
            index = _proc_index(proc)
            if proc == self.own_dir or index == self.process_index or index >= num_processes:
                shutil.rmtree(proc, ignore_errors=True)
        with self._lock:
            self._committed = []
        self._spare = None
        with contextlib.suppress(OSError):
            os.rmdir(self.root)  # only if empty: the last process of this host removes it


# ------------------------------------------------------------------ the layout, for inspection


@dataclasses.dataclass
class Listed:
    """A committed step directory of some process instance, with its manifest if readable."""

    step: int
    dir: str
    files: StepFiles | None  # None: the manifest is unreadable
    problem: str = ""  # why it is unreadable

    @property
    def process_dir(self) -> str:
        return os.path.basename(os.path.dirname(self.dir))


def list_committed(run_root: str) -> list[Listed]:
    """Every committed copy under a run's directory, by process instance, then step."""
    listed = []
    for proc in _proc_dirs(run_root):
        for step, path in _committed_dirs(proc):
            try:
                with open(os.path.join(path, MANIFEST)) as f:
                    listed.append(Listed(step, path, StepFiles(path, json.load(f))))
            except (OSError, ValueError) as e:
                listed.append(Listed(step, path, None, str(e)))
    return listed


def list_temp_dirs(run_root: str) -> list[str]:
    """Uncommitted step directories (being written, or left by a crash), as `proc-.../tmp-...`."""
    return [
        os.path.join(os.path.basename(proc), name)
        for proc in _proc_dirs(run_root)
        for name in sorted(_listdir(proc))
        if name.startswith(TMP_PREFIX)
    ]


def count_bad_pieces(copy: StepFiles) -> int:
    """Pieces of a copy that are truncated or fail their CRC-32. Raises `OSError` if its data
    file cannot be read."""
    bad = 0
    with open(os.path.join(copy.dir, DATA_FILE), "rb") as f:
        for piece in copy.manifest["pieces"]:
            f.seek(piece["offset"])
            raw = f.read(piece["nbytes"])
            if len(raw) != piece["nbytes"] or crc32(raw) != piece["crc32"]:
                bad += 1
    return bad


def coverage_gaps(copies: list[StepFiles]) -> list[str]:
    """Arrays (leaf paths) that the union of these copies of one step does not hold whole."""
    gaps = []
    for leaf, spec in copies[0].manifest.get("leaves", {}).items():
        boxes = {piece.box for copy in copies for piece in copy.pieces(leaf)}
        if sum(size_of(box) for box in boxes) < size_of(tuple((0, n) for n in spec["shape"])):
            gaps.append(leaf)
    return gaps


def _proc_index(proc_dir: str) -> int:
    """The process index in `proc-<index>-<token>` (-1 if the name is not of that form)."""
    try:
        return int(os.path.basename(proc_dir)[len(PROC_PREFIX) :].split("-")[0])
    except ValueError:
        return -1


def _proc_dirs(root: str) -> list[str]:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return [os.path.join(root, n) for n in sorted(names) if n.startswith(PROC_PREFIX)]


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    """The manifest, durable: inside a copy's directory it is the commit marker."""
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())


def _makedirs(path: str, attempts: int = 3) -> None:
    """`os.makedirs`, again if a peer's cleanup removed our still empty process directory between
    its creation of the parent and of `path`."""
    for attempt in range(attempts):
        try:
            os.makedirs(path)
            return
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise


def _committed_dirs(proc: str) -> list[tuple[int, str]]:
    names = _listdir(proc)
    out = []
    for name in names:
        if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX) :].isdigit():
            out.append((int(name[len(STEP_PREFIX) :]), os.path.join(proc, name)))
    return sorted(out)
