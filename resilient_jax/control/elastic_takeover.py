"""What a restarted elastic supervisor takes over: the slices and the standby an earlier one left
running under the hosts' agents, as the agents registered them (`elastic_state` for the file).

Each recorded launch the agents report is adopted as it is now: a slice whose every process
exited 0 while no supervisor was there finished the run; one with a failed process is adopted
all the same, then lost and replaced by the supervisor. Everything else this job started is
ended, so that no process trains beside a slice's replacement: launches the agents report that
the state does not name (started just before the last supervisor died, or a state file lost), and
recorded processes no agent reports (their agent died too), by pid and start time.
"""

from __future__ import annotations

import dataclasses
import signal

from resilient_jax.control import elastic_state
from resilient_jax.control.elastic_slice import SliceProcesses
from resilient_jax.control.hosts import HostRegistry


@dataclasses.dataclass
class Takeover:
    slices: dict[int, SliceProcesses] = dataclasses.field(default_factory=dict)  # adopted
    done: set[int] = dataclasses.field(default_factory=set)  # finished the run
    standby: SliceProcesses | None = None  # adopted, still running
    next_launch: int = 0  # past every launch recorded or reported
    ended: list[int] = dataclasses.field(default_factory=list)  # pids of processes ended


def take_over(previous: elastic_state.ElasticState | None, hosts: HostRegistry) -> Takeover:
    """Adopts `previous`'s launches the connected agents report and ends the rest (module doc)."""
    reported = hosts.generations_reported()
    found = Takeover(next_launch=max([0, *(g + 1 for g in reported)]))
    adopted: set[int] = set()
    if previous is not None:
        found.next_launch = max(found.next_launch, previous.next_launch)
        found.done.update(previous.done)
        if previous.standby is not None and previous.standby in reported:
            standby = _adopt(hosts, previous.standby)
            adopted.add(previous.standby)
            if standby.poll() is None:
                found.standby = standby
        for slice_id, launch in sorted(previous.slices.items()):
            if launch not in reported:
                continue  # its agent is gone: started afresh (its recorded processes ended below)
            worker = _adopt(hosts, launch)
            adopted.add(launch)
            if all(m.poll() == 0 for m in worker.members):
                found.done.add(slice_id)
            else:
                found.slices[slice_id] = worker
        for launch, records in previous.processes.items():
            if launch not in reported:
                found.ended += elastic_state.end_recorded(records)
    for launch in sorted(reported - adopted):
        for worker in _adopt(hosts, launch).members:
            if worker.poll() is None and worker.pid is not None:
                worker.signal(signal.SIGKILL, group=True)
                found.ended.append(worker.pid)
    return found


def _adopt(hosts: HostRegistry, launch: int) -> SliceProcesses:
    """The processes of `launch` the agents registered (running or exited)."""
    return SliceProcesses(hosts.adopt(launch, hosts.reported(launch)), launch)
