"""The start of a generation: every worker of it, each with its place in the job, from a ready
standby where there is one, else a fresh process; and the standbys for the next generation.

A generation's workers get a fresh JAX coordinator port, so no survivor of an earlier generation
can join it. Standbys (`resilient_jax.worker.standby`) are started once the job trains, so their
imports do not slow the start of the generation they would serve.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from resilient_jax.contracts import env_vars
from resilient_jax.contracts.event_types import EventType
from resilient_jax.control import processes
from resilient_jax.control.worker_env import free_port, placement_env
from resilient_jax.events import EventLog


class WorkerLauncher:
    """Starts `worker_argv` as the workers of each generation; keeps standbys if asked to."""

    def __init__(
        self,
        worker_argv: Sequence[str],
        sink: processes.OutputSink,
        events: EventLog,
        use_standbys: bool,
        cwd: str | None = None,
    ) -> None:
        self._argv = list(worker_argv)
        self._sink = sink
        self._events = events
        self._cwd = cwd
        self._standby_argv = processes.standby_argv(self._argv) if use_standbys else None
        self._standbys: list[processes.Standby] = []

    def start_generation(
        self,
        generation: int,
        slices: Sequence[int],
        processes_per_slice: int,
        shared_env: Mapping[str, str],
        observed_mtbf_s: float | None,
    ) -> list[processes.WorkerProcess]:
        """Starts `processes_per_slice` workers on each of `slices`, numbered slice by slice, and
        writes a `process_start` event for each."""
        port = free_port()
        num_processes = len(slices) * processes_per_slice
        workers: list[processes.WorkerProcess] = []
        try:
            for index, slice_id in enumerate(slices):
                for local in range(processes_per_slice):
                    process = index * processes_per_slice + local
                    env = dict(shared_env)
                    env.update(
                        placement_env(
                            port, num_processes, process, len(slices), slice_id, generation
                        )
                    )
                    if observed_mtbf_s is not None:  # the local checkpoint interval follows it
                        env[env_vars.OBSERVED_MTBF_S] = f"{observed_mtbf_s:.1f}"
                    prefix = f"[g{generation} s{slice_id} p{process}] "
                    worker = self._spawn(env, prefix, process, slice_id, generation)
                    workers.append(worker)
                    self._events.emit(
                        EventType.PROCESS_START,
                        pid=worker.pid,
                        process=process,
                        slice=slice_id,
                        generation=generation,
                        num_processes=num_processes,
                        num_slices=len(slices),
                    )
        except BaseException:  # e.g. the command cannot start: leave no half generation behind
            processes.stop(workers, grace_s=0.0)
            raise
        return workers

    def refill_standbys(self, wanted: int, shared_env: Mapping[str, str]) -> None:
        """Starts standbys until `wanted` are alive (a no-op without standbys)."""
        if self._standby_argv is None:
            return
        if len(self._standbys) >= wanted and all(s.alive for s in self._standbys):
            return
        processes.discard([s for s in self._standbys if not s.alive])
        self._standbys = [s for s in self._standbys if s.alive]
        while len(self._standbys) < wanted:
            self._standbys.append(
                processes.spawn_standby(self._standby_argv, shared_env, self._sink, cwd=self._cwd)
            )

    def close(self) -> None:
        """Ends the standbys no generation will need."""
        processes.discard(self._standbys)
        self._standbys = []

    def _spawn(
        self, env: dict[str, str], prefix: str, process: int, slice_id: int, generation: int
    ) -> processes.WorkerProcess:
        """A worker from a ready standby if there is one, else a freshly started process."""
        while self._standbys:
            standby = self._standbys.pop(0)
            if not standby.alive:
                processes.discard([standby])
                continue
            try:
                return processes.assign(standby, env, prefix, process, slice_id, generation)
            except OSError:  # it died just now
                processes.discard([standby])
        return processes.spawn(
            self._argv, env, self._sink, prefix, process, slice_id, generation, cwd=self._cwd
        )
