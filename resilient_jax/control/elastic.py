"""The supervisor of elastic mode: each slice its own JAX runtime (one process, or several with a
coordinator of their own: `elastic_slice`), joined by the quorum server; a lost slice is replaced
while the others keep training.

Unlike `supervisor.Supervisor`, which stops every worker at a failure and restarts the job on what
is left, this one never stops a survivor: the survivors re-form their exchange without the lost
slice within a step (the quorum server sees its connection close) and take over its part of the
global batch, and the replacement, started after `restart_delay_s`, heals from a live slice at a
step boundary and takes its part back. Its slices run under the hosts' agents (`host_plane`): one
host per slice on this machine, one for the standby, each slice on a free host (`elastic_slice`);
a lost host's processes are ended by pid and it gets a fresh agent. Each slice writes into
`<workdir>/slices/<id>/` (events, metrics, checkpoints, output in `output.log`, `output.p<p>.log`
for process p > 0). A slice is lost when any of its processes exits non-zero (the others are
ended with it), done when all exited 0; the job is done when every slice is, and fails after more
than `max_restarts` failures. The quorum server lives in this process; the workers keep their
last quorum while it is away (`elastic.trainer`), their agents keep them running up to
`coordinator.orphan_timeout_s`, and one started again on the workdir with the run token takes
them over (`elastic_takeover`): same quorum address, no slice restarted.

With `elastic.standby` (the default) it keeps one warm standby slice: processes started ahead
on the spare host, waiting idle at the join point (`<workdir>/standby/` until given a slice). A
lost slice's identity goes to it at once (it heals and joins within about a second), and the next
standby starts on the host the lost slice left; only with none running is a replacement started
cold. Until given a slice it runs under SCHED_IDLE (`elastic.standby_idle_cpu`, `standby_cpu`).
"""

from __future__ import annotations

import collections
import os
import secrets
import signal
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

import ml_collections

from resilient_jax.contracts import env_vars
from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.exit_codes import PREEMPTED_STATUSES, ExitCode
from resilient_jax.control import (
    agent_protocol,
    compile_cache,
    elastic_slice,
    elastic_state,
    elastic_takeover,
    processes,
    standby_cpu,
)
from resilient_jax.control.cluster import ClusterSpec
from resilient_jax.control.elastic_slice import SliceProcesses, pids_field
from resilient_jax.control.host_plane import HostPlane
from resilient_jax.control.quorum import QuorumServer
from resilient_jax.control.refusals import RefusalReports
from resilient_jax.control.run_result import SupervisorResult
from resilient_jax.control.supervisor_core import Refused, SupervisorCore
from resilient_jax.events import EventLog

# argv of slice `slice_id`'s worker, whose workdir is the given one
ArgvFor = Callable[[int, str], Sequence[str]]


def slice_workdir(workdir: str, slice_id: int) -> str:
    return os.path.join(workdir, "slices", str(slice_id))


def standby_workdir(workdir: str) -> str:
    return os.path.join(workdir, "standby")


STANDBY = -1  # the slice id `argv_for` is called with for the standby (it has none yet)
STANDBY_AFTER_S = 30.0  # the next standby starts when the last has joined, or this long after


