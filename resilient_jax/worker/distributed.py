"""Worker side of multi-controller start-up: join the JAX job the environment describes.

Under `launch/local_cluster.py` the supervisor sets `RJ_*` variables (coordinator address, process
count and id, slice count, generation). On a real cluster (`RJ_AUTO_DISTRIBUTED=1`: SLURM, Open MPI,
Cloud TPU) `jax.distributed.initialize()` finds everything by itself. With neither, the run is a
single process and nothing is initialised.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping

import jax
import ml_collections

from resilient_jax.config import BadInput
from resilient_jax.contracts import env_vars
from resilient_jax.contracts.event_types import EventType
from resilient_jax.control import protocol
from resilient_jax.events import EventLog

_MEGASCALE_NAMES = (
    env_vars.MEGASCALE_COORDINATOR_ADDRESS,
    env_vars.MEGASCALE_NUM_SLICES,
    env_vars.MEGASCALE_SLICE_ID,
    env_vars.MEGASCALE_PORT,
)


class WorkerEnvError(BadInput, ValueError):
    """The environment a launcher gave this worker does not add up: fatal, a restart would get the
    same environment."""


@dataclasses.dataclass(frozen=True)
class WorkerEnv:
    """Where this process sits in the job, as the launcher described it."""

    num_processes: int
    process_id: int
    num_slices: int
    generation: int
    slice: int | None  # physical slice id under the local supervisor, else None
    coordinator_address: str | None  # None when JAX detected the cluster itself

    @property
    def processes_per_slice(self) -> int:
        return self.num_processes // self.num_slices

    @property
    def slice_index(self) -> int:
        """The slice's position in this generation's topology (not its physical id)."""
        return self.process_id // self.processes_per_slice


def read_env(environ: Mapping[str, str] = os.environ) -> WorkerEnv | None:
    """The supervisor-given place of this process, or None when no supervisor started it."""
    address = environ.get(env_vars.COORDINATOR_ADDRESS)
    if not address:
        return None
    try:
        num_processes = int(environ[env_vars.NUM_PROCESSES])
        process_id = int(environ[env_vars.PROCESS_ID])
        num_slices = int(environ.get(env_vars.NUM_SLICES, "1"))
        generation = int(environ.get(env_vars.GENERATION, "0"))
        slice_id = environ.get(env_vars.SLICE)
    except (KeyError, ValueError) as e:
        raise WorkerEnvError(
            f"{env_vars.COORDINATOR_ADDRESS} is set but the worker environment lacks {e}"
        ) from e
    if not 0 <= process_id < num_processes or num_slices < 1 or num_processes % num_slices:
        raise WorkerEnvError(
            f"inconsistent worker environment: process {process_id} of {num_processes} "
            f"in {num_slices} slices"
        )
    return WorkerEnv(
        num_processes=num_processes,
        process_id=process_id,
        num_slices=num_slices,
        generation=generation,
        slice=int(slice_id) if slice_id is not None else None,
        coordinator_address=address,
    )


def megascale_env(env: WorkerEnv, port: str) -> dict[str, str]:
    """The MEGASCALE_* variables of Cloud TPU multislice for this process's place: the generation's
    slices numbered as the supervisor numbered them, slice 0's first host (JAX process 0's host)
    coordinating the cross-slice transfers on `port`. One slice needs none."""
    if env.num_slices == 1:
        return {}
    host, _ = protocol.split_address(env.coordinator_address or "")
    return {
        env_vars.MEGASCALE_COORDINATOR_ADDRESS: f"{host}:{port}",
        env_vars.MEGASCALE_NUM_SLICES: str(env.num_slices),
        env_vars.MEGASCALE_SLICE_ID: str(env.slice_index),
        env_vars.MEGASCALE_PORT: port,
    }


def initialize_from_env(
    coordinator_config: ml_collections.ConfigDict,
    events: EventLog | None = None,
    environ: Mapping[str, str] = os.environ,
) -> WorkerEnv | None:
    """Joins the JAX job described by the environment; call before any other JAX call.

    Returns None (and initialises nothing) for a single-process run. Emits a `jax_init` event with
    its duration. The JAX heartbeat timeout comes from `coordinator.jax_heartbeat_timeout_s`: short,
    so that survivors of a dead peer are aborted quickly instead of waiting in a collective, but
    longer than the supervisor's own heartbeat timeout, so the supervisor names the lost process
    before JAX's abort of the survivors blurs the picture.
    """
    env = read_env(environ)
    auto = environ.get(env_vars.AUTO_DISTRIBUTED, "") == "1"
    if env is None and not auto:
        return None
    kwargs = dict(
        heartbeat_timeout_seconds=int(coordinator_config.jax_heartbeat_timeout_s),
        initialization_timeout=max(1, int(coordinator_config.startup_timeout_s)),
    )
    start = time.monotonic()
    if env is not None:
        megascale_port = environ.get(env_vars.MEGASCALE_PORT_FOR_WORKERS)
        if megascale_port:  # libtpu reads them from this process's environment at start-up
            for name in _MEGASCALE_NAMES:
                os.environ.pop(name, None)
            os.environ.update(megascale_env(env, megascale_port))
        # CPU collectives across processes need gloo; the option is ignored by GPU and TPU backends.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        host, port = protocol.split_address(env.coordinator_address or "")
        # JAX binds its service on all interfaces by default; a local job keeps it on loopback.
        bind = f"{host}:{port}" if protocol.is_loopback(host) else None
        jax.distributed.initialize(
            coordinator_address=env.coordinator_address,
            num_processes=env.num_processes,
            process_id=env.process_id,
            coordinator_bind_address=bind,
            **kwargs,
        )
    else:
        jax.distributed.initialize(**kwargs)
        num_slices = int(environ.get(env_vars.NUM_SLICES, "1"))
        env = WorkerEnv(
            num_processes=jax.process_count(),
            process_id=jax.process_index(),
            num_slices=num_slices,
            generation=int(environ.get(env_vars.GENERATION, "0")),
            slice=None,
            coordinator_address=None,
        )
    if events is not None:
        events.emit(
            EventType.JAX_INIT,
            duration_s=time.monotonic() - start,
            process=env.process_id,
            num_processes=env.num_processes,
            generation=env.generation,
        )
    return env
