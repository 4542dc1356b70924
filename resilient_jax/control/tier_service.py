"""The local tier served to peers: a host's committed local-tier steps, read-only over TCP, so a
replaced host (a new machine, an empty RAM disk) restores the newest local step from a surviving
host instead of falling back to the older persistent one.

The host agent runs a `TierServer` (its RAM disk outlives the workers); a restoring worker reads
through `list_copies` and `read_ranges` (`resilient_jax.checkpoint.peer_fetch`). One request per
connection, a typed message (`ListCopies`, `ReadRanges`) carrying the run's token:

    {"type": "list", "run": KEY}         -> {"ok": true, "copies": [{"copy": ID, "manifest": M}]}
    {"type": "read", "run": KEY, "copy": ID,
     "ranges": [[offset, nbytes], ...]}  -> {"ok": true, "nbytes": N} + N raw bytes

or `{"ok": false, "error": "..."}`. KEY is the run's directory under the tier's root, ID a committed
step directory (`proc-.../step_...`); nothing else under the root can be named. Every wait on both
sides is bounded: a client gives a whole request `timeout_s` and raises `PeerError` past it.

The port is reachable by anyone on the network, so it holds like the supervisor's control port
(`line_server.ConnectionLimits`, the `coordinator.*` keys the supervisor's `welcome` passes on):
a connection must send its whole request, with the run token, within `auth_timeout_s` of its
accept (a trickling client gains nothing), at most `max_pending` connections are open without
having done so (one beyond is closed at once), and every connection refused (silent, too slow,
an over-long or malformed request, a wrong token) is reported once, at a bounded rate per peer
(`refusals.RefusalLimiter`). An accepted request's answer is sent with `_CLIENT_TIMEOUT_S` per
send: a reader that stops taking bytes is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

from resilient_jax.contracts.local_tier import (
    COPY_ID,
    DATA_FILE,
    MANIFEST,
    PROC_PREFIX,
    RUN_KEY,
    STEP_PREFIX,
)
from resilient_jax.contracts.messages import TierRequest
from resilient_jax.contracts.names import Name
from resilient_jax.control import wire
from resilient_jax.control.line_client import LineConnection
from resilient_jax.control.line_server import LineServer, PortGuard
from resilient_jax.control.protocol import WRONG_TOKEN, encode, token_matches

MAX_REQUEST_BYTES = 8 << 20  # a read names each piece of one copy: thousands of ranges at most
_CLIENT_TIMEOUT_S = 30.0  # the server drops an accepted client that takes no bytes this long


class PeerError(OSError):
    """A peer that did not answer in time, refused, or sent something malformed."""


@dataclasses.dataclass(frozen=True)
class ListCopies(wire.Message):
    """Which committed copies of run `run` (its directory under the tier's root) a host holds."""

    TYPE: ClassVar[Name] = TierRequest.LIST
    run: str


@dataclasses.dataclass(frozen=True)
class ReadRanges(wire.Message):
    """Pieces of one committed copy's data file: [[offset, nbytes], ...], sent back to back."""

    TYPE: ClassVar[Name] = TierRequest.READ
    run: str
    copy: str
    ranges: list[list[int]]


# ------------------------------------------------------------------------------------ server


class TierServer(LineServer):
    """Serves the committed local-tier steps under `root` (set by `serve`) on `host:port` (port 0:
    any free port), from construction until `close()`; requests without `token` are refused, and
    clients that are not the run's are held to `limits` (`set_limits` changes them)."""

    LATE = "no request with the run token within {seconds:g}s (coordinator.auth_timeout_s)"
    TOO_LONG = "a request longer than {limit} bytes"

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        guard: PortGuard | None = None,
    ) -> None:
        super().__init__(
            host, port, "tier-server", 0.2, guard=guard, max_line_bytes=MAX_REQUEST_BYTES
        )
        self._token = token
        self._root: str | None = None  # None: the local tier is not served (yet)
        self._start()

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def serve(self, root: str | None) -> None:
        """Serves the local tier rooted at `root` (`checkpoint.local_dir`); None or "": nothing."""
        self._root = os.path.abspath(root) if root else None

    def _handle_line(self, conn: socket.socket, line: bytes) -> str | None:
        """The connection's one request: refused, or answered from a thread of its own (a copy
        is streamed at the reader's pace; the server thread goes on serving the others)."""
        try:
            request = json.loads(line)
        except ValueError:
            return "not a JSON request"
        if not isinstance(request, dict):
            return "not a JSON request"
        if not token_matches(request.get("token"), self._token):
            return WRONG_TOKEN  # answered by `_farewell`
        self._detach(conn)
        try:
            threading.Thread(target=self._reply, args=(conn, request), daemon=True).start()
        except RuntimeError:  # no thread to be had: this request goes unanswered
            conn.close()
        return None

    def _farewell(self, why: str) -> bytes | None:
        # A wrong token is told so (a peer with a stale token sees why); other refusals not.
        return encode({"ok": False, "error": WRONG_TOKEN}) if why == WRONG_TOKEN else None

    def _reply(self, conn: socket.socket, request: dict[str, Any]) -> None:
        try:
            try:
                header, data = self._answer(request)
            except (OSError, ValueError, KeyError, TypeError) as e:
                header, data = {"ok": False, "error": f"{type(e).__name__}: {e}"}, None
            with contextlib.suppress(OSError):
                conn.settimeout(_CLIENT_TIMEOUT_S)
                conn.sendall(encode(header))
                if data is not None:
                    _send_ranges(conn, *data)
        finally:
            conn.close()

    def _answer(self, line: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """The answer to a request that carries the run token."""
        root = self._root
        if root is None:
            return {"ok": False, "error": "this host serves no local tier"}, None
        try:
            request = wire.decode(line, ListCopies, ReadRanges)
        except wire.UnknownMessage:
            return {"ok": False, "error": f"unknown request type {line.get('type')!r}"}, None
        if not RUN_KEY.fullmatch(request.run):
            return {"ok": False, "error": f"bad run key {request.run!r}"}, None
        if isinstance(request, ListCopies):
            return {"ok": True, "copies": _committed_copies(os.path.join(root, request.run))}, None
        if not COPY_ID.fullmatch(request.copy):
            return {"ok": False, "error": f"bad copy {request.copy!r}"}, None
        path = os.path.join(root, request.run, request.copy, DATA_FILE)
        ranges = [(int(o), int(n)) for o, n in request.ranges]
        size = os.path.getsize(path)
        if any(o < 0 or n < 0 or o + n > size for o, n in ranges):
            return {"ok": False, "error": f"a range outside {request.copy}'s {size} bytes"}, None
        return {"ok": True, "nbytes": sum(n for _, n in ranges)}, (path, ranges)


def _committed_copies(run_root: str) -> list[dict[str, Any]]:
    """Every committed step directory of the run with its manifest (unreadable ones left out)."""
    copies = []
    for proc in sorted(_listdir(run_root)):
        if not proc.startswith(PROC_PREFIX):
            continue
        for step in sorted(_listdir(os.path.join(run_root, proc))):
            copy = f"{proc}/{step}"
            if not step.startswith(STEP_PREFIX) or not COPY_ID.fullmatch(copy):
                continue
            try:
                with open(os.path.join(run_root, copy, MANIFEST)) as f:
                    copies.append({"copy": copy, "manifest": json.load(f)})
            except (OSError, ValueError):
                continue  # being deleted, or damaged: the peer's restore judges its own copies
    return copies


def _send_ranges(conn: socket.socket, path: str, ranges: list[tuple[int, int]]) -> None:
    """Sends the ranges from the file by `sendfile`: the kernel copies the RAM disk's pages to
    the socket, no pass through Python (reading into `bytes` and sending those halved a stream's
    rate)."""
    with open(path, "rb") as f:
        for offset, nbytes in ranges:
            if nbytes and conn.sendfile(f, offset, nbytes) != nbytes:
                raise OSError(f"{path} shrank while being read")


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


# ------------------------------------------------------------------------------------ client


def list_copies(address: str, token: str, run: str, timeout_s: float) -> list[dict[str, Any]]:
    """The committed copies of run `run` a peer holds: [{"copy": ID, "manifest": {...}}].
    Raises `PeerError` if the peer does not answer in full within `timeout_s`."""
    with _Request(address, timeout_s) as request:
        header = request.ask(ListCopies(run), token)
        copies = header.get("copies")
        if not isinstance(copies, list):
            raise PeerError(f"peer {address}: a listing without copies")
        return copies


def read_ranges(
    address: str,
    token: str,
    run: str,
    copy: str,
    ranges: list[tuple[int, int]],
    timeout_s: float,
    into: memoryview | None = None,
) -> memoryview:
    """The bytes of `ranges` of one copy's data file, back to back: in the first bytes of `into`
    if given (a buffer reused across requests: no fresh pages to fault in), else in a new
    buffer. Raises `PeerError` if the peer does not send them all within `timeout_s`."""
    expected = sum(n for _, n in ranges)
    if into is not None and len(into) < expected:
        raise ValueError(f"a buffer of {len(into)} bytes for {expected}")
    with _Request(address, timeout_s) as request:
        header = request.ask(ReadRanges(run, copy, [[o, n] for o, n in ranges]), token)
        if header.get("nbytes") != expected:
            raise PeerError(f"peer {address}: {header.get('nbytes')} bytes for {expected}")
        if into is None:  # only now: the peer has the ranges asked for
            into = memoryview(bytearray(expected))
        request.receive_into(into[:expected])
        return into[:expected]


class _Request:
    """One request to a peer on a connection of its own, every step of it within one deadline;
    whatever goes wrong is a `PeerError` that names the peer."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self._address = address
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        try:
            # Answers are a header line, up to the longest listing, then raw bytes.
            self._conn = LineConnection.open(address, timeout_s, MAX_REQUEST_BYTES * 16)
        except OSError as e:
            raise PeerError(f"peer {address}: cannot connect ({e})") from e

    def __enter__(self) -> _Request:
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.close()

    def ask(self, message: wire.Message, token: str) -> dict[str, Any]:
        with self._peer_errors():
            self._conn.send(message, self._left(), token=token)
            line = self._conn.read_line(self._left())
        try:
            header = json.loads(line)
        except ValueError as e:
            raise PeerError(f"peer {self._address}: not JSON ({e})") from e
        if not isinstance(header, dict) or not header.get("ok"):
            error = header.get("error") if isinstance(header, dict) else header
            raise PeerError(f"peer {self._address}: {error}")
        return header

    def receive_into(self, view: memoryview) -> None:
        """Exactly `len(view)` more bytes, received in place (a copy may be gigabytes)."""
        with self._peer_errors():
            self._conn.receive_into(view, self._left())

    def _left(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise PeerError(f"peer {self._address}: no full answer within {self._timeout_s:g}s")
        return left

    @contextlib.contextmanager
    def _peer_errors(self) -> Iterator[None]:
        try:
            yield
        except PeerError:
            raise
        except TimeoutError as e:
            raise PeerError(f"peer {self._address}: no answer within {self._timeout_s:g}s") from e
        except OSError as e:
            raise PeerError(f"peer {self._address}: {e}") from e
