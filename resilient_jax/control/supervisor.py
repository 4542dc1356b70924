"""The supervisor: runs a multi-slice job's workers, detects failures, restarts on what is left.

A *generation* is one start of all workers on a set of physical slices, with a fresh JAX
coordinator port. The supervisor watches it (process exits, heartbeats, step progress) until it
completes, fails, is preempted, or a returned slice can be re-admitted; then it stops every worker
and starts the next generation. Workers restore from the newest checkpoint on whatever mesh the
new topology gives (`topology.plan_mesh(strict=False)` keeps the global batch with more microbatches).

Why stop the survivors of a failure instead of keeping them: on CPU a survivor inside a gloo
collective with a dead peer never returns, and JAX aborts survivors anyway once its coordination
service misses the peer; a clean restart from a checkpoint is the one path that always works.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

import ml_collections

from resilient_jax import topology as topology_lib
from resilient_jax.config import ConfigError
from resilient_jax.contracts import env_vars, exit_codes
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.control import compile_cache, detector, processes
from resilient_jax.control.outages import OutageReader
from resilient_jax.control.policy import (
    ReshapeLedger,
    RestartPolicy,
    SlicePool,
    scale_up_pays,
)
from resilient_jax.control.server import HeartbeatServer, WorkerReport
from resilient_jax.control.stragglers import Straggler, StragglerWatch
from resilient_jax.events import EventLog
from resilient_jax.topology import MeshPlan, plan_mesh

ACTION_KINDS = ("kill", "hang", "lose_slice", "preempt")
# A generation's step time counts for the reshape ledger once it is this many steps past its first.
_STEPS_BEFORE_STEP_TIME = 5
_ACTION_SIGNALS = {
    "kill": signal.SIGKILL,
    "lose_slice": signal.SIGKILL,
    "hang": signal.SIGSTOP,
    "preempt": signal.SIGTERM,
}


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    num_slices: int
    processes_per_slice: int = 1
    devices_per_process: int = 1
    spare_slices: int = 0

    def __post_init__(self) -> None:
        for name in ("num_slices", "processes_per_slice", "devices_per_process"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.spare_slices < 0:
            raise ValueError(f"spare_slices={self.spare_slices} must be >= 0")


@dataclasses.dataclass(frozen=True)
class SupervisorAction:
    """A fault the supervisor injects into its own workers (tests, experiments, demos).

    kind: "kill" (SIGKILL), "hang" (SIGSTOP: no heartbeats, no progress), "lose_slice" (SIGKILL
    every process of the slice; the slice stays out for `duration_s`, then may be re-admitted) or
    "preempt" (SIGTERM, as a cloud preemption notice: the workers save and exit ExitCode.PREEMPTED).
    `process` is the index inside the slice (None: every process of it). It fires once, when any
    worker has reported `at_step` or `at_s` seconds after the supervisor started, whichever is set.
    Faults hit hardware that runs: aimed at a slice that is out (evicted, lost), it hits the
    running slice at that position modulo the number running; with none running, it waits.
    """

    kind: str
    slice: int
    process: int | None = None
    at_step: int | None = None
    at_s: float | None = None
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"action kind {self.kind!r}; allowed: {', '.join(ACTION_KINDS)}")
        if (self.at_step is None) == (self.at_s is None):
            raise ValueError("an action needs exactly one of at_step and at_s")


@dataclasses.dataclass(frozen=True)
class SupervisorResult:
    exit_code: int  # 0 only when every worker of the last generation finished training
    reason: str
    generations: int
    failures: int


@dataclasses.dataclass(frozen=True)
class _Outcome:
    # complete | failure | fatal | preempted | scale_up | straggler | interrupted | time_limit
    kind: str
    failure: detector.Failure | None = None
    straggler: Straggler | None = None


def plan_for(config: ml_collections.ConfigDict, num_slices: int, cluster: ClusterSpec) -> MeshPlan:
    """The mesh the trainer will build on `num_slices` slices (raises ConfigError if none fits).

    `plan_mesh` only counts devices, so stand-ins replace the devices the supervisor never sees.
    """
    processes = num_slices * cluster.processes_per_slice
    devices = tuple(object() for _ in range(processes * cluster.devices_per_process))
    topo = topology_lib.Topology(
        num_slices=num_slices,
        num_processes=processes,
        process_index=0,
        devices=devices,  # type: ignore[arg-type]
    )
    return plan_mesh(config, topo, strict=False)


def action_targets(workers, action: SupervisorAction, processes_per_slice: int) -> list:
    """The running workers a fault-injection action hits: its slice, and its process within the
    slice when it names one."""
    return [
        w
        for w in workers
        if w.slice == action.slice
        and w.running
        and (action.process is None or w.process % processes_per_slice == action.process)
    ]


class Supervisor:
    """Runs `worker_argv` as S x P processes on simulated slices; `run()` returns the verdict."""

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        cluster: ClusterSpec,
        worker_argv: Sequence[str],
        workdir: str,
        actions: Sequence[SupervisorAction] = (),
        out: IO[str] | None = None,
        poll_interval_s: float = 0.05,
        cwd: str | None = None,
    ) -> None:
        self._config = config
        self._c = config.coordinator
        self._cluster = cluster
        self._argv = list(worker_argv)
        self._workdir = workdir
        self._cwd = cwd
        self._poll_s = poll_interval_s
        self._thresholds = detector.Thresholds.from_config(self._c)
        self._pool = SlicePool(
            cluster.num_slices, cluster.spare_slices, float(self._c.readmit_after_s)
        )
        self._policy = RestartPolicy(self._c)
        self._pending_actions = list(actions)
        for action in actions:
            if action.slice not in self._pool.all_slices:
                raise ValueError(f"action {action} names slice {action.slice}, which is no slice")
        self._sink = processes.OutputSink(out if out is not None else sys.stdout)
        self._events = EventLog(workdir, process="supervisor", source="supervisor")
        self._outages = OutageReader(workdir)
        self._token = secrets.token_hex(16)
        self._server: HeartbeatServer | None = None
        self._workers: list[processes.WorkerProcess] = []
        self._slices: list[int] = []
        self._generation = -1
        self._fault_times: dict[int, float] = {}  # process -> when an injected fault hit it
        self._max_step: int | None = None  # highest step any worker reported, any generation
        self._gen_max_step: int | None = None
        self._stragglers: StragglerWatch | None = None  # the running generation's
        # Step time per slice count and restart costs: whether re-admitting a slice pays.
        self._ledger = ReshapeLedger()
        self._gen_started = 0.0  # when stopping the previous generation began
        self._gen_first_step: int | None = None
        self._scale_up_deferred = False  # said so in this generation
        # Workers started ahead of the next generation (imports done while the job trains).
        self._standby_argv = processes.standby_argv(self._argv) if self._c.standby_workers else None
        self._standbys: list[processes.Standby] = []
        self._signals: list[int] = []
        self._start_time = 0.0

    # Public.

    def request_stop(self, signum: int) -> None:
        """Asks the supervisor to save and stop (safe to call from a signal handler)."""
        self._signals.append(signum)

    def run(self, time_limit_s: float | None = None) -> SupervisorResult:
        self._start_time = time.monotonic()
        deadline = None if time_limit_s is None else self._start_time + time_limit_s
        restore_handlers = self._install_signal_handlers()
        self._server = HeartbeatServer(self._token)
        try:
            return self._supervise(deadline)
        except OSError as e:  # the worker command cannot start (missing file, permissions)
            return self._finish(2, f"cannot start workers: {e}")
        finally:
            processes.stop(self._workers, grace_s=0.0)
            processes.discard(self._standbys)
            self._server.close()
            restore_handlers()

    # The loop over generations.

    def _supervise(self, deadline: float | None) -> SupervisorResult:
        slices = self._pool.choose([])
        fitted, reason = self._fit(slices)
        if reason or len(fitted) < len(slices):
            return self._finish(2, reason or f"cannot run on {len(slices)} slices")
        self._start_generation(slices)
        while True:
            outcome = self._watch(deadline)
            if outcome.kind == "complete":
                return self._finish(0, f"completed at step {self._gen_max_step}")
            if outcome.kind in ("interrupted", "time_limit"):
                self._stop_workers(float(self._c.save_grace_s))
                if outcome.kind == "time_limit":
                    return self._finish(
                        ExitCode.TIME_LIMIT, "time limit reached; workers asked to save and stop"
                    )
                name = signal.Signals(self._signals[0]).name
                return self._finish(
                    ExitCode.INTERRUPTED, f"interrupted by {name}; workers asked to save and stop"
                )
            if outcome.kind == "fatal":
                assert outcome.failure is not None and outcome.failure.exit_code is not None
                code = outcome.failure.exit_code
                return self._finish(
                    code,
                    f"process {outcome.failure.process} stopped the run: "
                    f"{exit_codes.FATAL[code]} (exit {code}); see its output",
                )
            if outcome.kind == "scale_up":
                result = self._scale_up()
            elif outcome.kind == "straggler":
                assert outcome.straggler is not None
                result = self._evict_straggler(outcome.straggler)
            elif outcome.kind == "preempted":
                result = self._after_preemption()
            else:
                assert outcome.failure is not None
                result = self._after_failure(outcome.failure)
            if result is not None:
                return result

    def _after_failure(self, failure: detector.Failure) -> SupervisorResult | None:
        now = time.monotonic()
        worker = self._worker(failure.process)
        slice_id = worker.slice if worker else None
        since = self._fault_times.get(failure.process, failure.since) if worker else failure.since
        self._events.emit(
            "failure_detected",
            cause=failure.cause,
            process=failure.process,
            scope="job" if failure.process is None else "process",  # job: no process stood out
            slice=slice_id,
            pid=worker.pid if worker else None,
            generation=self._generation,
            latency_s=round(now - since, 4),
            exit_code=failure.exit_code,
            step=self._gen_max_step,
            detail=failure.detail,
        )
        self._say(f"failure: {failure.detail} (process {failure.process}, slice {slice_id})")
        stopping_s = self._stop_workers(float(self._c.kill_grace_s))
        # A process that exited with an error code ran and reported a software error: its
        # hardware is presumed fine and the slice is retried in place (a repeat is a crash loop).
        # Killed by a signal, silent or stuck: the slice is lost and evicted whole.
        software_error = failure.cause == detector.CAUSE_ERROR or (
            failure.exit_code is not None and failure.exit_code > 0
        )
        lost_slice = slice_id is not None and not software_error
        self._policy.record_failure(self._gen_max_step, hardware=lost_slice)
        reason = self._policy.stop_reason()
        if reason:
            return self._finish(1, f"{reason}; last: {failure.detail}")
        if lost_slice:
            assert slice_id is not None
            self._apply_announced_outages()
            returns_at = self._pool.evict(slice_id, time.monotonic())
            self._events.emit(
                "evict",
                slice=slice_id,
                generation=self._generation,
                cause=failure.cause,
                returns_in_s=None if returns_at is None else round(returns_at - now, 3),
            )
            self._say(f"evicted slice {slice_id}")
        slices, reason = self._wait_for_slices()
        if reason:
            code = ExitCode.INTERRUPTED if self._signals else 1
            return self._finish(code, f"{reason}; last failure: {failure.detail}")
        backoff = self._policy.backoff()
        if backoff and self._sleep(backoff):
            return self._finish(ExitCode.INTERRUPTED, "interrupted during back-off")
        self._start_generation(slices, reason="failure", stopping_s=stopping_s, backoff_s=backoff)
        return None

    def _after_preemption(self) -> SupervisorResult | None:
        # The others save at the step JAX's preemption sync agreed on; give them the time.
        self._stop_workers(float(self._c.save_grace_s))
        self._say("workers preempted; restarting without counting a failure")
        slices, _ = self._fit(self._pool.choose(self._slices))
        self._start_generation(slices, reason="preemption")
        return None

    def _scale_up(self) -> SupervisorResult | None:
        slices, _ = self._fit(self._pool.choose(self._slices))
        added = [s for s in slices if s not in self._slices]
        self._events.emit(
            "scale_up", slices=added, generation=self._generation, step=self._gen_max_step
        )
        self._say(f"re-admitting slices {added}: asking workers to save and stop")
        # SIGTERM is the save-and-stop request: JAX's preemption notifier turns it into a step all
        # processes agree on (multihost_utils.reached_preemption_sync_point), where the
        # checkpointer saves and the worker exits with ExitCode.PREEMPTED.
        stopping_s = self._stop_workers(float(self._c.save_grace_s))
        self._start_generation(slices, reason="scale_up", stopping_s=stopping_s)
        return None

    def _evict_straggler(self, straggler: Straggler) -> SupervisorResult | None:
        assert straggler.slice is not None
        self._say(
            f"evicting slice {straggler.slice}: process {straggler.process} is a straggler "
            f"({straggler.ratio:.2f}x); asking workers to save and stop"
        )
        # Nothing failed: every worker saves at the step JAX's preemption sync agrees on, so the
        # eviction loses no steps, and it does not count against the restart budget.
        stopping_s = self._stop_workers(float(self._c.save_grace_s))
        now = time.monotonic()
        returns_at = self._pool.evict(straggler.slice, now)
        self._events.emit(
            "evict",
            slice=straggler.slice,
            generation=self._generation,
            cause="straggler",
            process=straggler.process,
            returns_in_s=None if returns_at is None else round(returns_at - now, 3),
        )
        slices, reason = self._wait_for_slices()
        if reason:
            return self._finish(1, f"{reason}; after evicting a straggler")
        self._start_generation(slices, reason="straggler", stopping_s=stopping_s)
        return None

    def _straggler_outcome(self, reports: dict[int, WorkerReport]) -> _Outcome | None:
        """Reports new stragglers; an outcome when one should be evicted."""
        assert self._stragglers is not None
        for straggler in self._stragglers.update(reports):
            evict, why = self._should_evict(straggler)
            ratio = straggler.ratio
            self._events.emit(
                "straggler",
                process=straggler.process,
                slice=straggler.slice,
                generation=self._generation,
                step=self._gen_max_step,
                ratio=round(ratio, 3) if ratio != float("inf") else "inf",
                median_s=round(straggler.median_s, 4),
                reference_s=round(straggler.reference_s, 4),
                action="evict" if evict else "report",
                why=why,
            )
            self._say(
                f"straggler: process {straggler.process} (slice {straggler.slice}) takes "
                f"{ratio:.2f}x its peers' time per step; {why}"
            )
            if evict:
                return _Outcome("straggler", straggler=straggler)
        return None

    def _should_evict(self, straggler: Straggler) -> tuple[bool, str]:
        """Evict when the job gets faster: a spare takes the slice's place, or the other slices
        alone step faster than the job waiting for the straggler (the step time grows by
        N / N_after on fewer devices, so the ratio must exceed that)."""
        if not self._c.evict_stragglers:
            return False, "coordinator.evict_stragglers is off"
        if straggler.slice is None:
            return False, "its slice is unknown"
        current = self._slices
        after, _ = self._fit(self._pool.choose(current, exclude=(straggler.slice,)))
        if len(after) < max(1, int(self._c.min_slices)):
            return False, f"{len(after)} slices would be left, below min_slices"
        if len(after) >= len(current):
            return True, "a spare slice replaces it"
        needed = len(current) / len(after)
        if straggler.ratio > needed:
            return True, f"the other {len(after)} slice(s) alone are faster (ratio > {needed:.2f})"
        return False, f"the other {len(after)} slice(s) alone are slower (ratio <= {needed:.2f})"

    def _wait_for_slices(self) -> tuple[list[int], str | None]:
        """Slices for the next generation; waits (bounded) for returns if too few are healthy."""
        min_slices = int(self._c.min_slices)
        give_up = time.monotonic() + float(self._c.wait_for_slices_s)
        said = False
        while True:
            self._pool.refresh(time.monotonic())
            slices, _ = self._fit(self._pool.choose(self._slices))
            if len(slices) >= min_slices:
                return slices, None
            early = self._pool.readmit_suspects(time.monotonic(), min_slices - len(slices))
            if early:
                self._events.emit("readmit", slices=early, generation=self._generation)
                self._say(f"too few healthy slices: re-admitting {early} before their cooldown")
                continue
            back = self._pool.next_return()
            if back is None or back > give_up:
                return [], (
                    f"only {len(slices)} healthy slices, below min_slices={min_slices}, "
                    f"and none returns within wait_for_slices_s={self._c.wait_for_slices_s:g}"
                )
            if not said:
                self._say(f"{len(slices)} healthy slices < min_slices={min_slices}: waiting")
                said = True
            if self._sleep(min(back - time.monotonic(), 1.0)):
                return [], "interrupted while waiting for slices"

    def _fit(self, slices: list[int]) -> tuple[list[int], str | None]:
        """The longest prefix of `slices` the config can run on (the global batch must divide)."""
        error = "no slices"
        for n in range(len(slices), 0, -1):
            try:
                plan_for(self._config, n, self._cluster)
            except ConfigError as e:
                error = f"cannot run on {n} slices: {e}" if n == len(slices) else error
                continue
            return slices[:n], None
        return [], error

    # One generation.

    def _start_generation(
        self,
        slices: list[int],
        reason: str | None = None,
        stopping_s: float | None = None,
        backoff_s: float | None = None,
    ) -> None:
        assert self._server is not None
        self._generation += 1
        self._server.forget_before(self._generation)
        self._slices = list(slices)
        self._fault_times = {}
        self._gen_max_step = None
        self._gen_first_step = None
        self._scale_up_deferred = False
        self._gen_started = time.monotonic() - (stopping_s or 0.0)
        cluster = self._cluster
        num_processes = len(slices) * cluster.processes_per_slice
        self._stragglers = StragglerWatch(
            float(self._config.health.straggler_factor),
            int(self._config.health.straggler_window),
            {p: slices[p // cluster.processes_per_slice] for p in range(num_processes)},
        )
        if reason is not None:
            plan = plan_for(self._config, len(slices), cluster)
            self._events.emit(
                "restart",
                generation=self._generation,
                reason=reason,
                slices=slices,
                num_slices=len(slices),
                num_processes=num_processes,
                devices=num_processes * cluster.devices_per_process,
                mesh=plan.describe(),
                stopping_s=None if stopping_s is None else round(stopping_s, 4),
                backoff_s=backoff_s,
                failures=self._policy.failures,
            )
            self._say(f"generation {self._generation} on slices {slices} ({reason})")
        port = _free_port()
        self._workers = []
        for index, slice_id in enumerate(slices):
            for local in range(cluster.processes_per_slice):
                process = index * cluster.processes_per_slice + local
                env = self._worker_env(port, num_processes, process, len(slices), slice_id)
                prefix = f"[g{self._generation} s{slice_id} p{process}] "
                worker = self._spawn_worker(env, prefix, process, slice_id)
                self._workers.append(worker)
                self._events.emit(
                    "process_start",
                    pid=worker.pid,
                    process=process,
                    slice=slice_id,
                    generation=self._generation,
                    num_processes=num_processes,
                    num_slices=len(slices),
                )

    def _shared_env(self) -> dict[str, str]:
        """What every worker of the job gets, whatever its place (also a standby's start)."""
        assert self._server is not None
        env = dict(os.environ)
        flags = [
            f
            for f in env.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        flags.append(f"--xla_force_host_platform_device_count={self._cluster.devices_per_process}")
        env.update(
            {
                env_vars.SUPERVISOR_ADDRESS: self._server.address,
                env_vars.SUPERVISOR_PID: str(os.getpid()),
                env_vars.RUN_TOKEN: self._token,
                "XLA_FLAGS": " ".join(flags),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.setdefault("JAX_PLATFORMS", "cpu")  # simulated slices are host devices
        for key, value in compile_cache.cache_env(self._c, self._workdir).items():
            env.setdefault(key, value)  # a cache configured in our own environment wins
        env.pop(env_vars.AUTO_DISTRIBUTED, None)
        return env

    def _worker_env(
        self, port: int, num_processes: int, process: int, num_slices: int, slice_id: int
    ) -> dict[str, str]:
        env = self._shared_env()
        env.update(
            {
                env_vars.COORDINATOR_ADDRESS: f"127.0.0.1:{port}",
                env_vars.NUM_PROCESSES: str(num_processes),
                env_vars.PROCESS_ID: str(process),
                env_vars.NUM_SLICES: str(num_slices),
                env_vars.SLICE: str(slice_id),
                env_vars.GENERATION: str(self._generation),
            }
        )
        if self._policy.failures:  # the checkpointer's local interval follows the failure rate
            elapsed = time.monotonic() - self._start_time
            env[env_vars.OBSERVED_MTBF_S] = f"{elapsed / self._policy.failures:.1f}"
        return env

    def _spawn_worker(
        self, env: dict[str, str], prefix: str, process: int, slice_id: int
    ) -> processes.WorkerProcess:
        """A worker from a ready standby if there is one, else a freshly started process."""
        while self._standbys:
            standby = self._standbys.pop(0)
            if not standby.alive:
                processes.discard([standby])
                continue
            try:
                return processes.assign(standby, env, prefix, process, slice_id, self._generation)
            except OSError:  # it died just now
                processes.discard([standby])
        return processes.spawn(
            self._argv, env, self._sink, prefix, process, slice_id, self._generation, cwd=self._cwd
        )

    def _refill_standbys(self) -> None:
        """Starts standbys for the next generation (as many workers as the largest one has)."""
        if self._standby_argv is None:
            return
        wanted = self._pool.target * self._cluster.processes_per_slice
        if len(self._standbys) >= wanted and all(s.alive for s in self._standbys):
            return
        processes.discard([s for s in self._standbys if not s.alive])
        self._standbys = [s for s in self._standbys if s.alive]
        env = self._shared_env()
        while len(self._standbys) < wanted:
            self._standbys.append(
                processes.spawn_standby(self._standby_argv, env, self._sink, cwd=self._cwd)
            )

    def _watch(self, deadline: float | None) -> _Outcome:
        """Polls the running generation until something needs a decision."""
        assert self._server is not None
        completed_at: float | None = None
        while True:
            now = time.monotonic()
            if self._signals:
                return _Outcome("interrupted")
            if deadline is not None and now > deadline:
                return _Outcome("time_limit")
            reports = self._server.reports(self._generation)
            steps = [r.step for r in reports.values() if r.step is not None]
            if steps:
                self._gen_max_step = max(steps)
                self._max_step = max(self._max_step or 0, self._gen_max_step)
                self._measure(now, reports)
            self._fire_actions(now)
            returned = self._pool.refresh(now)
            if returned:
                self._say(f"slices {returned} are healthy again")
            running: dict[int, float] = {}
            # A worker that stops the run on purpose outranks its peers, which may fail a moment
            # later in a collective with it: look at fatal exits first.
            by_severity = sorted(self._workers, key=lambda w: w.poll() not in exit_codes.FATAL)
            for worker in by_severity:
                code = worker.poll()
                if code is None:
                    running[worker.process] = worker.started_at
                elif code == 0:
                    completed_at = now if completed_at is None else completed_at
                elif code in exit_codes.PREEMPTED_STATUSES:
                    return _Outcome("preempted")
                else:
                    return _Outcome(
                        "fatal" if code in exit_codes.FATAL else "failure",
                        detector.Failure(
                            detector.CAUSE_EXIT,
                            worker.process,
                            f"process {worker.process} {_describe_exit(code)}",
                            since=now - self._poll_s,
                            exit_code=code,
                        ),
                    )
            if not running:
                return _Outcome("complete")
            if completed_at is not None and now - completed_at > float(self._c.save_grace_s):
                straggler = min(running)
                return _Outcome(
                    "failure",
                    detector.Failure(
                        detector.CAUSE_HANG,
                        straggler,
                        f"process {straggler} still running {now - completed_at:.1f}s after "
                        "another finished training",
                        since=completed_at,
                    ),
                )
            failure = detector.check(now, running, reports, self._thresholds)
            if failure is not None:
                return _Outcome("failure", failure)
            if completed_at is None:
                straggling = self._straggler_outcome(reports)
                if straggling is not None:
                    return straggling
            if self._gen_max_step is not None:
                # Once this generation trains: their imports must not slow its start.
                self._refill_standbys()
            if completed_at is None and self._can_scale_up():
                return _Outcome("scale_up")
            time.sleep(self._poll_s)

    def _measure(self, now: float, reports: dict[int, WorkerReport]) -> None:
        """Feeds the reshape ledger: the restart's cost at a generation's first step, then the
        generation's step time (the slowest process's median, once it has a few steps)."""
        assert self._gen_max_step is not None
        if self._gen_first_step is None:
            self._gen_first_step = self._gen_max_step
            if self._generation > 0:
                self._ledger.restart_costs_s.append(now - self._gen_started)
        medians = [r.step_time_s for r in reports.values() if r.step_time_s is not None]
        if medians and self._gen_max_step - self._gen_first_step >= _STEPS_BEFORE_STEP_TIME:
            self._ledger.step_time_s[len(self._slices)] = max(medians)

    def _can_scale_up(self) -> bool:
        # Only once this generation trains: stopping it while it compiles would waste the start.
        if self._gen_max_step is None or len(self._slices) >= self._pool.target:
            return False
        bigger = len(self._fit(self._pool.choose(self._slices))[0])
        if bigger <= len(self._slices):
            return False
        if not self._c.scale_up_when_faster:
            return True
        elapsed = time.monotonic() - self._start_time
        mtbf_s = elapsed / self._policy.failures if self._policy.failures else None
        pays, why = scale_up_pays(
            self._ledger,
            len(self._slices),
            bigger,
            mtbf_s,
            int(self._config.total_steps) - self._gen_max_step,
        )
        measured = len(self._slices) in self._ledger.step_time_s
        if not pays and measured and not self._scale_up_deferred:
            self._scale_up_deferred = True
            self._events.emit(
                "scale_up_deferred", generation=self._generation, step=self._gen_max_step, why=why
            )
            self._say(f"a returned slice waits: re-admitting it does not pay yet ({why})")
        return pays

    def _fire_actions(self, now: float) -> None:
        due = [
            a
            for a in self._pending_actions
            if (a.at_s is not None and now - self._start_time >= a.at_s)
            or (a.at_step is not None and (self._max_step or 0) >= a.at_step)
        ]
        running = [
            s for s in self._slices if any(w.slice == s and w.running for w in self._workers)
        ]
        for planned in due:
            if not running:
                return  # between generations: faults wait for hardware that runs
            self._pending_actions.remove(planned)
            hit = planned.slice
            if hit not in running:
                hit = running[planned.slice % len(running)]
            action = dataclasses.replace(planned, slice=hit)
            targets = action_targets(self._workers, action, self._cluster.processes_per_slice)
            if action.kind == "lose_slice":
                duration = action.duration_s
                if duration is None:
                    duration = float(self._c.readmit_after_s)
                if duration >= 0:
                    self._pool.announce_outage(action.slice, now + duration)
            signum = _ACTION_SIGNALS[action.kind]
            for worker in targets:
                # A preemption notice goes to the worker alone, as a scheduler would send it.
                worker.signal(signum, group=action.kind != "preempt")
                self._fault_times[worker.process] = now
            self._events.emit(
                "fault_injected",
                kind=action.kind,
                slice=action.slice,
                aimed_at=planned.slice if planned.slice != action.slice else None,
                processes=[w.process for w in targets],
                pids=[w.pid for w in targets],
                generation=self._generation,
                step=self._max_step,
            )
            self._say(
                f"injected {action.kind} on slice {action.slice} "
                f"(processes {[w.process for w in targets]})"
            )

    def _apply_announced_outages(self) -> None:
        """Outages the chaos hook announced in the event log, mapped to physical slices."""
        for outage in self._outages.read_new():
            if outage.generation not in (None, self._generation):
                continue
            if 0 <= outage.slice_index < len(self._slices):
                remaining = outage.until - time.time()
                physical = self._slices[outage.slice_index]
                self._pool.announce_outage(physical, time.monotonic() + remaining)

    def _stop_workers(self, grace_s: float) -> float:
        return processes.stop(self._workers, grace_s, should_hurry=lambda: len(self._signals) > 1)

    # Helpers.

    def _worker(self, process: int | None) -> processes.WorkerProcess | None:
        return next((w for w in self._workers if w.process == process), None)

    def _finish(self, exit_code: int, reason: str) -> SupervisorResult:
        self._stop_workers(0.0)
        self._events.emit(
            "stop",
            reason=reason,
            exit_code=exit_code,
            generation=self._generation,
            step=self._gen_max_step,
            failures=self._policy.failures,
        )
        self._say(f"stop (exit {exit_code}): {reason}")
        return SupervisorResult(exit_code, reason, self._generation + 1, self._policy.failures)

    def _say(self, message: str) -> None:
        self._sink.write_line(f"[supervisor] {message}")

    def _sleep(self, seconds: float) -> bool:
        """Sleeps up to `seconds`; True if a stop was requested meanwhile."""
        end = time.monotonic() + max(0.0, seconds)
        while time.monotonic() < end:
            if self._signals:
                return True
            time.sleep(min(self._poll_s, max(0.0, end - time.monotonic())))
        return bool(self._signals)

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for signum in previous:
            signal.signal(signum, lambda s, _frame: self.request_stop(s))

        def restore() -> None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

        return restore


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
