"""Failure and hang detection from worker reports: a pure function of the reports and the time.

Three signs, from fast to slow:
- a process exits (the supervisor sees it at once with `poll`; not judged here) or reports an
  error (it may be stuck on its way out);
- a process stops sending heartbeats (`heartbeat_timeout_s`): dead, stopped or cut off;
- the job stops making step progress while heartbeats still come: a hang. The budget is
  `max(hang_factor x median step time, hang_floor_s)` while training, and the longer
  `startup_timeout_s` while any process is starting (JAX init, restore, compile) or finishing
  (done); once every process is ready, `first_step_timeout_s` for the generation's
  first step (it sets up the collectives), timed from the last process to get ready.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from resilient_jax.contracts.messages import Phase
from resilient_jax.contracts.names import Name
from resilient_jax.control.server import WorkerReport


class FailureCause(Name):
    """How the supervisor saw a worker fail (the `cause` of a `failure_detected` event)."""

    EXIT = "exit"  # it exited (code or signal)
    ERROR = "error"  # it reported an error it cannot recover from
    HEARTBEAT = "heartbeat"  # it went silent (a frozen host, a dead network)
    HANG = "hang"  # it stopped making progress while its peers waited
    STARTUP = "startup_timeout"  # it never reported after starting
    HOST_LOST = "host_lost"  # its host's agent went silent or away (killed, frozen, cut off)


@dataclasses.dataclass(frozen=True)
class Thresholds:
    heartbeat_timeout_s: float
    hang_factor: float
    hang_floor_s: float
    startup_timeout_s: float
    first_step_timeout_s: float

    @classmethod
    def from_config(cls, coordinator_config: ml_collections.ConfigDict) -> Thresholds:
        c = coordinator_config
        return cls(
            heartbeat_timeout_s=float(c.heartbeat_timeout_s),
            hang_factor=float(c.hang_factor),
            hang_floor_s=float(c.hang_floor_s),
            startup_timeout_s=float(c.startup_timeout_s),
            first_step_timeout_s=float(c.first_step_timeout_s),
        )

    def step_budget_s(self, median_step_time_s: float | None) -> float:
        if median_step_time_s is None:
            return self.hang_floor_s
        return max(self.hang_factor * median_step_time_s, self.hang_floor_s)


@dataclasses.dataclass(frozen=True)
class Failure:
    cause: FailureCause
    process: int | None  # None: the whole job is stuck and no process stands out
    detail: str  # one line for people
    since: float  # supervisor-clock time of the last sign of health: latency is measured from it
    exit_code: int | None = None


def check(
    now: float,
    spawned_at: dict[int, float],
    reports: dict[int, WorkerReport],
    thresholds: Thresholds,
) -> Failure | None:
    """The first failure among the running processes (`spawned_at` keys), or None."""
    for process in sorted(spawned_at):
        report = reports.get(process)
        if report is None:
            if now - spawned_at[process] > thresholds.startup_timeout_s:
                why = f"no heartbeat within startup_timeout_s={thresholds.startup_timeout_s:g}"
                return Failure(FailureCause.STARTUP, process, why, since=spawned_at[process])
            continue
        if report.phase == Phase.ERROR:
            why = f"process {process} failed: {report.error or 'error'}"
            return Failure(FailureCause.ERROR, process, why, since=report.last_seen)
        silent = now - report.last_seen
        if not report.said_bye and silent > thresholds.heartbeat_timeout_s:
            why = f"no heartbeat for {silent:.1f}s (phase {report.phase}, step {report.step})"
            return Failure(FailureCause.HEARTBEAT, process, why, since=report.last_seen)
    return _check_progress(now, spawned_at, reports, thresholds)


def _check_progress(
    now: float,
    spawned_at: dict[int, float],
    reports: dict[int, WorkerReport],
    thresholds: Thresholds,
) -> Failure | None:
    running = [reports[p] for p in spawned_at if p in reports]
    if not running:
        return None
    progress_times = [r.last_progress for r in running if r.last_progress is not None]
    phases = {r.phase for r in running}
    ready_times = [r.ready_at for r in running if r.ready_at is not None]
    if phases - {Phase.READY, Phase.TRAIN} or len(running) < len(spawned_at):
        # Someone is still starting (or finishing): the long budget.
        budget, budget_name = thresholds.startup_timeout_s, "startup_timeout_s"
        since = max(progress_times) if progress_times else min(spawned_at.values())
    elif Phase.READY in phases:
        # Everyone is restored and compiled; the first step sets up the collectives. Timed from
        # the last process to get ready, so a slow compile elsewhere is not held against anyone.
        budget, budget_name = thresholds.first_step_timeout_s, "first_step_timeout_s"
        since = max(progress_times + ready_times)
    else:
        medians = [r.step_time_s for r in running if r.step_time_s is not None]
        budget = thresholds.step_budget_s(max(medians) if medians else None)
        budget_name = "hang budget"
        since = max(progress_times)
    stalled = now - since
    if stalled <= budget:
        return None
    steps = {r.process: -1 if r.step is None else r.step for r in running}
    behind = [p for p, s in sorted(steps.items()) if s < max(steps.values())]
    detail = (
        f"no step progress for {stalled:.1f}s > {budget_name} {budget:.1f}s "
        f"(steps {min(steps.values())}..{max(steps.values())}, phases {','.join(sorted(phases))})"
    )
    cause = FailureCause.HANG if progress_times or ready_times else FailureCause.STARTUP
    # In lockstep collectives the stuck process is the one behind; if all agree, none stands out.
    return Failure(cause, behind[0] if behind else None, detail, since=since)
