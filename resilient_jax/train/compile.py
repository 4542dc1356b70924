"""Compiling the train step, ahead of time, with a per-process cache of the compiled executable.

A restarted worker must not pay the XLA compile of the train step again. JAX's persistent
compilation cache covers that only partly in a multi-process job: only JAX process 0 writes
entries, and on the CPU backend each process's cache key differs (it hashes the process-local
topology), so every other process recompiles after each restart and the whole job waits for the
slowest. Here each process also stores its own compiled step (`jax.experimental.
serialize_executable`) under `<jax_compilation_cache_dir>/train_step/` (a path or gs:// URL),
keyed by everything that decides the executable, and loads it on the next start with the same
key: a restart onto a mesh seen before costs tracing and lowering only, on every process.

The key covers the lowered program (shapes, shardings, the computation itself), the JAX and
jaxlib versions, the backend and its version, the XLA flags in the environment, the global device
assignment of the mesh, and this process's index and the process count. A file that cannot be
read or loaded is reported and replaced by a fresh compile; the cache never decides correctness,
and a loaded step is the executable compiled before, so resumed runs stay bitwise equal.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import time
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
from etils import epath
from jax.experimental import serialize_executable

from resilient_jax import mesh as mesh_lib
from resilient_jax.train.context import RunContext
from resilient_jax.train.step import make_train_step

CACHE_SUBDIR = "train_step"
_ENV_KEYS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


def compile_step(ctx: RunContext, cache_dir: str | None = None) -> Any:
    """The compiled train step for the context's mesh; emits a `compile` event with its duration
    and whether it came from the cache. `cache_dir`: where compiled steps are kept (default: under
    JAX's compilation cache directory when one is set; None there: no cache)."""
    start = time.perf_counter()
    step_fn = make_train_step(ctx.config, ctx.mesh)
    rows = ctx.config.global_batch_size // ctx.plan.microbatches
    batch = jax.ShapeDtypeStruct(
        (ctx.plan.microbatches, rows, ctx.config.data.seq_len + 1),
        jnp.int32,
        sharding=mesh_lib.batch_sharding(ctx.mesh),
    )
    scale = jax.ShapeDtypeStruct((), jnp.float32, sharding=mesh_lib.replicated(ctx.mesh))
    lowered = step_fn.lower(ctx.abstract_state, batch, scale)
    if cache_dir is None:
        root = jax.config.jax_compilation_cache_dir
        cache_dir = os.path.join(root, CACHE_SUBDIR) if root else None
    cache = ExecutableCache(cache_dir, ctx) if cache_dir else None
    compiled = cache.load(lowered) if cache is not None else None
    hit = compiled is not None
    if compiled is None:
        compiled = lowered.compile()
        if cache is not None:
            cache.store(lowered, compiled)
    fields: dict[str, Any] = {"duration_s": time.perf_counter() - start}
    if cache is not None:
        fields["cache"] = "hit" if hit else "miss"
    ctx.events.emit("compile", **fields)
    return compiled


class ExecutableCache:
    """This process's compiled train steps in one directory, one file per key."""

    def __init__(self, directory: str, ctx: RunContext) -> None:
        self.directory = directory
        self._ctx = ctx

    def key(self, lowered: jax.stages.Lowered) -> str:
        backend = jax.devices()[0].client
        parts = [
            lowered.as_text(),
            jax.__version__,
            jaxlib.__version__,
            backend.platform,
            backend.platform_version,
            *(f"{k}={os.environ.get(k, '')}" for k in _ENV_KEYS),
            ",".join(str(d.id) for d in self._ctx.mesh.devices.flat),
            f"process {jax.process_index()} of {jax.process_count()}",
        ]
        digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]
        return f"{digest}-p{jax.process_index()}"

    def _path(self, lowered: jax.stages.Lowered) -> epath.Path:
        return epath.Path(self.directory) / (self.key(lowered) + ".bin")

    def load(self, lowered: jax.stages.Lowered) -> Any | None:
        path = self._path(lowered)
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except FileNotFoundError:
            return None
        except Exception as e:  # a damaged or incompatible entry: compile instead
            logging.warning("compiled step cache: cannot load %s (%s); compiling", path, e)
            self._ctx.events.emit("compile_cache_invalid", path=str(path), error=str(e)[:200])
            return None

    def store(self, lowered: jax.stages.Lowered, compiled: Any) -> None:
        path = self._path(lowered)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            tmp = path.parent / f"{path.name}.{uuid.uuid4().hex[:8]}.tmp"
            tmp.write_bytes(blob)
            tmp.rename(path)  # readers see a whole file or none (local paths; a copy on GCS)
        except Exception as e:  # a cache that cannot be written costs speed, not the run
            logging.warning("compiled step cache: cannot write %s (%s)", path, e)
