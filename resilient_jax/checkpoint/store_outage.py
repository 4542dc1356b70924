"""Bounded waits on the persistent tier: an object store that stops answering never holds training.

What an unreachable store does to the libraries underneath (measured against a local GCS
emulator, `FIELD_NOTES.md`): TensorStore retries a request 32 times (about 15 minutes) before a
save fails, and gcsfs (directories, JSON items, commit markers) about 33 s per operation. Orbax
builds its TensorStore context internally (`get_ts_context`, no parameter reaches it from a
`CheckpointManager`), and TensorStore reads no environment variable for `gcs_request_retries`:
there is no supported path to shorten those retries, so the bound is kept here instead, around
them. The checkpointer never waits on the store for longer than `checkpoint.persistent_timeout_s`:

- an in-flight save that has not committed within it is an outage (`persistent_outage` event),
  and is left to finish or fail in the background;
- before each persistent save a probe asks whether the directory answers, waiting at most
  `PROBE_WAIT_S` (the question runs in a daemon thread, so a store that never answers costs the
  training thread nothing more; an endpoint that refuses connections is an answer at once); no
  answer, or a save still in flight, skips the save with a `save_failed` event, and the next
  one is tried on schedule;
- the first save that commits again ends the outage (`persistent_recovered`);
- an outage longer than `checkpoint.persistent_outage_limit_s` stops the run after a local save.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import urllib.parse

import fsspec
from etils import epath

from resilient_jax.checkpoint.background import BackgroundThread, Job
from resilient_jax.checkpoint.persistent import RUN_ID_FILE
from resilient_jax.contracts.event_types import EventType
from resilient_jax.events import EventLog

# The longest a probe holds the training thread. A healthy store answers in milliseconds; the
# bound must stay far below a persistent save's own cost.
PROBE_WAIT_S = 2.0
GCS_ENDPOINT = ("storage.googleapis.com", 443)


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


class StoreProbe:
    """Whether a directory answers, asked in a daemon thread and waited for a bounded time.

    The thread lives across probes: starting one per probe costs the training thread the time a
    new thread takes to be scheduled, tens of milliseconds on a loaded host, before every
    persistent save. A probe still stuck in a store's retries keeps its thread; the next probe
    gets a fresh one."""

    def __init__(self, directory: str) -> None:
        self._directory = epath.Path(directory)
        self._thread: BackgroundThread | None = None
        self._last: Job | None = None

    def unreachable(self, wait_s: float) -> str | None:
        """None if the directory answered within `wait_s` (existing or not), else why not.

        Each call asks anew: an earlier probe may still sit in gcsfs's retries (about 33 s)
        after the store came back, and must not hide that it answers now."""
        outcome: list[str | None] = []

        def ask() -> None:
            try:
                _ask_store(os.fspath(self._directory), wait_s)
                outcome.append(None)
            except Exception as e:
                outcome.append(f"{self._directory} unreachable: {one_line(e)}")

        if self._thread is None or (self._last is not None and not self._last.done()):
            if self._thread is not None:
                self._thread.stop()  # ends once its stuck probe returns
            self._thread = BackgroundThread("store-probe")
        self._last = self._thread.submit(ask)
        self._last.wait(wait_s)
        if not outcome:
            return f"{self._directory} did not answer within {wait_s:g}s"
        return outcome[0]

    def close(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None


def store_endpoint(path: str) -> tuple[str, int] | None:
    """(host, port) that gcsfs sends the requests for a gs:// `path` to: `STORAGE_EMULATOR_HOST`
    (an emulator, a GCS-compatible store) or Google's; None for other paths."""
    if not path.startswith("gs://"):
        return None
    endpoint = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if not endpoint:
        return GCS_ENDPOINT
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    parsed = urllib.parse.urlsplit(endpoint)
    return parsed.hostname or "localhost", parsed.port or (443 if parsed.scheme == "https" else 80)


def _refuses_connections(path: str, wait_s: float) -> str | None:
    """Why the store's endpoint refused a TCP connection, if it did. A refusal is an answer,
    and a final one: gcsfs would retry it for about 33 s before saying so."""
    endpoint = store_endpoint(path)
    if endpoint is None:
        return None
    try:
        with socket.create_connection(endpoint, timeout=wait_s):
            return None
    except ConnectionRefusedError:
        return f"connection to {endpoint[0]}:{endpoint[1]} refused"
    except OSError:
        return None  # slow or unresolvable: the store's own request tells


def _ask_store(path: str, wait_s: float) -> None:
    """One request to the store holding `path`; raises if it does not answer. A missing path is
    an answer. gcsfs answers from its listing cache when it can, so that is dropped first."""
    refused = _refuses_connections(path, wait_s)
    if refused is not None:
        raise ConnectionRefusedError(refused)
    fs, stripped = fsspec.core.url_to_fs(path)
    fs.invalidate_cache(stripped)
    with contextlib.suppress(FileNotFoundError):
        fs.info(stripped)


class Outage:
    """When the persistent tier stopped answering, and the events that say so."""

    def __init__(self, events: EventLog, directory: str) -> None:
        self._events = events
        self._directory = directory
        self.since: float | None = None  # time.monotonic() of the first failure; None: healthy

    def duration_s(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since

    def begin(self, step: int | None, cause: str) -> None:
        """Records a failure; the first of an outage is a `persistent_outage` event."""
        if self.since is not None:
            return
        self.since = time.monotonic()
        self._events.emit(EventType.PERSISTENT_OUTAGE, step=step, cause=cause)
        logging.warning(
            "persistent tier %s unreachable (%s): training goes on with the local tier",
            self._directory,
            cause,
        )

    def end(self, step: int) -> None:
        """A persistent save committed: the outage, if any, is over."""
        if self.since is None:
            return
        outage_s = self.duration_s()
        self.since = None
        self._events.emit(EventType.PERSISTENT_RECOVERED, step=step, outage_s=outage_s)
        logging.warning("persistent tier %s reachable again after %.0fs", self._directory, outage_s)


def read_cached_run_id(workdir: str) -> str | None:
    """The persistent tier's run id as the workdir last saw it (`cache_run_id`): what tells
    this run's local copies from an earlier run's while the persistent tier cannot be read."""
    path = os.path.join(workdir, RUN_ID_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def cache_run_id(workdir: str, run_id: str | None) -> None:
    if run_id is None or read_cached_run_id(workdir) == run_id:
        return
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, RUN_ID_FILE), "w") as f:
        f.write(run_id)
