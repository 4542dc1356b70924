"""The host agent and the control channel, one real agent process against the supervisor's side
(`HostPlane`): registration, worker start and exit reports, the health probe, and the run token.

The whole supervisor driving agents through faults is in `test_coordinator_cluster.py`.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from resilient_jax.config import default_config
from resilient_jax.contracts import env_vars
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.contracts.messages import AgentMessage
from resilient_jax.control import agent_protocol, processes, protocol, wire
from resilient_jax.control.agent_protocol import Start
from resilient_jax.control.cluster import ClusterSpec
from resilient_jax.control.host_plane import HostPlane
from resilient_jax.control.probe import probe_host
from resilient_jax.events import EventLog, read_events

TOKEN = "0123456789abcdef"


def _plane(workdir: str) -> HostPlane:
    config = default_config()
    config.coordinator.probe_jax = False
    config.coordinator.heartbeat_interval_s = 0.1
    config.checkpoint.local_dir = os.path.join(workdir, "local")
    events = EventLog(workdir, process="supervisor", source="supervisor")
    sink = processes.OutputSink(io.StringIO())
    plane = HostPlane(
        config, ClusterSpec(1, 1, 1), workdir, [0], "external", None, events, sink, lambda _: None
    )
    plane.open()
    return plane


@pytest.fixture
def plane(tmp_path, monkeypatch):
    monkeypatch.setenv(env_vars.RUN_TOKEN, TOKEN)
    plane = _plane(str(tmp_path))
    yield plane
    plane.close()


def _agent(workdir, **env) -> subprocess.Popen[str]:
    argv = [
        sys.executable,
        "-m",
        "resilient_jax.control.agent",
        f"--workdir={workdir}",
        "--host=h0",
        "--slice=0",
    ]
    return subprocess.Popen(
        argv,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_token_comes_from_a_private_file_or_the_environment(tmp_path):
    path = tmp_path / "token"
    path.write_text("secret\n")
    os.chmod(path, 0o600)
    assert agent_protocol.read_token({env_vars.RUN_TOKEN_FILE: str(path)}) == "secret"
    assert agent_protocol.read_token({env_vars.RUN_TOKEN: "t"}) == "t"
    assert agent_protocol.read_token({}) is None
    os.chmod(path, 0o644)
    with pytest.raises(agent_protocol.TokenError, match="mode 644; allowed: 600"):
        agent_protocol.read_token({env_vars.RUN_TOKEN_FILE: str(path)})


def test_connection_without_the_token_is_refused_and_logged(plane, tmp_path):
    assert plane.server is not None
    assert protocol.split_address(plane.server.address)[0] == "127.0.0.1"  # loopback by default
    host, port = protocol.split_address(plane.server.address)
    with socket.create_connection((host, port), timeout=2.0) as sock:
        register = {"type": AgentMessage.REGISTER, "host": "intruder", "slice": 0}
        sock.sendall(protocol.encode({**register, "token": "wrong"}))
        sock.settimeout(2.0)
        assert sock.recv(100) == b""  # closed without an answer
    refused = [e for e in read_events(str(tmp_path)) if e["type"] == "connection_refused"]
    assert len(refused) == 1 and refused[0]["why"] == protocol.WRONG_TOKEN
    assert refused[0]["peer"].startswith("127.0.0.1:")
    assert not plane.hosts.records()  # the line never reached the registry


def test_agent_without_a_token_exits_2_with_one_line(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (env_vars.RUN_TOKEN, env_vars.RUN_TOKEN_FILE)
    }
    agent = subprocess.run(
        [sys.executable, "-m", "resilient_jax.control.agent", f"--workdir={tmp_path}", "--slice=0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert agent.returncode == ExitCode.BAD_INPUT
    assert agent.stderr.strip().count("\n") == 0 and "RJ_RUN_TOKEN" in agent.stderr


def test_agent_registers_is_probed_starts_a_worker_and_reports_its_exit_at_once(plane, tmp_path):
    agent = _agent(tmp_path, **{env_vars.RUN_TOKEN: TOKEN})
    try:
        _wait(lambda: 0 in plane.hosts.ready_slices(1))  # registered, probe passed
        (record,) = plane.hosts.hosts_for(0)
        assert (record.name, record.slots, record.pid) == ("h0", 1, agent.pid)
        exited_file = tmp_path / "exited_at"
        code = (
            "import os, sys, time; print('hello from the worker', flush=True); time.sleep(0.3); "
            f"open({str(exited_file)!r}, 'w').write(repr(time.time())); os._exit(3)"
        )
        command = Start(
            generation=0,
            process=0,
            slice=0,
            argv=[sys.executable, "-c", code],
            placement={},
            devices=1,
        )
        worker = plane.hosts.start(record, 0, 0, command)
        plane.hosts.await_started([worker])
        _wait(lambda: worker.exit_code is not None)
        reported_at = time.time()
        assert worker.exit_code == 3
        # The agent's waiter thread reports the exit the moment it happens.
        assert reported_at - float(exited_file.read_text()) < 0.1
        log = (tmp_path / "logs" / "h0" / "workers.log").read_text()
        assert "[g0 s0 p0] hello from the worker" in log
        events = list(read_events(str(tmp_path)))
        (start,) = [e for e in events if e["type"] == "agent_start"]
        assert (start["pid"], start["host"], start["slice"]) == (agent.pid, "h0", 0)
        assert [e["host"] for e in events if e["type"] == "host_joined"] == ["h0"]
        plane.end("done")
        assert agent.wait(timeout=10) == 0
    finally:
        agent.kill()
        agent.wait()


def test_agent_starts_an_elastic_slice_with_its_own_output_file_and_no_heartbeats(plane, tmp_path):
    """An elastic slice's process (`Start(output=..., heartbeats=False)`): its output goes to its
    own file, not the host's log, and it is not told the supervisor's address or pid."""
    agent = _agent(tmp_path, **{env_vars.RUN_TOKEN: TOKEN})
    try:
        _wait(lambda: 0 in plane.hosts.ready_slices(1))
        (record,) = plane.hosts.hosts_for(0)
        output = tmp_path / "slices" / "0" / "output.log"
        code = (
            "import os; print('slice says', os.environ.get('RJ_SUPERVISOR_ADDRESS'), "
            "os.environ.get('RJ_SUPERVISOR_PID'), os.environ['RJ_ELASTIC_SLICE'], flush=True)"
        )
        command = Start(
            generation=4,
            process=0,
            slice=0,
            argv=[sys.executable, "-c", code],
            placement={env_vars.ELASTIC_SLICE: "0"},
            devices=1,
            output=str(output),
            heartbeats=False,
        )
        worker = plane.hosts.start(record, 4, 0, command)
        plane.hosts.await_started([worker])
        _wait(lambda: worker.exit_code is not None)
        assert worker.exit_code == 0
        assert output.read_text() == "slice says None None 0\n"
        assert "slice says" not in (tmp_path / "logs" / "h0" / "workers.log").read_text()
        plane.end("done")
        assert agent.wait(timeout=10) == 0
    finally:
        agent.kill()
        agent.wait()


def test_agent_without_a_supervisor_stops_after_the_orphan_timeout(tmp_path):
    agent = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_jax.control.agent",
            f"--workdir={tmp_path}",
            "--slice=0",
            "--supervisor=127.0.0.1:9",  # nothing listens there
            "--connect_timeout_s=0.5",
        ],
        env={**os.environ, env_vars.RUN_TOKEN: TOKEN},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert agent.returncode == ExitCode.SUPERVISOR_LOST
    assert agent.stderr.strip().count("\n") == 0 and "no supervisor for" in agent.stderr


def test_probe_refuses_a_host_that_cannot_write_its_local_tier(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    ok, detail = probe_host(str(tmp_path), str(blocked / "tier"), 0.0, None, {})
    assert not ok and "is not writable" in detail
    ok, detail = probe_host(str(tmp_path), str(tmp_path / "tier"), 0.0, None, {})
    assert ok, detail
    ok, detail = probe_host(str(tmp_path), "", 1e9, None, {})
    assert not ok and "probe_min_free_gb" in detail


@pytest.mark.slow
def test_probe_starts_jax_and_counts_its_devices(tmp_path):
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=3",
    }
    ok, detail = probe_host(str(tmp_path), "", 0.0, 3, env)
    assert ok and "JAX sees 3 devices" in detail
    ok, detail = probe_host(str(tmp_path), "", 0.0, 2, env)
    assert not ok and "sees 3 devices, expected 2" in detail


def test_supervisor_file_round_trip(tmp_path):
    assert agent_protocol.read_supervisor_address(str(tmp_path)) is None
    agent_protocol.write_supervisor_file(str(tmp_path), "10.0.0.1:7077", 12)
    assert agent_protocol.read_supervisor_address(str(tmp_path)) == "10.0.0.1:7077"
    assert json.loads((tmp_path / "supervisor.json").read_text())["pid"] == 12


class _Connection:
    """An agent's connection as the registry keeps it (identity and the peer's address)."""

    def getpeername(self) -> tuple[str, int]:
        return ("127.0.0.1", 1)


def test_a_worker_that_ends_before_a_restarted_supervisor_adopts_it_is_adopted_ended(tmp_path):
    """An agent registers a running worker with a supervisor that does not know it yet (one
    restarted), and the worker's exit arrives before the supervisor adopts it: the exit is kept,
    so the adopted worker is not taken for running forever (an elastic slice sends no
    heartbeats that would tell otherwise)."""
    from resilient_jax.control.hosts import HostRegistry

    events = EventLog(str(tmp_path), process="supervisor", source="supervisor")
    welcome = agent_protocol.Welcome(settings={}, probe={})
    registry = HostRegistry(events, lambda _: None, welcome, agent_timeout_s=60.0)
    registry.bind(lambda conn, message: True, lambda now: now)
    conn = _Connection()

    def line(message) -> dict:
        return {**json.loads(wire.encode(message)), "token": TOKEN, "host": "h0"}

    try:
        worker = {"generation": 7, "process": 0, "slice": 0, "pid": 4242, "exit_code": None}
        registry.on_message(conn, line(agent_protocol.Register(slice=0, workers=[worker])))
        assert registry.generations_reported() == {7}
        registry.on_message(conn, line(agent_protocol.WorkerExit(7, 0, 3, pid=4242)))
        (adopted,) = registry.adopt(7, registry.reported(7))
        assert (adopted.pid, adopted.poll()) == (4242, 3)
        # The same numbers reported by another host are not this worker's.
        other = _Connection()
        registry.on_message(other, {**line(agent_protocol.Register(slice=1)), "host": "h1"})
        registry.on_message(other, {**line(agent_protocol.WorkerExit(7, 0, 9)), "host": "h1"})
        assert adopted.poll() == 3
    finally:
        registry.close()
