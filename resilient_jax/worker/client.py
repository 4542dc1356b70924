"""Worker side of supervision: heartbeats and progress reports to the supervisor.

A background thread sends one message every `heartbeat_interval_s` with the latest phase, step and
median step time, so heartbeats keep coming while the main thread compiles, restores or saves: the
supervisor tells "alive but slow" (heartbeats, no steps) from "dead" (no heartbeats). The main
thread only updates a few fields under a lock; it never touches the socket, so a dead or stopped
supervisor can never block training.

The same thread fences the worker: when the supervisor answers a heartbeat with
`WorkerMessage.FENCED`, or the run's generation file names a newer generation, this generation was
given up (its agent frozen or cut off, say), and the worker ends itself and its process group at
once, whatever its main thread is doing (a collective with a dead peer never returns).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import ml_collections

from resilient_jax.contracts import env_vars
from resilient_jax.contracts.generation_file import Fenced, GenerationFence
from resilient_jax.contracts.messages import PHASES, Phase
from resilient_jax.control import protocol, wire
from resilient_jax.control.line_client import LineConnection
from resilient_jax.train.hooks import Hook, StepInfo

if TYPE_CHECKING:
    from resilient_jax.train.context import RunContext
    from resilient_jax.train.state import TrainState

_STEP_TIME_WINDOW = 32
# Steps whose arrival times every heartbeat repeats: the supervisor merges them, so a lost
# heartbeat costs nothing as long as fewer steps than this pass between two heartbeats.
ARRIVALS_SENT = 16
_PR_SET_PDEATHSIG = 1


class SupervisorClient(Hook):
    """Reports this worker's liveness and progress; add it to the train loop's hooks."""

    def __init__(
        self,
        address: str,
        token: str,
        generation: int,
        process: int,
        slice_id: int | None,
        interval_s: float,
        fence: GenerationFence | None = None,
    ) -> None:
        protocol.split_address(address)  # a malformed address is refused here, not retried
        self._address = address
        self.fence = fence  # also what the worker's event log and checkpoints check
        self._token = token
        self._identity = {
            "generation": generation,
            "process": process,
            "slice": slice_id,
            "pid": os.getpid(),
        }
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._phase = Phase.INIT
        self._step: int | None = None
        self._step_times: deque[float] = deque(maxlen=_STEP_TIME_WINDOW)
        self._arrivals: deque[tuple[int, float]] = deque(maxlen=ARRIVALS_SENT)
        self._error: str | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # send now instead of at the next tick
        self._conn: LineConnection | None = None  # used by the background thread only
        self._thread = threading.Thread(target=self._run, name="rj-supervisor-client", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(
        cls,
        coordinator_config: ml_collections.ConfigDict,
        environ: Mapping[str, str] = os.environ,
        workdir: str | None = None,
    ) -> SupervisorClient | None:
        """A started client when a supervisor launched this process, else None; with `workdir`
        it fences the worker by the run's generation file too."""
        address = environ.get(env_vars.SUPERVISOR_ADDRESS)
        if not address:
            return None
        supervisor_pid = environ.get(env_vars.SUPERVISOR_PID)
        if supervisor_pid:
            _die_with_parent(int(supervisor_pid))
        slice_id = environ.get(env_vars.SLICE)
        generation = int(environ.get(env_vars.GENERATION, "0"))
        client = cls(
            address=address,
            token=environ.get(env_vars.RUN_TOKEN, ""),
            generation=generation,
            process=int(environ.get(env_vars.PROCESS_ID, "0")),
            slice_id=int(slice_id) if slice_id is not None else None,
            interval_s=float(coordinator_config.heartbeat_interval_s),
            fence=GenerationFence(workdir, generation) if workdir else None,
        )
        client.install_excepthook()
        return client

    # What the worker program calls.

    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; allowed: {', '.join(PHASES)}")
        with self._lock:
            if self._phase != Phase.ERROR:  # an error is final
                self._phase = phase

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """Reports `phase` (e.g. "restore") while the block runs, then the previous one."""
        with self._lock:
            previous = self._phase
        self.set_phase(phase)
        try:
            yield
        finally:
            self.set_phase(previous)

    def report_error(self, message: str) -> None:
        """Tells the supervisor at once that this worker failed (it may hang on its way out)."""
        with self._lock:
            self._phase = Phase.ERROR
            self._error = message[: protocol.MAX_ERROR_CHARS]
        self._wake.set()

    def install_excepthook(self) -> None:
        """Reports an uncaught exception of the main thread before Python's exit handlers run."""
        previous = sys.excepthook

        def hook(exc_type, exc, tb) -> None:
            self.report_error(f"{exc_type.__name__}: {exc}")
            previous(exc_type, exc, tb)

        sys.excepthook = hook

    def report_step(self, step: int, step_time_s: float) -> None:
        # When this process got step `step` under way, on the wall clock every process of the
        # job shares (to the precision of clock sync): the supervisor compares these arrivals
        # across processes to find the one the others wait for (`control.stragglers`).
        arrival = round(time.time(), 4)
        with self._lock:
            self._arrivals.append((step, arrival))
            # The first step after start-up or a save includes compile or save time: it would
            # inflate the median the supervisor derives its hang timeout from.
            if self._phase == Phase.TRAIN:
                self._step_times.append(step_time_s)
            if self._phase != Phase.ERROR:
                self._phase = Phase.TRAIN
            self._step = step

    # Hook interface.

    def on_start(self, ctx: RunContext, state: TrainState) -> None:
        self.set_phase(Phase.READY)  # restored and compiled: the first step is next

    def after_step(self, ctx: RunContext, state: TrainState, info: StepInfo) -> None:
        self.report_step(info.step, info.step_time_s)

    def on_end(self, ctx: RunContext, state: TrainState, info: StepInfo | None) -> None:
        self.set_phase(Phase.DONE)

    def close(self) -> None:
        """Says goodbye (best effort) and stops the thread; never blocks for long."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=2 * self._interval_s + 1.0)

    # Background thread.

    def _message(self, kind: type[protocol.Heartbeat]) -> protocol.Heartbeat:
        with self._lock:
            times = list(self._step_times)
            return kind(
                **self._identity,
                phase=self._phase,
                step=self._step,
                step_time_s=statistics.median(times) if times else None,
                error=self._error,
                arrivals=[list(a) for a in self._arrivals],
            )

    def _run(self) -> None:
        while True:
            self._send(self._message(protocol.Heartbeat))
            self._check_fence()
            self._wake.wait(self._interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
        self._send(self._message(protocol.Bye))
        self._disconnect()

    def _send(self, message: protocol.Heartbeat) -> None:
        # Timeouts bound every socket call: a supervisor that stopped reading costs one missed
        # heartbeat, then a reconnect attempt at the next tick.
        try:
            if self._conn is None:
                timeout = max(0.1, min(1.0, self._interval_s))
                self._conn = LineConnection.open(self._address, timeout)
            self._conn.send(message, token=self._token)
        except OSError:
            self._disconnect()

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _check_fence(self) -> None:
        """Ends this process when the supervisor said, or the generation file says, that a
        newer generation replaced this one."""
        newer = self._fenced_by_supervisor()
        if newer is None and self.fence is not None:
            newer = self.fence.superseded_by()
        if newer is None:
            return
        reason = Fenced(int(self._identity["generation"]), newer)
        with contextlib.suppress(OSError):
            os.write(2, f"error: {reason}\n".encode())
        # The worker leads its own session when an agent started it: its helpers go with it.
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def _fenced_by_supervisor(self) -> int | None:
        """The newer generation a `fenced` answer names, if one has arrived (never blocks)."""
        if self._conn is None:
            return None
        try:
            lines = self._conn.lines(wait_s=0.0)
        except OSError:  # the supervisor went away: the next heartbeat reconnects
            self._disconnect()
            return None
        for line in lines:
            try:
                return wire.decode(json.loads(line), protocol.FencedReply).generation
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # nothing this worker acts on
        return None


def _die_with_parent(supervisor_pid: int) -> None:
    """Asks Linux to SIGKILL this process when the supervisor dies, so no worker outlives it.

    Only when the supervisor is the direct parent: a worker command wrapped in a shell has another
    parent, whose death says nothing about the supervisor's.
    """
    if not sys.platform.startswith("linux") or os.getppid() != supervisor_pid:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != supervisor_pid:  # the supervisor died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
