"""The run's event log: one JSON object per line in `<workdir>/events.jsonl`.

Every phase and decision (start, compile, restore, save, step, failure, restart, ...) is an event
with at least `time` (unix seconds) and `type`. Several processes append to the same file: each line
is written with one `write` on a file opened in append mode, which POSIX keeps whole for lines
shorter than the pipe buffer, so lines from different processes never interleave.
Goodput accounting (`resilient_jax.goodput.accounting`) reads this file back.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends events for one process; fields given at construction go into every event."""

    def __init__(
        self,
        workdir: str | None,
        clock: Callable[[], float] = time.time,
        **common: Any,
    ) -> None:
        self._path = os.path.join(workdir, EVENTS_FILE) if workdir else None
        self._clock = clock
        self._common = {k: v for k, v in common.items() if v is not None}
        self._lock = threading.Lock()
        if self._path:
            os.makedirs(workdir, exist_ok=True)

    @property
    def path(self) -> str | None:
        return self._path

    def move(self, workdir: str) -> None:
        """Later events go to `workdir`'s log (a standby slice taking a slice's identity)."""
        os.makedirs(workdir, exist_ok=True)
        self._path = os.path.join(workdir, EVENTS_FILE)

    def update_common(self, **fields: Any) -> None:
        self._common.update({k: v for k, v in fields.items() if v is not None})

    def emit(self, type: str, **fields: Any) -> dict[str, Any]:
        event = {"time": self._clock(), "type": type, **self._common}
        event.update({k: v for k, v in fields.items() if v is not None})
        if self._path:
            line = json.dumps(event, default=_jsonable) + "\n"
            with self._lock:
                fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)
        return event


def _jsonable(value: Any) -> Any:
    try:
        return value.item()  # numpy and jax scalars
    except AttributeError:
        return str(value)


def read_events(workdir_or_file: str) -> Iterator[dict[str, Any]]:
    """Yields the events of a run in file order, skipping a torn last line from a crash."""
    path = workdir_or_file
    if os.path.isdir(path):
        path = os.path.join(path, EVENTS_FILE)
    if not os.path.exists(path):
        return
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
