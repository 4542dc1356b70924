"""`<workdir>/chaos_fired.json`: the run's start time, who fired which fault in which generation,
and the steps process 0 scheduled for random loss faults.

Each fault fires once per run, even across restarts: a fault recorded in an earlier generation
(or by an earlier incarnation of the same process) is spent. Writers take an exclusive `flock` on
a side file and replace the JSON atomically, so readers never need the lock and several processes
can share one workdir.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from typing import Any

from resilient_jax.chaos.spec import Fault

FIRED_FILE = "chaos_fired.json"


class FiredRecord:
    """Reads and updates one workdir's `chaos_fired.json`."""

    def __init__(self, workdir: str) -> None:
        self.path = os.path.join(workdir, FIRED_FILE)
        self._lock_path = self.path + ".lock"
        self._cache: tuple[float, dict[str, Any]] | None = None

    def read(self) -> dict[str, Any]:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            data = {}
        data.setdefault("fired", {})
        data.setdefault("scheduled", {})
        return data

    def read_if_changed(self) -> dict[str, Any]:
        """The record, re-read only when the file's mtime moved (cheap to call every step)."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            mtime = -1
        if self._cache is None or self._cache[0] != mtime:
            self._cache = (mtime, self.read())
        return self._cache[1]

    def update(self, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self.read()
            change(data)
            tmp = f"{self.path}.tmp.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        return data


def is_spent(data: dict[str, Any], fault: Fault, generation: int, process: int, pid: int) -> bool:
    """Fired in an earlier generation, or by an earlier incarnation of this process."""
    records = data["fired"].get(fault.key, {})
    if any(r["generation"] < generation for r in records.values()):
        return True
    mine = records.get(str(process))
    return mine is not None and mine["pid"] != pid
