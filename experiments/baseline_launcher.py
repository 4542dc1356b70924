"""The common baseline for chaos experiments: a plain multi-controller JAX job under a scheduler.

What it does, and what it leaves out compared with `resilient_jax.control.Supervisor`:

- It starts every worker with the job's `RJ_*` environment (as SLURM or a JobSet would) but no
  supervisor address: workers send no heartbeats and report no progress to anyone.
- It does not watch workers one by one. A job counts as failed once it has *died as a JAX job*:
  a worker exited non-zero and every other worker has exited too, which happens when JAX's
  coordination service aborts the survivors of a dead peer after its heartbeat timeout
  (`coordinator.jax_heartbeat_timeout_s`, 100 s by default in JAX). A worker frozen by an
  injected hang never exits by itself; it counts as gone once the others have.
- It then restarts every worker, on the same number of slices, from the newest checkpoint the
  workers find (the experiment turns the local tier off: the last persistent one). A slice that is
  lost for a while must come back first: a fixed-size job waits for its nodes.
- It injects the same timed faults as the supervisor does (`SupervisorAction`, with the signals of
  `resilient_jax.control.fault_injection`), and writes the
  events goodput accounting reads (`process_start`, `fault_injected`, `failure_detected`,
  `restart`, `stop`) on the supervisor's lane.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import IO

from resilient_jax.contracts import env_vars
from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.contracts.faults import FaultKind
from resilient_jax.control import ClusterSpec, SupervisorAction, processes
from resilient_jax.control.fault_injection import ACTION_SIGNALS, action_targets
from resilient_jax.control.generation import RestartReason
from resilient_jax.control.worker_env import free_port, placement_env
from resilient_jax.events import EventLog

# A scheduler sees hardware faults, not preemption notices it sends itself.
_KINDS = (FaultKind.KILL, FaultKind.LOSE_SLICE, FaultKind.HANG)


class BaselineLauncher:
    def __init__(
        self,
        cluster: ClusterSpec,
        worker_argv: Sequence[str],
        workdir: str,
        actions: Sequence[SupervisorAction] = (),
        out: IO[str] | None = None,
        cwd: str | None = None,
        save_grace_s: float = 60.0,
        poll_s: float = 0.05,
    ) -> None:
        for action in actions:
            if action.kind not in _KINDS or action.at_s is None:
                raise ValueError(f"the baseline injects timed kill, hang, lose_slice: {action}")
        self._cluster = cluster
        self._argv = list(worker_argv)
        self._cwd = cwd
        self._pending = list(actions)
        self._sink = processes.OutputSink(out if out is not None else sys.stdout)
        self._events = EventLog(workdir, process="supervisor", source="baseline")
        self._save_grace_s = save_grace_s
        self._poll_s = poll_s
        self._workers: list[processes.WorkerProcess] = []
        self._frozen: set[int] = set()  # processes an injected hang stopped
        self._faults: list[float] = []  # when faults hit the running generation
        self._outage_until = 0.0  # monotonic time a lost slice is back
        self._generation = -1
        self._start = 0.0

    def run(self, time_limit_s: float) -> int:
        """Runs until training completes (0) or the time limit (124, workers asked to save)."""
        self._start = time.monotonic()
        deadline = self._start + time_limit_s
        self._start_generation()
        try:
            while True:
                now = time.monotonic()
                if now > deadline:
                    processes.stop(self._workers, self._save_grace_s)
                    return self._finish(ExitCode.TIME_LIMIT, "time limit reached")
                self._fire(now)
                codes = [w.poll() for w in self._workers]
                if all(code == ExitCode.FINISHED for code in codes):
                    return self._finish(ExitCode.FINISHED, "completed")
                if self._job_died(codes):
                    self._restart(now, codes, deadline)
                time.sleep(self._poll_s)
        finally:
            processes.stop(self._workers, grace_s=0.0)

    def _job_died(self, codes: list[int | None]) -> bool:
        failed = any(code not in (None, ExitCode.FINISHED) for code in codes)
        gone = all(
            code is not None or w.process in self._frozen
            for code, w in zip(codes, self._workers, strict=True)
        )
        return failed and gone

    def _restart(self, now: float, codes: list[int | None], deadline: float) -> None:
        since = min(self._faults) if self._faults else now
        self._events.emit(
            EventType.FAILURE_DETECTED,
            cause="job_aborted",
            generation=self._generation,
            latency_s=round(now - since, 4),
            exit_codes=codes,
        )
        self._say(f"job died (exit codes {codes}); restarting every worker")
        processes.stop(self._workers, grace_s=0.0)
        while time.monotonic() < min(self._outage_until, deadline):
            time.sleep(self._poll_s)  # a fixed-size job waits for its lost nodes
        self._start_generation(RestartReason.FAILURE)

    def _start_generation(self, reason: RestartReason | None = None) -> None:
        self._generation += 1
        self._frozen, self._faults = set(), []
        c = self._cluster
        num_processes = c.num_slices * c.processes_per_slice
        if reason is not None:
            self._events.emit(EventType.RESTART, generation=self._generation, reason=reason)
        port = free_port()
        env = dict(os.environ)
        env.pop(env_vars.SUPERVISOR_ADDRESS, None)
        env.update(
            {
                env_vars.XLA_FLAGS: (
                    f"--xla_force_host_platform_device_count={c.devices_per_process}"
                ),
                env_vars.JAX_PLATFORMS: "cpu",
                env_vars.PYTHONUNBUFFERED: "1",
            }
        )
        self._workers = []
        for process in range(num_processes):
            slice_id = process // c.processes_per_slice
            place = placement_env(
                "127.0.0.1", port, num_processes, process, c.num_slices, slice_id, self._generation
            )
            worker_env = {**env, **place}
            prefix = f"[g{self._generation} s{slice_id} p{process}] "
            worker = processes.spawn(
                self._argv,
                worker_env,
                self._sink,
                prefix,
                process,
                slice_id,
                self._generation,
                cwd=self._cwd,
            )
            self._workers.append(worker)
            self._events.emit(
                EventType.PROCESS_START,
                pid=worker.pid,
                process=process,
                slice=slice_id,
                generation=self._generation,
            )

    def _fire(self, now: float) -> None:
        due = [a for a in self._pending if now - self._start >= (a.at_s or 0.0)]
        for action in due:
            targets = action_targets(self._workers, action, self._cluster.processes_per_slice)
            if not targets:
                continue  # as in the supervisor: a fault waits for its hardware to run
            self._pending.remove(action)
            for worker in targets:
                worker.signal(ACTION_SIGNALS[action.kind], group=True)
                if action.kind == FaultKind.HANG:
                    self._frozen.add(worker.process)
            if action.kind == FaultKind.LOSE_SLICE:
                self._outage_until = max(self._outage_until, now + (action.duration_s or 0.0))
            self._faults.append(now)
            self._events.emit(
                EventType.FAULT_INJECTED,
                kind=action.kind,
                slice=action.slice,
                processes=[w.process for w in targets],
                generation=self._generation,
            )
            self._say(f"injected {action.kind} on slice {action.slice}")

    def _finish(self, code: int, reason: str) -> int:
        self._events.emit(
            EventType.STOP, reason=reason, exit_code=code, generation=self._generation
        )
        self._say(f"stop (exit {code}): {reason}")
        return code

    def _say(self, message: str) -> None:
        self._sink.write_line(f"[baseline] {message}")
