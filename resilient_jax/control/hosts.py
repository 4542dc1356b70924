"""The supervisor's view of its hosts: each agent's registration, liveness and workers.

`HostRegistry.on_message` and `on_disconnect` run on the heartbeat server's thread; the
supervisor's loop reads the registry (`ready_slices`, `newly_lost`, `adoptable`) and drives
workers through it (`start`, `RemoteWorker.signal`). A `RemoteWorker` looks to the supervisor
like a local `processes.WorkerProcess`: its exit code is what the agent reported, and a worker on a
host declared lost counts as gone (nothing more can be heard of it).

A host is lost when its agent is silent for `coordinator.agent_timeout_s` (frozen, or a cut link
that leaves the connection open) or its connection has been closed for `_RECONNECT_GRACE_S`
(killed, or partitioned on one machine). A host that registers again is probed by its agent and
admitted when the probe passes; the slice pool then decides when it runs again.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from resilient_jax.contracts.event_types import EventType
from resilient_jax.control import agent_protocol as ap
from resilient_jax.control import protocol, wire
from resilient_jax.events import EventLog

# A closed agent connection not replaced within this is a lost host: long enough for an agent to
# reconnect after a hiccup, far below any heartbeat timeout.
_RECONNECT_GRACE_S = 0.5
_START_ACK_TIMEOUT_S = 10.0
_LIVENESS_POLL_S = 0.05


@dataclasses.dataclass
class HostRecord:
    name: str
    slice: int
    devices: int
    slots: int
    pid: int
    address: str  # where other hosts reach it (process 0's host is the JAX coordinator)
    conn: socket.socket | None
    tier_port: int | None  # its agent's local-tier server on `address` (None: it has none)
    last_seen: float
    disconnected_at: float | None = None
    probe_ok: bool | None = None  # None: its probe has not answered yet
    standby_pids: list[int] = dataclasses.field(default_factory=list)  # as last heard
    lost: bool = False
    # (generation, process) -> (pid, exit code or None) as the agent registered them
    reported: dict[tuple[int, int], tuple[int | None, int | None]] = dataclasses.field(
        default_factory=dict
    )

    @property
    def admitted(self) -> bool:
        return not self.lost and self.conn is not None and self.probe_ok is True


@dataclasses.dataclass
class RemoteWorker:
    """A worker process an agent runs, with the interface of `processes.WorkerProcess`."""

    process: int
    slice: int
    generation: int
    host: str
    started_at: float
    registry: HostRegistry
    pid: int | None = None
    exit_code: int | None = None  # Popen convention: -N = killed by signal N
    start_error: str | None = None
    from_standby: bool = False  # the agent made a warm standby this worker
    presumed_dead: bool = False  # its host was lost before the agent reported an exit

    @property
    def running(self) -> bool:
        return self.poll() is None

    def poll(self) -> int | None:
        if self.exit_code is None and self.registry.is_lost(self.host):
            self.exit_code = -signal.SIGKILL  # its host is gone, and it with it
            self.presumed_dead = True
        return self.exit_code

    def signal(self, signum: int, group: bool = False) -> None:
        name = signal.Signals(signum).name
        self.registry.send(
            self.host, ap.SignalWorkers(name, self.generation, self.process, group=group)
        )

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)


class HostRegistry:
    def __init__(
        self,
        events: EventLog,
        say: Callable[[str], None],
        welcome: ap.Welcome,
        agent_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._events = events
        self._say = say
        self._welcome = welcome  # the `welcome` command every registering agent gets
        self._agent_timeout_s = agent_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._hosts: dict[str, HostRecord] = {}
        self._workers: dict[tuple[int, int], RemoteWorker] = {}
        self._send: Callable[[socket.socket, wire.Message], bool] | None = None
        self._heard_until: Callable[[float], float] = lambda now: now
        self.generation: int | None = None  # the generation the supervisor runs (fences others)
        self._standbys: ap.Standbys | None = None  # the standby request for every agent
        self._lost_queue: list[tuple[HostRecord, str, float]] = []
        self._closed = threading.Event()
        self._liveness = threading.Thread(
            target=self._watch_liveness, name="rj-host-liveness", daemon=True
        )
        self._liveness.start()

    def bind(
        self,
        send: Callable[[socket.socket, wire.Message], bool],
        heard_until: Callable[[float], float],
    ) -> None:
        """Sends through the server, and judges agents' silence up to what it has read
        (`LineServer.heard_until`)."""
        self._send = send
        self._heard_until = heard_until

    # From the server's thread.

    def on_message(self, conn: socket.socket, line: dict[str, Any]) -> str | None:
        """Handles a host agent's line (its token checked); a reason refuses it."""
        try:
            message = ap.decode_agent_line(line)
        except protocol.ProtocolError as e:
            return str(e)
        now = self._clock()
        name = line["host"]
        if isinstance(message, ap.Register):
            self._register(conn, name, message, now)
            return None
        with self._lock:
            record = self._hosts.get(name)
            if record is None or record.conn is not conn:
                return None  # a line from a connection the host has since replaced
            record.last_seen = now
            if isinstance(message, ap.AgentHeartbeat):
                record.standby_pids = [p for p in message.standbys if isinstance(p, int)]
            worker = None
            if isinstance(message, (ap.Started, ap.WorkerExit)):
                key = (message.generation, message.process)
                worker = self._workers.get(key)
                if worker is not None and worker.host != name:
                    worker = None  # the same numbers on another host: not this worker
                # What the host runs, as `adopt` reads it: a worker that starts or ends before
                # a restarted supervisor adopts it is adopted as it is now.
                if isinstance(message, ap.WorkerExit):
                    known_pid = record.reported.get(key, (None, None))[0]
                    record.reported[key] = (message.pid or known_pid, message.exit_code)
                elif message.pid is not None:
                    record.reported.setdefault(key, (message.pid, None))
        if isinstance(message, ap.Started) and worker is not None:
            worker.pid = message.pid
            worker.from_standby = message.standby
            worker.start_error = message.error or worker.start_error
            if worker.pid is None and worker.start_error is None:
                worker.start_error = "the agent gave no pid"
        elif isinstance(message, ap.WorkerExit) and worker is not None:
            worker.exit_code = message.exit_code
        elif isinstance(message, ap.ProbeResult):
            self._probed(record, message.ok, message.detail)
        return None

    def on_disconnect(self, conn: socket.socket) -> None:
        with self._lock:
            for record in self._hosts.values():
                if record.conn is conn:
                    record.conn, record.disconnected_at = None, self._clock()

    def _register(self, conn: socket.socket, name: str, message: ap.Register, now: float) -> None:
        reported = {}
        for w in message.workers:
            if (
                isinstance(w, dict)
                and isinstance(w.get("generation"), int)
                and isinstance(w.get("process"), int)
                and isinstance(w.get("pid"), (int, type(None)))
                and isinstance(w.get("exit_code"), (int, type(None)))
            ):
                reported[(w["generation"], w["process"])] = (w.get("pid"), w.get("exit_code"))
        with self._lock:
            previous = self._hosts.get(name)
            record = HostRecord(
                name=name,
                slice=message.slice,
                devices=message.devices,
                slots=message.slots,
                pid=message.pid,
                address=message.address or conn.getpeername()[0],
                conn=conn,
                tier_port=message.tier_port,
                last_seen=now,
                reported=reported,
            )
            running = [k for k, (_, code) in reported.items() if code is None]
            # Workers of this host the supervisor runs: what the agent saw of them counts.
            for key, (pid, code) in reported.items():
                worker = self._workers.get(key)
                if worker is not None and worker.host == name:
                    worker.pid = worker.pid or pid
                    if code is not None:
                        worker.exit_code = code
            # Workers running for the first supervisor this one knows show the host's health
            # (a supervisor restart); a reconnect keeps the verdict; the agent probes any other.
            if previous is None and running:
                record.probe_ok = True
            elif previous is not None and not previous.lost:
                record.probe_ok = previous.probe_ok
            self._hosts[name] = record
            stale = self.generation is not None and any(g < self.generation for g, _ in running)
        self._events.emit(
            EventType.SUPERVISOR_ATTACH,
            host=name,
            slice=record.slice,
            agent_pid=record.pid,
            address=record.address,
            workers=[[g, p] for g, p in sorted(running)],
            rejoined=previous is not None,
        )
        self.send(name, dataclasses.replace(self._welcome, probe_now=record.probe_ok is None))
        if stale and self.generation is not None:
            self.send(name, ap.Fence(self.generation))
        if self._standbys is not None:
            self.send(name, self._standbys)
        if record.probe_ok:
            self._events.emit(
                EventType.HOST_JOINED, host=name, slice=record.slice, probe="training"
            )

    def _probed(self, record: HostRecord | None, ok: bool, detail: str) -> None:
        if record is None:
            return
        with self._lock:
            record.probe_ok = ok
        kind = EventType.HOST_JOINED if ok else EventType.HOST_PROBE_FAILED
        self._events.emit(kind, host=record.name, slice=record.slice, probe=detail)
        verdict = "joined" if ok else "failed its probe"
        self._say(f"host {record.name} (slice {record.slice}) {verdict}: {detail}")

    # From the supervisor's loop.

    def send(self, host: str, command: wire.Message) -> bool:
        with self._lock:
            record = self._hosts.get(host)
            conn = record.conn if record is not None and not record.lost else None
        if conn is None or self._send is None:
            return False
        return self._send(conn, command)

    def is_lost(self, host: str) -> bool:
        with self._lock:
            record = self._hosts.get(host)
            return record is None or record.lost

    def newly_lost(self) -> list[tuple[HostRecord, str, float]]:
        """Hosts found lost since the last call: (record, cause, seconds since last heard)."""
        with self._lock:
            lost, self._lost_queue = self._lost_queue, []
        return lost

    def _watch_liveness(self) -> None:
        """Declares hosts lost as soon as they are (a thread): detection must not wait for the
        supervisor's loop, which may be busy stopping a generation."""
        while not self._closed.wait(_LIVENESS_POLL_S):
            now = self._heard_until(self._clock())
            lost = []
            with self._lock:
                for record in self._hosts.values():
                    if record.lost:
                        continue
                    if record.conn is None:
                        assert record.disconnected_at is not None
                        if now - record.disconnected_at > _RECONNECT_GRACE_S:
                            lost.append((record, "disconnected", now - record.last_seen))
                    elif now - record.last_seen > self._agent_timeout_s:
                        lost.append((record, "silent", now - record.last_seen))
                for record, _, _ in lost:
                    record.lost = True
                    # Its workers count as gone from now on, even once the host is back.
                    for worker in self._workers.values():
                        if worker.host == record.name and worker.exit_code is None:
                            worker.exit_code, worker.presumed_dead = -signal.SIGKILL, True
                self._lost_queue.extend(lost)
            for record, cause, silent_s in lost:
                self._events.emit(
                    EventType.HOST_LOST,
                    host=record.name,
                    slice=record.slice,
                    cause=cause,
                    silent_s=round(silent_s, 4),
                )

    def close(self) -> None:
        self._closed.set()
        self._liveness.join(timeout=1.0)

    def records(self) -> list[HostRecord]:
        with self._lock:
            return list(self._hosts.values())

    def hosts_for(self, slice_id: int) -> list[HostRecord]:
        with self._lock:
            return sorted(
                (r for r in self._hosts.values() if r.slice == slice_id and r.admitted),
                key=lambda r: r.name,
            )

    def ready_slices(self, processes_per_slice: int) -> set[int]:
        """Slices whose admitted hosts have enough worker slots between them."""
        slots: dict[int, int] = {}
        with self._lock:
            for record in self._hosts.values():
                if record.admitted:
                    slots[record.slice] = slots.get(record.slice, 0) + record.slots
        return {s for s, n in slots.items() if n >= processes_per_slice}

    def tier_peers(self, exclude: str) -> list[str]:
        """The local-tier servers (host:port) of every admitted host but `exclude`, by name."""
        with self._lock:
            return [
                f"{r.address}:{r.tier_port}"
                for r in sorted(self._hosts.values(), key=lambda r: r.name)
                if r.admitted and r.tier_port is not None and r.name != exclude
            ]

    def host_names(self, slice_id: int) -> list[str]:
        with self._lock:
            return sorted(r.name for r in self._hosts.values() if r.slice == slice_id)

    def presumed_dead(self, host: str) -> list[int]:
        """Pids of the workers of `host` taken for gone when it was found lost (no exit heard:
        they may run on, out of any agent's reach)."""
        with self._lock:
            return [
                w.pid
                for w in self._workers.values()
                if w.host == host and w.presumed_dead and w.pid is not None
            ]

    def worker_pids(self) -> list[int]:
        """Pids of every worker started through the registry that no agent saw exit, and of the
        standbys of lost hosts (a frozen agent never ends its own)."""
        with self._lock:
            workers = list(self._workers.values())
            standbys = [pid for r in self._hosts.values() if r.lost for pid in r.standby_pids]
        return standbys + [
            w.pid for w in workers if w.pid is not None and (w.exit_code is None or w.presumed_dead)
        ]

    def start(
        self, host: HostRecord, generation: int, process: int, command: ap.Start
    ) -> RemoteWorker:
        worker = RemoteWorker(process, host.slice, generation, host.name, self._clock(), self)
        with self._lock:
            self._workers[(generation, process)] = worker
        if not self.send(host.name, command):
            worker.start_error = f"host {host.name} is not connected"
        return worker

    def await_started(self, workers: Sequence[RemoteWorker]) -> None:
        """Waits for every start's acknowledgement; raises OSError naming the first that failed."""
        deadline = self._clock() + _START_ACK_TIMEOUT_S
        while any(w.pid is None and w.start_error is None for w in workers):
            if self._clock() > deadline:
                missing = [w.process for w in workers if w.pid is None]
                raise OSError(f"no agent confirmed the start of processes {missing}")
            time.sleep(0.005)
        for worker in workers:
            if worker.start_error is not None:
                raise OSError(f"host {worker.host}: {worker.start_error}")

    def adopt(
        self, generation: int, processes: Sequence[tuple[str, int, int]]
    ) -> list[RemoteWorker]:
        """RemoteWorkers for workers a previous supervisor started: (host, process, pid); one its
        agent saw exit has the exit code the agent registered."""
        adopted = []
        with self._lock:
            for host, process, pid in processes:
                record = self._hosts[host]
                worker = RemoteWorker(process, record.slice, generation, host, self._clock(), self)
                worker.pid = pid
                worker.exit_code = record.reported.get((generation, process), (pid, None))[1]
                self._workers[(generation, process)] = worker
                adopted.append(worker)
        return adopted

    def _reports(self) -> list[tuple[str, int, int, int | None, int | None]]:
        """Every worker the connected hosts' agents registered or reported since, running or
        exited: (host, generation, process, pid, exit code)."""
        with self._lock:
            return [
                (record.name, g, p, pid, code)
                for record in self._hosts.values()
                if not record.lost and record.conn is not None
                for (g, p), (pid, code) in record.reported.items()
            ]

    def reported(self, generation: int) -> list[tuple[str, int, int]]:
        """The workers of `generation` the connected agents registered, running or exited:
        (host, process, pid), by process."""
        found = [
            (h, p, pid)
            for h, g, p, pid, _ in self._reports()
            if g == generation and pid is not None
        ]
        return sorted(found, key=lambda r: r[1])

    def generations_reported(self) -> set[int]:
        """Every generation of which a connected agent registered a worker."""
        return {g for _, g, _, _, _ in self._reports()}

    def running_reported(self) -> dict[int, list[tuple[str, int, int]]]:
        """Running workers the agents registered, by generation: (host, process, pid)."""
        out: dict[int, list[tuple[str, int, int]]] = {}
        for host, g, p, pid, code in self._reports():
            if code is None:
                out.setdefault(g, []).append((host, p, pid))
        return out

    def set_standbys(self, command: ap.Standbys) -> None:
        """Sends the standby request to every agent now and to each that registers later."""
        self._standbys = command
        self.broadcast(command)

    def broadcast(self, command: wire.Message) -> None:
        with self._lock:
            names = [r.name for r in self._hosts.values() if not r.lost]
        for name in names:
            self.send(name, command)
