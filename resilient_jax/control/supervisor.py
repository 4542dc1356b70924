"""The supervisor: runs a multi-slice job's workers, detects failures, restarts on what is left.

A *generation* is one start of all workers on a set of physical slices, with a fresh JAX
coordinator port (`launcher`). The supervisor watches it (process exits, heartbeats from
`server`, step progress judged by `detector`, stragglers) until it completes, fails, is
preempted, or a returned slice can be re-admitted; then it stops every worker and starts the next
generation. Workers restore from the newest checkpoint on whatever mesh the new topology gives
(`cluster.plan_for`: `topology.plan_mesh(strict=False)` keeps the global batch with more
microbatches). Which slices run and when to give up is `policy`'s; planned faults for tests and
experiments are `fault_injection`'s.

Why stop the survivors of a failure instead of keeping them: on CPU a survivor inside a gloo
collective with a dead peer never returns, and JAX aborts survivors anyway once its coordination
service misses the peer; a clean restart from a checkpoint is the one path that always works.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import IO, Any

import ml_collections

from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.control import attach, compile_cache, detector, processes
from resilient_jax.control.announced_outages import OutageReader
from resilient_jax.control.cluster import ClusterSpec, fit_slices, plan_for
from resilient_jax.control.failure_verdicts import blamed_slice, fatal_reason, hang_after_finish
from resilient_jax.control.fault_injection import FaultInjector, SupervisorAction
from resilient_jax.control.generation import (
    Generation,
    Outcome,
    RestartReason,
    Watched,
    blame,
    poll_exits,
)
from resilient_jax.control.host_plane import HOST_AGENTS, HostPlane
from resilient_jax.control.launcher import WorkerLauncher
from resilient_jax.control.reconfigure import Reconfigurer
from resilient_jax.control.restart_policy import RestartPolicy, SlicePool, straggler_eviction_pays
from resilient_jax.control.run_result import SupervisorResult
from resilient_jax.control.server import HeartbeatServer, WorkerReport
from resilient_jax.control.stragglers import Straggler, StragglerWatch
from resilient_jax.control.supervisor_core import Refused, SupervisorCore
from resilient_jax.events import EventLog
from resilient_jax.perf.plans import PlanKind


class Supervisor(SupervisorCore):
    """Runs `worker_argv` as S x P processes through the hosts' agents; `run()` returns the verdict
    (the restart policy on `supervisor_core`).

    host_agents: "local" starts one agent per slice on this machine (`local_hosts`); "external"
    waits for agents started elsewhere (Slurm, Kubernetes, a test bed) to register. `listen` is
    the control channel's host:port (default: loopback; after a restart, the address in
    `<workdir>/supervisor.json`, so running workers' heartbeats reach the new supervisor).
    """

    NAME = "supervisor"

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
        host_agents: str = "local",
        listen: str | None = None,
    ) -> None:
        super().__init__(out, poll_interval_s)
        self._config = config
        self._c = config.coordinator
        self._cluster = cluster
        self._workdir = workdir
        self._worker_argv, self._actions, self._cwd = list(worker_argv), list(actions), cwd
        if host_agents not in HOST_AGENTS:
            raise ValueError(f"host_agents={host_agents!r}; allowed: {', '.join(HOST_AGENTS)}")
        self._host_agents, self._listen = host_agents, listen
        self._poll_s = poll_interval_s
        self._thresholds = detector.Thresholds.from_config(self._c)
        self._pool = SlicePool(
            cluster.num_slices, cluster.spare_slices, float(self._c.readmit_after_s)
        )
        self._policy = RestartPolicy(self._c)
        self._outages = OutageReader(workdir)
        self._gen = Generation()
        self._max_step: int | None = None  # highest step any worker reported, any generation

    def _open_for_run(self) -> None:
        try:
            self._open()
        except (OSError, ValueError) as e:  # a bad token, say: no worker or agent started yet
            if self._plane is not None:  # its host registry's thread runs from its construction
                self._plane.hosts.close()
            raise Refused(ExitCode.BAD_INPUT, str(e)) from e

    def _open(self) -> None:
        """At the run's start (construction touches nothing): the event log, earlier reshapes'
        costs, the token, the hosts. Raises OSError or ValueError (a bad token, say)."""
        self._events = EventLog(self._workdir, process="supervisor", source="supervisor")
        # What a reshape costs and gains; which plan to follow when a slice is lost or returns.
        self._reconfigure = Reconfigurer(
            self._config, self._cluster, self._workdir, self._events, self._say
        )
        self._plane = HostPlane(
            self._config,
            self._cluster,
            self._workdir,
            self._pool.all_slices,
            self._host_agents,
            self._listen,
            self._events,
            self._sink,
            self._say,
        )
        self._hosts = self._plane.hosts
        # The planned faults, aimed at the pool's slices; host faults go through the plane.
        self._faults = FaultInjector(
            self._actions,
            self._pool.all_slices,
            self._cluster.processes_per_slice,
            float(self._c.readmit_after_s),
            self._pool.announce_outage,
            self._events,
            self._say,
            self._plane.inject_fault,
        )
        # Workers started ahead of the next generation (imports done while the job trains).
        self._launcher = WorkerLauncher(
            self._worker_argv,
            self._hosts,
            self._events,
            self._c,  # standby_workers, standby_idle_cpu
            self._cluster.devices_per_process,
            compile_cache.cache_env(self._c, self._workdir),
            cwd=self._cwd,
        )

    # The loop over generations.

    def _supervise(self, deadline: float | None) -> SupervisorResult:
        try:
            return self._generations(deadline)
        except OSError as e:  # the worker command cannot start (missing file, permissions)
            raise Refused(ExitCode.BAD_INPUT, f"cannot start workers: {e}") from e

    def _generations(self, deadline: float | None) -> SupervisorResult:
        slices = self._pool.choose([])
        fitted, reason = fit_slices(self._config, self._cluster, slices)
        if reason or len(fitted) < len(slices):
            return self._finish(ExitCode.BAD_INPUT, reason or f"cannot run on {len(slices)} slices")
        history = attach.read_history(self._workdir)
        for step in history.failure_steps:  # a restarted supervisor keeps the run's budget
            self._policy.record_failure(step)
        reason = self._open_hosts(
            self._pool.all_slices,
            self._cluster.processes_per_slice,
            float(self._c.startup_timeout_s),
            int(self._c.min_slices),
        )
        if reason:
            return self._finish(ExitCode.FAILED, reason)
        running = attach.adoptable(self._hosts, self._cluster.processes_per_slice)
        if running is not None:
            self._gen = self._plane.adopt(running)
        else:
            self._gen.number = history.last_generation  # the next one is numbered after it
            self._start_generation(self._fit(self._pool.choose([]))[0])
        while True:
            result = self._decide(self._watch(deadline))
            if result is not None:
                return result

    def _decide(self, watched: Watched) -> SupervisorResult | None:
        """Acts on how a watch ended: the run's result when it ends, else None once the next
        generation runs."""
        outcome = watched.outcome
        if outcome == Outcome.COMPLETE:
            # A generation that restored the last step reports none of its own.
            step = self._gen.max_step or self._max_step
            return self._finish(ExitCode.FINISHED, f"completed at step {step}")
        if outcome in (Outcome.INTERRUPTED, Outcome.TIME_LIMIT):
            self._stop_workers(float(self._c.save_grace_s))
            if outcome == Outcome.TIME_LIMIT:
                return self._finish(
                    ExitCode.TIME_LIMIT, "time limit reached; workers asked to save and stop"
                )
            name = self._stop.first_name()
            return self._finish(
                ExitCode.INTERRUPTED, f"interrupted by {name}; workers asked to save and stop"
            )
        if outcome == Outcome.FATAL:
            assert watched.failure is not None and watched.failure.exit_code is not None
            return self._finish(watched.failure.exit_code, fatal_reason(watched.failure))
        if outcome == Outcome.SCALE_UP:
            return self._scale_up()
        if outcome == Outcome.STRAGGLER:
            assert watched.straggler is not None
            return self._evict_straggler(watched.straggler)
        if outcome == Outcome.PREEMPTED:
            return self._after_preemption()
        assert watched.failure is not None
        return self._after_failure(watched.failure)

    def _after_failure(self, failure: detector.Failure) -> SupervisorResult | None:
        now = time.monotonic()
        gen = self._gen
        self._plane.supersede(gen.number)  # a worker out of reach must write nothing more
        slice_id = self._report_failure(failure, now)
        stopping_s = self._stop_workers(float(self._c.kill_grace_s))
        slice_id, lost_slice = blamed_slice(failure, slice_id, self._plane.lost_slices(gen))
        self._policy.record_failure(gen.max_step, hardware=lost_slice)
        reason = self._policy.stop_reason()
        if reason:
            return self._finish(ExitCode.FAILED, f"{reason}; last: {failure.detail}")
        if lost_slice:
            assert slice_id is not None
            interrupted = self._evict_lost_slice(slice_id, failure.cause, now)
            if interrupted is not None:
                return interrupted
        slices, reason = self._wait_for_slices()
        if reason:
            code = ExitCode.INTERRUPTED if self._stop.requested else ExitCode.FAILED
            return self._finish(code, f"{reason}; last failure: {failure.detail}")
        backoff = self._policy.backoff()
        if backoff and self._stop.sleep(backoff):
            return self._finish(ExitCode.INTERRUPTED, "interrupted during back-off")
        self._start_generation(
            slices, RestartReason.FAILURE, stopping_s=stopping_s, backoff_s=backoff
        )
        return None

    def _report_failure(self, failure: detector.Failure, now: float) -> int | None:
        """Writes the `failure_detected` event and says so; the failed process's slice."""
        gen = self._gen
        worker = gen.worker(failure.process)
        slice_id = worker.slice if worker else None
        since = gen.fault_times.get(failure.process, failure.since) if worker else failure.since
        self._events.emit(
            EventType.FAILURE_DETECTED,
            cause=failure.cause,
            process=failure.process,
            scope="job" if failure.process is None else "process",  # job: no process stood out
            slice=slice_id,
            pid=worker.pid if worker else None,
            generation=gen.number,
            latency_s=round(now - since, 4),
            exit_code=failure.exit_code,
            step=gen.max_step,
            detail=failure.detail,
        )
        self._say(f"failure: {failure.detail} (process {failure.process}, slice {slice_id})")
        return slice_id

    def _evict_lost_slice(
        self, slice_id: int, cause: detector.FailureCause, failed_at: float
    ) -> SupervisorResult | None:
        """Evicts a lost slice and waits for it when the plan says to; the run's result when a
        stop request interrupts the wait."""
        self._apply_announced_outages()
        returns_at = self._pool.evict(slice_id, time.monotonic())
        self._events.emit(
            EventType.EVICT,
            slice=slice_id,
            generation=self._gen.number,
            cause=cause,
            returns_in_s=None if returns_at is None else round(returns_at - failed_at, 3),
        )
        self._say(f"evicted slice {slice_id}")
        wait_s = self._plan_after_loss(returns_at)
        if wait_s and self._stop.sleep(wait_s):
            return self._finish(ExitCode.INTERRUPTED, "interrupted while waiting for a slice")
        return None

    def _after_preemption(self) -> SupervisorResult | None:
        # The others save at the step JAX's preemption sync agreed on; give them the time.
        self._stop_workers(float(self._c.save_grace_s))
        self._say("workers preempted; restarting without counting a failure")
        slices, _ = self._fit(self._pool.choose(self._gen.slices))
        self._start_generation(slices, RestartReason.PREEMPTION)
        return None

    def _scale_up(self) -> SupervisorResult | None:
        slices, _ = self._fit(self._pool.choose(self._gen.slices))
        added = [s for s in slices if s not in self._gen.slices]
        self._events.emit(
            EventType.SCALE_UP, slices=added, generation=self._gen.number, step=self._gen.max_step
        )
        self._say(f"re-admitting slices {added}: asking workers to save and stop")
        # SIGTERM is the save-and-stop request: JAX's preemption notifier turns it into a step all
        # processes agree on (multihost_utils.reached_preemption_sync_point), where the
        # checkpointer saves and the worker exits with ExitCode.PREEMPTED.
        stopping_s = self._stop_workers(float(self._c.save_grace_s))
        self._start_generation(slices, RestartReason.SCALE_UP, stopping_s=stopping_s)
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
            EventType.EVICT,
            slice=straggler.slice,
            generation=self._gen.number,
            cause=RestartReason.STRAGGLER,
            process=straggler.process,
            returns_in_s=None if returns_at is None else round(returns_at - now, 3),
        )
        slices, reason = self._wait_for_slices()
        if reason:
            return self._finish(ExitCode.FAILED, f"{reason}; after evicting a straggler")
        self._start_generation(slices, RestartReason.STRAGGLER, stopping_s=stopping_s)
        return None

    def _straggler_outcome(self, reports: dict[int, WorkerReport]) -> Watched | None:
        """Reports new stragglers; an outcome when one should be evicted."""
        assert self._gen.stragglers is not None
        for straggler in self._gen.stragglers.update(reports):
            evict, why = self._should_evict(straggler)
            ratio = straggler.ratio
            self._events.emit(
                EventType.STRAGGLER,
                process=straggler.process,
                slice=straggler.slice,
                generation=self._gen.number,
                step=self._gen.max_step,
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
                return Watched(Outcome.STRAGGLER, straggler=straggler)
        return None

    def _should_evict(self, straggler: Straggler) -> tuple[bool, str]:
        """Evict when the job gets faster without the straggler's slice."""
        if not self._c.evict_stragglers:
            return False, "coordinator.evict_stragglers is off"
        if straggler.slice is None:
            return False, "its slice is unknown"
        current = self._gen.slices
        after, _ = self._fit(self._pool.choose(current, exclude=(straggler.slice,)))
        if len(after) < max(1, int(self._c.min_slices)):
            return False, f"{len(after)} slices would be left, below min_slices"
        return straggler_eviction_pays(straggler.ratio, len(current), len(after))

    def _wait_for_slices(self) -> tuple[list[int], str | None]:
        """Slices for the next generation; waits (bounded) for returns if too few are healthy."""
        min_slices = int(self._c.min_slices)
        give_up = time.monotonic() + float(self._c.wait_for_slices_s)
        said = False
        while True:
            self._pool.refresh(time.monotonic())
            slices, _ = self._fit(self._pool.choose(self._gen.slices))
            if len(slices) >= min_slices:
                return slices, None
            if self._awaiting_hosts():  # a healthy slice's host may come back (re-registers)
                if self._stop.sleep(0.2):
                    return [], "interrupted while waiting for slices"
                if time.monotonic() < give_up:
                    continue
            early = self._pool.readmit_suspects(time.monotonic(), min_slices - len(slices))
            if early:
                self._events.emit(EventType.READMIT, slices=early, generation=self._gen.number)
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
            if self._stop.sleep(min(back - time.monotonic(), 1.0)):
                return [], "interrupted while waiting for slices"

    def _fit(self, slices: list[int]) -> tuple[list[int], str | None]:
        """The slices of `slices` the next generation can run on: hosts admitted, mesh fits."""
        ready = self._plane.ready_slices()
        return fit_slices(self._config, self._cluster, [s for s in slices if s in ready])

    def _awaiting_hosts(self) -> bool:
        """Whether a slice the pool holds healthy waits only for its host to (re-)join."""
        ready = self._plane.ready_slices()
        return any(s not in ready for s in self._pool.healthy())

    # One generation.

    def _start_generation(
        self,
        slices: list[int],
        reason: RestartReason | None = None,
        stopping_s: float | None = None,
        backoff_s: float | None = None,
    ) -> None:
        assert self._plane.server is not None
        number = self._plane.next_generation(self._gen.number)
        self._plane.server.forget_before(number)
        self._plane.fence(number)
        pps = self._cluster.processes_per_slice
        num_processes = len(slices) * pps
        self._gen = Generation(
            number=number,
            slices=list(slices),
            started=time.monotonic() - (stopping_s or 0.0),
            stragglers=StragglerWatch(
                float(self._config.health.straggler_factor),
                int(self._config.health.straggler_window),
                {p: slices[p // pps] for p in range(num_processes)},
            ),
        )
        if reason is not None:
            plan = plan_for(self._config, len(slices), self._cluster)
            self._events.emit(
                EventType.RESTART,
                generation=number,
                reason=reason,
                slices=slices,
                num_slices=len(slices),
                num_processes=num_processes,
                devices=num_processes * self._cluster.devices_per_process,
                mesh=plan.describe(),
                stopping_s=None if stopping_s is None else round(stopping_s, 4),
                backoff_s=backoff_s,
                failures=self._policy.failures,
            )
            self._say(f"generation {number} on slices {slices} ({reason.value})")
        self._gen.workers = self._launcher.start_generation(number, slices, pps, self._mtbf_s())

    def _watch(self, deadline: float | None) -> Watched:
        """Polls the running generation until something needs a decision."""
        server = self._plane.server
        assert server is not None
        gen = self._gen
        completed_at: float | None = None
        while True:
            now = time.monotonic()
            if self._stop.requested:
                return Watched(Outcome.INTERRUPTED)
            if deadline is not None and now > deadline:
                return Watched(Outcome.TIME_LIMIT)
            reports = self._observe(server, now)
            lost = self._plane.lost_outcome(gen, now)
            if lost is not None:
                return lost
            running, finished, exited = poll_exits(gen.workers, now, self._poll_s)
            if exited is not None:
                return blame(gen.workers, exited, self._poll_s)
            if finished and completed_at is None:
                completed_at = now
            if not running:
                return Watched(Outcome.COMPLETE)
            if completed_at is not None and now - completed_at > float(self._c.save_grace_s):
                return hang_after_finish(min(running), completed_at, now)
            # Silence is judged up to what the server has read: after a pause of this process
            # the heartbeats that arrived meanwhile may not be read yet.
            heard = server.heard_until(now)
            failure = detector.check(heard, running, reports, self._thresholds)
            if failure is not None:
                return blame(gen.workers, Watched(Outcome.FAILURE, failure), self._poll_s)
            if completed_at is None:
                straggling = self._straggler_outcome(reports)
                if straggling is not None:
                    return straggling
            if gen.max_step is not None:
                # Once this generation trains: their imports must not slow its start.
                self._launcher.refill_standbys()
            if completed_at is None and self._can_scale_up():
                return Watched(Outcome.SCALE_UP)
            time.sleep(self._poll_s)

    def _observe(self, server: HeartbeatServer, now: float) -> dict[int, WorkerReport]:
        """One poll's bookkeeping: the generation's reports and steps, the faults due, slices
        back from their cooldown, the hosts' news; the reports."""
        gen = self._gen
        reports = server.reports(gen.number)
        steps = [r.step for r in reports.values() if r.step is not None]
        if steps:
            gen.max_step = max(steps)
            self._max_step = max(self._max_step or 0, gen.max_step)
            self._reconfigure.measure(gen, now, reports)
        hit = self._faults.fire_due(
            now, now - self._start_time, self._max_step, gen.slices, gen.workers, gen.number
        )
        gen.fault_times.update(hit)
        returned = self._pool.refresh(now)
        if returned:
            self._say(f"slices {returned} are healthy again")
        self._plane.tick()
        return reports

    def _can_scale_up(self) -> bool:
        gen = self._gen
        # Only once this generation trains: stopping it while it compiles would waste the start.
        if gen.max_step is None or len(gen.slices) >= self._pool.target:
            return False
        bigger = len(self._fit(self._pool.choose(gen.slices))[0])
        if bigger <= len(gen.slices):
            return False
        return self._reconfigure.readmit(gen, bigger, self._mtbf_s())

    def _mtbf_s(self) -> float | None:
        """The run's observed mean time between failures (None before the first)."""
        if not self._policy.failures:
            return None
        return (time.monotonic() - self._start_time) / self._policy.failures

    def _plan_after_loss(self, returns_at: float | None) -> float:
        """Prices the plans after a slice's loss when the others can go on; how long to wait for
        it (0: not at all)."""
        gen, now = self._gen, time.monotonic()
        survivors = [s for s in gen.slices if s in self._pool.healthy()]
        healthy = len(self._fit(survivors)[0])
        if healthy < int(self._c.min_slices):  # `_wait_for_slices` waits or re-admits
            return 0.0
        available = len(self._fit(self._pool.choose(gen.slices))[0])
        return_in_s = None if returns_at is None else returns_at - now
        plan = self._reconfigure.after_loss(gen, healthy, available, return_in_s, self._mtbf_s())
        if plan != PlanKind.WAIT or return_in_s is None:
            return 0.0
        return max(0.0, return_in_s)

    def _apply_announced_outages(self) -> None:
        """Outages the chaos hook announced in the event log, mapped to physical slices."""
        for outage in self._outages.read_new():
            if outage.generation not in (None, self._gen.number):
                continue
            if 0 <= outage.slice_index < len(self._gen.slices):
                remaining = outage.until - time.time()
                physical = self._gen.slices[outage.slice_index]
                self._pool.announce_outage(physical, time.monotonic() + remaining)

    def _stop_workers(self, grace_s: float) -> float:
        return processes.stop(self._gen.workers, grace_s, should_hurry=lambda: self._stop.hurry)

    # The verdict (`supervisor_core`).

    def _end(self, reason: str) -> None:
        self._stop_workers(0.0)

    def _close(self) -> None:
        processes.stop(self._gen.workers, grace_s=0.0)
        self._launcher.close()

    def _stop_fields(self) -> dict[str, Any]:
        gen = self._gen
        return {"generation": gen.number, "step": gen.max_step, "failures": self._policy.failures}

    def _result(self, exit_code: int, reason: str) -> SupervisorResult:
        return SupervisorResult(
            exit_code, reason, self._policy.failures, generations=self._gen.number + 1
        )
