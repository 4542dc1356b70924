"""Simulated hosts on one machine: one host agent per slice, started by the supervisor.

`launch/local_cluster.py` and the tests run the supervisor this way, so the code path is the one a
cluster takes (supervisor -> agent -> worker); only who starts the agents differs. Host `host<S>`
serves slice S with `processes_per_slice` worker slots. A host lost to a `lose_host` fault with a
duration is started again after it, as a rebooted machine's agent would be.

An agent's life never depends on the supervisor's process: it runs in its own session, writes its
output (and its workers') to `<workdir>/logs/<host>/workers.log`, which the supervisor follows,
and holds no pipe to the supervisor. A supervisor started again (the same command and run token)
finds each host's agent in `<workdir>/logs/<host>/agent.json` and starts agents only for hosts
whose agent is gone; the survivors register with it and their workers are adopted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from resilient_jax.contracts import env_vars
from resilient_jax.control import processes

_EXIT_WAIT_S = 5.0  # after the run's end, an agent gets this long to stop its workers and exit
_FOLLOW_POLL_S = 0.1
LOG_FILE = "workers.log"
AGENT_FILE = "agent.json"  # the pid of the host's agent, and its run token's digest


def process_gone(pid: int, zombie: bool = True) -> bool:
    """Whether `pid` no longer runs; a zombie not reaped yet counts as gone when `zombie`."""
    if zombie:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] == "Z"
        except OSError:
            pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def host_name(slice_id: int) -> str:
    return f"host{slice_id}"


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class ForeignAgent(ValueError):
    """A live agent of this run directory that answers to another run token."""


class _LogFollower:
    """Copies the lines appended to the hosts' logs into the supervisor's output (a thread)."""

    def __init__(self, sink: processes.OutputSink) -> None:
        self._sink = sink
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rj-log-follower", daemon=True)
        self._thread.start()

    def follow(self, path: str, offset: int) -> None:
        with self._lock:
            self._offsets.setdefault(path, offset)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._drain()

    def _run(self) -> None:
        while not self._stop.wait(_FOLLOW_POLL_S):
            self._drain()

    def _drain(self) -> None:
        with self._lock:
            for path, offset in self._offsets.items():
                try:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        data = f.read()
                except OSError:
                    continue
                self._offsets[path] = offset + len(data)
                *lines, self._partial[path] = (self._partial.get(path, b"") + data).split(b"\n")
                for line in lines:
                    self._sink.write_line(line.decode(errors="replace"))


class LocalHosts:
    def __init__(
        self,
        workdir: str,
        slices: Sequence[int],
        processes_per_slice: int,
        devices_per_process: int,
        token: str,
        sink: processes.OutputSink,
    ) -> None:
        self._workdir = workdir
        self._slices = list(slices)
        self._slots = processes_per_slice
        self._devices = devices_per_process
        self._token = token
        self._sink = sink
        self._address = ""
        self._children: list[subprocess.Popen[bytes]] = []
        self._adopted: list[int] = []  # pids of agents an earlier supervisor started
        self._reboots: dict[int, float] = {}  # slice -> when its host comes back (monotonic)
        self._agents: dict[int, int] = {}  # slice -> pid of its host's agent now
        self._follower: _LogFollower | None = None

    def survivors(self) -> dict[int, int]:
        """Slice -> pid of its host's agent, started by an earlier supervisor and still running.
        Raises ForeignAgent when one of them answers to another run token."""
        alive = {}
        for slice_id in self._slices:
            name = host_name(slice_id)
            try:
                with open(self._path(name, AGENT_FILE)) as f:
                    record = json.load(f)
                pid = int(record["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if process_gone(pid) or not self._is_agent(pid, name):
                continue
            if record.get("token_sha256") != _digest(self._token):
                raise ForeignAgent(
                    f"the agent of {name} (pid {pid}) from an earlier start of this run "
                    f"directory still runs under another run token: start with its token "
                    f"({env_vars.RUN_TOKEN}) or end it"
                )
            alive[slice_id] = pid
        return alive

    def start(self, supervisor_address: str) -> None:
        """Starts an agent for each host that has none; follows every host's log."""
        self._address = supervisor_address
        self._follower = _LogFollower(self._sink)
        survivors = self.survivors()
        for slice_id in self._slices:
            if slice_id in survivors:
                self._adopted.append(survivors[slice_id])
                self._agents[slice_id] = survivors[slice_id]
                path = self._path(host_name(slice_id), LOG_FILE)
                self._follower.follow(path, os.path.getsize(path) if os.path.exists(path) else 0)
            else:
                self._spawn(slice_id)

    def reboot_after(self, slice_id: int, delay_s: float) -> None:
        """The host of `slice_id` (lost) gets a fresh agent `delay_s` from now."""
        self._reboots[slice_id] = time.monotonic() + delay_s

    def replace(self, slice_id: int) -> None:
        """Ends the agent of `slice_id`'s host (SIGKILL to its process group, by pid) and starts
        a fresh one."""
        pid = self._agents.get(slice_id)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            for popen in [p for p in self._children if p.pid == pid]:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=5.0)  # reaped: its pid is not ended again at close
                self._children.remove(popen)
            if pid in self._adopted:
                self._adopted.remove(pid)
        self._spawn(slice_id)

    def poll(self) -> None:
        """Starts the agents of hosts whose reboot is due."""
        now = time.monotonic()
        for slice_id, due in list(self._reboots.items()):
            if due <= now:
                del self._reboots[slice_id]
                self._spawn(slice_id)

    def close(self, worker_pids: Sequence[int]) -> None:
        """Waits (bounded) for the agents to leave after the run's end, then ends what is left:
        agents (a frozen one never leaves) and workers no agent saw exit."""
        deadline = time.monotonic() + _EXIT_WAIT_S
        for popen in self._children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        while not all(process_gone(pid) for pid in self._adopted) and time.monotonic() < deadline:
            time.sleep(0.02)
        agents = [p.pid for p in self._children] + self._adopted
        for pid in agents + list(worker_pids):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for popen in self._children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5.0)
        # A worker or an adopted agent killed here is not our child: gone once init reaps it.
        gone_by = time.monotonic() + _EXIT_WAIT_S
        while any(not process_gone(pid, zombie=False) for pid in [*self._adopted, *worker_pids]):
            if time.monotonic() > gone_by:
                break
            time.sleep(0.02)
        if self._follower is not None:
            self._follower.close()

    def _path(self, host: str, name: str) -> str:
        return os.path.join(self._workdir, "logs", host, name)

    def _is_agent(self, pid: int, host: str) -> bool:
        """Whether `pid` runs this run directory's agent of `host` (not a reused pid)."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            return False
        return f"--host={host}" in argv and f"--workdir={self._workdir}" in argv

    def _spawn(self, slice_id: int) -> None:
        name = host_name(slice_id)
        argv = [
            sys.executable,
            "-m",
            "resilient_jax.control.agent",
            f"--workdir={self._workdir}",
            f"--host={name}",
            f"--slice={slice_id}",
            f"--slots={self._slots}",
            f"--devices={self._devices}",
            f"--supervisor={self._address}",
            "--address=127.0.0.1",
            "--log_only",
        ]
        env = dict(os.environ)
        env[env_vars.RUN_TOKEN] = self._token
        env.pop(env_vars.RUN_TOKEN_FILE, None)
        env[env_vars.PYTHONUNBUFFERED] = "1"
        log = self._path(name, LOG_FILE)
        os.makedirs(os.path.dirname(log), exist_ok=True)
        # The agent's stderr (its last line, a traceback) goes to its log: no pipe to this
        # process, whose death must not reach the agent.
        with open(log, "ab") as stderr:
            offset = stderr.tell()
            popen = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )
        self._children.append(popen)
        self._agents[slice_id] = popen.pid
        record = {"pid": popen.pid, "token_sha256": _digest(self._token)}
        tmp = self._path(name, AGENT_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self._path(name, AGENT_FILE))
        assert self._follower is not None
        self._follower.follow(log, offset)
