"""A per-process cache of compiled XLA executables, so a restarted worker loads what it compiled
before (or what was compiled for it ahead of a fault) instead of compiling it again.

JAX's persistent compilation cache covers that only partly in a multi-process job: only JAX
process 0 writes entries, and on the CPU backend each process's cache key differs (it hashes the
process-local topology), so every other process recompiles after each restart, and the whole job
waits for the slowest. Here each process stores its own executables
(`jax.experimental.serialize_executable`) under `<jax_compilation_cache_dir>/executables/` (a
path or gs:// URL), one file per key, and loads them on the next start.

Entries are keyed by `program_key` (the train and eval steps), computed without tracing or
lowering anything, so a hit costs only the load. The key covers everything the compiled program
depends on: the config (model, optimizer, batch, schedule, health thresholds, ...) less the keys
only the host reads (`HOST_ONLY_KEYS`: where and when to save, log and evaluate, the control
plane's timeouts; a run that changes them on a restart keeps its executables), the
code (a hash of every source file of this package), the mesh (axis names, shape, device ids in
order) and the process's place (index and count), the JAX and jaxlib versions, the backend, its
version and the device kind, JAX's configuration flags and the XLA flags in the environment.
Changing any of them changes the key (`tests/test_executables.py`); what is not in that list
cannot change the program. The mesh plan (microbatches, slices) follows from config and
topology, and is in the key as well. A process that uses this cache turns JAX's own off
(`supersede_jax_cache`): an executable JAX loaded from its cache does not serialize whole.

A file that cannot be read or loaded is reported and replaced by a fresh compile: the cache never
decides correctness, and a loaded executable is the one compiled before, so resumed runs stay
bitwise equal.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jaxlib
import ml_collections
from etils import epath
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import Mesh

from resilient_jax.config import config_to_dict
from resilient_jax.contracts.event_types import EventType
from resilient_jax.events import EventLog

SUBDIR = "executables"
_jax_cache_lock = threading.Lock()
_jax_cache_superseded = False  # JAX's cache turned off for good in this process
_ENV_KEYS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# JAX flags that say where and when to cache, not what to compile: a run may move its cache.
_CACHE_FLAGS = ("jax_compilation_cache", "jax_persistent_cache", "jax_enable_compilation_cache")
# Config sections and keys that no compiled step reads (tests/test_executables.py changes every
# one of them and compares the lowered programs): left out of `program_key`. Whether a save keeps
# the state or copies it picks the program's name ("train" or "train_keep"), not its text.
HOST_ONLY_KEYS = (
    "seed",  # the data order and init's key: init is keyed by its own lowered text
    "per_device_batch_size",  # shapes programs only through the mesh plan, which the key holds
    "checkpoint",
    "coordinator",
    "log",
    "profile",
    "rehearsal",  # what is mixed into the batches, not how a batch is trained
    "data.path",
    "data.prefetch",
    "data.num_threads",
    "eval.every_steps",
    "eval.steps",
    "eval.fraction",
    "eval.datasets",
    "health.max_skips",  # the escalation after anomalous steps (`health.monitor`), on the host
    "health.max_rollbacks",
    "health.rollback_skip_batches",
    "health.straggler_factor",
    "health.straggler_window",
    "health.watchdog_timeout_s",
    "health.watchdog_startup_timeout_s",
)


def default_dir() -> str | None:
    """The cache directory under JAX's compilation cache directory, or None when that is unset."""
    root = jax.config.jax_compilation_cache_dir
    return os.path.join(root, SUBDIR) if root else None


def supersede_jax_cache() -> None:
    """Turns JAX's own persistent compilation cache off in this process when this cache is on.

    On XLA:CPU, an executable that JAX loaded from its cache serializes into an entry that lacks
    its kernels: the process that loads that entry fails at its first call into one ("NOT_FOUND:
    Function add_reduce_fusion not found"), and so does every restart after it. JAX's cache is
    written by JAX process 0 of any job, the compile-ahead helper's included, so a restarted
    worker could hit it and store such an entry. With JAX's cache off, everything stored here
    comes from a compile. What this cache does not hold (initialisation, small helpers) compiles
    in milliseconds. Takes effect from the process's next compile.
    """
    global _jax_cache_superseded
    if default_dir():
        with _jax_cache_lock:
            _jax_cache_superseded = True
            _set_jax_cache(False)


def _set_jax_cache(enabled: bool) -> None:
    """Turns JAX's persistent compilation cache on or off from the next compile on: JAX reads
    the flag once and keeps its answer until `reset_cache`."""
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


_jax_cache_holds = 0  # compiles in flight that turned JAX's cache off; the last turns it back on


@contextlib.contextmanager
def _bypassing_jax_cache():
    """JAX's persistent cache off while the body compiles something this cache will store.

    A process that runs workers turns JAX's cache off for good (`supersede_jax_cache`), but one
    that keeps it on for its other programs (a test session sharing compiles between tests, a
    notebook) must not store an executable JAX loaded from it: that entry lacks its kernels. The
    flag is process-wide, so compiles in other threads meanwhile neither read nor write JAX's
    cache; it is turned back on when the last such compile ends."""
    global _jax_cache_holds
    with _jax_cache_lock:
        held = _jax_cache_holds > 0 or bool(
            jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
        )
        if held:
            if _jax_cache_holds == 0:
                _set_jax_cache(False)
            _jax_cache_holds += 1
    try:
        yield
    finally:
        if held:
            with _jax_cache_lock:
                _jax_cache_holds -= 1
                if _jax_cache_holds == 0 and not _jax_cache_superseded:
                    _set_jax_cache(True)


