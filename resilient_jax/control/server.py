"""The supervisor's heartbeat server: collects what each worker last reported.

One thread multiplexes every connection with `selectors`. Each received line replaces the
worker's record; the receive time on the supervisor's own monotonic clock is what detection uses,
so clocks of other hosts never matter. Lines without this run's token close the connection, and
`on_refused` hears of it (the supervisor logs a `connection_refused` event), as it does of every
other refusal of `LineServer`'s (a connection silent past the auth timeout, one too many
unauthenticated, an over-long line); `on_suppressed` hears how many refusals it was not told of
one by one (`ConnectionLimits`).

Host agents (`agent_protocol`) talk over the same listener: their lines go to `on_agent` with the
connection, which `send` answers on; `on_disconnect` hears when such a connection closes.

A heartbeat of a generation older than the current one (`fence_below`) is answered with
`WorkerMessage.FENCED`: a worker the supervisor gave up stops itself even when its agent cannot
stop it (frozen, cut off).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from resilient_jax.contracts.messages import PHASES, Phase
from resilient_jax.control import protocol, wire
from resilient_jax.control.line_server import LineServer, PortGuard


@dataclasses.dataclass
class WorkerReport:
    """The latest news from one worker of one generation (times on the supervisor's clock)."""

    generation: int
    process: int
    slice: int | None
    pid: int | None
    phase: str
    step: int | None
    step_time_s: float | None  # median of recent steps, compile and save steps excluded
    first_seen: float
    last_seen: float
    last_progress: float | None  # when `step` last increased
    ready_at: float | None = None  # when it reported phase "ready" (about to take its first step)
    said_bye: bool = False
    error: str | None = None  # what a worker in phase "error" reported
    # step -> unix time the worker got it under way (its own clock), the most recent steps only
    arrivals: dict[int, float] = dataclasses.field(default_factory=dict)


class HeartbeatServer(LineServer):
    """Listens on `host:port` (port 0: any free port) until `close()`."""

    def __init__(
        self,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Callable[[], float] = time.monotonic,
        on_agent: Callable[[socket.socket, dict[str, Any]], str | None] | None = None,
        on_disconnect: Callable[[socket.socket], None] | None = None,
        guard: PortGuard | None = None,
    ) -> None:
        super().__init__(host, port, "rj-heartbeat-server", 0.1, clock=clock, guard=guard)
        self._token = token
        self._on_agent = on_agent
        self._on_disconnect = on_disconnect
        self._lock = threading.Lock()
        self._reports: dict[tuple[int, int], WorkerReport] = {}
        self._current: int | None = None  # heartbeats of generations before it are fenced
        self._start()

    def reports(self, generation: int) -> dict[int, WorkerReport]:
        """Copies of the records of `generation`'s workers, by process id."""
        with self._lock:
            return {
                process: dataclasses.replace(report, arrivals=dict(report.arrivals))
                for (gen, process), report in self._reports.items()
                if gen == generation
            }

    def send(self, conn: socket.socket, message: wire.Message) -> bool:
        """Sends one message to an agent's connection; False when it is gone (closed on the way)."""
        return self._send(conn, wire.encode(message))

    def fence_below(self, generation: int) -> None:
        """Workers of generations before `generation` are told to stop at their next heartbeat."""
        with self._lock:
            self._current = max(generation, self._current or 0)

    def forget_before(self, generation: int) -> None:
        self.fence_below(generation)
        with self._lock:
            for key in [k for k in self._reports if k[0] < generation]:
                del self._reports[key]

    def _on_drop(self, conn: socket.socket) -> None:
        if self._on_disconnect is not None:
            self._on_disconnect(conn)

    def _handle_line(self, conn: socket.socket, line: bytes) -> str | None:
        try:
            message = protocol.read(line, self._token)
            if protocol.is_agent_line(message):
                return self._on_agent(conn, message) if self._on_agent is not None else None
            heartbeat = protocol.worker_line(message)
        except protocol.ProtocolError as e:
            return str(e)
        self._record(heartbeat)
        with self._lock:
            current = self._current
        if current is not None and heartbeat.generation < current:
            self._send(conn, wire.encode(protocol.FencedReply(current)))
        return None

    def _record(self, heartbeat: protocol.Heartbeat) -> None:
        now = self._clock()
        key = (heartbeat.generation, heartbeat.process)
        with self._lock:
            report = self._reports.get(key)
            if report is None:
                report = WorkerReport(
                    generation=key[0],
                    process=key[1],
                    slice=heartbeat.slice,
                    pid=heartbeat.pid,
                    phase=Phase.INIT,
                    step=None,
                    step_time_s=None,
                    first_seen=now,
                    last_seen=now,
                    last_progress=None,
                )
                self._reports[key] = report
            step = heartbeat.step
            if step is not None and (report.step is None or step > report.step):
                report.last_progress = now
                report.step = step
            if heartbeat.phase in PHASES:
                if heartbeat.phase == Phase.READY and report.phase != heartbeat.phase:
                    report.ready_at = now
                report.phase = heartbeat.phase
            if heartbeat.step_time_s is not None:
                report.step_time_s = heartbeat.step_time_s
            if heartbeat.error is not None:
                report.error = heartbeat.error[: protocol.MAX_ERROR_CHARS]
            _merge_arrivals(report.arrivals, heartbeat.arrivals)
            report.last_seen = now
            report.said_bye = report.said_bye or isinstance(heartbeat, protocol.Bye)


def _merge_arrivals(arrivals: dict[int, float], reported: Any) -> None:
    """Adds well-formed `[step, time]` pairs; keeps the newest `MAX_ARRIVALS_KEPT` steps."""
    if not isinstance(reported, list):
        return
    for pair in reported:
        if (
            isinstance(pair, list)
            and len(pair) == 2
            and isinstance(pair[0], int)
            and isinstance(pair[1], (int, float))
        ):
            arrivals[pair[0]] = float(pair[1])
    for step in sorted(arrivals)[: max(0, len(arrivals) - protocol.MAX_ARRIVALS_KEPT)]:
        del arrivals[step]
