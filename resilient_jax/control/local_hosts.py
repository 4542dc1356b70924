"""Simulated hosts on one machine: one host agent per slice, started by the supervisor.

`launch/local_cluster.py` and the tests run the supervisor this way, so the code path is the one a
cluster takes (supervisor -> agent -> worker); only who starts the agents differs. Host `host<S>`
serves slice S with `processes_per_slice` worker slots. A host lost to a `lose_host` fault with a
duration is started again after it, as a rebooted machine's agent would be.
"""

from __future__ import annotations

import contextlib
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


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def host_name(slice_id: int) -> str:
    return f"host{slice_id}"


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
        self._agents: dict[int, tuple[subprocess.Popen[bytes], threading.Thread]] = {}
        self._all: list[subprocess.Popen[bytes]] = []
        self._reboots: dict[int, float] = {}  # slice -> when its host comes back (monotonic)

    def start(self, supervisor_address: str) -> None:
        self._address = supervisor_address
        for slice_id in self._slices:
            self._spawn(slice_id)

    def reboot_after(self, slice_id: int, delay_s: float) -> None:
        """The host of `slice_id` (lost) gets a fresh agent `delay_s` from now."""
        self._reboots[slice_id] = time.monotonic() + delay_s

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
        for popen in self._all:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        for pid in [p.pid for p in self._all] + list(worker_pids):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for popen in self._all:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5.0)
        # A worker killed here was a dead agent's child: it is gone once init has reaped it.
        gone_by = time.monotonic() + _EXIT_WAIT_S
        while any(_exists(pid) for pid in worker_pids) and time.monotonic() < gone_by:
            time.sleep(0.02)
        for _, reader in self._agents.values():
            reader.join(timeout=1.0)

    def _spawn(self, slice_id: int) -> None:
        argv = [
            sys.executable,
            "-m",
            "resilient_jax.control.agent",
            f"--workdir={self._workdir}",
            f"--host={host_name(slice_id)}",
            f"--slice={slice_id}",
            f"--slots={self._slots}",
            f"--devices={self._devices}",
            f"--supervisor={self._address}",
            "--address=127.0.0.1",
        ]
        env = dict(os.environ)
        env[env_vars.RUN_TOKEN] = self._token
        env.pop(env_vars.RUN_TOKEN_FILE, None)
        env[env_vars.PYTHONUNBUFFERED] = "1"
        popen, reader = processes.start_piped(argv, env, self._sink)
        self._agents[slice_id] = (popen, reader)
        self._all.append(popen)