@functools.cache
def code_version() -> str:
    """Hash of every Python source file of this package: any edit to the code that builds a step
    (model, optimizer, step, sharding rules) gives new keys. Read once per process."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(_PACKAGE_DIR):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                digest.update(os.path.relpath(path, _PACKAGE_DIR).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read() + b"\0")
    return digest.hexdigest()[:32]


def runtime_parts() -> list[str]:
    """What the compiled code depends on beyond the program: versions, backend, flags, place."""
    backend = jax.devices()[0].client
    flags = {k: repr(v) for k, v in jax.config.values.items() if not k.startswith(_CACHE_FLAGS)}
    return [
        jax.__version__,
        jaxlib.__version__,
        backend.platform,
        backend.platform_version,
        jax.devices()[0].device_kind,
        json.dumps(flags, sort_keys=True),
        *(f"{k}={os.environ.get(k, '')}" for k in _ENV_KEYS),
        f"process {jax.process_index()} of {jax.process_count()}",
    ]


def program_key(
    program: str, config: ml_collections.ConfigDict, mesh: Mesh, plan: dict[str, Any]
) -> str:
    """The cache key of `program` (e.g. "train") built from `config` on `mesh` with the mesh
    plan's `describe()` (microbatches, slices), without tracing."""
    parts = [
        program,
        json.dumps(program_config(config), sort_keys=True),
        code_version(),
        f"mesh {dict(mesh.shape)} devices {[d.id for d in mesh.devices.flat]}",
        json.dumps(plan, sort_keys=True),
        *runtime_parts(),
    ]
    return _digest(parts)


def program_config(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config as a dict, less `HOST_ONLY_KEYS`."""
    tree = config_to_dict(config)
    for dotted in HOST_ONLY_KEYS:
        *parents, leaf = dotted.split(".")
        node = tree
        for name in parents:
            node = node.get(name, {})
        node.pop(leaf, None)
    return tree


def lowered_key(program: str, lowered: jax.stages.Lowered, devices: Iterable[jax.Device]) -> str:
    """The cache key of a program already lowered: its text, the devices it runs on and the
    runtime. For programs that trace in a fraction of their compile (initialisation), every
    config that builds the same program shares the entry; `program_key` spares the train step
    its seconds of tracing instead."""
    parts = [program, lowered.as_text(), f"devices {[d.id for d in devices]}", *runtime_parts()]
    return _digest(parts)


def load_or_compile(
    key: str,
    lower: Callable[[], jax.stages.Lowered],
    devices: Iterable[jax.Device],
    directory: str | None,
    events: EventLog | None = None,
) -> tuple[Any, bool]:
    """The executable stored under `key` in `directory`, loaded onto `devices` (the device
    assignment it runs on); when there is none (or no cache: `directory` None), `lower()`
    compiled, and stored. Returns (compiled, hit)."""
    if not directory:
        return lower().compile(), False
    path = entry_path(directory, key)
    compiled = _load(path, list(devices), events)
    if compiled is not None:
        return compiled, True
    with _bypassing_jax_cache():
        compiled = lower().compile()
    _store(path, compiled)
    return compiled, False


def compile_ahead(key: str, lower: Callable[[], jax.stages.Lowered], directory: str) -> bool:
    """Compiles `lower()` and stores it under `key`, unless `directory` holds it already (then
    nothing is loaded). Returns whether it compiled."""
    path = entry_path(directory, key)
    if path.exists():
        return False
    with _bypassing_jax_cache():
        compiled = lower().compile()
    _store(path, compiled)
    return True


def entry_path(directory: str, key: str) -> epath.Path:
    return epath.Path(directory) / f"{key}.bin"


def _digest(parts: list[str]) -> str:
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]
    return f"{digest}-p{jax.process_index()}"


def _prepare_custom_calls() -> None:
    """Loads what a deserialized executable's custom calls need but only lowering sets up.

    On CPU, jax's linear algebra (the SVD of GaLore's basis refresh, eigh, qr, ...) calls LAPACK
    through FFI targets whose function pointers are filled in on the first lowering of such an
    op (`prepare_lapack_call`). A process that loads its step from this cache lowers nothing, and
    the first such call jumped through an empty pointer: SIGSEGV.
    """
    from jax._src.lib import lapack  # no public entry point does only this

    lapack._lapack.initialize()


def _load(path: epath.Path, devices: list[jax.Device], events: EventLog | None) -> Any | None:
    try:
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        _prepare_custom_calls()
        # The devices it runs on, not all of the backend's: a mesh over some of them (a test, a
        # shrunk job) would otherwise abort the process in XLA's sharding check.
        return serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, execution_devices=devices
        )
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
