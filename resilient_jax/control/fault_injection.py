"""Faults the supervisor injects into its own workers, for tests, experiments and demos.

A `SupervisorAction` plans one fault: kill a process, hang it, lose a whole slice for a while, or
send it a preemption notice, at a step or a time. The `FaultInjector` carries the actions out as
they fall due, with the signal each kind stands for, and writes a `fault_injected` event. Faults
inside a worker (NaN, spikes, slow steps, corrupt checkpoints) are the chaos hook's job
(`resilient_jax.chaos`); these are the ones that hit a process from outside, as hardware and
schedulers do.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable, Sequence

from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.faults import HOST_FAULT_KINDS, FaultKind, SupervisorFaultKind
from resilient_jax.control.hosts import RemoteWorker
from resilient_jax.events import EventLog

ActionKind = FaultKind | SupervisorFaultKind

# The signal each kind sends: SIGKILL is a dead host, SIGSTOP a frozen one (no heartbeats, no
# progress), SIGTERM a preemption notice (the worker saves and exits ExitCode.PREEMPTED).
ACTION_SIGNALS: dict[ActionKind, signal.Signals] = {
    FaultKind.KILL: signal.SIGKILL,
    FaultKind.LOSE_SLICE: signal.SIGKILL,
    FaultKind.HANG: signal.SIGSTOP,
    SupervisorFaultKind.PREEMPT: signal.SIGTERM,
}
ACTION_KINDS: tuple[ActionKind, ...] = (*ACTION_SIGNALS, *HOST_FAULT_KINDS)
_KIND_BY_NAME = {kind.value: kind for kind in ACTION_KINDS}


@dataclasses.dataclass(frozen=True)
class SupervisorAction:
    """A fault the supervisor injects into its own workers.

    kind: `kill` (SIGKILL), `hang` (SIGSTOP), `lose_slice` (SIGKILL every process of the slice;
    the slice stays out for `duration_s`, by default `coordinator.readmit_after_s`, then may be
    re-admitted), `preempt` (SIGTERM), or a host fault carried out by the agents of the slice's
    hosts: `lose_host` (agent and workers SIGKILLed; with `duration_s` a fresh agent starts after
    it, on the local cluster), `freeze_host` (agent and workers SIGSTOPped), `partition_host` (the
    agent drops its link for `duration_s`); given as a kind or its name. `process` is the index
    inside the slice (None: every process of it). It fires once, when any worker has reported
    `at_step` or `at_s` seconds after the supervisor started, whichever is set. Faults hit
    hardware that runs: aimed at a slice that is out (evicted, lost), it hits the running slice at
    that position modulo the number running, or with `wait_for_slice` waits until its own slice
    runs again (a scenario that must hit a re-admitted slice, however fast the steps go); with none
    running, it waits.
    """

    kind: ActionKind
    slice: int
    process: int | None = None
    at_step: int | None = None
    at_s: float | None = None
    duration_s: float | None = None
    wait_for_slice: bool = False

    def __post_init__(self) -> None:
        kind = _KIND_BY_NAME.get(str(self.kind))
        if kind is None:
            allowed = ", ".join(k.value for k in ACTION_KINDS)
            raise ValueError(f"action kind {self.kind!r}; allowed: {allowed}")
        object.__setattr__(self, "kind", kind)
        if (self.at_step is None) == (self.at_s is None):
            raise ValueError("an action needs exactly one of at_step and at_s")


def action_targets(
    workers: Sequence[RemoteWorker], action: SupervisorAction, processes_per_slice: int
) -> list[RemoteWorker]:
    """The running workers an action hits: its slice, and its process within the slice when it
    names one."""
    return [
        w
        for w in workers
        if w.slice == action.slice
        and w.running
        and (action.process is None or w.process % processes_per_slice == action.process)
    ]


class FaultInjector:
    """Holds the planned actions and carries out each one once it is due."""

    def __init__(
        self,
        actions: Sequence[SupervisorAction],
        all_slices: Sequence[int],
        processes_per_slice: int,
        default_outage_s: float,
        announce_outage: Callable[[int, float], None],
        events: EventLog,
        say: Callable[[str], None],
        host_fault: Callable[[int, ActionKind, float | None], None] | None = None,
    ) -> None:
        for action in actions:
            if action.slice not in all_slices:
                raise ValueError(f"action {action} names slice {action.slice}, which is no slice")
        self._pending = list(actions)
        self._processes_per_slice = processes_per_slice
        self._default_outage_s = default_outage_s
        self._announce_outage = announce_outage  # (slice, until on the monotonic clock)
        self._events = events
        self._say = say
        self._host_fault = host_fault  # (slice, kind, duration_s): carried out by its hosts' agents

    def fire_due(
        self,
        now: float,
        elapsed_s: float,
        max_step: int | None,
        slices: Sequence[int],
        workers: Sequence[RemoteWorker],
        generation: int,
    ) -> dict[int, float]:
        """Fires the actions due at `elapsed_s` seconds into the run or at `max_step` (the highest
        step any worker reported), on the generation running `workers` on `slices`. Returns the
        processes hit, with `now`: detection latency is measured from the fault, not the symptom.
        """
        running = [s for s in slices if any(w.slice == s and w.running for w in workers)]
        hit_at: dict[int, float] = {}
        for planned in self._due(elapsed_s, max_step):
            if not running:
                break  # between generations: faults wait for hardware that runs
            hit = planned.slice
            if hit not in running:
                if planned.wait_for_slice:
                    continue
                hit = running[planned.slice % len(running)]
            self._pending.remove(planned)
            action = dataclasses.replace(planned, slice=hit)
            targets = self._carry_out(action, now, workers)
            hit_at.update({w.process: now for w in targets})
            self._report(planned, action, targets, generation, max_step)
        return hit_at

    def _due(self, elapsed_s: float, max_step: int | None) -> list[SupervisorAction]:
        """The pending actions due at `elapsed_s` seconds into the run or at `max_step`."""
        return [
            a
            for a in self._pending
            if (a.at_s is not None and elapsed_s >= a.at_s)
            or (a.at_step is not None and (max_step or 0) >= a.at_step)
        ]

    def _carry_out(
        self, action: SupervisorAction, now: float, workers: Sequence[RemoteWorker]
    ) -> list[RemoteWorker]:
        """Carries out `action`, aimed at a running slice; the workers it hits."""
        if action.kind in HOST_FAULT_KINDS:
            return self._fault_hosts(action, now, workers)
        targets = action_targets(workers, action, self._processes_per_slice)
        if action.kind == FaultKind.LOSE_SLICE:
            duration = action.duration_s
            if duration is None:
                duration = self._default_outage_s
            if duration >= 0:
                self._announce_outage(action.slice, now + duration)
        # A preemption notice goes to the worker alone, as a scheduler would send it.
        group = action.kind != SupervisorFaultKind.PREEMPT
        for worker in targets:
            worker.signal(ACTION_SIGNALS[action.kind], group=group)
        return targets

    def _fault_hosts(
        self, action: SupervisorAction, now: float, workers: Sequence[RemoteWorker]
    ) -> list[RemoteWorker]:
        """Has the agents of the slice's hosts carry out a host fault; the slice's running
        workers, which it hits whatever process the action names."""
        assert self._host_fault is not None, "host faults need the hosts' agents"
        if action.kind == FaultKind.LOSE_HOST and action.duration_s is not None:
            self._announce_outage(action.slice, now + action.duration_s)
        self._host_fault(action.slice, action.kind, action.duration_s)
        return [w for w in workers if w.slice == action.slice and w.running]

    def _report(
        self,
        planned: SupervisorAction,
        action: SupervisorAction,
        targets: Sequence[RemoteWorker],
        generation: int,
        max_step: int | None,
    ) -> None:
        """Writes the `fault_injected` event of `action` (`planned`, re-aimed) and says so."""
        self._events.emit(
            EventType.FAULT_INJECTED,
            kind=action.kind,
            slice=action.slice,
            aimed_at=planned.slice if planned.slice != action.slice else None,
            processes=[w.process for w in targets],
            pids=[w.pid for w in targets],
            generation=generation,
            step=max_step,
        )
        self._say(
            f"injected {action.kind} on slice {action.slice} "
            f"(processes {[w.process for w in targets]})"
        )
