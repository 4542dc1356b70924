"""The local-tier port of a host agent (control/tier_service.py) holds against clients that are
not the run's, like the supervisor's control port: a deadline for the whole request, a cap on
connections that have not sent one, every refusal reported once and rate-limited per peer."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from resilient_jax.control.line_server import ConnectionLimits, PortGuard
from resilient_jax.control.tier_service import MAX_REQUEST_BYTES, TierServer, list_copies

TOKEN = "tier-token-0123"
AUTH_S = 0.5


class _Reports:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.refused: list[str] = []
        self.suppressed: list[tuple[int, dict[str, int]]] = []

    def on_refused(self, peer: str, why: str) -> None:
        assert peer.startswith("127.0.0.1:")
        with self.lock:
            self.refused.append(why)

    def on_suppressed(self, peer: str, count: int, reasons: dict[str, int], window_s: float):
        assert peer == "127.0.0.1" and window_s == 30.0
        with self.lock:
            self.suppressed.append((count, reasons))

    def wait_for(self, count: int, timeout_s: float = 5.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.refused) >= count:
                    return list(self.refused)
            time.sleep(0.01)
        raise AssertionError(f"{count} refusals expected, got {self.refused}")


def _closed_by_server(conn: socket.socket, timeout_s: float) -> float:
    """Seconds until the server closed `conn` (it answers nothing before)."""
    started = time.monotonic()
    conn.settimeout(timeout_s)
    assert conn.recv(1) == b""
    return time.monotonic() - started


@pytest.mark.timeout(60)
def test_tier_port_refuses_hostile_clients_and_serves_the_run(tmp_path):
    reports = _Reports()
    server = TierServer(
        "127.0.0.1",
        0,
        TOKEN,
        guard=PortGuard(on_refused=reports.on_refused, on_suppressed=reports.on_suppressed),
    )
    try:
        # The run's limits arrive later (with the supervisor's welcome).
        server.set_limits(
            ConnectionLimits(
                auth_timeout_s=AUTH_S, max_pending=2, refusals_logged=4, refusal_window_s=30.0
            )
        )
        server.serve(str(tmp_path))
        address = ("127.0.0.1", server.port)
        opened = time.monotonic()
        silent = socket.create_connection(address, timeout=5)
        trickling = socket.create_connection(address, timeout=5)
        trickling.sendall(b'{"type": "list", ')  # the rest never comes in time
        time.sleep(0.1)
        # Two connections without a request: the third is closed at once.
        third = socket.create_connection(address, timeout=5)
        assert _closed_by_server(third, 5.0) < AUTH_S
        assert reports.wait_for(1)[0] == (
            "2 unauthenticated connections open already (coordinator.max_pending_connections)"
        )
        _closed_by_server(silent, 5.0)
        assert AUTH_S <= time.monotonic() - opened < AUTH_S + 2.0
        trickling.sendall(b'"run": "x"')
        _closed_by_server(trickling, 5.0)
        late = "no request with the run token within 0.5s (coordinator.auth_timeout_s)"
        assert reports.wait_for(3)[1:] == [late, late]
        # A wrong token is answered and refused; an over-long request is closed and refused.
        with socket.create_connection(address, timeout=5) as wrong:
            wrong.sendall(b'{"type": "list", "run": "r", "token": "guess"}\n')
            answer = json.loads(wrong.makefile().readline())
            assert answer == {"ok": False, "error": "no or wrong run token"}
        with socket.create_connection(address, timeout=5) as long:
            try:
                long.sendall(b"x" * (MAX_REQUEST_BYTES + 2))
                _closed_by_server(long, 5.0)
            except ConnectionResetError:  # closed while the rest was still arriving
                pass
        with socket.create_connection(address, timeout=5) as garbage:
            garbage.sendall(b"\x00\xff not json\n")
            _closed_by_server(garbage, 5.0)
        refused = reports.wait_for(4)
        assert refused[3] == "no or wrong run token"
        # The run's own request is served meanwhile.
        run = "0123456789abcdef"
        assert list_copies(f"127.0.0.1:{server.port}", TOKEN, run, timeout_s=5.0) == []
        deadline = time.monotonic() + 5.0
        while server.refused_total < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.refused_total == 6
    finally:
        server.close()
    # Four refusals reported one by one in the window, the other two counted, each once.
    assert len(reports.refused) == 4
    assert reports.suppressed == [
        (2, {f"a request longer than {MAX_REQUEST_BYTES} bytes": 1, "not a JSON request": 1})
    ]
