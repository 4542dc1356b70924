"""One slice of elastic mode as its supervisor sees it: its processes, started together by the
agent of one host with a JAX coordinator of their own (one runtime among them), and lost together.

A slice (or the warm standby) is one *launch*: its processes are the agents' workers of that
generation number, each launch a number of its own, so a restarted supervisor finds them in the
agents' registrations. A slice of P processes gets a fresh port for its coordinator at every
start; process p is told its place (`RJ_COORDINATOR_ADDRESS`, `RJ_NUM_PROCESSES`=P,
`RJ_PROCESS_ID`=p, one slice) and writes its output to `output.log` (process 0) or
`output.p<p>.log` of the slice's workdir. `SliceProcesses` stands for them where the supervisor
kept one process: `pid` is process 0's (the one the quorum server knows), `poll` says 0 once
every process has exited 0, and, the moment any exits non-zero, ends the others (their process
groups, through their agent) and says that code: a slice missing a process cannot train, so it is
replaced as a whole. One process is the single-process slice (no coordinator of its own).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

from resilient_jax.contracts import env_vars
from resilient_jax.control import agent_protocol as ap
from resilient_jax.control import processes
from resilient_jax.control.hosts import HostRegistry, RemoteWorker
from resilient_jax.control.launcher import worker_places
from resilient_jax.control.worker_env import free_port


def output_file(process: int) -> str:
    """The file, in its slice's workdir, process `process` of a slice writes its output to."""
    return "output.log" if process == 0 else f"output.p{process}.log"


def runtime_env(processes: int, host_address: str = "127.0.0.1") -> list[dict[str, str]]:
    """The environment of each process of a slice started now on the host at `host_address`: its
    place in the slice's own JAX runtime (a coordinator on a fresh port, found free on this
    machine: elastic mode's hosts are this machine's), nothing for a single-process slice."""
    if processes == 1:
        return [{}]
    address = f"{host_address}:{free_port()}"
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
    """The processes of one slice, one launch (see the module docstring)."""

    def __init__(self, members: Sequence[RemoteWorker], launch: int) -> None:
        self.members = list(members)
        self.launch = launch
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.pids[0]

    @property
    def pids(self) -> list[int]:
        return [m.pid for m in self.members if m.pid is not None]

    @property
    def host_slice(self) -> int:
        """The physical slice (host) it runs on."""
        return self.members[0].slice

    @property
    def host(self) -> str:
        return self.members[0].host

    def describe(self) -> str:
        """Its pids, for people."""
        if len(self.members) == 1:
            return f"pid {self.pid}"
        return "pids " + ", ".join(str(pid) for pid in self.pids)

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
        for member in self.members:
            member.signal(signum)

    def kill(self) -> None:
        """Ends every process of the slice with its children (their process groups, through
        their agent), and waits (bounded) for the agent to report them gone."""
        for member in self.members:
            member.signal(signal.SIGKILL, group=True)
        for member in self.members:
            member.wait(timeout=5.0)
        if self.returncode is None:
            codes = [m.poll() for m in self.members]
            self.returncode = next((c for c in codes if c not in (None, 0)), codes[0])


def pids_field(worker: SliceProcesses) -> dict[str, list[int]]:
    """An event's `pids` field for a slice of several processes (none for one)."""
    return {"pids": worker.pids} if len(worker.members) > 1 else {}


def start_slice(
    hosts: HostRegistry,
    host_slice: int,
    launch: int,
    argv: Sequence[str],
    workdir: str,
    placement: Mapping[str, str],
    processes_per_slice: int,
    devices_per_process: int,
    cwd: str | None,
    cache_env: Mapping[str, str],
) -> SliceProcesses:
    """Starts a slice's processes as launch `launch` on the hosts of physical slice `host_slice`,
    each with `placement` and its place in the slice's runtime. Raises OSError (nothing left
    running) when a start fails."""
    places = worker_places(hosts, [host_slice], processes_per_slice)
    runtime = runtime_env(processes_per_slice, places[0][2].address)
    workers: list[RemoteWorker] = []
    try:
        for (process, _, host), place in zip(places, runtime, strict=True):
            command = ap.Start(
                generation=launch,
                process=process,
                slice=host_slice,
                argv=list(argv),
                placement={**placement, **place},
                devices=devices_per_process,
                cwd=cwd,
                cache_env=dict(cache_env),
                output=os.path.join(workdir, output_file(process)),
                heartbeats=False,
            )
            workers.append(hosts.start(host, launch, process, command))
        hosts.await_started(workers)
    except BaseException:
        processes.stop(workers, grace_s=0.0)
        raise
    return SliceProcesses(workers, launch)


def wait_polled(poll: Callable[[], int | None], timeout: float, what: str) -> int:
    """The exit code `poll` reports, polled every 20 ms (a slice's processes together have no
    `wait` of their own). Raises subprocess.TimeoutExpired naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while (code := poll()) is None:
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(what, timeout)
        time.sleep(0.02)
    return code
