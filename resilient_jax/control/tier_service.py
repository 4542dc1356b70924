"""The local tier served to peers: a host's committed local-tier steps, read-only over TCP, so a
replaced host (a new machine, an empty RAM disk) restores the newest local step from a surviving
host instead of falling back to the older persistent one.

The host agent runs a `TierServer` (its RAM disk outlives the workers); a restoring worker reads
through `list_copies` and `read_ranges` (`resilient_jax.checkpoint.peer_fetch`). One request per
connection, a JSON line carrying the run's token:

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
import hmac
import json
import os
import socket
import socketserver
import threading
import time
from typing import Any

from resilient_jax.contracts.local_tier import (
    COPY_ID,
    DATA_FILE,
    MANIFEST,
    PROC_PREFIX,
    RUN_KEY,
    STEP_PREFIX,
)
from resilient_jax.contracts.messages import TierRequest
from resilient_jax.control.line_server import SEND_TIMEOUT_S, ConnectionLimits
from resilient_jax.control.refusals import OnRefused, OnSuppressed, RefusalLimiter

MAX_REQUEST_BYTES = 8 << 20  # a read names each piece of one copy: thousands of ranges at most
_CLIENT_TIMEOUT_S = 30.0  # the server drops an accepted client that takes no bytes this long
_CHUNK = 1 << 20


class PeerError(OSError):
    """A peer that did not answer in time, refused, or sent something malformed."""


class _Refused(Exception):
    """A connection the server closes for what it sent (or did not send in time)."""


# ------------------------------------------------------------------------------------ server


class TierServer:
    """Serves the committed local-tier steps under `root` (set by `serve`) on `host:port` (port 0:
    any free port), from construction until `close()`; requests without `token` are refused, and
    clients that are not the run's are held to `limits` (`set_limits` changes them)."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        limits: ConnectionLimits | None = None,
        on_refused: OnRefused | None = None,
        on_suppressed: OnSuppressed | None = None,
    ) -> None:
        self._token = token
        self._root: str | None = None  # None: the local tier is not served (yet)
        self._limits = limits or ConnectionLimits()
        self._on_refused, self._on_suppressed = on_refused, on_suppressed
        # Connection threads and the accepting thread share these; the lock guards both.
        self._lock = threading.Lock()
        self._refusals = RefusalLimiter(
            self._limits.refusals_logged, self._limits.refusal_window_s, on_refused, on_suppressed
        )
        self._pending = 0  # connections accepted whose request has not been accepted yet
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._handle(self.request, _peer(self.client_address))

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True  # a slow client never delays the agent's exit

            def verify_request(self, request: Any, client_address: Any) -> bool:
                return outer._admit(_peer(client_address))

            def service_actions(self) -> None:  # every poll_interval: windows that ended
                with outer._lock:
                    outer._refusals.flush(time.monotonic())

        self._server = Server((host, port), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def refused_total(self) -> int:
        """Connections refused since the start (reported one by one or counted)."""
        with self._lock:
            return self._refusals.total

    def serve(self, root: str | None) -> None:
        """Serves the local tier rooted at `root` (`checkpoint.local_dir`); None or "": nothing."""
        self._root = os.path.abspath(root) if root else None

    def set_limits(self, limits: ConnectionLimits) -> None:
        """Holds connections accepted from now on to `limits` (the run's, once it names them)."""
        with self._lock:
            if limits == self._limits:
                return
            self._refusals.flush(None)  # what the old windows counted is reported, not lost
            self._limits = limits
            self._refusals = RefusalLimiter(
                limits.refusals_logged,
                limits.refusal_window_s,
                self._on_refused,
                self._on_suppressed,
            )

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=1.0)
        with self._lock:
            self._refusals.flush(None)

    def _admit(self, peer: str) -> bool:
        """Whether a new connection is served (the accepting thread; a refused one is closed)."""
        with self._lock:
            if self._pending < self._limits.max_pending:
                self._pending += 1
                return True
        self._refuse(
            peer,
            f"{self._limits.max_pending} unauthenticated connections open already "
            "(coordinator.max_pending_connections)",
        )
        return False

    def _refuse(self, peer: str, why: str) -> None:
        with self._lock:
            self._refusals.refused(peer, why, time.monotonic())

    def _handle(self, conn: socket.socket, peer: str) -> None:
        with self._lock:
            auth_timeout_s = self._limits.auth_timeout_s
        pending = True
        try:
            try:
                request = _read_request(conn, time.monotonic() + auth_timeout_s, auth_timeout_s)
            except _Refused as e:
                self._refuse(peer, str(e))
                return
            if request is None:
                return  # the peer closed on its own
            if not hmac.compare_digest(str(request.get("token", "")), self._token):
                self._refuse(peer, "no or wrong run token")
                header: dict[str, Any] = {"ok": False, "error": "no or wrong run token"}
                with contextlib.suppress(OSError):
                    conn.settimeout(SEND_TIMEOUT_S)
                    conn.sendall(_line(header))
                return
            with self._lock:
                self._pending -= 1
            pending = False
            try:
                header, data = self._answer(request)
            except (OSError, ValueError, KeyError, TypeError) as e:
                header, data = {"ok": False, "error": f"{type(e).__name__}: {e}"}, None
            with contextlib.suppress(OSError):
                conn.settimeout(_CLIENT_TIMEOUT_S)
                conn.sendall(_line(header))
                if data is not None:
                    _send_ranges(conn, *data)
        finally:
            if pending:
                with self._lock:
                    self._pending -= 1

    def _answer(self, request: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """The answer to a request that carries the run token."""
        root = self._root
        if root is None:
            return {"ok": False, "error": "this host serves no local tier"}, None
        run = str(request.get("run", ""))
        if not RUN_KEY.fullmatch(run):
            return {"ok": False, "error": f"bad run key {run!r}"}, None
        if request.get("type") == TierRequest.LIST:
            return {"ok": True, "copies": _committed_copies(os.path.join(root, run))}, None
        if request.get("type") == TierRequest.READ:
            copy = str(request.get("copy", ""))
            if not COPY_ID.fullmatch(copy):
                return {"ok": False, "error": f"bad copy {copy!r}"}, None
            path = os.path.join(root, run, copy, DATA_FILE)
            ranges = [(int(o), int(n)) for o, n in request["ranges"]]
            size = os.path.getsize(path)
            if any(o < 0 or n < 0 or o + n > size for o, n in ranges):
                return {"ok": False, "error": f"a range outside {copy}'s {size} bytes"}, None
            return {"ok": True, "nbytes": sum(n for _, n in ranges)}, (path, ranges)
        return {"ok": False, "error": f"unknown request type {request.get('type')!r}"}, None


def _read_request(
    conn: socket.socket, deadline: float, auth_timeout_s: float
) -> dict[str, Any] | None:
    """The request line of a new connection, whole by `deadline`; None if the peer closed first.
    Raises `_Refused` for a request late, over-long or malformed."""
    buffer = bytearray()
    while b"\n" not in buffer:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Refused(
                f"no request with the run token within {auth_timeout_s:g}s "
                "(coordinator.auth_timeout_s)"
            )
        try:
            conn.settimeout(left)
            data = conn.recv(_CHUNK)
        except TimeoutError:
            continue  # the deadline says
        except OSError:
            return None
        if not data:
            return None
        buffer += data
        if len(buffer) > MAX_REQUEST_BYTES and b"\n" not in buffer[:MAX_REQUEST_BYTES]:
            raise _Refused(f"a request longer than {MAX_REQUEST_BYTES} bytes")
    line = bytes(buffer).partition(b"\n")[0]
    if len(line) > MAX_REQUEST_BYTES:
        raise _Refused(f"a request longer than {MAX_REQUEST_BYTES} bytes")
    try:
        request = json.loads(line)
    except ValueError:
        raise _Refused("not a JSON request") from None
    if not isinstance(request, dict):
        raise _Refused("not a JSON request")
    return request


def _peer(address: Any) -> str:
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else "?"


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


def _line(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


# ------------------------------------------------------------------------------------ client


def list_copies(address: str, token: str, run: str, timeout_s: float) -> list[dict[str, Any]]:
    """The committed copies of run `run` a peer holds: [{"copy": ID, "manifest": {...}}].
    Raises `PeerError` if the peer does not answer in full within `timeout_s`."""
    with _Request(address, timeout_s) as request:
        header = request.ask({"type": TierRequest.LIST, "run": run, "token": token})
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
        message = {
            "type": TierRequest.READ,
            "run": run,
            "copy": copy,
            "ranges": ranges,
            "token": token,
        }
        header = request.ask(message)
        if header.get("nbytes") != expected:
            raise PeerError(f"peer {address}: {header.get('nbytes')} bytes for {expected}")
        if into is None:  # only now: the peer has the ranges asked for
            into = memoryview(bytearray(expected))
        request.receive_into(into[:expected])
        return into[:expected]


class _Request:
    """One connection to a peer, every step of it within one deadline."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self._address = address
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        host, _, port = address.rpartition(":")
        try:
            self._conn = socket.create_connection((host, int(port)), timeout=timeout_s)
        except (OSError, ValueError) as e:
            raise PeerError(f"peer {address}: cannot connect ({e})") from e
        self._buffer = bytearray()

    def __enter__(self) -> _Request:
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.close()

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        self._settimeout()
        try:
            self._conn.sendall(_line(message))
        except OSError as e:
            raise PeerError(f"peer {self._address}: {e}") from e
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_REQUEST_BYTES * 16:
                raise PeerError(f"peer {self._address}: an answer without end")
            self._recv()
        line, _, rest = bytes(self._buffer).partition(b"\n")
        self._buffer = bytearray(rest)
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
        nbytes = len(view)
        if len(self._buffer) > nbytes:
            raise PeerError(f"peer {self._address}: more bytes than announced")
        got = len(self._buffer)
        view[:got] = self._buffer
        while got < nbytes:
            self._settimeout()
            try:
                n = self._conn.recv_into(view[got:], min(nbytes - got, _CHUNK))
            except OSError as e:  # socket.timeout included
                raise PeerError(
                    f"peer {self._address}: no answer within {self._timeout_s:g}s"
                ) from e
            if not n:
                raise PeerError(f"peer {self._address}: closed the connection mid-answer")
            got += n

    def _recv(self) -> None:
        self._settimeout()
        try:
            data = self._conn.recv(_CHUNK)
        except OSError as e:  # socket.timeout included
            raise PeerError(f"peer {self._address}: no answer within {self._timeout_s:g}s") from e
        if not data:
            raise PeerError(f"peer {self._address}: closed the connection mid-answer")
        self._buffer += data

    def _settimeout(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise PeerError(f"peer {self._address}: no full answer within {self._timeout_s:g}s")
        self._conn.settimeout(left)
