"""Slice outages announced by the chaos hook, read from the run's event log.

When fault injection (`resilient_jax.chaos`, `lose_slice:slice=S,step=K,for=T`) takes a slice down,
its processes write a `chaos` event (kind `lose_slice`, the slice's index in its generation,
`for_s`) and kill themselves. The supervisor detects the deaths like any other; this reader tells it
how long the slice stays out, so the slice is re-admitted when the outage ends, not after the
default cooldown.
"""

from __future__ import annotations

import dataclasses
import json
import os

from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.faults import FaultKind
from resilient_jax.events import EVENTS_FILE


@dataclasses.dataclass(frozen=True)
class Outage:
    generation: int | None
    slice_index: int  # position in that generation's slice list
    until: float  # unix time the slice is back


class OutageReader:
    """Reads the event log incrementally (from where it stopped) for `lose_slice` chaos events."""

    def __init__(self, workdir: str) -> None:
        self._path = os.path.join(workdir, EVENTS_FILE)
        self._offset = 0

    def read_new(self) -> list[Outage]:
        try:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._offset += end
        outages = []
        for line in data[:end].splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(event, dict) or event.get("type") != EventType.CHAOS:
                continue
            if event.get("kind") != FaultKind.LOSE_SLICE or not isinstance(event.get("slice"), int):
                continue
            generation = event.get("generation")
            outages.append(
                Outage(
                    generation=generation if isinstance(generation, int) else None,
                    slice_index=event["slice"],
                    until=float(event.get("time", 0.0)) + float(event.get("for_s", 0.0)),
                )
            )
        return outages
