"""Weighted mixtures of datasets, and the example stream the loader cuts batches from.

Without a mixture, example k of the stream is element k of a seeded, epoch-aware permutation of the
source (Grain's `MapDataset.shuffle` permutes each epoch with its own seed). With one
(`config.data.mixture = "PATH:WEIGHT,..."`), each dataset is permuted that way with a seed derived
from (seed, its place in the list), and `MapDataset.mix` interleaves them in a fixed pattern with
the weights' proportions: which dataset example k comes from, and which of its examples, is
arithmetic on k. The stream is defined for every k >= 0 (each dataset goes through its own epochs
at its own pace, so a small dataset repeats more often than a large one), and example k is a pure
function of (datasets, weights, seed, k): independent of the mesh and the process count, and a
resume needs only the global batch index (`DataPosition`), as for a single dataset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain
import numpy as np


class Mixture:
    """Datasets (Grain random-access sources of equal-length sequences) and their weights."""

    def __init__(self, components: Sequence[tuple[Any, float]]) -> None:
        self.sources = [source for source, _ in components]
        self.weights = [float(weight) for _, weight in components]
        if not self.sources or min(self.weights) <= 0:
            raise ValueError(f"a mixture needs datasets with positive weights, got {self.weights}")

    def stream(self, seed: int) -> grain.MapDataset:
        shuffled = [
            grain.MapDataset.source(source).shuffle(seed=component_seed(seed, i))
            for i, source in enumerate(self.sources)
        ]
        return grain.MapDataset.mix(shuffled, self.weights)

    def __repr__(self) -> str:
        parts = ", ".join(f"{s!r}: {w:g}" for s, w in zip(self.sources, self.weights, strict=True))
        return f"Mixture({parts})"


def component_seed(seed: int, index: int) -> int:
    """The shuffle seed of a mixture's `index`-th dataset: distinct datasets, distinct orders."""
    return int(np.random.SeedSequence((seed, index)).generate_state(1)[0])


def example_stream(source: Any, seed: int) -> grain.MapDataset:
    """Example k of the data for every k >= 0: a shuffled source, or a mixture's interleaving."""
    if isinstance(source, Mixture):
        return source.stream(seed)
    return grain.MapDataset.source(source).shuffle(seed=seed)
