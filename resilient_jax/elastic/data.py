"""The global batch of a step, in parts: what an elastic slice computes is a pure function of
(batch index, part), never of which slices are alive.

Batch `k` is rows `[k*B, (k+1)*B)` of the example stream, exactly as in the single-runtime mode
(`data.loader`); part `p` of `elastic.slices` parts is its rows `[p*B/P, (p+1)*B/P)`. A slice
computes its own part and, when slices are lost, some of theirs (`owned_parts`), so every example
of every step is trained exactly once whatever the membership.

`StepIndex` stands in for the loop's loader: the elastic step reads its rows itself, per part, so
the loop hands it only the batch index (with the same data position, skips included).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from resilient_jax.data.mixture import example_stream
from resilient_jax.data.position import DataPosition, skip_forward
from resilient_jax.elastic.slice_step import global_array
from resilient_jax.mesh import batch_sharding
from resilient_jax.train.context import RunContext


def owned_parts(members: tuple[int, ...], slice_id: int, num_parts: int) -> list[int]:
    """The parts `slice_id` computes: its own (if it has one) and its share of the parts whose
    slices are not members, dealt round-robin over the members in slice order."""
    orphans = [p for p in range(num_parts) if p not in members]
    rank = members.index(slice_id)
    own = [slice_id] if slice_id < num_parts else []
    return sorted(own + orphans[rank :: len(members)])


class PartRows:
    """Rows of one part of one global batch, laid out and sharded for this slice's mesh."""

    def __init__(self, ctx: RunContext, source: Any, shape: tuple[int, int, int]) -> None:
        self._examples = example_stream(source, ctx.config.seed)
        self._batch = ctx.config.global_batch_size
        self._shape = shape
        self._rows = shape[0] * shape[1]
        self._sharding = batch_sharding(ctx.mesh)

    def __call__(self, batch_index: int, part: int) -> jax.Array:
        first = batch_index * self._batch + part * self._rows
        rows = np.stack([self._examples[first + i] for i in range(self._rows)])
        return global_array(rows.reshape(self._shape), self._sharding)


class StepIndex:
    """The loop's loader in elastic mode: yields (batch index, batch index)."""

    def __init__(self, position: DataPosition) -> None:
        self.last_wait_s = 0.0
        self.seek(position)

    def seek(self, position: DataPosition) -> None:
        self._skips = tuple(sorted(position.skips))
        self._next = skip_forward(position.next_batch, self._skips)

    @property
    def position(self) -> DataPosition:
        return DataPosition(next_batch=self._next, skips=self._skips)

    def next(self) -> tuple[int, int]:
        batch_index = self._next
        self._next = skip_forward(self._next + 1, self._skips)
        return batch_index, batch_index

    def close(self) -> None:
        pass
