"""What a restarted elastic supervisor needs to take over a running job: `<workdir>/elastic.json`.

The elastic supervisor writes there the quorum server's address, its own pid, a digest of the run
token, the launch (the agents' generation number) of each running slice and of its warm standby,
the pids (and start times) of their processes, the slices that finished, and the next launch
number, saved before that launch starts. The slices run under the hosts' agents and outlive the
supervisor; while it is away they train on with their last quorum. A supervisor started again on
the same workdir (with the same run token) finds them here, listens on the same address, so their
quorum clients reconnect, and adopts the workers the agents register under each launch: no slice
is restarted. A launch it does not adopt is ended: through its agent, or by its recorded pids
when no agent reports it (its agent died too), so no process trains beside a slice's replacement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
from collections.abc import Iterable, Mapping

from resilient_jax.control.elastic_slice import SliceProcesses

STATE_FILE = "elastic.json"


def token_digest(token: str) -> str:
    """Names the token without saying it (the file is readable by others)."""
    return hashlib.sha256(token.encode()).hexdigest()


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot; tells it from a later process given the same
    pid), None when no such process is running (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    if fields[0] in ("Z", "X"):  # exited, not yet reaped
        return None
    return int(fields[19])


def process_records(pids: list[int]) -> list[list[int]]:
    """[pid, start time] of each running process of `pids`, for `ElasticState.processes`."""
    return [[pid, started] for pid in pids if (started := start_time(pid)) is not None]


def end_recorded(records: list[list[int]]) -> list[int]:
    """Ends (SIGKILL to its process group) each recorded process still running as the same
    process; the pids ended."""
    ended = []
    for pid, started in records:
        if start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
                ended.append(pid)
    return ended


@dataclasses.dataclass(frozen=True)
class ElasticState:
    address: str  # the quorum server's
    supervisor_pid: int
    token_sha256: str
    slices: dict[int, int]  # slice -> the launch running it
    done: list[int]  # slices that finished the run (exit 0)
    standby: int | None = None  # the warm standby's launch, if one runs
    next_launch: int = 0  # the number the next launch gets (saved before it starts)
    # launch -> [pid, start time] of each of its processes (slices' and the standby's)
    processes: dict[int, list[list[int]]] = dataclasses.field(default_factory=dict)


def snapshot(
    address: str,
    token: str,
    slices: Mapping[int, SliceProcesses],
    standby: SliceProcesses | None,
    done: Iterable[int],
    next_launch: int,
) -> ElasticState:
    """The state of a supervisor running `slices` (and `standby`) with its quorum at `address`."""
    running = [*slices.values(), *([standby] if standby is not None else [])]
    return ElasticState(
        address=address,
        supervisor_pid=os.getpid(),
        token_sha256=token_digest(token),
        slices={s: w.launch for s, w in slices.items()},
        done=sorted(done),
        standby=None if standby is None else standby.launch,
        next_launch=next_launch,
        processes={w.launch: process_records(w.pids) for w in running},
    )


def write_state(workdir: str, state: ElasticState) -> None:
    path = os.path.join(workdir, STATE_FILE)
    data = {
        "address": state.address,
        "supervisor_pid": state.supervisor_pid,
        "token_sha256": state.token_sha256,
        "slices": {str(s): launch for s, launch in sorted(state.slices.items())},
        "done": sorted(state.done),
        "standby": state.standby,
        "next_launch": state.next_launch,
        "processes": {str(launch): r for launch, r in sorted(state.processes.items())},
    }
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def read_state(workdir: str) -> ElasticState | None:
    """The state a supervisor left in `workdir`, None when there is none or it is unreadable (or
    written before slices ran under agents: nothing of it can be adopted)."""
    try:
        with open(os.path.join(workdir, STATE_FILE)) as f:
            data = json.load(f)
        standby = data["standby"]
        return ElasticState(
            address=str(data["address"]),
            supervisor_pid=int(data["supervisor_pid"]),
            token_sha256=str(data["token_sha256"]),
            slices={int(s): int(launch) for s, launch in data["slices"].items()},
            done=[int(s) for s in data["done"]],
            standby=None if standby is None else int(standby),
            next_launch=int(data["next_launch"]),
            processes={
                int(launch): [[int(pid), int(started)] for pid, started in records]
                for launch, records in data.get("processes", {}).items()
            },
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
