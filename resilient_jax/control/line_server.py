"""A TCP server of newline-terminated messages: one thread serves every connection.

The control plane's servers (the heartbeat server, the quorum server) speak JSON lines over
long-lived connections. This class holds what they share: the listener, one `selectors` loop in a
background thread that accepts connections, reads them and splits what arrives into lines, the
closing of a connection (its peer went away, or sent something refused or over-long), bounded
sends and a bounded shutdown. A subclass handles whole lines (`_handle_line`), and may hear of
closed connections (`_on_drop`) and act after each turn of the loop (`_tick`).
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Callable

from resilient_jax.control import protocol

SEND_TIMEOUT_S = 1.0  # a peer that takes no bytes for this long is taken for gone


class LineServer:
    """Listens on `host:port` (port 0: any free port) from construction until `close()`."""

    def __init__(
        self,
        host: str,
        port: int,
        name: str,
        poll_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._poll_s = poll_s
        self._clock = clock
        self._turn_started = clock()  # when the server thread last began to wait for input
        self._listener = socket.create_server((host, port))  # SO_REUSEADDR: re-listen at once
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._buffers: dict[socket.socket, bytes] = {}
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

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

    def close(self) -> None:
        if self._stop.is_set():
            return  # closed already
        self._stop.set()
        self._thread.join(timeout=2.0)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()

    def _send(self, conn: socket.socket, data: bytes) -> bool:
        """Sends bytes to a connection (from any thread); False when it is gone."""
        try:
            with self._send_lock:
                conn.sendall(data)
        except OSError:
            return False
        return True

    # For subclasses.

    def _handle_line(self, conn: socket.socket, line: bytes) -> bool:
        """Handles one received line; False closes the connection (the rest of what it sent is
        not read)."""
        raise NotImplementedError

    def _on_drop(self, conn: socket.socket) -> None:
        """Hears that `conn` is about to close (in the server thread)."""

    def _tick(self) -> None:
        """Runs in the server thread after every turn of the loop (at least every `poll_s`)."""

    # The server thread.

    def _serve(self) -> None:
        while not self._stop.is_set():
            # Whatever arrived before this moment is read in this turn: `select` reports every
            # connection with bytes waiting.
            self._turn_started = self._clock()
            for key, _ in self._selector.select(timeout=self._poll_s):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            self._tick()

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        # Reads happen only when the selector says data is there; the timeout bounds sends.
        conn.settimeout(SEND_TIMEOUT_S)
        self._buffers[conn] = b""
        self._selector.register(conn, selectors.EVENT_READ)

    def _drop(self, conn: socket.socket) -> None:
        if conn not in self._buffers:
            return  # closed already
        self._selector.unregister(conn)
        del self._buffers[conn]
        self._on_drop(conn)
        conn.close()

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError, TimeoutError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        *lines, rest = (self._buffers[conn] + data).split(b"\n")
        if len(rest) > protocol.MAX_LINE_BYTES:
            self._drop(conn)
            return
        self._buffers[conn] = rest
        for line in lines:
            if not self._handle_line(conn, line):
                self._drop(conn)
                return


def peer_of(conn: socket.socket) -> str:
    """`host:port` of the other end, "?" when the connection is gone."""
    try:
        host, port = conn.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"
