"""The supervisor's side of its hosts: the control channel's listener, the registry of agents,
the local agents of a one-machine cluster, host faults, lost hosts, and taking over a generation
after a restart.

The listener serves workers' heartbeats and agents' lines on one address, on loopback unless told
otherwise; the address goes to `<workdir>/supervisor.json`, where agents (and a restarted
supervisor, which listens there again so running workers' heartbeats reach it) find it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import signal
import time
from collections.abc import Callable
from typing import Any

import ml_collections

from resilient_jax.contracts import generation_file
from resilient_jax.contracts.faults import FaultKind
from resilient_jax.control import agent_protocol as ap
from resilient_jax.control import attach, compile_cache, detector, processes, protocol
from resilient_jax.control.cluster import ClusterSpec
from resilient_jax.control.generation import Generation, Outcome, Watched
from resilient_jax.control.hosts import HostRegistry
from resilient_jax.control.line_server import ConnectionLimits, PortGuard
from resilient_jax.control.local_hosts import LocalHosts
from resilient_jax.control.refusals import RefusalReports
from resilient_jax.control.server import HeartbeatServer
from resilient_jax.control.stragglers import StragglerWatch
from resilient_jax.events import EventLog

HOST_AGENTS = ("local", "external")


class HostPlane:
    def __init__(
        self,
        config: ml_collections.ConfigDict,
        cluster: ClusterSpec,
        workdir: str,
        all_slices: list[int],
        host_agents: str,
        listen: str | None,
        events: EventLog,
        sink: processes.OutputSink,
        say: Callable[[str], None],
        token: str | None = None,
    ) -> None:
        self._config = config
        self._c = config.coordinator
        self._cluster = cluster
        self._workdir = workdir
        self._listen = listen
        self._events = events
        self._say = say
        self.token = token or ap.read_token(os.environ) or secrets.token_hex(16)
        self.hosts = HostRegistry(events, say, self._welcome(), float(self._c.agent_timeout_s))
        self._local = None
        if host_agents == "local":
            self._local = LocalHosts(
                workdir,
                all_slices,
                cluster.processes_per_slice,
                cluster.devices_per_process,
                self.token,
                sink,
            )
        self.server: HeartbeatServer | None = None

    def survivors(self) -> dict[int, int]:
        """Slice -> pid of each local agent an earlier supervisor left running ({} with external
        agents). Raises `local_hosts.ForeignAgent` when one answers to another run token."""
        return self._local.survivors() if self._local is not None else {}

    def open(self) -> None:
        """Listens, says where in supervisor.json, starts local agents for hosts whose agent is
        gone. Raises OSError or ValueError (an address that is not host:port) when it cannot
        listen, `local_hosts.ForeignAgent` when a surviving agent has another run token."""
        if self._local is not None:
            self._local.survivors()  # before this supervisor listens or says where
        listen = self._listen or ap.read_supervisor_address(self._workdir) or "127.0.0.1:0"
        host, port = protocol.split_address(listen)
        refusals = RefusalReports(self._events, self._say)
        self.server = HeartbeatServer(
            self.token,
            host,
            port,
            on_agent=self.hosts.on_message,
            on_disconnect=self.hosts.on_disconnect,
            guard=PortGuard.reporting_to(refusals, ConnectionLimits.from_config(self._c)),
        )
        self.hosts.bind(self.server.send, self.server.heard_until)
        ap.write_supervisor_file(self._workdir, self.server.address, os.getpid())
        if self._local is not None:
            self._local.start(self.server.address)

    def close(self) -> None:
        if self._local is not None:
            self._local.close(self.hosts.worker_pids())
        if self.server is not None:
            self.server.close()
        self.hosts.close()

    def tick(self) -> None:
        """Starts local agents whose host's reboot is due."""
        if self._local is not None:
            self._local.poll()

    def end_presumed_dead(self, host: str) -> None:
        """On the local cluster, ends (by pid) the workers of `host`, found lost, that were taken
        for gone: they may run on (a frozen agent), and must not beside their replacements."""
        if self._local is None:
            return
        for pid in self.hosts.presumed_dead(host):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def replace_agent(self, slice_id: int) -> None:
        """On the local cluster, ends the agent of `slice_id`'s host (found lost: frozen, or
        gone) and starts a fresh one; with external agents, their launcher's job."""
        if self._local is not None:
            self._local.replace(slice_id)

    def ready_slices(self) -> set[int]:
        self.tick()
        return self.hosts.ready_slices(self._cluster.processes_per_slice)

    def next_generation(self, after: int) -> int:
        """The number of the generation after `after`: never below the generation file's (a
        generation given up by `supersede` is followed by the one the file names)."""
        return max(after + 1, generation_file.current(self._workdir) or 0)

    def supersede(self, generation: int) -> None:
        """Gives `generation` up at once (a failure): its workers may append no event and commit
        no checkpoint from now on, and stop at their next heartbeat, agent or none."""
        generation_file.advance(self._workdir, generation + 1)
        if self.server is not None:
            self.server.fence_below(generation + 1)

    def fence(self, generation: int) -> None:
        """From now on the supervisor runs `generation`: survivors of earlier ones on hosts that
        were cut off end now (by their agents, by the generation file and by the answer to their
        heartbeats), and those that come back later are ended on registration."""
        generation_file.advance(self._workdir, generation)
        if self.server is not None:
            self.server.fence_below(generation)
        self.hosts.generation = generation
        self.hosts.broadcast(ap.Fence(generation))

    def end(self, reason: str) -> None:
        """The run is over: agents stop their workers and leave (and, told to, are no longer
        watched: one that leaves is not a host lost)."""
        self.hosts.broadcast(ap.End(0, reason))
        self.hosts.close()

    def inject_fault(self, slice_id: int, kind: Any, duration_s: float | None) -> None:
        """Has the agents of the slice's hosts act out a host fault; on the local cluster a lost
        host with a duration gets a fresh agent after it (a rebooted machine)."""
        for name in self.hosts.host_names(slice_id):
            self.hosts.send(name, ap.Fault(kind, duration_s))
        lost = kind == FaultKind.LOSE_HOST
        if lost and self._local is not None and duration_s is not None and duration_s >= 0:
            self._local.reboot_after(slice_id, duration_s)

    def lost_outcome(self, gen: Generation, now: float) -> Watched | None:
        """A failure when a host found lost ran workers of `gen`."""
        for record, cause, silent_s in self.hosts.newly_lost():
            self._say(
                f"host {record.name} (slice {record.slice}) lost: {cause} for {silent_s:.2f}s"
            )
            ours = [w for w in gen.workers if w.host == record.name]
            if not ours or record.slice not in gen.slices:
                continue
            since = min(gen.fault_times.get(w.process, now - silent_s) for w in ours)
            return Watched(
                Outcome.FAILURE,
                detector.Failure(
                    detector.FailureCause.HOST_LOST,
                    min(w.process for w in ours),
                    f"host {record.name} of slice {record.slice} lost ({cause})",
                    since=since,
                ),
            )
        return None

    def lost_slices(self, gen: Generation) -> list[int]:
        """Slices of `gen` with a host found lost (however the failure was first seen)."""
        return sorted({w.slice for w in gen.workers if self.hosts.is_lost(w.host)})

    def adopt(self, running: attach.Adoptable) -> Generation:
        """Takes over a generation a previous supervisor started, its workers untouched."""
        pps = self._cluster.processes_per_slice
        gen = Generation(
            number=running.generation,
            slices=running.slices,
            started=time.monotonic(),
            stragglers=StragglerWatch(
                float(self._config.health.straggler_factor),
                int(self._config.health.straggler_window),
                {p: running.slices[p // pps] for p in range(len(running.slices) * pps)},
            ),
        )
        gen.workers = self.hosts.adopt(running.generation, running.processes)
        self.fence(running.generation)
        self._say(
            f"adopted generation {running.generation} on slices {running.slices}: "
            f"{len(running.processes)} workers train on"
        )
        return gen

    def _welcome(self) -> ap.Welcome:
        """What every registering agent is told: its settings and what its probe checks."""
        ckpt = self._config.checkpoint
        return ap.Welcome(
            settings={
                "heartbeat_interval_s": float(self._c.heartbeat_interval_s),
                "orphan_timeout_s": float(self._c.orphan_timeout_s),
                "save_grace_s": float(self._c.save_grace_s),
                # The local tier the agent serves to peers' restores ("": none).
                "serve_local_dir": str(ckpt.local_dir) if ckpt.peer_fetch else "",
                # What the agent's local-tier port allows clients that are not the run's.
                "connection_limits": dataclasses.asdict(ConnectionLimits.from_config(self._c)),
            },
            probe={
                "jax": bool(self._c.probe_jax),
                "devices": self._cluster.devices_per_process,
                "local_dir": str(ckpt.local_dir),
                "min_free_gb": float(self._c.probe_min_free_gb),
                "cache_env": compile_cache.cache_env(self._c, self._workdir),
            },
        )
