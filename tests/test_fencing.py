"""Generation fencing: a worker of a generation the supervisor gave up stops by itself and writes
nothing more to the run (`contracts.generation_file`, the `fenced` answer to a heartbeat,
`worker.client`), even when its host's agent is frozen and cannot stop it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import FAST_SUPERVISION

from resilient_jax.contracts import generation_file
from resilient_jax.contracts.generation_file import Fenced, GenerationFence
from resilient_jax.contracts.messages import Phase, WorkerMessage
from resilient_jax.control import ClusterSpec, Supervisor, protocol
from resilient_jax.control.server import HeartbeatServer
from resilient_jax.events import EventLog, read_events

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "test-token-0123"


def test_generation_file_only_moves_forward_and_fences_older_generations(tmp_path):
    workdir = str(tmp_path)
    fence = GenerationFence(workdir, 1)
    assert generation_file.current(workdir) is None and fence.superseded_by() is None
    generation_file.advance(workdir, 1)
    fence.check()  # its own generation is current
    generation_file.advance(workdir, 3)
    generation_file.advance(workdir, 2)  # never back
    assert generation_file.current(workdir) == 3 and fence.superseded_by() == 3
    with pytest.raises(Fenced, match="generation 1 was superseded by generation 3"):
        fence.check()


def test_fenced_event_log_appends_nothing(tmp_path):
    events = EventLog(str(tmp_path), process=0)
    events.fence_with(GenerationFence(str(tmp_path), 0))
    events.emit("step", step=1)
    generation_file.advance(str(tmp_path), 1)
    with pytest.raises(Fenced):
        events.emit("step", step=2)
    assert [e["step"] for e in read_events(str(tmp_path))] == [1]


def _heartbeat(sock: socket.socket, generation: int) -> None:
    message = {"type": WorkerMessage.HEARTBEAT, "token": TOKEN, "generation": generation}
    sock.sendall(protocol.encode({**message, "process": 0, "phase": Phase.TRAIN}))


def test_server_answers_only_a_superseded_generation_with_fenced():
    server = HeartbeatServer(TOKEN)
    try:
        server.fence_below(2)
        host, port = protocol.split_address(server.address)
        with (
            socket.create_connection((host, port), timeout=5) as current,
            socket.create_connection((host, port), timeout=5) as stale,
        ):
            _heartbeat(current, 2)
            _heartbeat(stale, 1)
            assert json.loads(stale.makefile().readline()) == {"type": "fenced", "generation": 2}
            current.settimeout(0.5)
            with pytest.raises(TimeoutError):
                current.recv(1)
        assert set(server.reports(1)) == {0} and set(server.reports(2)) == {0}
    finally:
        server.close()


_CLIENT = """
import sys, time
from resilient_jax.contracts.generation_file import GenerationFence
from resilient_jax.worker.client import SupervisorClient
SupervisorClient(sys.argv[1], sys.argv[2], 0, 0, 0, 0.1, fence=GenerationFence(sys.argv[3], 0))
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("told_by", ["server", "file"])
def test_worker_client_ends_its_process_once_fenced(tmp_path, told_by):
    server = HeartbeatServer(TOKEN)
    try:
        worker = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, server.address, TOKEN, str(tmp_path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert worker.stdout is not None and worker.stdout.readline() == "ready\n"
        time.sleep(0.3)
        assert worker.poll() is None  # its generation is current: it runs on
        fenced_at = time.monotonic()
        if told_by == "server":
            server.fence_below(1)
        else:
            generation_file.advance(str(tmp_path), 1)
        assert worker.wait(timeout=10) == -signal.SIGKILL
        assert time.monotonic() - fenced_at < 1.0
        assert worker.stderr is not None
        assert worker.stderr.read().strip().splitlines() == [
            "error: generation 0 was superseded by generation 1: stopping (fenced)"
        ]
    finally:
        server.close()


# A frozen agent: the supervisor loses the host, gives its generation up and starts the next; the
# worker it can no longer reach stops by itself.

CONFIG = {
    "total_steps": 60,
    "global_batch_size": 8,
    "checkpoint.every_steps": 5,
    **FAST_SUPERVISION,
    # JAX's own heartbeat would end the stale process 0 later anyway: the fence must be first.
    "coordinator.jax_heartbeat_timeout_s": 60,
}


def _event_of(workdir, kind: str, timeout_s: float, **fields) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in read_events(str(workdir)):
            if event["type"] == kind and all(event.get(k) == v for k, v in fields.items()):
                return event
        time.sleep(0.02)
    raise AssertionError(f"no {kind} event {fields} within {timeout_s}s")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"  # its frozen agent cannot reap
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_worker_of_a_frozen_agent_fences_itself_after_the_eviction(tmp_path):
    workdir = tmp_path / "run"
    lines = [f"    c.{key} = {value!r}" for key, value in CONFIG.items()]
    config_path = tmp_path / "config.py"
    config_path.write_text(
        "from resilient_jax.config import default_config\n\n\n"
        "def get_config():\n    c = default_config()\n" + "\n".join(lines) + "\n    return c\n"
    )
    config = runpy.run_path(str(config_path))["get_config"]()
    argv = [
        sys.executable,
        "-m",
        "resilient_jax.testing.sim_worker",
        f"--config={config_path}",
        f"--workdir={workdir}",
        "--sim_step_time_s=0.1",
    ]
    supervisor = Supervisor(config, ClusterSpec(2, 1, 1), argv, str(workdir), out=io.StringIO())
    outcome = {}
    thread = threading.Thread(
        target=lambda: outcome.update(result=supervisor.run(time_limit_s=120.0)), daemon=True
    )
    thread.start()
    agent: int | None = None
    try:
        _event_of(workdir, "save", 60.0, step=10)
        agent = _event_of(workdir, "agent_start", 1.0, host="host0")["pid"]
        worker = _event_of(workdir, "process_start", 1.0, process=0, generation=0)["pid"]
        os.kill(agent, signal.SIGSTOP)  # process 0's host: the agent alone, its worker runs on
        deadline = time.monotonic() + 60.0
        while not _gone(worker):
            assert time.monotonic() < deadline, "the stale worker ran on"
            time.sleep(0.01)
        exited_at = time.time()
        thread.join(timeout=120)
    finally:
        if agent is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent, signal.SIGCONT)
        thread.join(timeout=30)
    result = outcome["result"]
    assert result.exit_code == 0, result.reason
    events = list(read_events(str(workdir)))
    failure = next(e for e in events if e["type"] == "failure_detected")
    assert failure["cause"] == "host_lost" and failure["generation"] == 0
    evict = next(e for e in events if e["type"] == "evict")
    assert evict["slice"] == 0
    after_s = exited_at - evict["time"]
    assert after_s <= CONFIG["coordinator.heartbeat_timeout_s"] + 1.0, after_s
    # Nothing from the stale worker after its generation was given up: no event, no save.
    late = [e for e in events if e.get("pid") == worker and e["time"] > failure["time"]]
    assert late == []
    restart = next(e for e in events if e["type"] == "restart")
    assert (restart["generation"], restart["slices"]) == (1, [1])
    state = json.loads((workdir / "sim_state.json").read_text())
    assert state["step"] == CONFIG["total_steps"]