class ElasticSupervisor(SupervisorCore):
    """Runs `elastic.slices` slices on this machine's hosts and replaces the ones that fail while
    the others train on (the elastic quorum on `supervisor_core`). Construction keeps its
    arguments; `open` (or `run`) touches the workdir, the token file and the network, and `run`
    starts the agents. A stop request (SIGINT or SIGTERM) reaches every slice once as SIGTERM:
    they save and stop, and nothing replaces them."""

    NAME = "elastic"

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        argv_for: ArgvFor,
        workdir: str,
        devices_per_process: int,
        out: IO[str] | None = None,
        restart_delay_s: float = 1.0,
        max_restarts: int | None = None,
        token: str | None = None,
        cwd: str | None = None,
        processes_per_slice: int = 1,
        poll_s: float = 0.05,
    ) -> None:
        super().__init__(out, poll_s)
        self._poll_s = poll_s
        self._cwd = cwd
        self._config = config
        self._slices = int(config.elastic.slices)
        self._standby_enabled = bool(config.elastic.standby)
        # One host per slice, and a spare one for the standby.
        self._cluster = ClusterSpec(
            self._slices,
            processes_per_slice,
            devices_per_process,
            spare_slices=1 if self._standby_enabled else 0,
        )
        self._argv_for = argv_for
        self._workdir = workdir
        self._restart_delay_s = restart_delay_s
        limit = config.coordinator.max_restarts if max_restarts is None else max_restarts
        self._max_restarts = int(limit)
        self._token_given = token
        self._opened = False
        self.workers: dict[int, SliceProcesses] = {}
        self.adopted: list[int] = []
        self.standby: SliceProcesses | None = None
        self._standby_at: float | None = None  # when to start the next standby
        # the slice given to the last standby, its pid, when
        self._joining: tuple[int, int, float] | None = None
        self._reconnected = False
        self._restart_at: dict[int, float] = {}
        self._no_host_since: dict[int, float] = {}  # replacements waiting for a free host
        self._agents_replaced: collections.Counter[int] = collections.Counter()  # by host
        self._done: set[int] = set()
        self._next_launch = 0
        self._replacements = 0
        self._failures = 0  # slices' and standbys' non-zero exits
        self._stopping = False  # a stop was requested: nothing is replaced any more

    def open(self) -> ElasticSupervisor:
        """Reads what a supervisor before this one left in the workdir and listens for the
        slices' quorum clients (`run` opens it when nobody did; `run` starts the agents). Raises
        `local_hosts.ForeignAgent` (a ValueError) for an agent left running with another run
        token and `OSError` when the job's quorum address is taken; nothing stays open."""
        if self._opened:
            return self
        given = self._token_given
        self._token = given or agent_protocol.read_token(os.environ) or secrets.token_hex(16)
        os.makedirs(self._workdir, exist_ok=True)
        self._events = EventLog(self._workdir, process="supervisor", source="supervisor")
        self._previous = elastic_state.read_state(self._workdir)
        if self._previous and self._previous.token_sha256 != elastic_state.token_digest(
            self._token
        ):
            self._previous = None  # another job's: its agents, if alive, are refused below
        self._plane = HostPlane(
            self._config,
            self._cluster,
            self._workdir,
            list(range(self._cluster.num_slices + self._cluster.spare_slices)),
            "local",
            None,
            self._events,
            self._sink,
            self._say,
            token=self._token,
        )
        try:
            # A job whose supervisor died: its agents' slices reconnect to the same address.
            survivors = self._plane.survivors()  # raises ForeignAgent: another token's
            takeover = self._previous is not None and bool(survivors)
            # Where the slices it takes over reconnect, else a free loopback port.
            address = self._previous.address if takeover and self._previous else "127.0.0.1:0"
            self.quorum = QuorumServer.for_job(
                self._config, self._token, address, RefusalReports(self._events, self._say)
            )
            self._standby_idle = self._standby_enabled and standby_cpu.idle_usable(
                bool(self._config.elastic.standby_idle_cpu), "the standby", self._say
            )
        except BaseException:
            self._plane.hosts.close()  # its registry's thread runs from its construction
            raise
        self._listening_since = time.monotonic()
        self._opened = True
        return self

    def _free_host(self, preferred: int | None = None) -> int | None:
        """A ready host running no slice and no standby (`preferred` if it is one)."""
        busy = {w.host_slice for w in [*self.workers.values(), self.standby] if w is not None}
        free = sorted(self._plane.ready_slices() - busy)
        if preferred in free:
            return preferred
        return free[0] if free else None

    def _launch(self, slice_id: int, workdir: str, role: dict[str, str]) -> SliceProcesses | None:
        """The slice's (or standby's) processes started on a free host, None when there is none.
        Raises OSError when the agent cannot start them."""
        host_slice = self._free_host(preferred=slice_id if slice_id >= 0 else None)
        if host_slice is None:
            return None
        os.makedirs(workdir, exist_ok=True)
        launch, self._next_launch = self._next_launch, self._next_launch + 1
        self._save_state()  # first: a supervisor restarted from here on knows the number taken
        return elastic_slice.start_slice(
            self._plane.hosts,
            host_slice,
            launch,
            self._argv_for(slice_id, workdir),
            workdir,
            {env_vars.QUORUM_ADDRESS: self.quorum.address, **role},
            self._cluster.processes_per_slice,
            self._cluster.devices_per_process,
            self._cwd,
            # One executable cache for the job's slices (they compile the same programs for the
            # same local devices): a replacement loads its steps instead of compiling them.
            compile_cache.cache_env(self._config.coordinator, self._workdir),
        )

    def start_slice(self, slice_id: int) -> bool:
        """Starts slice `slice_id` on a free host; False when no host is free."""
        workdir = slice_workdir(self._workdir, slice_id)
        worker = self._launch(slice_id, workdir, {env_vars.ELASTIC_SLICE: str(slice_id)})
        if worker is None:
            return False
        self.workers[slice_id] = worker
        self._save_state()
        self._events.emit(
            EventType.ELASTIC_SLICE_START,
            slice=slice_id,
            pid=worker.pid,
            host=worker.host,
            **pids_field(worker),
        )
        self._say(
            f"slice {slice_id} started on {worker.host} ({worker.describe()}, "
            f"output in {workdir}/output.log)"
        )
        return True

    def start_standby(self) -> None:
        """Starts the standby on a free host (or tries again after the restart delay)."""
        self._standby_at = None
        workdir = standby_workdir(self._workdir)
        self.standby = self._launch(STANDBY, workdir, {env_vars.ELASTIC_STANDBY: "1"})
        if self.standby is None:
            self._standby_at = time.monotonic() + self._restart_delay_s
            return
        if self._standby_idle:  # its agent is on this machine
            for pid in self.standby.pids:
                standby_cpu.lower(pid)
        self._save_state()
        self._events.emit(
            EventType.ELASTIC_STANDBY_START,
            pid=self.standby.pid,
            host=self.standby.host,
            **pids_field(self.standby),
        )
        self._say(
            f"standby started on {self.standby.host} ({self.standby.describe()}, "
            f"output in {workdir}/output.log)"
        )

    # The run (`supervisor_core`).

    def _open_for_run(self) -> None:
        try:
            self.open()
        except OSError as e:  # the job's quorum address is taken (its supervisor still runs?)
            reason = f"cannot listen for the slices' quorum clients: {e}"
            raise Refused(ExitCode.FAILED, reason) from e
        except ValueError as e:  # another run token's agent, or a bad token
            raise Refused(ExitCode.BAD_INPUT, str(e)) from e

    def _supervise(self, deadline: float | None) -> SupervisorResult:
        reason = self._open_hosts(
            list(range(self._cluster.num_slices + self._cluster.spare_slices)),
            self._cluster.processes_per_slice,
            float(self._config.coordinator.startup_timeout_s),
            self._slices,  # the standby's host may come later
        )
        if reason:
            return self._finish(ExitCode.FAILED, reason)
        try:
            self._take_over()
            for slice_id in range(self._slices):
                if slice_id in self.workers or slice_id in self._done:
                    continue
                if self._standby_ready():  # an adopted standby: a slice lost meanwhile
                    self._replacements += 1
                    self._assign_standby(slice_id)
                elif not self.start_slice(slice_id):
                    self._restart_at[slice_id] = time.monotonic() + self._restart_delay_s
            if self._standby_enabled and self.standby is None and not self._done:
                self.start_standby()
        except OSError as e:  # the worker command cannot start (missing file, permissions)
            raise Refused(ExitCode.BAD_INPUT, f"cannot start slices: {e}") from e
        return self._watch(deadline)

    def _end(self, reason: str) -> None:
        self._stop_all()

    def _close(self) -> None:
        self._stop_all()
        self.quorum.close()

    def _stop_fields(self) -> dict[str, Any]:
        return {"failures": self._failures, "replacements": self._replacements}

    def _watch(self, deadline: float | None) -> SupervisorResult:
        while True:
            now = time.monotonic()
            for slice_id, worker in list(self.workers.items()):
                if slice_id not in self.workers:
                    continue  # ended by `_stop_unjoined` in this round
                code = worker.poll()
                if code is None:
                    continue
                self._plane.end_presumed_dead(worker.host)
                del self.workers[slice_id]
                ended = self._after_exit(slice_id, code, now)
                if ended is not None:
                    return ended
            for slice_id, when in list(self._restart_at.items()):
                if now >= when:
                    del self._restart_at[slice_id]
                    ended = self._replace(slice_id, now)
                    if ended is not None:
                        return ended
            self._after_lost_hosts()
            stopped = self._watch_standby(now)
            if stopped is not None:
                return stopped
            if self.adopted and not self._reconnected and self.quorum.decided:
                self._report_reconnected()
            if not self.workers and not self._restart_at:
                if self._done:
                    return self._finish(0, "finished")
                if self._stopping:
                    name = self._stop.first_name()
                    reason = f"interrupted by {name}; slices asked to save and stop"
                    return self._finish(ExitCode.INTERRUPTED, reason)
                return self._finish(1, "every slice failed")
            for _ in self._stop.unseen():  # SIGTERM: the trainer's notice to save and stop
                self._stopping = True
                self._restart_at.clear()  # a replacement due now would never hear the stop
                for worker in self.workers.values():
                    worker.signal(signal.SIGTERM)
            if deadline is not None and now > deadline:
                return self._finish(1, "time limit")
            time.sleep(self._poll_s)

    def _after_exit(self, slice_id: int, code: int, now: float) -> SupervisorResult | None:
        """Acts on slice `slice_id`'s exit with `code` (the state file first says what ran and
        what is done); the job's result when it must end."""
        if code == 0:
            self._done.add(slice_id)
        self._save_state()
        if code == 0:
            # The run's last step is trained: a replacement still waiting to start, or started
            # but not yet joined, would find no live slice to heal from and train the whole run
            # again alone.
            self._restart_at.clear()
            self._stop_unjoined()
            self._stop_standby()
            return None
        if self._stopping and code in PREEMPTED_STATUSES:  # saved and stopped, as asked
            self._events.emit(EventType.ELASTIC_SLICE_EXIT, slice=slice_id, exit_code=code)
            return None
        self._failures += 1
        self._events.emit(
            EventType.ELASTIC_SLICE_EXIT, slice=slice_id, exit_code=code, failures=self._failures
        )
        ended = self._after_failed_exit(f"slice {slice_id}", code)
        if ended is not None or self._done or self._stopping:
            return ended  # the job ends, is finished or is being stopped: nothing replaces it
        if self._standby_ready():  # warm: it heals and joins at once
            self._replacements += 1
            self._assign_standby(slice_id)
        else:  # started cold, after the restart delay
            self._restart_at[slice_id] = now + self._restart_delay_s
        return None

    def _after_failed_exit(self, who: str, code: int) -> SupervisorResult | None:
        """Reports a failed exit of a slice or the standby (already counted in `_failures`);
        the job's result when it must end: bad input, which any replacement would meet alike,
        or more failures than `coordinator.max_restarts`."""
        self._say(f"{who} exited: {processes.describe_exit(code)}")
        if code == ExitCode.BAD_INPUT:
            reason = f"{who}: {processes.describe_exit(code)}"
            return self._finish(ExitCode.BAD_INPUT, reason)
        if self._failures > self._max_restarts:
            return self._finish(1, f"{self._failures} slice failures")
        return None

    def _result(self, exit_code: int, reason: str) -> SupervisorResult:
        return SupervisorResult(exit_code, reason, self._failures, replacements=self._replacements)

    def _standby_ready(self) -> bool:
        """A standby is running (ready or still starting: either way it joins sooner than a
        replacement started now)."""
        return self.standby is not None and self.standby.poll() is None

    def _assign_standby(self, slice_id: int) -> None:
        """Gives the standby the identity of lost slice `slice_id`: it becomes that slice's
        worker, and a new standby is started."""
        worker, self.standby = self.standby, None
        assert worker is not None
        self.workers[slice_id] = worker
        self._save_state()  # first: a supervisor restarted from here on knows it as the slice
        raised = 0
        for pid in worker.pids:  # every process of the standby becomes this slice's
            raised += standby_cpu.restore(pid) if self._standby_idle else 0
            self.quorum.assign(pid, slice_id, slice_workdir(self._workdir, slice_id))
        self._events.emit(
            EventType.ELASTIC_SLICE_START,
            slice=slice_id,
            pid=worker.pid,
            standby=True,
            **pids_field(worker),
            threads_raised=raised,
        )
        self._say(f"slice {slice_id} given to the standby ({worker.describe()})")
        # The next standby starts once this one has joined (its start-up would take CPU from the
        # join on a shared host), or at the latest after STANDBY_AFTER_S.
        self._joining = (slice_id, worker.pid, time.monotonic())
        self._standby_at = time.monotonic() + STANDBY_AFTER_S

    def _watch_standby(self, now: float) -> SupervisorResult | None:
        """Keeps one standby running while the job trains; the result when a standby's exit
        ends the job (bad input, or too many failures)."""
        if not self._standby_enabled or self._done or self._stopping:
            return None
        # A worker of a slice that still waits as a standby: its assignment was not sent before
        # the supervisor was restarted. Sent again.
        standby_pids = set(self.quorum.ready_standbys())
        for slice_id, worker in self.workers.items():
            for pid in standby_pids.intersection(worker.pids):
                self.quorum.assign(pid, slice_id, slice_workdir(self._workdir, slice_id))
        if self.standby is not None:
            code = self.standby.poll()
            if code is None:
                return None
            self._plane.end_presumed_dead(self.standby.host)
            pid, self.standby = self.standby.pid, None
            self._save_state()
            self._failures += 1
            self._events.emit(
                EventType.ELASTIC_STANDBY_EXIT, pid=pid, exit_code=code, failures=self._failures
            )
            ended = self._after_failed_exit("standby", code)
            if ended is not None:
                return ended
            self._standby_at = now + self._restart_delay_s
        if self._joining is not None:
            slice_id, pid, since = self._joining
            gone = slice_id not in self.workers or self.workers[slice_id].pid != pid
            joined = any(
                q["monotonic"] > since and slice_id in q["slices"] for q in self.quorum.decided
            )
            if gone or joined:
                self._joining = None
                self._standby_at = now
        if self._standby_at is not None and now >= self._standby_at:
            try:
                self.start_standby()
            except OSError as e:
                self._standby_at = now + self._restart_delay_s
                return self._start_failed("the standby", e)
        return None

    def _stop_standby(self) -> None:
        worker, self.standby = self.standby, None
        self._standby_at = None
        if worker is None:
            return
        self._save_state()
        worker.kill()
        self._events.emit(
            EventType.ELASTIC_STANDBY_EXIT, pid=worker.pid, exit_code=worker.returncode
        )
        self._say("standby stopped: the run finished")

    def _stop_unjoined(self) -> None:
        """Ends the slices that are not in the last quorum (replacements still starting)."""
        last = self.quorum.last_slices() or self.adopted
        for slice_id, worker in list(self.workers.items()):
            if slice_id in last:
                continue
            del self.workers[slice_id]
            self._save_state()
            worker.kill()
            self._events.emit(
                EventType.ELASTIC_SLICE_EXIT,
                slice=slice_id,
                exit_code=worker.returncode,
                reason="the run finished before it joined",
            )
            self._say(f"slice {slice_id} stopped: the run finished before it joined")

    def _take_over(self) -> None:
        """Adopts what an earlier supervisor of this job left running (`elastic_takeover`)."""
        found = elastic_takeover.take_over(self._previous, self._plane.hosts)
        self._next_launch = found.next_launch
        self._done.update(found.done)
        if found.ended:
            self._say(f"ended processes of this job it does not take over: pids {found.ended}")
        self.standby = found.standby
        if self.standby is not None:
            self._events.emit(
                EventType.ELASTIC_STANDBY_START,
                pid=self.standby.pid,
                host=self.standby.host,
                adopted=True,
                **pids_field(self.standby),
            )
            self._say(f"standby adopted ({self.standby.describe()}, still running)")
        for slice_id, worker in found.slices.items():
            self.workers[slice_id] = worker
            self.adopted.append(slice_id)
            self._events.emit(
                EventType.ELASTIC_SLICE_ADOPTED,
                slice=slice_id,
                pid=worker.pid,
                host=worker.host,
                **pids_field(worker),
            )
            self._say(f"slice {slice_id} adopted ({worker.describe()}, still running)")
        self._save_state()

    def _replace(self, slice_id: int, now: float) -> SupervisorResult | None:
        """Replaces lost slice `slice_id` by the standby when one runs, else cold on a free host;
        tries again after the restart delay when no host is free or the start fails (a failure).
        The job's result when it must end: too many failures, or no host for too long."""
        if self._standby_ready():
            self._no_host_since.pop(slice_id, None)
            self._replacements += 1
            self._assign_standby(slice_id)
            return None
        try:
            if self.start_slice(slice_id):
                self._no_host_since.pop(slice_id, None)
                self._replacements += 1
                return None
            self._no_host_since.setdefault(slice_id, now)
        except OSError as e:
            if slice_id in self.workers:
                raise  # started, and only its bookkeeping failed (a full disk): not a start
            ended = self._start_failed(f"slice {slice_id}", e)
            if ended is not None:
                return ended
        timeout_s = float(self._config.coordinator.startup_timeout_s)
        if now - self._no_host_since.get(slice_id, now) > timeout_s:
            reason = f"no free host for slice {slice_id} within {timeout_s:g} s"
            return self._finish(ExitCode.FAILED, f"{reason} (coordinator.startup_timeout_s)")
        self._restart_at[slice_id] = now + self._restart_delay_s
        return None

    def _start_failed(self, who: str, error: OSError) -> SupervisorResult | None:
        """Counts a start its agent could not make (its host just lost, say) as a failure; the
        job's result when there are too many."""
        self._failures += 1
        self._say(f"{who} could not start: {error}")
        if self._failures > self._max_restarts:
            return self._finish(ExitCode.FAILED, f"{self._failures} slice failures")
        return None

    def _after_lost_hosts(self) -> None:
        """Each host found lost gets a fresh agent (its workers and the lost agent ended first,
        by pid), up to `max_restarts` times."""
        for record, cause, silent_s in self._plane.hosts.newly_lost():
            self._plane.end_presumed_dead(record.name)
            replaced = self._agents_replaced[record.slice] = self._agents_replaced[record.slice] + 1
            if replaced > self._max_restarts:
                self._say(f"host {record.name} lost ({cause}) {replaced} times: left out")
                continue
            self._say(f"host {record.name} lost: {cause} for {silent_s:.2f}s; a new agent starts")
            self._plane.replace_agent(record.slice)

    def _report_reconnected(self) -> None:
        self._reconnected = True
        first = self.quorum.decided[0]
        after_s = first["monotonic"] - self._listening_since
        self._events.emit(
            EventType.ELASTIC_RECONNECTED,
            slices=first["slices"],
            quorum_id=first["quorum_id"],
            carried_over=first["carried_over"],
            after_s=after_s,
        )
        self._say(f"slices {first['slices']} back in a quorum {after_s:.2f} s after the takeover")

    def _save_state(self) -> None:
        running = {s: w for s, w in self.workers.items() if w.returncode is None}
        state = elastic_state.snapshot(
            self.quorum.address, self._token, running, self.standby, self._done, self._next_launch
        )
        elastic_state.write_state(self._workdir, state)

    def _stop_all(self) -> None:
        """Ends every slice and the standby still running (through their agents)."""
        workers = list(self.workers.values()) + ([self.standby] if self.standby else [])
        for worker in workers:
            if worker.returncode is None:
                worker.kill()
