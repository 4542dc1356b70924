"""A TCP server of newline-terminated messages: one thread serves every connection.

The control plane's servers (the heartbeat server, the quorum server) speak JSON lines over
long-lived connections. This class holds what they share: the listener, one `selectors` loop in a
background thread that accepts connections, reads them and splits what arrives into lines, the
closing of a connection (its peer went away, or sent something refused or over-long), bounded
sends and a bounded shutdown. A subclass handles whole lines (`_handle_line`), and may hear of
closed connections (`_on_drop`) and act after each turn of the loop (`_tick`).

A control port is reachable by anyone on the network, so it holds against clients that are not
the run's (`ConnectionLimits`): a connection is unauthenticated until the subclass accepted one
of its lines (which carry the run token); it is closed if that has not happened within
`auth_timeout_s`, and at most `max_pending` are open at once (a new one beyond is closed at
once). Every connection the server closes for what it sent or failed to send is a refusal,
reported once, at a bounded rate per peer (`refusals.RefusalLimiter`); a peer that closes on its
own is no refusal. What a connection may buffer is bounded by the longest line the server takes
(`max_line_bytes`), so the memory unauthenticated peers can hold is bounded too.

A server of one request per connection (`tier_service.TierServer`: a peer's checkpoint copy,
gigabytes) takes the connection out of the loop once its request is accepted (`_detach`) and
answers it from a thread of its own, so one slow reader never holds the others.
"""

from __future__ import annotations

import dataclasses
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from resilient_jax.config import default_config
from resilient_jax.control import protocol
from resilient_jax.control.refusals import (
    OnRefused,
    OnSuppressed,
    RefusalLimiter,
    RefusalReports,
)

SEND_TIMEOUT_S = 1.0  # a peer that takes no bytes for this long is taken for gone
_ACCEPTS_PER_TURN = 64  # a burst of connections is taken in a few turns, others still served


_DEFAULTS = default_config().coordinator


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """What a control port allows clients that have not shown the run token (the
    `coordinator.*` keys of the same names in `config/defaults.py`, their defaults too)."""

    auth_timeout_s: float = float(_DEFAULTS.auth_timeout_s)
    max_pending: int = int(_DEFAULTS.max_pending_connections)
    # Per peer host and window; the rest are counted.
    refusals_logged: int = int(_DEFAULTS.refusals_logged_per_peer)
    refusal_window_s: float = float(_DEFAULTS.refusal_log_window_s)

    @classmethod
    def from_config(cls, coordinator: Any) -> ConnectionLimits:
        return cls(
            auth_timeout_s=float(coordinator.auth_timeout_s),
            max_pending=int(coordinator.max_pending_connections),
            refusals_logged=int(coordinator.refusals_logged_per_peer),
            refusal_window_s=float(coordinator.refusal_log_window_s),
        )


@dataclasses.dataclass(frozen=True)
class PortGuard:
    """How a control port holds against clients that are not the run's: its limits, and whom it
    tells of each refusal (`on_refused`) and of those it only counted (`on_suppressed`)."""

    limits: ConnectionLimits = ConnectionLimits()
    on_refused: OnRefused | None = None
    on_suppressed: OnSuppressed | None = None

    @classmethod
    def reporting_to(
        cls, reports: RefusalReports, limits: ConnectionLimits | None = None
    ) -> PortGuard:
        """`limits` (default: the config's defaults), each refusal an event and a log line."""
        return cls(limits or ConnectionLimits(), reports.refused, reports.suppressed)


@dataclasses.dataclass
class _Connection:
    peer: str  # "host:port", read at accept: a reset connection no longer has one
    # The start of a line whose end has not arrived yet.
    buffer: bytearray = dataclasses.field(default_factory=bytearray)
    authenticated: bool = False


