"""Deterministic data: corpus readers, the token store a corpus is prepared into once
(`python -m resilient_jax.data.prepare`), sources of token sequences and the per-process,
step-keyed batch loader.

The loader and the sources (Grain, and through it JAX and Orbax) load on first use: processes that
need only `data.position` (the simulated workers, the supervisor's client) skip their import."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from resilient_jax.data.loader import BatchLoader
    from resilient_jax.data.sources import make_source

__all__ = ["BatchLoader", "make_source"]


def __getattr__(name: str) -> Any:
    if name == "BatchLoader":
        from resilient_jax.data.loader import BatchLoader

        return BatchLoader
    if name == "make_source":
        from resilient_jax.data.sources import make_source

        return make_source
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
