"""Deterministic data: sources of token sequences and the per-process, step-keyed batch loader."""

from resilient_jax.data.loader import BatchLoader
from resilient_jax.data.sources import make_source

__all__ = ["BatchLoader", "make_source"]
