"""A per-process cache of compiled XLA executables, so a restarted worker loads what it compiled
before instead of compiling it again.

JAX's persistent compilation cache covers that only partly in a multi-process job: only JAX
process 0 writes entries, and on the CPU backend each process's cache key differs (it hashes the
process-local topology), so every other process recompiles after each restart, and the whole job
waits for the slowest. Here each process stores its own executables
(`jax.experimental.serialize_executable`) under `<jax_compilation_cache_dir>/executables/` (a
path or gs:// URL), one file per key, and loads them on the next start.

The key covers the lowered program (shapes, shardings, the computation itself), the JAX and
jaxlib versions, the backend and its version, the XLA flags in the environment, the global device
assignment, and this process's index and the process count. A file that cannot be read or loaded
is reported and replaced by a fresh compile: the cache never decides correctness, and a loaded
executable is the one compiled before, so resumed runs stay bitwise equal.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import uuid
from collections.abc import Iterable
from typing import Any

import jax
import jaxlib
from etils import epath
from jax.experimental import serialize_executable

from resilient_jax.contracts.event_types import EventType
from resilient_jax.events import EventLog

SUBDIR = "executables"
_ENV_KEYS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


def default_dir() -> str | None:
    """The cache directory under JAX's compilation cache directory, or None when that is unset."""
    root = jax.config.jax_compilation_cache_dir
    return os.path.join(root, SUBDIR) if root else None


def compile_cached(
    lowered: jax.stages.Lowered,
    devices: Iterable[jax.Device],
    directory: str | None,
    events: EventLog | None = None,
) -> tuple[Any, bool]:
    """`lowered` compiled, from this process's cache in `directory` when it holds it (None: no
    cache). `devices`: the device assignment the program runs on. Returns (compiled, hit)."""
    if not directory:
        return lowered.compile(), False
    path = epath.Path(directory) / f"{_key(lowered, devices)}.bin"
    compiled = _load(path, events)
    if compiled is not None:
        return compiled, True
    compiled = lowered.compile()
    _store(path, compiled)
    return compiled, False


def _key(lowered: jax.stages.Lowered, devices: Iterable[jax.Device]) -> str:
    backend = jax.devices()[0].client
    parts = [
        lowered.as_text(),
        jax.__version__,
        jaxlib.__version__,
        backend.platform,
        backend.platform_version,
        *(f"{k}={os.environ.get(k, '')}" for k in _ENV_KEYS),
        ",".join(str(d.id) for d in devices),
        f"process {jax.process_index()} of {jax.process_count()}",
    ]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]
    return f"{digest}-p{jax.process_index()}"


def _load(path: epath.Path, events: EventLog | None) -> Any | None:
    try:
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except FileNotFoundError:
        return None
    except Exception as e:  # a damaged or incompatible entry: compile instead
        logging.warning("executable cache: cannot load %s (%s); compiling", path, e)
        if events is not None:
            events.emit(EventType.COMPILE_CACHE_INVALID, path=str(path), error=str(e)[:200])
        return None


def _store(path: epath.Path, compiled: Any) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        blob = pickle.dumps(serialize_executable.serialize(compiled))
        tmp = path.parent / f"{path.name}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.write_bytes(blob)
        tmp.replace(path)  # readers see a whole file or none (local paths; a copy on GCS)
    except Exception as e:  # a cache that cannot be written costs speed, not the run
        logging.warning("executable cache: cannot write %s (%s)", path, e)
