"""A supervisor's start: wait for the hosts' agents, and after a restart take over what runs.

A restarted supervisor rebuilds its view from two sources: the agents' registrations (which
workers of which generation still run, on which host) and the event log (how many failures the run
has had, the highest generation started). When every process of the newest generation still runs,
it adopts that generation as it is: no worker restarts, no step is lost.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from resilient_jax.contracts.event_types import EventType
from resilient_jax.control.hosts import HostRegistry
from resilient_jax.events import read_events


@dataclasses.dataclass(frozen=True)
class History:
    """What the event log says about the run so far."""

    last_generation: int  # -1: none started yet
    failure_steps: list[int | None]  # the step of each failure, in order


def read_history(workdir: str) -> History:
    last, failures = -1, []
    for event in read_events(workdir):
        if event.get("source") != "supervisor":
            continue
        if event["type"] == EventType.PROCESS_START and isinstance(event.get("generation"), int):
            last = max(last, event["generation"])
        elif event["type"] == EventType.FAILURE_DETECTED:
            failures.append(event.get("step"))
    return History(last, failures)


def await_hosts(
    hosts: HostRegistry,
    slices: Sequence[int],
    processes_per_slice: int,
    timeout_s: float,
    enough: int,
    stopped: Callable[[float], bool],
    tick: Callable[[], None],
) -> str | None:
    """Waits until every slice has admitted hosts, or `timeout_s` passed with at least `enough`;
    None when the run can start, else why not."""
    deadline = time.monotonic() + timeout_s
    while True:
        tick()
        ready = hosts.ready_slices(processes_per_slice)
        if all(s in ready for s in slices):
            return None
        if time.monotonic() > deadline:
            if len([s for s in slices if s in ready]) >= enough:
                return None
            missing = [s for s in slices if s not in ready]
            return (
                f"no admitted host for slices {missing} within "
                f"coordinator.startup_timeout_s={timeout_s:g}"
            )
        if stopped(0.05):
            return "interrupted while waiting for hosts"


@dataclasses.dataclass(frozen=True)
class Adoptable:
    generation: int
    slices: list[int]
    processes: list[tuple[str, int, int]]  # (host, process, pid)


def adoptable(hosts: HostRegistry, processes_per_slice: int) -> Adoptable | None:
    """The newest generation whose every process still runs, per the agents; None if none does."""
    reported = hosts.running_reported()
    if not reported:
        return None
    generation = max(reported)
    running = sorted(reported[generation], key=lambda r: r[1])
    slices: list[int] = []
    for host, _, _ in running:
        slice_id = next(r for r in hosts.records() if r.name == host).slice
        if slice_id not in slices:
            slices.append(slice_id)
    if [p for _, p, _ in running] != list(range(len(slices) * processes_per_slice)):
        return None  # a process is gone: the generation cannot go on
    return Adoptable(generation, slices, running)