# A persistent save in flight when its generation is given up: Orbax commits it in its own thread,
# later; the tier's fence check right before the commit must keep the step from ever appearing.


def _held_orbax_commit(monkeypatch) -> threading.Event:
    """Holds Orbax's background commit thread (the write of the items, then the commit) until
    the returned event is set: a save in flight on a slow store."""
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    release = threading.Event()
    commit = async_checkpointer._background_wait_for_commit_futures

    def held(*args, **kwargs):
        assert release.wait(30.0), "the test never released the save"
        return commit(*args, **kwargs)

    monkeypatch.setattr(async_checkpointer, "_background_wait_for_commit_futures", held)
    return release


@pytest.mark.timeout(60)
@pytest.mark.parametrize("superseded", [True, False])
def test_persistent_save_in_flight_commits_only_while_its_generation_is_current(
    tmp_path, persistent_base, monkeypatch, superseded
):
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from resilient_jax.checkpoint.errors import CheckpointError
    from resilient_jax.checkpoint.persistent import PersistentTier

    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    generation_file.advance(workdir, 0)
    directory = f"{persistent_base}/checkpoints"
    tier = PersistentTier(directory, keep=3, keep_period=0, fence=GenerationFence(workdir, 0))
    state = {"w": jnp.arange(16.0), "b": jnp.ones((4,), jnp.int32)}
    try:
        tier.save(1, state, {"next_index": 8}, {"step": 1}, temporary=False)
        assert tier.finish() is not None and tier.steps() == [1]
        release = _held_orbax_commit(monkeypatch)
        tier.save(2, state, {"next_index": 16}, {"step": 2}, temporary=False)
        assert tier.save_in_progress()
        if superseded:  # the supervisor gives generation 0 up while its save is in flight
            generation_file.advance(workdir, 1)
        release.set()
        if superseded:
            with pytest.raises(CheckpointError) as failed:
                tier.finish(timeout_s=20.0)
            reason = str(failed.value)
            assert reason.splitlines() == [reason]
            assert reason.startswith(f"persistent save of step 2 to {directory} failed: Fenced: ")
            assert reason.endswith("generation 0 was superseded by generation 1: stopping (fenced)")
            assert tier.last_committed == 1 and tier.steps() == [1]
            assert not ocp.utils.is_checkpoint_finalized(tier.step_dir(2))
            # Nothing more starts either, and the step before stays.
            with pytest.raises(CheckpointError, match="step 3 not started: generation 0 was"):
                tier.save(3, state, {"next_index": 24}, {"step": 3}, temporary=False)
        else:
            assert tier.finish(timeout_s=20.0) is not None and tier.last_committed == 2
    finally:
        tier.close()
    # What plain Orbax (and the next generation) sees in the directory.
    with ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(read_only=True)
    ) as plain:
        assert plain.all_steps() == ([1] if superseded else [1, 2])
    reopened = PersistentTier(directory, keep=3, keep_period=0, read_only=True)
    assert reopened.steps() == ([1] if superseded else [1, 2])
    assert reopened.read_data_position(1) == {"next_index": 8}
    reopened.close()
