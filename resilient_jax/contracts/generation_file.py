"""The generation file: only the current generation writes the run's shared state.

The supervisor advances `<workdir>/generation.json` (`advance`) before it starts a generation, and
as soon as it gives one up after a failure. A worker holds a `GenerationFence` for its own
generation and checks it (`check`) before it appends to the run's event log and before it
commits a checkpoint step: a worker the supervisor has given up (its agent frozen, its host cut
off) can then never write over what the next generation does. Its heartbeat thread checks the
same file, so it also stops itself (`worker.client`).

A missing or unreadable file fences nothing: a run without a supervisor has no generations.
"""

from __future__ import annotations

import json
import os

GENERATION_FILE = "generation.json"


class Fenced(RuntimeError):
    """This process's generation was superseded: it must write nothing more and stop."""

    def __init__(self, generation: int, current: int) -> None:
        super().__init__(
            f"generation {generation} was superseded by generation {current}: stopping (fenced)"
        )
        self.generation = generation
        self.current = current


def current(workdir: str) -> int | None:
    """The generation the supervisor runs now, per the file; None when there is none."""
    try:
        with open(os.path.join(workdir, GENERATION_FILE)) as f:
            value = json.load(f).get("generation")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def advance(workdir: str, generation: int) -> None:
    """Makes `generation` the current one (never moves back); atomic for every reader."""
    now = current(workdir)
    if now is not None and now >= generation:
        return
    path = os.path.join(workdir, GENERATION_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"generation": generation}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class GenerationFence:
    """A worker's view of the fence: its own generation against the run's current one."""

    def __init__(self, workdir: str, generation: int) -> None:
        self.workdir = workdir
        self.generation = generation

    def superseded_by(self) -> int | None:
        """The newer generation that replaced this one; None while this one is current."""
        now = current(self.workdir)
        return now if now is not None and now > self.generation else None

    def check(self) -> None:
        """Raises `Fenced` once a newer generation started."""
        newer = self.superseded_by()
        if newer is not None:
            raise Fenced(self.generation, newer)
