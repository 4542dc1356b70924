"""Local-tier pieces from peer hosts: what a replaced host (a new machine, an empty RAM disk) needs
to restore the newest local step instead of the older persistent one.

Every slice writes a full copy of the state to its hosts' RAM disks, and each host agent serves
its disk read-only (`control.tier_service`). At restore, a process asks each peer host (their
addresses come from the supervisor, `env_vars.LOCAL_TIER_PEERS`) for its manifests, in parallel
and bounded by `checkpoint.peer_timeout_s`; a local step its own pieces do not cover but the peers'
do is listed as restorable, and the processes agree on candidates as before (`restore`). Only once
a candidate is chosen are the missing pieces fetched: CRC-32 checked on arrival, a piece that fails
or a peer that does not answer in time is replaced by another copy of the same piece, and when no
copy is left the candidate fails like a bad local copy (`InvalidCheckpoint`: the next candidate).

Fetched pieces arrive in memory, each request received in place, and the restore reads them
from there (no second CRC pass, no file): a replaced host pays the transfer and one copy into the
restored arrays. After the restore, the local tier's writer thread writes them to this host's RAM
disk as a copy of their own (a `proc-` directory with a fresh token: the tier's clean-up treats
it as another instance's copy), so this host can serve them in turn.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from resilient_jax.checkpoint import piece_io
from resilient_jax.checkpoint.assembly import (
    Assembly,
    Piece,
    StepFiles,
    named_leaves,
    needed_regions,
)
from resilient_jax.checkpoint.checksum import crc32
from resilient_jax.checkpoint.errors import InvalidCheckpoint
from resilient_jax.checkpoint.local import LocalTier
from resilient_jax.contracts import env_vars
from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.local_tier import (
    DATA_FILE,
    PROC_PREFIX,
    step_name,
)
from resilient_jax.control.tier_service import PeerError, list_copies, read_ranges
from resilient_jax.events import EventLog

_BATCH_BYTES = 64 << 20  # one request asks a peer for at most this much (a larger piece alone)
_STREAMS = 4  # requests in flight at once, each on a connection of its own

_Item = tuple[str, Piece, list[Piece]]  # (leaf, the copy asked for, every copy of the piece)
_Job = tuple[str, str, list[_Item]]  # (peer address, its copy, the items one request asks for)


@dataclasses.dataclass(frozen=True)
class PeerCopy:
    """A committed copy of one step on a peer host, as its manifest describes it."""

    address: str  # the peer's tier server, host:port
    copy: str  # `proc-.../step_...` on the peer
    files: StepFiles  # its manifest; `dir` names the peer, not a local path

    @property
    def data_path(self) -> str:
        return os.path.join(self.files.dir, DATA_FILE)  # how its pieces' `path` reads


def peer_fetcher(
    c: Any, local: LocalTier | None, events: EventLog, environ: Mapping[str, str]
) -> PeerFetcher | None:
    """A fetcher from the peer hosts the supervisor listed for this worker (`c`: the config's
    checkpoint section); None without a local tier, with `checkpoint.peer_fetch` off, or when
    the worker was started without peers (a single host, or not by a supervisor)."""
    peers = [a for a in environ.get(env_vars.LOCAL_TIER_PEERS, "").split(",") if a]
    token = environ.get(env_vars.RUN_TOKEN, "")
    if local is None or not c.peer_fetch or not peers or not token:
        return None
    return PeerFetcher(peers, token, local, float(c.peer_timeout_s), events)


class PeerFetcher:
    def __init__(
        self,
        peers: list[str],
        token: str,
        local: LocalTier,
        timeout_s: float,
        events: EventLog,
    ) -> None:
        self.peers = peers
        self._token = token
        self._local = local
        self._run = os.path.basename(local.root)  # the run key: the same on every host
        self._timeout_s = timeout_s
        self._events = events

    def copies(self, fingerprint: str, run_id: str) -> tuple[list[PeerCopy], list[str]]:
        """Every copy of this run (config and run id) the peers hold, and one line for each peer
        that did not answer. Peers are asked at once: the whole takes at most one timeout."""
        if not self.peers:
            return [], []
        found: list[PeerCopy] = []
        problems: list[str] = []
        with concurrent.futures.ThreadPoolExecutor(len(self.peers)) as pool:
            listings = {
                address: pool.submit(list_copies, address, self._token, self._run, self._timeout_s)
                for address in self.peers
            }
            for address, listing in listings.items():
                try:
                    entries = listing.result()
                except PeerError as e:
                    problems.append(str(e))
                    continue
                for entry in entries:
                    copy = _peer_copy(address, entry)
                    if copy is None:
                        continue
                    manifest = copy.files.manifest
                    if (
                        manifest.get("fingerprint") == fingerprint
                        and manifest.get("run_id") == run_id
                    ):
                        found.append(copy)
        return found, problems

    def fetch(
        self,
        local_copies: list[StepFiles],
        remote: list[PeerCopy],
        abstract_state: Any,
        wanted: dict[str, dict[str, Any]],
    ) -> StepFiles:
        """Fetches the pieces this process needs that `local_copies` lack from `remote` copies of
        the same step, into memory: a copy whose `data` the restore reads, and which
        `LocalTier.keep_fetched` then writes to its `dir` on this host (a process instance of its
        own) in the background. Raises `InvalidCheckpoint` when some piece has no copy left that
        arrives intact in time."""
        started = time.perf_counter()
        step = remote[0].files.step
        by_path = {copy.data_path: copy for copy in remote}
        needed = _missing(local_copies, remote, abstract_state, wanted)
        # Grouped by the copy each piece is first asked from (stable: in order within it): one
        # request's pieces then lie back to back in `data` and arrive in place.
        needed.sort(key=lambda item: item[1][0].path)  # a piece's path names its copy
        slots: dict[tuple[str, Any], int] = {}  # (leaf, box) -> offset in `data`
        end = 0
        for leaf, pieces in needed:
            slots[(leaf, pieces[0].box)] = end
            end += pieces[0].nbytes
        data = piece_io.as_bytes(piece_io.aligned_empty([end], np.uint8))
        entries: list[dict[str, Any]] = []
        sources = self._fetch_into(data, needed, slots, by_path, entries)
        manifest = {
            **{k: v for k, v in remote[0].files.manifest.items() if k not in ("pieces", "bytes")},
            "pieces": entries,
            "bytes": sum(e["nbytes"] for e in entries),
            "fetched_from": sorted(sources),
        }
        self._events.emit(
            EventType.LOCAL_FETCH,
            step=step,
            bytes=manifest["bytes"],
            pieces=len(entries),
            peers=sorted(sources),
            duration_s=time.perf_counter() - started,
        )
        return StepFiles(self._copy_dir(step), manifest, data)

    def _copy_dir(self, step: int) -> str:
        """Where a fetched copy of `step` is kept: a process instance of its own."""
        token = uuid.uuid4().hex[:8]
        proc = f"{PROC_PREFIX}{self._local.process_index:05d}-fetched{token}"
        return os.path.join(self._local.root, proc, step_name(step))

    def _fetch_into(
        self,
        data: memoryview,
        needed: list[tuple[str, list[Piece]]],
        slots: dict[tuple[str, Any], int],
        by_path: dict[str, PeerCopy],
        entries: list[dict[str, Any]],
    ) -> set[str]:
        """Places each needed piece in `data` at its slot (appending its manifest entry to
        `entries`), from the first of its copies whose peer answers and whose bytes pass their
        CRC; returns the peers that served any.

        Requests run on `_STREAMS` connections at once (one TCP stream on loopback moved about
        300 MB/s of a RAM disk's 1-2 GB/s), each received straight into `data` where its pieces'
        slots lie back to back, else into a buffer of its own."""
        dead: set[str] = set()  # peers that failed a request: not asked again
        bad: set[Piece] = set()  # pieces that arrived corrupt
        problems: list[str] = []
        sources: set[str] = set()
        # A copy whose manifest gives its piece another size would overrun its neighbour's slot.
        fits = {(leaf, p) for leaf, ps in needed for p in ps if p.nbytes == ps[0].nbytes}
        buffers = threading.local()
        fetch_batch = functools.partial(self._fetch_batch, data=data, slots=slots, buffers=buffers)

        def usable(leaf: str, piece: Piece) -> bool:  # `bad` and `dead` grow from round to round
            return (
                (leaf, piece) in fits
                and piece not in bad
                and by_path[piece.path].address not in dead
            )

        pending = needed
        while pending:
            jobs = _jobs(pending, by_path, usable, problems)
            pending = []
            for (address, copy_id, batch), (failed, peer_problem) in zip(
                jobs, piece_io.parallel_map(fetch_batch, jobs, _STREAMS), strict=True
            ):
                if peer_problem is not None:
                    dead.add(address)
                    problems.append(peer_problem)
                for leaf, piece, alternatives in failed:
                    if peer_problem is None:
                        bad.add(piece)
                        problems.append(f"peer {address} {copy_id}: CRC mismatch in {leaf}")
                    pending.append((leaf, alternatives))
                arrived = _arrived_entries(batch, failed, slots)
                if arrived:
                    sources.add(address)
                entries.extend(arrived)
        entries.sort(key=lambda entry: entry["offset"])
        return sources

    def _fetch_batch(
        self,
        job: _Job,
        data: memoryview,
        slots: dict[tuple[str, Any], int],
        buffers: threading.local,
    ) -> tuple[list[_Item], str | None]:
        """One request: (items that failed, why the peer failed or None); writes the rest to
        their slots in `data`. It is received in place when its slots lie back to back, else
        into this thread's buffer in `buffers` (kept for the thread's next request)."""
        address, copy_id, batch = job
        ranges = [(piece.offset, piece.nbytes) for _, piece, _ in batch]
        size = sum(n for _, n in ranges)
        first = slots[(batch[0][0], batch[0][1].box)]
        back_to_back = itertools.accumulate((n for _, n in ranges), initial=first)
        in_place = all(
            slots[(leaf, piece.box)] == at
            for (leaf, piece, _), at in zip(batch, back_to_back, strict=False)
        )
        if in_place:
            into = data[first : first + size]
        else:
            if len(getattr(buffers, "data", b"")) < size:
                buffers.data = memoryview(bytearray(max(size, _BATCH_BYTES)))
            into = buffers.data
        try:
            received = read_ranges(
                address, self._token, self._run, copy_id, ranges, self._timeout_s, into
            )
        except PeerError as e:
            return batch, str(e)
        failed, offset = [], 0
        for leaf, piece, alternatives in batch:
            raw = received[offset : offset + piece.nbytes]
            offset += piece.nbytes
            if crc32(raw) != piece.crc32:
                failed.append((leaf, piece, alternatives))
                continue
            if not in_place:
                slot = slots[(leaf, piece.box)]
                data[slot : slot + piece.nbytes] = raw
        return failed, None


def _jobs(
    pending: list[tuple[str, list[Piece]]],
    by_path: dict[str, PeerCopy],
    usable: Callable[[str, Piece], bool],
    problems: list[str],
) -> list[_Job]:
    """One round's requests: each pending piece asked from the first of its copies still
    `usable`, grouped by copy and split by `_split`. Raises `InvalidCheckpoint` for a piece
    with no copy left, with the last `problems` as the reason."""
    batches: dict[tuple[str, str], list[_Item]] = {}
    for leaf, pieces in pending:
        candidates = [p for p in pieces if usable(leaf, p)]
        if not candidates:
            why = "; ".join(problems[-3:]) or "no peer holds it"
            raise InvalidCheckpoint(f"{leaf} box {list(pieces[0].box)}: {why}")
        copy = by_path[candidates[0].path]
        batches.setdefault((copy.address, copy.copy), []).append((leaf, candidates[0], pieces))
    return [(a, c, batch) for (a, c), items in batches.items() for batch in _split(items)]


def _arrived_entries(
    batch: list[_Item], failed: list[_Item], slots: dict[tuple[str, Any], int]
) -> list[dict[str, Any]]:
    """The manifest entries of the pieces of `batch` that arrived (are not in `failed`)."""
    failed_boxes = {(leaf, piece.box) for leaf, piece, _ in failed}
    return [
        {
            "leaf": leaf,
            "box": [list(b) for b in piece.box],
            "offset": slots[(leaf, piece.box)],
            "nbytes": piece.nbytes,
            "crc32": piece.crc32,
        }
        for leaf, piece, _ in batch
        if (leaf, piece.box) not in failed_boxes
    ]


def _missing(
    local_copies: list[StepFiles],
    remote: list[PeerCopy],
    abstract_state: Any,
    wanted: dict[str, dict[str, Any]],
) -> list[tuple[str, list[Piece]]]:
    """(leaf, the peers' copies of one piece) for each piece this process needs that no local
    copy holds, each once."""
    assembly = Assembly([*local_copies, *(copy.files for copy in remote)], wanted)
    local_paths = {os.path.join(copy.dir, DATA_FILE) for copy in local_copies}
    needed: list[tuple[str, list[Piece]]] = []
    seen: set[tuple[str, Any]] = set()
    for leaf, target in named_leaves(abstract_state):
        for region in needed_regions(target):
            plan = assembly.plan(leaf, region)
            if plan is None:
                raise InvalidCheckpoint(
                    f"{leaf} region {list(region)} is in no copy, here or on a peer"
                )
            for _, pieces in plan:
                if any(piece.path in local_paths for piece in pieces):
                    continue
                if (leaf, pieces[0].box) not in seen:
                    seen.add((leaf, pieces[0].box))
                    needed.append((leaf, pieces))
    return needed


def _split(items: list[Any]) -> list[list[Any]]:
    """Items (leaf, piece, alternatives) in batches of at most `_BATCH_BYTES` each."""
    batches: list[list[Any]] = [[]]
    size = 0
    for item in items:
        if batches[-1] and size + item[1].nbytes > _BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += item[1].nbytes
    return batches


def _peer_copy(address: str, entry: Any) -> PeerCopy | None:
    """A listing entry as a `PeerCopy`; None when it is malformed."""
    try:
        copy, manifest = str(entry["copy"]), entry["manifest"]
        files = StepFiles(f"{address}/{copy}", manifest)
        files.step  # noqa: B018 (a manifest without a step is malformed)
        return PeerCopy(address, copy, files) if isinstance(manifest.get("pieces"), list) else None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
