"""A client's side of a line server (`line_server.LineServer`): JSON messages out, lines in.

Every client of the control plane's ports holds one of these: a worker's heartbeats, a host
agent's link to the supervisor, an elastic slice's quorum link, a waiting elastic standby, a
restoring worker's request to a peer's local tier. What they share is here: the connect with a
timeout, the framing (`wire.encode`, one typed message per line), a receive buffer bounded by the
longest line the server may send, and a bound on every wait. A connection that fails in any way
raises `OSError` (`TimeoutError` for a wait that ran out, `ConnectionError` for a server that
closed or sent a line past the bound), so a caller has one exception to handle; what it does
then (reconnect at its next tick, give up, report a peer) stays its own.
"""

from __future__ import annotations

import select
import socket
import time
from typing import Any

from resilient_jax.control import protocol, wire

_RECV_BYTES = 1 << 20


class LineConnection:
    """One connection to `address` ("host:port"), open from `open` until `close`."""

    def __init__(
        self, sock: socket.socket, address: str, timeout_s: float, max_line_bytes: int
    ) -> None:
        self._sock = sock
        self.address = address
        self._timeout_s = timeout_s
        self._max_line_bytes = max_line_bytes
        self._buffer = bytearray()  # what arrived after the last whole line handed out

    @classmethod
    def open(
        cls, address: str, timeout_s: float, max_line_bytes: int = protocol.MAX_LINE_BYTES
    ) -> LineConnection:
        """Connects within `timeout_s`; later sends wait at most `timeout_s` too. Raises
        `OSError` (a malformed address included) when the server cannot be reached."""
        try:
            host, port = protocol.split_address(address)
        except ValueError as e:
            raise ConnectionError(str(e)) from e
        sock = socket.create_connection((host, port), timeout=timeout_s)
        return cls(sock, address, timeout_s, max_line_bytes)

    def __enter__(self) -> LineConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def local_host(self) -> str:
        """This side's address, as the server sees it on this network."""
        return str(self._sock.getsockname()[0])

    def send(self, message: wire.Message, timeout_s: float | None = None, **envelope: Any) -> None:
        """Sends one message with the channel's `envelope` (the run token), within `timeout_s`
        (None: the connection's timeout)."""
        self._sock.settimeout(self._timeout_s if timeout_s is None else timeout_s)
        self._sock.sendall(wire.encode(message, **envelope))

    def lines(self, wait_s: float) -> list[bytes]:
        """The whole lines that arrive within `wait_s` (0: only those already there), [] for
        none. Raises `ConnectionError` when the server closed the connection or sent a line
        longer than the bound."""
        lines = self._take_lines()
        if lines:
            return lines
        if not select.select([self._sock], [], [], max(0.0, wait_s))[0]:
            return []
        self._receive(self._timeout_s)  # bytes are there: this returns at once
        return self._take_lines()

    def read_line(self, timeout_s: float | None) -> bytes:
        """The next whole line, waiting at most `timeout_s` (None: until one comes). Raises
        `TimeoutError` past it and `ConnectionError` as `lines` does."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            self._receive(_left(deadline))
        line, _, rest = bytes(self._buffer).partition(b"\n")
        self._buffer = bytearray(rest)
        return line

    def receive_into(self, view: memoryview, timeout_s: float) -> None:
        """Exactly `len(view)` raw bytes following the last line, received in place (a peer's
        checkpoint copy may be gigabytes), all within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        nbytes = len(view)
        if len(self._buffer) > nbytes:
            raise ConnectionError(f"{self.address}: more bytes than announced")
        got = len(self._buffer)
        view[:got] = self._buffer
        self._buffer = bytearray()
        while got < nbytes:
            self._sock.settimeout(_left(deadline))
            n = self._sock.recv_into(view[got:], min(nbytes - got, _RECV_BYTES))
            if not n:
                raise ConnectionError(f"{self.address}: closed the connection mid-answer")
            got += n

    def close(self) -> None:
        self._sock.close()
        self._buffer = bytearray()

    def _receive(self, timeout_s: float | None) -> None:
        # None: blocked in recv until bytes come (a waiting standby spends no CPU).
        self._sock.settimeout(timeout_s)
        data = self._sock.recv(_RECV_BYTES)
        if not data:
            raise ConnectionError(f"{self.address}: the server closed the connection")
        self._buffer += data
        if b"\n" not in data and len(self._buffer) > self._max_line_bytes:
            limit = self._max_line_bytes
            raise ConnectionError(f"{self.address}: a line longer than {limit} bytes")

    def _take_lines(self) -> list[bytes]:
        if b"\n" not in self._buffer:
            return []
        *lines, rest = bytes(self._buffer).split(b"\n")
        self._buffer = bytearray(rest)
        return lines


def _left(deadline: float | None) -> float | None:
    """Seconds to `deadline` (None: no bound); raises `TimeoutError` once it has passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no answer in time")
    return left
