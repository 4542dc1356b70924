"""A control port against clients that are not the run's: each rule of `LineServer` on a bare
server (over-long lines, the auth timeout, the cap on unauthenticated connections, refusal
reports rate-limited per peer), and the quorum server's refusals.

The same rules held during a whole run under 1,000 hostile connections: `test_control_port_soak`.
"""

from __future__ import annotations

import socket
import time

import pytest

from resilient_jax.config import ConfigError, default_config, validate
from resilient_jax.control import protocol, refusals
from resilient_jax.control.line_server import ConnectionLimits, LineServer, PortGuard
from resilient_jax.control.quorum import QuorumServer
from resilient_jax.control.refusals import RefusalLimiter

TOKEN = b"run-token"


class _Server(LineServer):
    """Accepts the line `TOKEN` (and any line after it); refuses every other."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.refused: list[tuple[str, str]] = []
        self.suppressed: list[tuple[str, int, dict[str, int]]] = []
        self.accepted: list[bytes] = []
        super().__init__(
            "127.0.0.1",
            0,
            name="test-line-server",
            poll_s=0.01,
            guard=PortGuard(
                limits,
                on_refused=lambda peer, why: self.refused.append((peer, why)),
                on_suppressed=lambda peer, n, why, _: self.suppressed.append((peer, n, why)),
            ),
        )
        self._start()

    def _handle_line(self, conn: socket.socket, line: bytes) -> str | None:
        if line == TOKEN or self.accepted:
            self.accepted.append(line)
            return None
        return protocol.WRONG_TOKEN


@pytest.fixture
def make_server():
    servers: list[_Server] = []

    def make(**limits) -> _Server:
        servers.append(_Server(ConnectionLimits(**limits)))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def _connect(server: LineServer) -> socket.socket:
    host, port = protocol.split_address(server.address)
    sock = socket.create_connection((host, port), timeout=5.0)
    return sock


def _closed_by_server(sock: socket.socket, within_s: float = 5.0) -> bool:
    """Whether the server closed `sock` (reads EOF or a reset) within `within_s`."""
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _wait(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_an_over_long_line_is_refused_and_reported_once(make_server):
    server = make_server()
    with _connect(server) as sock:
        sock.sendall(b"x" * (protocol.MAX_LINE_BYTES + 1))  # no newline: still arriving
        assert _closed_by_server(sock)
    with _connect(server) as sock:
        sock.sendall(b"y" * (protocol.MAX_LINE_BYTES + 1) + b"\n" + TOKEN + b"\n")  # whole line
        assert _closed_by_server(sock)
    _wait(lambda: len(server.refused) == 2)
    assert [why for _, why in server.refused] == [
        f"a line longer than {protocol.MAX_LINE_BYTES} bytes"
    ] * 2
    assert server.refused[0][0].startswith("127.0.0.1:")
    assert not server.accepted and server.refused_total == 2


def test_a_silent_connection_is_closed_after_the_auth_timeout(make_server):
    server = make_server(auth_timeout_s=0.3)
    with _connect(server) as silent, _connect(server) as member:
        member.sendall(TOKEN + b"\n")
        started = time.monotonic()
        assert _closed_by_server(silent)
        assert 0.25 <= time.monotonic() - started < 3.0
        assert not _closed_by_server(member, within_s=0.5)  # authenticated: kept
    _wait(lambda: server.refused_total == 1)
    assert server.refused[0][1] == (
        "no message with the run token within 0.3s (coordinator.auth_timeout_s)"
    )


def test_slow_bytes_do_not_extend_the_auth_timeout(make_server):
    server = make_server(auth_timeout_s=0.3)
    with _connect(server) as slow:
        started = time.monotonic()
        closed = False
        for _ in range(50):  # a byte every 50 ms, never a newline
            try:
                slow.sendall(b"r")
            except OSError:
                closed = True
                break
            time.sleep(0.05)
        assert closed or _closed_by_server(slow, within_s=0.1)
        assert time.monotonic() - started < 2.0
    _wait(lambda: server.refused_total == 1)
    assert "auth_timeout_s" in server.refused[0][1]


def test_connections_beyond_the_pending_cap_are_refused_at_once(make_server):
    server = make_server(max_pending=2, auth_timeout_s=30.0)
    first, second = _connect(server), _connect(server)
    try:
        _wait(lambda: server.connection_counts() == (2, 2))
        with _connect(server) as third:
            assert _closed_by_server(third, within_s=2.0)
        _wait(lambda: server.refused_total == 1)
        assert "coordinator.max_pending_connections" in server.refused[0][1]
        first.sendall(TOKEN + b"\n")  # authenticated: no longer counts against the cap
        _wait(lambda: server.connection_counts() == (2, 1))
        with _connect(server) as fourth:
            assert not _closed_by_server(fourth, within_s=0.3)
        assert server.refused_total == 1
    finally:
        first.close()
        second.close()


def test_a_peer_that_closes_on_its_own_is_no_refusal(make_server):
    server = make_server()
    with _connect(server) as sock:
        sock.sendall(b"partial")
    _wait(lambda: server.connection_counts() == (0, 0))
    assert server.refused_total == 0 and not server.refused


def test_refusals_beyond_the_burst_are_counted_and_reported_when_the_window_ends(make_server):
    server = make_server(refusals_logged=2, refusal_window_s=2.0)  # outlasts 5 refusals
    for i in range(5):
        with _connect(server) as sock:
            sock.sendall(b"wrong\n" if i % 2 else b"z" * (protocol.MAX_LINE_BYTES + 10))
            assert _closed_by_server(sock)
    _wait(lambda: server.refused_total == 5)
    assert len(server.refused) == 2 and not server.suppressed  # the window is still open
    _wait(lambda: server.suppressed, timeout_s=5.0)
    ((peer, count, reasons),) = server.suppressed
    long_line = f"a line longer than {protocol.MAX_LINE_BYTES} bytes"
    assert (peer, count, reasons) == ("127.0.0.1", 3, {long_line: 2, protocol.WRONG_TOKEN: 1})
    # A new window: reported one by one again.
    with _connect(server) as sock:
        sock.sendall(b"wrong\n")
        assert _closed_by_server(sock)
    _wait(lambda: len(server.refused) == 3)


def test_close_reports_the_refusals_its_open_window_suppressed(make_server):
    server = make_server(refusals_logged=1, refusal_window_s=3600.0)
    for _ in range(3):
        with _connect(server) as sock:
            sock.sendall(b"wrong\n")
            assert _closed_by_server(sock)
    _wait(lambda: server.refused_total == 3)
    server.close()
    assert len(server.refused) == 1
    assert server.suppressed == [("127.0.0.1", 2, {protocol.WRONG_TOKEN: 2})]


def test_the_limiter_keeps_each_peer_host_apart():
    logged: list[str] = []
    suppressed: list[tuple[str, int]] = []
    limiter = RefusalLimiter(
        1, 10.0, lambda peer, _: logged.append(peer), lambda h, n, _r, _w: suppressed.append((h, n))
    )
    for now, peer in enumerate(["10.0.0.1:5", "10.0.0.2:6", "10.0.0.1:7", "10.0.0.1:8"]):
        limiter.refused(peer, "why", float(now))
    assert logged == ["10.0.0.1:5", "10.0.0.2:6"]
    limiter.flush(10.5)  # 10.0.0.1's window (from t=0) is over; 10.0.0.2's (from t=1) is not
    assert suppressed == [("10.0.0.1", 2)]
    limiter.flush(None)
    assert suppressed == [("10.0.0.1", 2)] and limiter.total == 4


def test_the_reasons_a_window_remembers_are_bounded():
    summaries: list[dict[str, int]] = []
    limiter = RefusalLimiter(0, 10.0, None, lambda _h, _n, reasons, _w: summaries.append(reasons))
    for i in range(3 * refusals.MAX_REASONS):
        limiter.refused("10.0.0.1:5", f"reason {i}", 0.0)
    limiter.flush(None)
    ((reasons,),) = [summaries]
    assert len(reasons) == refusals.MAX_REASONS + 1
    assert reasons[refusals.OTHER_REASONS] == 2 * refusals.MAX_REASONS


def test_the_quorum_server_refuses_and_reports_what_is_not_a_quorum_request():
    refused: list[str] = []
    server = QuorumServer(
        "t",
        join_timeout_s=0.5,
        expected=1,
        settle_s=0.0,
        guard=PortGuard(
            ConnectionLimits(auth_timeout_s=0.3), on_refused=lambda _, why: refused.append(why)
        ),
    )
    try:
        lines = [
            protocol.encode({"type": "quorum", "token": "wrong"}),
            protocol.encode({"type": "other", "token": "t"}),
            protocol.encode({"type": "quorum", "token": "t"}),  # no slice, step or store
            b"\x00\xff random \x13\n",
            b"",  # silent
        ]
        for line in lines:
            with _connect(server) as sock:
                sock.sendall(line)
                assert _closed_by_server(sock)
        _wait(lambda: len(refused) == 5)
        assert refused[0] == protocol.WRONG_TOKEN
        assert refused[1] == "not a quorum message: type 'other'"
        assert refused[2] == "malformed quorum message: KeyError"
        assert refused[3].startswith("malformed quorum message")
        assert "auth_timeout_s" in refused[4]
    finally:
        server.close()


@pytest.mark.parametrize(
    "key, value",
    [
        ("auth_timeout_s", 0.0),
        ("max_pending_connections", 0),
        ("refusals_logged_per_peer", 0),
        ("refusal_log_window_s", -1.0),
    ],
)
def test_limits_are_validated(key, value):
    config = default_config()
    config.coordinator[key] = value
    with pytest.raises(ConfigError, match=f"coordinator.{key}"):
        validate(config)


@pytest.mark.parametrize("kind", ["heartbeat", "quorum", "tier"])
def test_no_line_a_peer_sends_ends_a_control_port(kind, tmp_path):
    """Lines that make the parser itself fail (JSON nested past Python's recursion limit, a token
    that is not ASCII) are refused like any other, and the port goes on serving the run."""
    from resilient_jax.control.server import HeartbeatServer
    from resilient_jax.control.tier_service import TierServer, list_copies

    refused: list[str] = []
    guard = PortGuard(on_refused=lambda _, why: refused.append(why))
    token = "t" * 16
    if kind == "heartbeat":
        server: LineServer = HeartbeatServer(token, guard=guard)
    elif kind == "quorum":
        server = QuorumServer(token, expected=1, settle_s=0.0, guard=guard)
    else:
        server = TierServer("127.0.0.1", 0, token, guard=guard)
        server.serve(str(tmp_path))
    try:
        for line in (b"[" * 4000 + b"\n", protocol.encode({"type": "x", "token": "\u00e9"})):
            with _connect(server) as sock:
                sock.sendall(line)
                assert _closed_by_server(sock)
        _wait(lambda: len(refused) == 2)
        assert refused[0].startswith(("malformed", "not JSON", "not a JSON")), refused
        assert refused[1] == protocol.WRONG_TOKEN
        if kind == "heartbeat":  # the run's own lines are still read
            with _connect(server) as sock:
                beat = {"type": "heartbeat", "token": token, "generation": 0, "process": 0}
                sock.sendall(protocol.encode(beat))
                _wait(lambda: 0 in server.reports(0))
        elif kind == "tier":  # and its requests answered
            assert list_copies(server.address, token, "0123456789abcdef", timeout_s=5.0) == []
        else:
            with _connect(server) as sock:
                sock.sendall(b"\n")  # not JSON: refused, by a server thread still running
                assert _closed_by_server(sock)
            _wait(lambda: len(refused) == 3)
    finally:
        server.close()
