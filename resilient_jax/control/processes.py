"""Worker processes: start with a per-process output prefix, signal, stop within a bound.

Each worker runs in its own session (process group), so a SIGKILL to the group also reaches
whatever the worker started (data loader processes); nothing is left behind after `stop`.

A standby (`resilient_jax.worker.standby`) is a worker process started before it is needed:
`spawn_standby` starts it, `assign` gives it its place in a generation and makes it a worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Protocol

from resilient_jax.control import standby_cpu, wire
from resilient_jax.control.standby import Role


@dataclasses.dataclass
class WorkerProcess:
    process: int  # JAX process id in its generation
    slice: int  # physical slice id
    generation: int
    popen: subprocess.Popen[bytes]
    started_at: float  # supervisor clock
    reader: threading.Thread | None  # pumps its output into a sink (None: it writes to a file)
    exit_code: int | None = None  # Popen convention: -N = killed by signal N

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.poll() is None

    def poll(self) -> int | None:
        if self.exit_code is None:
            self.exit_code = self.popen.poll()
        return self.exit_code

    def wait(self, timeout: float) -> None:
        """Waits up to `timeout` for the exit (a process in uninterruptible I/O may outlive
        SIGKILL for a while), then for its output to be drained."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout)
        self.poll()
        if self.reader is not None:
            self.reader.join(timeout=1.0)

    def signal(self, signum: int, group: bool = False) -> None:
        """Sends `signum` to the worker (or its whole process group); a gone process is fine."""
        try:
            if group:
                os.killpg(self.popen.pid, signum)
            elif self.popen.poll() is None:
                os.kill(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


class OutputSink:
    """Merges worker output into one stream, a whole line at a time, each with its prefix."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def write_line(self, line: str) -> None:
        with self._lock:
            self._stream.write(line if line.endswith("\n") else line + "\n")
            self._stream.flush()

    def pump(self, pipe: IO[bytes], prefix: Callable[[], str]) -> None:
        for raw in iter(pipe.readline, b""):
            self.write_line(prefix() + raw.decode(errors="replace"))
        pipe.close()


def _start(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str | None,
    stdin: int,
    sink: OutputSink,
    prefix: Callable[[], str],
    output: str | None = None,
) -> tuple[subprocess.Popen[bytes], threading.Thread | None]:
    """Starts a process in its own session (so it is ended by PID with its children), its output
    pumped into `sink` under the current `prefix()`, or appended to the file `output` (then no
    reader thread)."""
    if output is not None:
        os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
    with open(output, "ab") if output is not None else contextlib.nullcontext() as log:
        popen = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdin=stdin,
            stdout=subprocess.PIPE if log is None else log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    if log is not None:
        return popen, None
    assert popen.stdout is not None
    reader = threading.Thread(
        target=sink.pump, args=(popen.stdout, prefix), name="rj-output", daemon=True
    )
    reader.start()
    return popen, reader


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    sink: OutputSink,
    prefix: str,
    process: int,
    slice_id: int,
    generation: int,
    clock: Callable[[], float] = time.monotonic,
    cwd: str | None = None,
    output: str | None = None,
) -> WorkerProcess:
    """Starts a worker, its output into `sink` under `prefix`, or appended to the file `output`
    (an elastic slice's: no pipe through the agent, whose output mixes every worker's)."""
    popen, reader = _start(argv, env, cwd, subprocess.DEVNULL, sink, lambda: prefix, output)
    return WorkerProcess(process, slice_id, generation, popen, clock(), reader)


@dataclasses.dataclass
class Standby:
    """A started worker process waiting for its place in a generation."""

    popen: subprocess.Popen[bytes]
    reader: threading.Thread
    prefix: list[str]  # the output prefix, changed when it is assigned
    idle: bool = False  # under SCHED_IDLE until assigned (`standby_cpu`)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


# What a standby imports ahead: the trainer's dependencies (JAX, Flax, Optax, Orbax, Grain).
STANDBY_PRELOAD = ("resilient_jax.run",)


def standby_argv(
    worker_argv: Sequence[str], preload: Sequence[str] = STANDBY_PRELOAD
) -> list[str] | None:
    """The standby command for a Python worker command (None: not a Python command)."""
    if not worker_argv or worker_argv[0] != sys.executable:
        return None
    return [
        sys.executable,
        "-m",
        "resilient_jax.worker.standby",
        f"--preload={','.join(preload)}",
        "--",
        *worker_argv[1:],
    ]


def spawn_standby(
    argv: Sequence[str],
    env: Mapping[str, str],
    sink: OutputSink,
    cwd: str | None = None,
    idle_cpu: bool = False,
) -> Standby:
    """Starts `argv` (from `standby_argv`) with the environment every worker shares; with
    `idle_cpu`, under SCHED_IDLE until `assign` (where this process may raise it back: a worker
    left idle would starve)."""
    prefix = ["[standby] "]
    popen, reader = _start(argv, env, cwd, subprocess.PIPE, sink, lambda: prefix[0])
    assert reader is not None  # its output goes through the sink
    idle = idle_cpu and _may_raise_threads()
    if idle:  # the group's write tried once: an agent's loop must not wait out the rate limit
        standby_cpu.lower(popen.pid, group_tries=1)
    return Standby(popen, reader, prefix, idle)


@functools.cache
def _may_raise_threads() -> bool:
    return standby_cpu.raising_permitted()


def assign(
    standby: Standby,
    env: Mapping[str, str],
    prefix: str,
    process: int,
    slice_id: int,
    generation: int,
    clock: Callable[[], float] = time.monotonic,
) -> WorkerProcess:
    """Makes a standby the worker `process` of `generation`, with the worker's environment.

    Raises OSError if the standby is gone (its stdin is closed), or if its CPU group could not
    be raised back (the kernel limits those writes): a worker there would starve its job, so the
    caller starts one cold instead.
    """
    assert standby.popen.stdin is not None
    if standby.idle:  # the worker runs at this process's own priority
        standby_cpu.restore(standby.popen.pid)
        if standby_cpu.group_left_lowered(standby.popen.pid):
            raise OSError(f"standby {standby.popen.pid}: its CPU group is still lowered")
    standby.popen.stdin.write(wire.encode(Role(dict(env), whole_env=True)))
    standby.popen.stdin.close()
    standby.prefix[0] = prefix
    return WorkerProcess(process, slice_id, generation, standby.popen, clock(), standby.reader)


def discard(standbys: Sequence[Standby]) -> None:
    """Ends standbys that will not be needed (closed stdin, then SIGKILL to the group)."""
    for standby in standbys:
        with contextlib.suppress(OSError):
            if standby.popen.stdin is not None:
                standby.popen.stdin.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(standby.popen.pid, signal.SIGKILL)
    for standby in standbys:
        with contextlib.suppress(subprocess.TimeoutExpired):
            standby.popen.wait(timeout=5.0)
        standby.reader.join(timeout=1.0)


class Stoppable(Protocol):
    """A worker as `stop` sees it: a local `WorkerProcess` or an agent's `hosts.RemoteWorker`."""

    @property
    def running(self) -> bool: ...

    def signal(self, signum: int, group: bool = False) -> None: ...

    def wait(self, timeout: float) -> None: ...


def stop(
    workers: Sequence[Stoppable],
    grace_s: float,
    should_hurry: Callable[[], bool] = lambda: False,
) -> float:
    """SIGTERM, up to `grace_s` to exit, then SIGKILL to each process group; returns seconds taken.

    After a failure the grace is short: a survivor inside a collective with a dead peer never
    returns. When asked to save and stop (preemption, scale-up), the grace covers the save.
    `should_hurry` (e.g. a second Ctrl-C) cuts the grace short.
    """
    start = time.monotonic()
    for worker in workers:
        if worker.running:
            worker.signal(signal.SIGTERM)
    deadline = start + grace_s
    while any(w.running for w in workers) and time.monotonic() < deadline and not should_hurry():
        time.sleep(0.02)
    for worker in workers:
        # The group too: an exited worker's own children must not outlive it.
        worker.signal(signal.SIGKILL, group=True)
    for worker in workers:
        worker.wait(timeout=5.0)
    return time.monotonic() - start


def describe_exit(code: int) -> str:
    """How a worker ended, for people: `exited with code N` or `was killed by SIGNAME`."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
