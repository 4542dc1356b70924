"""The host agent: one long-lived process per host that runs that host's workers for the supervisor.

    python -m resilient_jax.control.agent --workdir=W --host=NAME --slice=S \
        [--supervisor=HOST:PORT] [--slots=1] [--devices=1] [--address=IP] [--token_file=PATH]

It connects to the supervisor (the address given, else the one in `<workdir>/supervisor.json`,
read again before every attempt, so a restarted supervisor is found), registers its host, slice,
devices and worker slots, and heartbeats. On command it starts workers with the environment the
supervisor gives (the restart path's generations, or elastic mode's slices, each launch numbered
as a generation), signals them, keeps warm standbys, and reports each worker's exit the moment a
waiter thread sees it. It serves the host's local checkpoint tier read-only to the workers of
other hosts (`tier_service`): the RAM disk outlives the workers, and a replaced host restores
from it. Its own lines and its workers' output (but an elastic slice's, which has a file of its
own) go to `<workdir>/logs/<host>/workers.log` (a supervisor may follow it) and to stdout unless
`--log_only`; a stream that fails a write (a pipe whose reader died with the supervisor) is
dropped, never the agent.

Workers keep training while no supervisor is connected: a restarted one finds them in the
agent's next registration. With no supervisor for `coordinator.orphan_timeout_s` the agent asks
its workers to save and stop (SIGTERM, the save-and-stop request) and exits
`ExitCode.SUPERVISOR_LOST`. Exit 0 when the supervisor ends the run, 2 on bad input; one line on
stderr for any non-zero exit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from resilient_jax.config import default_config
from resilient_jax.contracts import env_vars
from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.contracts.faults import FaultKind
from resilient_jax.control import agent_protocol as ap
from resilient_jax.control import processes, protocol, wire, worker_env
from resilient_jax.control.line_client import LineConnection
from resilient_jax.control.line_server import ConnectionLimits, PortGuard
from resilient_jax.control.probe import probe_host
from resilient_jax.control.refusals import RefusalReports
from resilient_jax.control.tier_service import TierServer
from resilient_jax.events import EventLog

# Registrations repeat the newest workers' records (running or exited) for a restarted supervisor.
_WORKERS_REPORTED = 16


class _Tee:
    """Writes to several streams (stdout and the host's worker log); a stream that fails a write
    or a flush is dropped: the agent and its workers outlive whoever read its output."""

    def __init__(self, *streams: IO[str]) -> None:
        self._streams = list(streams)

    def write(self, text: str) -> None:
        self._each(lambda stream: stream.write(text))

    def flush(self) -> None:
        self._each(lambda stream: stream.flush())

    def _each(self, act: Callable[[IO[str]], object]) -> None:
        for stream in list(self._streams):
            try:
                act(stream)
            except (OSError, ValueError):  # EPIPE, a full disk, a closed file
                self._streams.remove(stream)


class HostAgent:
    def __init__(
        self,
        workdir: str,
        host: str,
        slice_id: int,
        token: str,
        slots: int = 1,
        devices: int = 1,
        supervisor: str | None = None,
        address: str | None = None,
        connect_timeout_s: float | None = None,
        out: IO[str] | None = None,
        log_only: bool = False,
    ) -> None:
        self._workdir = workdir
        self._host = host
        self._slice = slice_id
        self._token = token
        self._slots = slots
        self._devices = devices
        self._fixed_supervisor = supervisor
        self._address = address
        self._out, self._log_only = out, log_only
        self._opened = False
        self._lock = threading.Lock()  # the connection and the worker tables
        self._conn: LineConnection | None = None
        self._supervisor_address: str | None = None
        self._workers: dict[tuple[int, int], processes.WorkerProcess] = {}
        self._standbys: list[processes.Standby] = []
        self._standby_spec: ap.Standbys | None = None
        # Settings the supervisor's `welcome` replaces; the orphan timeout before the first
        # welcome is how long the agent waits for a supervisor at all.
        defaults = default_config().coordinator  # the run's own come with the `welcome`
        if connect_timeout_s is None:
            connect_timeout_s = float(defaults.agent_connect_timeout_s)
        self._settings: dict[str, Any] = {
            "heartbeat_interval_s": defaults.heartbeat_interval_s,
            "orphan_timeout_s": connect_timeout_s,
            "save_grace_s": defaults.save_grace_s,
        }
        self._partitioned_until = 0.0
        self._end: tuple[int, str] | None = None
        self._terminated = False

    def open(self) -> HostAgent:
        """Opens the host's log and event log and starts serving its local tier (`run` opens it
        when nobody did). Raises `OSError` (nothing stays open) when either cannot be had."""
        if self._opened:
            return self
        log_dir = os.path.join(self._workdir, "logs", self._host)
        os.makedirs(log_dir, exist_ok=True)
        self._log = open(os.path.join(log_dir, "workers.log"), "a")  # noqa: SIM115 (closed in run)
        streams = [self._log] if self._log_only else [self._out or sys.stdout, self._log]
        self._sink = processes.OutputSink(_Tee(*streams))
        self._events = EventLog(self._workdir, process="agent", source="agent")
        # This host's local tier, read-only to peers (what it serves comes with the `welcome`):
        # it outlives the workers, so a replaced host restores from it.
        # Held to the control port's limits against clients that are not the run's: its
        # defaults until the `welcome` names the run's (`coordinator.*`).
        refusals = RefusalReports(self._events, self._say)
        try:
            self._tier = TierServer(
                self._address or "0.0.0.0",
                0,
                self._token,
                guard=PortGuard.reporting_to(refusals),
            )
        except BaseException:
            self._log.close()
            raise
        self._opened = True
        return self

    def request_stop(self) -> None:
        """SIGTERM to the agent (a scheduler ending the host): workers save and stop, the agent
        leaves with ExitCode.PREEMPTED (safe from a signal handler)."""
        self._terminated = True

    # The loop.

    def run(self) -> tuple[int, str]:
        self.open()
        self._events.emit(
            EventType.AGENT_START,
            pid=os.getpid(),
            host=self._host,
            slice=self._slice,
            devices=self._devices,
            slots=self._slots,
        )
        self._say(f"agent for host {self._host} (slice {self._slice}) started")
        alone_since = time.monotonic()
        next_beat = 0.0
        try:
            while self._end is None:
                if self._terminated:
                    with self._lock:
                        running = [w for w in self._workers.values() if w.running]
                    processes.stop(running, float(self._settings["save_grace_s"]))
                    return ExitCode.PREEMPTED, "asked to stop (SIGTERM): workers saved and stopped"
                now = time.monotonic()
                interval = float(self._settings["heartbeat_interval_s"])
                if self._conn is None:
                    if now - alone_since > float(self._settings["orphan_timeout_s"]):
                        return self._orphaned(now - alone_since)
                    if now < self._partitioned_until or not self._connect():
                        time.sleep(min(interval, 0.2))
                        continue
                    next_beat = 0.0
                if now >= next_beat:
                    standbys = [sb.popen.pid for sb in self._standbys if sb.alive]
                    self._send(ap.AgentHeartbeat(standbys))
                    next_beat = now + interval
                self._read_commands(max(0.0, min(next_beat - time.monotonic(), interval)))
                self._refill_standbys()
                if self._conn is None:
                    alone_since = time.monotonic()
            return self._end
        finally:
            self._stop_all(grace_s=0.0)
            self._close_conn()
            self._tier.close()
            self._log.close()

    def _connect(self) -> bool:
        address = self._fixed_supervisor or ap.read_supervisor_address(self._workdir)
        if address is None:
            return False
        try:
            conn = LineConnection.open(address, timeout_s=2.0, max_line_bytes=ap.MAX_COMMAND_BYTES)
        except OSError:
            return False
        with self._lock:
            self._conn = conn
            self._supervisor_address = address
        own_address = self._address or conn.local_host()
        self._send(
            ap.Register(
                slice=self._slice,
                devices=self._devices,
                slots=self._slots,
                pid=os.getpid(),
                address=own_address,
                tier_port=self._tier.port,
                workers=self._worker_records(),
            )
        )
        return self._conn is not None

    def _read_commands(self, wait_s: float) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            lines = conn.lines(wait_s)
        except (OSError, ValueError):  # ValueError: closed meanwhile by another thread
            self._say("lost the supervisor's connection; workers train on")
            self._close_conn()
            return
        for line in lines:
            try:
                self._handle(ap.decode_command(line))
            except protocol.ProtocolError as e:
                self._say(f"ignored a line from the supervisor: {e}")

    # Commands.

    def _handle(self, command: wire.Message) -> None:
        if isinstance(command, ap.Welcome):
            self._welcomed(command)
        elif isinstance(command, ap.Start):
            self._start_worker(command)
        elif isinstance(command, ap.SignalWorkers):
            self._signal(command)
        elif isinstance(command, ap.Standbys):
            count = self._slots if command.count < 0 else command.count
            self._standby_spec = dataclasses.replace(command, count=count) if count else None
            if count == 0:
                processes.discard(self._standbys)
                self._standbys = []
        elif isinstance(command, ap.Fence):
            self._fence(command.below)
        elif isinstance(command, ap.Fault):
            self._fault(command)
        elif isinstance(command, ap.End):
            self._end = (command.exit_code, command.reason)

    def _welcomed(self, welcome: ap.Welcome) -> None:
        self._settings.update(welcome.settings)
        self._tier.serve(str(self._settings.get("serve_local_dir", "")))
        limits = self._settings.get("connection_limits")
        if isinstance(limits, dict):
            self._tier.set_limits(ConnectionLimits(**limits))
        if welcome.probe_now:
            threading.Thread(target=self._probe, args=(welcome.probe,), daemon=True).start()

    def _probe(self, spec: dict[str, Any]) -> None:
        env = self._shared_env(spec.get("cache_env", {}), int(spec.get("devices", self._devices)))
        ok, detail = probe_host(
            self._workdir,
            str(spec.get("local_dir", "")),
            float(spec.get("min_free_gb", 0.0)),
            int(spec["devices"]) if spec.get("jax") else None,
            env,
        )
        self._send(ap.ProbeResult(ok, detail))

    def _shared_env(self, cache_env: dict[str, str], devices: int) -> dict[str, str]:
        return worker_env.shared_env(
            os.environ,
            self._supervisor_address or "",
            os.getpid(),
            self._token,
            devices,
            cache_env,
        )

    def _start_worker(self, command: ap.Start) -> None:
        generation, process, slice_id = command.generation, command.process, command.slice
        env = self._shared_env(command.cache_env, command.devices)
        env.update(command.placement)
        if not command.heartbeats:  # an elastic slice: the quorum server hears from it
            env.pop(env_vars.SUPERVISOR_ADDRESS, None)
            env.pop(env_vars.SUPERVISOR_PID, None)
        prefix = f"[g{generation} s{slice_id} p{process}] "
        try:
            worker = None
            if command.output is None and command.heartbeats:  # a standby is a supervised worker
                worker = self._from_standby(env, prefix, process, slice_id, generation)
            warm = worker is not None
            if worker is None:
                worker = processes.spawn(
                    command.argv,
                    env,
                    self._sink,
                    prefix,
                    process,
                    slice_id,
                    generation,
                    cwd=command.cwd,
                    output=command.output,
                )
        except OSError as e:
            self._send(ap.Started(generation, process, error=str(e)))
            return
        with self._lock:
            self._workers[(generation, process)] = worker
        threading.Thread(target=self._wait_for, args=(worker,), daemon=True).start()
        self._send(ap.Started(generation, process, pid=worker.pid, standby=warm))

    def _from_standby(
        self, env: dict[str, str], prefix: str, process: int, slice_id: int, generation: int
    ) -> processes.WorkerProcess | None:
        while self._standbys:
            standby = self._standbys.pop(0)
            try:
                if standby.alive:
                    return processes.assign(standby, env, prefix, process, slice_id, generation)
            except OSError:  # it died just now
                pass
            processes.discard([standby])
        return None

    def _refill_standbys(self) -> None:
        spec = self._standby_spec
        if spec is None:
            return
        dead = [s for s in self._standbys if not s.alive]
        if dead:
            processes.discard(dead)
            self._standbys = [s for s in self._standbys if s.alive]
        env = self._shared_env(spec.cache_env, spec.devices)
        while len(self._standbys) < spec.count:
            try:
                standby = processes.spawn_standby(
                    spec.argv, env, self._sink, spec.cwd, idle_cpu=spec.idle_cpu
                )
            except OSError:
                self._standby_spec = None
                return
            self._standbys.append(standby)

    def _wait_for(self, worker: processes.WorkerProcess) -> None:
        """Reports the worker's exit as soon as it happens (a thread per worker)."""
        code = worker.popen.wait()
        worker.poll()
        self._send(ap.WorkerExit(worker.generation, worker.process, code, pid=worker.pid))

    def _targets(self, command: ap.SignalWorkers) -> list[processes.WorkerProcess]:
        generation, process = command.generation, command.process
        with self._lock:
            return [
                w
                for (g, p), w in self._workers.items()
                if (generation is None or g == generation) and (process is None or p == process)
            ]

    def _signal(self, command: ap.SignalWorkers) -> None:
        try:
            signum = signal.Signals[command.signal]
        except KeyError:
            self._say(f"ignored a signal it does not know: {command.signal[:40]!r}")
            return
        for worker in self._targets(command):
            worker.signal(signum, group=command.group)

    def _fence(self, below: int) -> None:
        """Ends workers of generations before `below`: survivors the supervisor no longer runs
        (a host back from a partition) must not train on beside the new generation."""
        with self._lock:
            stale = [w for (g, _), w in self._workers.items() if g < below and w.running]
        for worker in stale:
            worker.signal(signal.SIGKILL, group=True)

    def _fault(self, command: ap.Fault) -> None:
        kind = command.kind
        self._say(f"host fault {kind}")
        if kind == FaultKind.PARTITION_HOST:
            self._partitioned_until = time.monotonic() + (command.duration_s or 0.0)
            self._close_conn()
            return
        signum = signal.SIGKILL if kind == FaultKind.LOSE_HOST else signal.SIGSTOP
        with self._lock:
            pids = [w.pid for w in self._workers.values() if w.running]
        pids += [s.popen.pid for s in self._standbys if s.alive]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signum)
        os.kill(os.getpid(), signum)

    # Leaving.

    def _orphaned(self, waited_s: float) -> tuple[int, str]:
        """No supervisor for too long: workers save at their next step and stop."""
        self._events.emit(EventType.AGENT_ORPHANED, host=self._host, waited_s=round(waited_s, 3))
        with self._lock:
            running = [w for w in self._workers.values() if w.running]
        # SIGTERM is the save-and-stop request (JAX's preemption notice): every worker saves at
        # the step they agree on and exits ExitCode.PREEMPTED.
        processes.stop(running, float(self._settings["save_grace_s"]))
        codes = sorted({processes.describe_exit(w.exit_code or 0) for w in running})
        return ExitCode.SUPERVISOR_LOST, (
            f"no supervisor for {waited_s:.1f}s (coordinator.orphan_timeout_s="
            f"{float(self._settings['orphan_timeout_s']):g}): asked {len(running)} workers to save "
            f"and stop; they {', '.join(codes) or 'were none'}"
        )

    def _stop_all(self, grace_s: float) -> None:
        with self._lock:
            workers = list(self._workers.values())
        processes.stop(workers, grace_s)
        processes.discard(self._standbys)
        self._standbys = []

    # The connection.

    def _worker_records(self) -> list[dict[str, Any]]:
        with self._lock:
            newest = sorted(self._workers.items())[-_WORKERS_REPORTED:]
        return [
            {"generation": g, "process": p, "slice": w.slice, "pid": w.pid, "exit_code": w.poll()}
            for (g, p), w in newest
        ]

    def _send(self, message: wire.Message) -> None:
        with self._lock:
            conn = self._conn
            if conn is None:
                return
            try:
                conn.send(message, token=self._token, host=self._host)
                return
            except OSError:
                pass
        self._close_conn()

    def _close_conn(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _say(self, message: str) -> None:
        self._sink.write_line(f"[agent {self._host}] {message}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m resilient_jax.control.agent", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--workdir", required=True, help="the run directory (shared by all hosts)")
    parser.add_argument("--host", default=socket.gethostname(), help="this host's name")
    parser.add_argument("--slice", type=int, required=True, help="the physical slice it serves")
    parser.add_argument("--slots", type=int, default=1, help="worker processes it can run")
    parser.add_argument("--devices", type=int, default=1, help="devices each worker sees")
    parser.add_argument("--supervisor", help="HOST:PORT (default: <workdir>/supervisor.json)")
    parser.add_argument("--address", help="how other hosts reach this one (JAX coordinator)")
    parser.add_argument("--token_file", help="file holding the run token (mode 0600)")
    parser.add_argument(
        "--connect_timeout_s",
        type=float,
        default=default_config().coordinator.agent_connect_timeout_s,
        help="wait this long for a supervisor (coordinator.agent_connect_timeout_s)",
    )
    parser.add_argument(
        "--log_only",
        action="store_true",
        help="write output only to WORKDIR/logs/HOST/workers.log (not stdout)",
    )
    args = parser.parse_args(argv)
    try:
        token = ap.read_token(os.environ, args.token_file)
        if token is None:
            raise ap.TokenError("no run token: set RJ_RUN_TOKEN, RJ_RUN_TOKEN_FILE or --token_file")
        if args.slice < 0 or args.slots < 1 or args.devices < 1:
            raise ValueError(
                f"--slice={args.slice} --slots={args.slots} --devices={args.devices}: "
                "slice must be >= 0, slots and devices >= 1"
            )
        agent = HostAgent(
            os.path.abspath(args.workdir),
            args.host,
            args.slice,
            token,
            slots=args.slots,
            devices=args.devices,
            supervisor=args.supervisor,
            address=args.address,
            connect_timeout_s=args.connect_timeout_s,
            log_only=args.log_only,
        ).open()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(ExitCode.BAD_INPUT)
    signal.signal(signal.SIGTERM, lambda *_: agent.request_stop())
    code, reason = agent.run()
    if code:
        # stderr may be a pipe whose reader is gone: the exit code still says what happened.
        with contextlib.suppress(OSError):
            print(f"error: {reason}", file=sys.stderr, flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
