"""Where the data stream stands: the next global batch to take and the windows never to take.

It is independent of the mesh and the process count, so it restores onto any topology; it is saved
with every checkpoint (as JSON) next to the model, and a rollback adds a skip window to it.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class DataPosition:
    next_batch: int = 0  # the global batch index the next step takes
    skips: tuple[tuple[int, int], ...] = ()  # [start, end) windows of batches never used again

    def skipping(self, start: int, end: int) -> DataPosition:
        """This position with one more skip window."""
        return dataclasses.replace(self, skips=tuple(sorted({*self.skips, (start, end)})))

    def to_json(self) -> dict[str, Any]:
        return {"next_batch": self.next_batch, "skips": [list(window) for window in self.skips]}

    @classmethod
    def from_json(cls, value: dict[str, Any] | None) -> DataPosition:
        """The position a checkpoint recorded (None or {}: the beginning of the data)."""
        if not value:
            return cls()
        skips = tuple(sorted((int(a), int(b)) for a, b in value.get("skips", [])))
        return cls(next_batch=int(value["next_batch"]), skips=skips)


def skip_forward(batch_index: int, skips: tuple[tuple[int, int], ...]) -> int:
    """The first batch index at or after `batch_index` that no skip window covers."""
    for first, end in skips:
        if first <= batch_index < end:
            batch_index = end
    return batch_index
