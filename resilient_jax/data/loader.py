"""Batches keyed by global batch index, each process loading only the rows its devices own.

Batch `k` is rows `[k*B, (k+1)*B)` of the example stream (`mixture.example_stream`: a seeded,
epoch-aware permutation of the source's examples, or a weighted mixture of such), laid out as
`[microbatches, B / microbatches, seq_len + 1]` and sharded over the data-parallel mesh axes, so
each device holds contiguous rows. Which rows form a batch depends only on (dataset, seed, k, B),
never on the mesh or the number of processes: the global array is the same for 1, 2 or 4 processes,
and after a reshape every step still sees the same examples.

Normally batch k feeds step k; the data position (`DataPosition`: the next batch and the windows
never to use) is saved with the model so a resume (or a rollback that skips a bad data window)
continues exactly. Grain threads load upcoming
batches while the current step runs.
"""

from __future__ import annotations

import time
from typing import Any

import grain
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from resilient_jax.data.mixture import example_stream
from resilient_jax.data.position import DataPosition, skip_forward
from resilient_jax.mesh import batch_sharding
from resilient_jax.topology import MeshPlan

# Far more batches than any run takes; Grain's range is lazy, so this costs nothing.
_HORIZON = 1 << 40


class BatchLoader:
    def __init__(
        self,
        config: ml_collections.ConfigDict,
        mesh: Mesh,
        plan: MeshPlan,
        source: Any,
        position: DataPosition | None = None,  # None: the beginning of the data
    ) -> None:
        self._examples = example_stream(source, config.seed)
        self._batch = config.global_batch_size
        self._shape = (plan.microbatches, self._batch // plan.microbatches, config.data.seq_len + 1)
        self._sharding = batch_sharding(mesh)
        self._read = grain.ReadOptions(
            num_threads=config.data.num_threads, prefetch_buffer_size=config.data.prefetch
        )
        # Rows of a batch (offsets in [0, B)) that this process's devices hold, in order.
        self._device_rows = {
            device: self._offsets(index)
            for device, index in self._sharding.addressable_devices_indices_map(self._shape).items()
        }
        self._local_rows = np.unique(np.concatenate(list(self._device_rows.values())))
        self.last_wait_s = 0.0
        self._skips: tuple[tuple[int, int], ...] = ()
        self._iter = None
        self.seek(position or DataPosition())

    def _offsets(self, index: tuple[slice, ...]) -> np.ndarray:
        microbatch, row = index[0], index[1]
        rows_per_mb = self._shape[1]
        mbs = range(self._shape[0])[microbatch]
        rows = range(rows_per_mb)[row]
        return np.asarray([m * rows_per_mb + r for m in mbs for r in rows], dtype=np.int64)

    def rows_of_batch(self, batch_index: int) -> np.ndarray:
        """The local rows of one batch as host arrays [local_rows, seq_len + 1]."""
        first = batch_index * self._batch
        return np.stack([self._examples[first + int(o)] for o in self._local_rows])

    def seek(self, position: DataPosition) -> None:
        """Continue from a saved data position (restore, rollback); drops anything prefetched.

        Its `skips` are windows `[first, end)` of batch indices that are never used: a rollback
        after an anomaly skips the data that caused it, and a rerun skips the same batches.
        """
        self.close()
        self._skips = tuple(sorted(position.skips))
        self._next = skip_forward(position.next_batch, self._skips)
        batches = grain.MapDataset.range(self._next, _HORIZON).map(self.rows_of_batch)
        self._iter = iter(batches.to_iter_dataset(self._read))

    def close(self) -> None:
        """Stops the prefetch threads (a thread still reading at interpreter exit can abort it)."""
        if self._iter is not None:
            self._iter.close()
            self._iter = None

    @property
    def position(self) -> DataPosition:
        """The data position to checkpoint: independent of mesh and process count."""
        return DataPosition(next_batch=self._next, skips=self._skips)

    def next(self) -> tuple[int, jax.Array]:
        """(batch index, global batch array [microbatches, rows, seq_len + 1] int32)."""
        start = time.perf_counter()
        local = next(self._iter)
        self.last_wait_s = time.perf_counter() - start
        where = {int(o): i for i, o in enumerate(self._local_rows)}

        def shard(index: tuple[slice, ...]) -> np.ndarray:
            rows = local[[where[int(o)] for o in self._offsets(index)]]
            num_microbatches = len(range(self._shape[0])[index[0]])
            return rows.reshape(num_microbatches, -1, self._shape[2])

        batch_index = self._next
        self._next += 1
        if skip_forward(self._next, self._skips) != self._next:
            self.seek(self.position)
        return batch_index, jax.make_array_from_callback(self._shape, self._sharding, shard)