class LineServer:
    """Listens on `host:port` (port 0: any free port) from construction until `close()`."""

    # The refusals' reasons; a subclass names what its clients send.
    LATE = "no message with the run token within {seconds:g}s (coordinator.auth_timeout_s)"
    TOO_LONG = "a line longer than {limit} bytes"

    def __init__(
        self,
        host: str,
        port: int,
        name: str,
        poll_s: float,
        clock: Callable[[], float] = time.monotonic,
        guard: PortGuard | None = None,
        max_line_bytes: int = protocol.MAX_LINE_BYTES,
    ) -> None:
        guard = guard or PortGuard()
        self._limits = guard.limits
        self._on_refused, self._on_suppressed = guard.on_refused, guard.on_suppressed
        self._refusals = self._limiter(self._limits)
        # set_limits's, for the server thread to take; the counts of the limiters it replaced.
        self._new_limits: ConnectionLimits | None = None
        self._new_limits_lock = threading.Lock()
        self._refused_before = 0
        self._max_line_bytes = max_line_bytes
        self._poll_s = poll_s
        self._clock = clock
        self._turn_started = clock()  # when the server thread last began to wait for input
        self._listener = socket.create_server((host, port))  # SO_REUSEADDR: re-listen at once
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._connections: dict[socket.socket, _Connection] = {}
        # Unauthenticated connections and when each is closed; insertion order is deadline
        # order (one timeout for all, deadlines taken from a monotonic clock).
        self._unauthenticated: dict[socket.socket, float] = {}
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def _limiter(self, limits: ConnectionLimits) -> RefusalLimiter:
        return RefusalLimiter(
            limits.refusals_logged, limits.refusal_window_s, self._on_refused, self._on_suppressed
        )

    def _start(self) -> None:
        """Starts the server thread; a subclass calls it once its own state is set up."""
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def heard_until(self, now: float) -> float:
        """The latest time up to which every line that arrived has been handled: `now`, unless
        the server thread has not begun a wait since `poll_s` before it (its process was paused:
        by the host, by swapping, by its own garbage collection), then the end of its last wait.
        Whoever judges a peer's silence judges it up to this time, so a paused process never
        blames a peer for lines it had not read yet."""
        return min(now, self._turn_started + self._poll_s)

    @property
    def refused_total(self) -> int:
        """Connections refused since the start (reported one by one or counted)."""
        return self._refused_before + self._refusals.total

    def set_limits(self, limits: ConnectionLimits) -> None:
        """Holds connections accepted from now on to `limits` (a host agent's tier port learns
        the run's with the supervisor's welcome). The server thread takes them before it handles
        anything that arrives after this call."""
        with self._new_limits_lock:
            self._new_limits = limits

    def connection_counts(self) -> tuple[int, int]:
        """(open connections, of which unauthenticated), as last seen by the server thread."""
        return len(self._connections), len(self._unauthenticated)

    def close(self) -> None:
        if self._stop.is_set():
            return  # closed already
        self._stop.set()
        self._thread.join(timeout=2.0)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()
        if not self._thread.is_alive():  # the counts belong to the server thread until it ends
            self._refusals.flush(None)

    def _send(self, conn: socket.socket, data: bytes) -> bool:
        """Sends bytes to a connection (from any thread); False when it is gone."""
        try:
            with self._send_lock:
                conn.sendall(data)
        except OSError:
            return False
        return True

    # For subclasses.

    def _handle_line(self, conn: socket.socket, line: bytes) -> str | None:
        """Handles one received line: None accepts it (the connection is then authenticated),
        a reason refuses it and closes the connection (the rest of what it sent is not read)."""
        raise NotImplementedError

    def _on_drop(self, conn: socket.socket) -> None:
        """Hears that `conn` is about to close (in the server thread)."""

    def _farewell(self, why: str) -> bytes | None:
        """What a refused connection is sent before it is closed (after the refusal is reported);
        None: nothing (a refusal answers nothing, by default)."""
        return None

    def _detach(self, conn: socket.socket) -> None:
        """Takes an accepted connection out of the loop, open, for the subclass to answer and
        close from another thread (sends bounded by `SEND_TIMEOUT_S` until it sets another)."""
        self._selector.unregister(conn)
        del self._connections[conn]
        self._unauthenticated.pop(conn, None)

    def _tick(self) -> None:
        """Runs in the server thread after every turn of the loop (at least every `poll_s`)."""

    # The server thread.

    def _serve(self) -> None:
        while not self._stop.is_set():
            # Whatever arrived before this moment is read in this turn: `select` reports every
            # connection with bytes waiting.
            self._turn_started = self._clock()
            ready = self._selector.select(timeout=self._poll_s)
            self._take_new_limits()
            for key, _ in ready:
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            now = self._clock()
            self._close_expired(now)
            self._refusals.flush(now)
            self._tick()

    def _take_new_limits(self) -> None:
        with self._new_limits_lock:
            limits, self._new_limits = self._new_limits, None
        if limits is None or limits == self._limits:
            return
        self._refusals.flush(None)  # what the old windows counted is reported, not lost
        self._refused_before += self._refusals.total
        self._limits, self._refusals = limits, self._limiter(limits)

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                conn, address = self._listener.accept()
            except OSError:  # none left to accept (or one reset before it was taken)
                return
            peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else "?"
            if len(self._unauthenticated) >= self._limits.max_pending:
                conn.close()
                self._refusals.refused(
                    peer,
                    f"{len(self._unauthenticated)} unauthenticated connections open already "
                    f"(coordinator.max_pending_connections)",
                    self._clock(),
                )
                continue
            # Reads happen only when the selector says data is there; the timeout bounds sends.
            conn.settimeout(SEND_TIMEOUT_S)
            self._connections[conn] = _Connection(peer)
            self._unauthenticated[conn] = self._clock() + self._limits.auth_timeout_s
            self._selector.register(conn, selectors.EVENT_READ)

    def _close_expired(self, now: float) -> None:
        while self._unauthenticated:
            conn, deadline = next(iter(self._unauthenticated.items()))
            if deadline > now:
                return
            self._refuse(conn, self.LATE.format(seconds=self._limits.auth_timeout_s))

    def _refuse(self, conn: socket.socket, why: str) -> None:
        """Closes `conn` for what it sent (or did not send) and reports it."""
        connection = self._connections.get(conn)
        if connection is None:
            return  # closed already
        # Reported before the close: a peer that sees its connection end finds the refusal
        # already logged (the other order let a reader of the event log race the report).
        self._refusals.refused(connection.peer, why, self._clock())
        farewell = self._farewell(why)
        if farewell is not None:
            self._send(conn, farewell)
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        if conn not in self._connections:
            return  # closed already
        self._selector.unregister(conn)
        del self._connections[conn]
        self._unauthenticated.pop(conn, None)
        self._on_drop(conn)
        _discard_unread(conn)
        conn.close()

    def _read(self, conn: socket.socket) -> None:
        connection = self._connections.get(conn)
        if connection is None:
            return  # closed earlier in this turn
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError, TimeoutError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        connection.buffer += data  # amortised: a long request arrives in many pieces
        too_long = self.TOO_LONG.format(limit=self._max_line_bytes)
        if b"\n" not in data:
            if len(connection.buffer) > self._max_line_bytes:
                self._refuse(conn, too_long)
            return
        *lines, rest = bytes(connection.buffer).split(b"\n")
        # A complete line is bounded too: what a peer makes this server parse stays bounded.
        if len(rest) > self._max_line_bytes or any(
            len(line) > self._max_line_bytes for line in lines
        ):
            self._refuse(conn, too_long)
            return
        connection.buffer = bytearray(rest)
        for line in lines:
            try:
                why = self._handle_line(conn, line)
            except Exception as e:
                why = f"malformed line ({type(e).__name__})"
            if why is not None:
                self._refuse(conn, why)
                return
            if conn not in self._connections:
                return  # the subclass closed it
            if not connection.authenticated:
                connection.authenticated = True
                del self._unauthenticated[conn]


def _discard_unread(conn: socket.socket) -> None:
    """Reads away what arrived unread (a refused request's rest, bounded): a socket closed with
    unread bytes ends in a reset, and its peer would read an error instead of the close."""
    try:
        conn.setblocking(False)
        for _ in range(16):
            if not conn.recv(65536):
                return
    except OSError:  # nothing left (BlockingIOError), or reset already
        return
