"""What a restarted elastic supervisor needs to take over a running job: `<workdir>/elastic.json`.

The elastic supervisor writes there the quorum server's address, its own pid, a digest of the run
token, each slice's processes (pid and start time of each) and its warm standby slice's, if one
runs. The
slices run in sessions of their own and outlive the supervisor; while it is away they train on with
their last quorum. A supervisor started again on the same workdir (with the same run token) finds
them here, listens on the same address, so their quorum clients reconnect, and adopts them: no
slice is restarted. A standby still running is adopted as the standby (it registers again with the
restarted quorum server). An adopted worker is not its child, so its end is seen in /proc, and its
exit code read from the `stop` event it wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
from collections.abc import Mapping

from resilient_jax.contracts.event_types import EventType
from resilient_jax.control.elastic_slice import SliceProcesses, wait_polled
from resilient_jax.events import read_events

STATE_FILE = "elastic.json"
# The exit code of an adopted worker that wrote no `stop` event (killed, or crashed hard).
NO_STOP_EVENT = -int(signal.SIGKILL)


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


@dataclasses.dataclass(frozen=True)
class SliceRecord:
    pid: int
    started: int  # `start_time(pid)` when it was started


# A slice's processes, process 0 first.
Records = tuple[SliceRecord, ...]


def _running(records: Records) -> bool:
    """Whether any of the recorded processes still runs (the same process): a slice one of whose
    processes died is adopted all the same, and then lost and replaced as a whole."""
    return any(start_time(r.pid) == r.started for r in records)


@dataclasses.dataclass(frozen=True)
class ElasticState:
    address: str  # the quorum server's
    supervisor_pid: int
    token_sha256: str
    slices: dict[int, Records]
    done: list[int]  # slices whose worker finished the run (exit 0)
    standby: Records | None = None  # the warm standby slice's processes, if one runs

    def standby_running(self) -> Records | None:
        """The recorded standby, if it is still running."""
        if self.standby is not None and _running(self.standby):
            return self.standby
        return None

    def running(self) -> dict[int, Records]:
        """The recorded slices that are still running."""
        return {s: records for s, records in self.slices.items() if _running(records)}


def write_state(workdir: str, state: ElasticState) -> None:
    path = os.path.join(workdir, STATE_FILE)
    data = {
        "address": state.address,
        "supervisor_pid": state.supervisor_pid,
        "token_sha256": state.token_sha256,
        "slices": {str(s): _to_json(records) for s, records in sorted(state.slices.items())},
        "done": sorted(state.done),
        "standby": None if state.standby is None else _to_json(state.standby),
    }
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def read_state(workdir: str) -> ElasticState | None:
    """The state a supervisor left in `workdir`, None when there is none or it is unreadable."""
    try:
        with open(os.path.join(workdir, STATE_FILE)) as f:
            data = json.load(f)
        return ElasticState(
            address=str(data["address"]),
            supervisor_pid=int(data["supervisor_pid"]),
            token_sha256=str(data["token_sha256"]),
            slices={int(s): _from_json(records) for s, records in data["slices"].items()},
            done=[int(s) for s in data["done"]],
            standby=_from_json(data["standby"]) if data.get("standby") else None,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _to_json(records: Records) -> list[list[int]]:
    return [[r.pid, r.started] for r in records]


def _from_json(data: list) -> Records:
    if data and isinstance(data[0], int):  # one process, as written before slices had several
        data = [data]
    return tuple(SliceRecord(int(pid), int(started)) for pid, started in data)


def stop_exit_code(slice_workdir: str, pid: int) -> int | None:
    """The exit code in the last `stop` event process `pid` wrote, None when it wrote none."""
    code = None
    for event in read_events(slice_workdir):
        if event.get("type") == EventType.STOP and event.get("pid") == pid:
            code = event.get("exit_code")
    return code if isinstance(code, int) else None


class AdoptedWorker:
    """A running slice worker started by an earlier supervisor: the part of `subprocess.Popen`
    the elastic supervisor uses (`pid`, `poll`, `wait`, `returncode`)."""

    def __init__(self, record: SliceRecord, slice_workdir: str) -> None:
        self.pid = record.pid
        self._started = record.started
        self.workdir = slice_workdir  # where its `stop` event is (a standby's: its slice's)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and start_time(self.pid) != self._started:
            code = stop_exit_code(self.workdir, self.pid)
            self.returncode = NO_STOP_EVENT if code is None else code
        return self.returncode

    def wait(self, timeout: float) -> int:
        return wait_polled(self.poll, timeout, f"pid {self.pid}")


def slice_records(workers: Mapping[int, SliceProcesses]) -> dict[int, Records]:
    """Records of the running slices, for `write_state`."""
    records = {}
    for slice_id, worker in workers.items():
        record = process_records(worker)
        if record is not None:
            records[slice_id] = record
    return records


def process_records(worker: SliceProcesses | None) -> Records | None:
    """The records of a slice's processes (one that ended: started 0, so never taken for a running
    one), None when there is none or all have ended."""
    if worker is None:
        return None
    records = tuple(SliceRecord(m.pid, start_time(m.pid) or 0) for m in worker.members)
    return records if any(r.started for r in records) else None


def adopt(records: Records, slice_workdir: str) -> SliceProcesses:
    """The processes of a slice started by an earlier supervisor, adopted."""
    return SliceProcesses([AdoptedWorker(r, slice_workdir) for r in records])


def finished(records: Records, slice_workdir: str) -> bool:
    """Whether every recorded process of a slice wrote a `stop` event with exit code 0."""
    return all(stop_exit_code(slice_workdir, r.pid) == 0 for r in records)
