"""One slice of elastic mode as its supervisor sees it: its processes, started together with a JAX
coordinator of their own (one runtime among them), and lost together.

A slice (or the warm standby) of P processes gets a fresh loopback port for its coordinator at
every start; process p is told its place (`RJ_COORDINATOR_ADDRESS`, `RJ_NUM_PROCESSES`=P,
`RJ_PROCESS_ID`=p, one slice) and writes its output to `output.log` (process 0) or
`output.p<p>.log`. `SliceProcesses` stands for them where the supervisor kept one process: `pid`
is process 0's (the one the quorum server knows), `poll` says 0 once every process has exited 0,
and, the moment any exits non-zero, ends the others (by their pids' process groups) and says that
code: a slice missing a process cannot train, so it is replaced as a whole. One process is the
single-process slice as before (no coordinator of its own).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from resilient_jax.contracts import env_vars
from resilient_jax.control.worker_env import free_port


class Process(Protocol):
    """What the supervisor uses of a process: `subprocess.Popen`'s, or an adopted one's."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float) -> int: ...


def output_file(process: int) -> str:
    """The file, in its slice's workdir, process `process` of a slice writes its output to."""
    return "output.log" if process == 0 else f"output.p{process}.log"


def runtime_env(processes: int) -> list[dict[str, str]]:
    """The environment of each process of a slice started now: its place in the slice's own JAX
    runtime (a coordinator on a fresh port), nothing for a single-process slice."""
    if processes == 1:
        return [{}]
    address = f"127.0.0.1:{free_port()}"
    return [
        {
            env_vars.COORDINATOR_ADDRESS: address,
            env_vars.NUM_PROCESSES: str(processes),
            env_vars.PROCESS_ID: str(process),
            env_vars.NUM_SLICES: "1",
        }
        for process in range(processes)
    ]


class SliceProcesses:
    """The processes of one slice (see the module docstring)."""

    def __init__(self, members: Sequence[Process]) -> None:
        self.members = list(members)
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.members[0].pid

    @property
    def pids(self) -> list[int]:
        return [m.pid for m in self.members]

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        codes = [m.poll() for m in self.members]
        failed = next((c for c in codes if c not in (None, 0)), None)
        if failed is not None:
            self.kill()  # the slice is lost with any of its processes
            self.returncode = failed
        elif all(c == 0 for c in codes):
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float) -> int:
        return wait_polled(self.poll, timeout, f"pids {self.pids}")

    def signal(self, signum: int) -> None:
        """Sends `signum` to every process of the slice (a stop request)."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def kill(self) -> None:
        """Ends every process of the slice with its children (their process groups, by pid), and
        reaps them (bounded)."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        for member in self.members:
            with contextlib.suppress(subprocess.TimeoutExpired):
                member.wait(timeout=5.0)
        if self.returncode is None:
            codes = [m.returncode for m in self.members]
            self.returncode = next((c for c in codes if c not in (None, 0)), codes[0])


def wait_polled(poll: Callable[[], int | None], timeout: float, what: str) -> int:
    """The exit code `poll` reports, polled every 20 ms: processes that are not our children (a
    slice's processes together, or one adopted from an earlier supervisor) have no `wait`.
    Raises subprocess.TimeoutExpired naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (code := poll()) is None:
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(what, timeout)
        time.sleep(0.02)
    return code
