"""JAX's persistent compilation cache for supervised workers: a restart loads the step it compiled
before instead of compiling it again.

After a failure every worker is a fresh process, so without a cache each generation pays the full
XLA compile of the train step (on a 2-core CPU most of the time from fault to first step). The
cache key covers the module, the compile options and the device assignment, so a generation on the
same mesh hits the entries of an earlier one, a reshaped mesh compiles once and later reshapes to
it hit too. The loaded executable is the one compiled before, so resumed runs stay bitwise equal.

The supervisor passes the cache to workers through JAX's own environment variables, so workers
need no code for it and settings the user made in the environment win. Only JAX process 0 writes
entries (JAX's rule), and on the CPU backend the other processes' keys differ from process 0's, so
they never hit; the train step and the checksum pass are therefore also kept per process under
the same directory (`resilient_jax.executables`).
"""

from __future__ import annotations

import os

import ml_collections

from resilient_jax.contracts import env_vars

# JAX skips caching computations that compiled faster than 1 s by default; a restart compiles
# many small ones (state checksums, restore helpers) that add up on a busy host.
MIN_COMPILE_TIME_S = 0.0


def cache_dir(coordinator_config: ml_collections.ConfigDict, workdir: str) -> str | None:
    """The cache directory for a run (a relative path is under the workdir), or None when off."""
    configured = coordinator_config.compilation_cache_dir
    if not configured:
        return None
    return os.path.join(os.path.abspath(workdir), configured)


def cache_env(coordinator_config: ml_collections.ConfigDict, workdir: str) -> dict[str, str]:
    """Environment variables that turn the cache on in a worker ({} when off)."""
    path = cache_dir(coordinator_config, workdir)
    if path is None:
        return {}
    return {
        env_vars.JAX_COMPILATION_CACHE_DIR: path,
        env_vars.JAX_MIN_COMPILE_TIME_S: str(MIN_COMPILE_TIME_S),
    }
