"""The run's event log: one JSON object per line in `<workdir>/events.jsonl`.

Every phase and decision (start, compile, restore, save, step, failure, restart, ...) is an event
with at least `time` (unix seconds) and `type`. Several processes append to the same file: each line
is written with one `write` on a file opened in append mode, which POSIX keeps whole for lines
shorter than the pipe buffer, so lines from different processes never interleave.
Goodput accounting (`resilient_jax.goodput.accounting`) reads this file back. A supervised
worker's log is fenced (`fence_with`): once a newer generation started it appends nothing.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from resilient_jax.contracts.generation_file import GenerationFence

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
        self.fence: GenerationFence | None = None
        if self._path:
            os.makedirs(workdir, exist_ok=True)

    def fence_with(self, fence: GenerationFence) -> None:
        """From now on `emit` raises `generation_file.Fenced` instead of appending once `fence`'s
        generation is superseded."""
        self.fence = fence

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
            if self.fence is not None:
                self.fence.check()
            line = strict_json(event) + "\n"
            with self._lock:
                fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)
        return event


def strict_json(value: Any) -> str:
    """`value` as strict JSON (RFC 8259, what `jq` and strict parsers read): a missing number
    (NaN, an infinity) is `null`, numpy and jax scalars are plain numbers, anything else that JSON
    has no type for is its `str`. Python's own `json.dumps` would write `NaN`."""
    return json.dumps(_finite(value), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    try:
        return _finite(value.item())  # numpy and jax scalars
    except (AttributeError, ValueError):  # no scalar (ValueError: an array of several values)
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
