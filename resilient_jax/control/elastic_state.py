"""What a restarted elastic supervisor needs to take over a running job: `<workdir>/elastic.json`.

The elastic supervisor writes there the quorum server's address, its own pid, a digest of the run
token, each slice's worker (pid and start time) and its warm standby slice's, if one runs. The
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
import subprocess
import time
from collections.abc import Mapping

from resilient_jax.contracts.event_types import EventType
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


@dataclasses.dataclass(frozen=True)
class ElasticState:
    address: str  # the quorum server's
    supervisor_pid: int
    token_sha256: str
    slices: dict[int, SliceRecord]
    done: list[int]  # slices whose worker finished the run (exit 0)
    standby: SliceRecord | None = None  # the warm standby slice's process, if one runs

    def standby_running(self) -> SliceRecord | None:
        """The recorded standby, if it is still running (the same process)."""
        record = self.standby
        if record is not None and start_time(record.pid) == record.started:
            return record
        return None

    def running(self) -> dict[int, SliceRecord]:
        """The recorded workers that are still running (the same processes)."""
        return {
            slice_id: record
            for slice_id, record in self.slices.items()
            if start_time(record.pid) == record.started
        }


def write_state(workdir: str, state: ElasticState) -> None:
    path = os.path.join(workdir, STATE_FILE)
    data = {
        "address": state.address,
        "supervisor_pid": state.supervisor_pid,
        "token_sha256": state.token_sha256,
        "slices": {str(s): [r.pid, r.started] for s, r in sorted(state.slices.items())},
        "done": sorted(state.done),
        "standby": None if state.standby is None else [state.standby.pid, state.standby.started],
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
            slices={
                int(s): SliceRecord(int(pid), int(started))
                for s, (pid, started) in data["slices"].items()
            },
            done=[int(s) for s in data["done"]],
            standby=SliceRecord(*map(int, data["standby"])) if data.get("standby") else None,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


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
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


def slice_records(workers: Mapping[int, subprocess.Popen[bytes] | AdoptedWorker]) -> dict:
    """Records of the running workers, for `write_state`."""
    records = {}
    for slice_id, worker in workers.items():
        record = process_record(worker)
        if record is not None:
            records[slice_id] = record
    return records


def process_record(worker: subprocess.Popen[bytes] | AdoptedWorker | None) -> SliceRecord | None:
    """The record of a running worker, None when there is none or it has ended."""
    started = start_time(worker.pid) if worker is not None else None
    return SliceRecord(worker.pid, started) if worker is not None and started is not None else None
