"""The start of a generation: every worker of it, each with its place in the job, started by the
agent of its host (`hosts`), from a ready standby where the agent has one; and the standbys.

A generation's workers get a fresh JAX coordinator port on process 0's host, so no survivor of an
earlier generation can join it. Standbys (`resilient_jax.worker.standby`) are asked for once the
job trains, so their imports do not slow the start of the generation they would serve.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import ml_collections

from resilient_jax.contracts import env_vars
from resilient_jax.contracts.event_types import EventType
from resilient_jax.control import agent_protocol as ap
from resilient_jax.control import processes
from resilient_jax.control.hosts import HostRecord, HostRegistry, RemoteWorker
from resilient_jax.control.worker_env import free_port, placement_env
from resilient_jax.events import EventLog


def worker_places(
    hosts: HostRegistry, slices: Sequence[int], processes_per_slice: int
) -> list[tuple[int, int, HostRecord]]:
    """(process, slice, host) of every worker of a job on `slices`: each slice's processes on its
    admitted hosts in name order, as many on each as it has slots. Raises OSError when a slice's
    hosts have too few slots."""
    places = []
    for index, slice_id in enumerate(slices):
        free = [(h, h.slots) for h in hosts.hosts_for(slice_id)]
        for local in range(processes_per_slice):
            while free and free[0][1] == 0:
                free.pop(0)
            if not free:
                raise OSError(f"slice {slice_id} has too few worker slots on its hosts")
            host, left = free[0]
            free[0] = (host, left - 1)
            places.append((index * processes_per_slice + local, slice_id, host))
    return places


class WorkerLauncher:
    """Starts `worker_argv` as the workers of each generation through the hosts' agents."""

    def __init__(
        self,
        worker_argv: Sequence[str],
        hosts: HostRegistry,
        events: EventLog,
        coordinator: ml_collections.ConfigDict,
        devices_per_process: int,
        cache_env: Mapping[str, str],
        cwd: str | None = None,
    ) -> None:
        self._argv = list(worker_argv)
        self._hosts = hosts
        self._events = events
        self._cwd = cwd
        self._devices = devices_per_process
        self._cache_env = dict(cache_env)
        use_standbys = bool(coordinator.standby_workers)
        self._standby_argv = processes.standby_argv(self._argv) if use_standbys else None
        self._standby_idle_cpu = bool(coordinator.standby_idle_cpu)
        self._standbys_asked = False

    def start_generation(
        self,
        generation: int,
        slices: Sequence[int],
        processes_per_slice: int,
        observed_mtbf_s: float | None,
    ) -> list[RemoteWorker]:
        """Starts `processes_per_slice` workers on each of `slices` (numbered slice by slice, on
        the slice's hosts in name order, as many as each has slots) and writes a `process_start`
        event for each. Raises OSError when a start fails."""
        num_processes = len(slices) * processes_per_slice
        places = worker_places(self._hosts, slices, processes_per_slice)
        coordinator = places[0][2].address
        port = free_port()
        workers: list[RemoteWorker] = []
        try:
            for process, slice_id, host in places:
                placement = placement_env(
                    coordinator, port, num_processes, process, len(slices), slice_id, generation
                )
                command = self._command(
                    generation, process, slice_id, host, placement, observed_mtbf_s
                )
                workers.append(self._hosts.start(host, generation, process, command))
            self._hosts.await_started(workers)
        except BaseException:  # e.g. the command cannot start: leave no half generation behind
            processes.stop(workers, grace_s=0.0)
            raise
        for worker in workers:
            self._events.emit(
                EventType.PROCESS_START,
                pid=worker.pid,
                process=worker.process,
                slice=worker.slice,
                host=worker.host,
                generation=generation,
                num_processes=num_processes,
                num_slices=len(slices),
                standby=worker.from_standby,
            )
        return workers

    def _command(
        self,
        generation: int,
        process: int,
        slice_id: int,
        host: HostRecord,
        placement: dict[str, str],
        observed_mtbf_s: float | None,
    ) -> ap.Start:
        """The agent's start command for one worker, its `placement` environment completed."""
        if observed_mtbf_s is not None:  # the local checkpoint interval follows it
            placement[env_vars.OBSERVED_MTBF_S] = f"{observed_mtbf_s:.1f}"
        # Where a restore finds the local-tier pieces this host's RAM disk lacks.
        placement[env_vars.LOCAL_TIER_PEERS] = ",".join(self._hosts.tier_peers(host.name))
        return ap.Start(
            generation=generation,
            process=process,
            slice=slice_id,
            argv=list(self._argv),
            placement=placement,
            devices=self._devices,
            cwd=self._cwd,
            cache_env=dict(self._cache_env),
        )

    def refill_standbys(self) -> None:
        """Asks every agent, and each that joins later, to keep one standby per worker slot."""
        if self._standby_argv is None or self._standbys_asked:
            return
        self._standbys_asked = True
        self._hosts.set_standbys(
            ap.Standbys(
                count=-1,  # one per slot
                argv=list(self._standby_argv),
                devices=self._devices,
                cwd=self._cwd,
                cache_env=self._cache_env,
                idle_cpu=self._standby_idle_cpu,
            )
        )

    def close(self) -> None:
        """Ends the standbys no generation will need."""
        self._hosts.set_standbys(ap.Standbys(count=0))
