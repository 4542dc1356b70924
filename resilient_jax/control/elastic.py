"""The supervisor of elastic mode: each slice its own JAX runtime (one process, or several with a
coordinator of their own: `elastic_slice`), joined by the quorum server; a lost slice is replaced
while the others keep training.

Unlike `supervisor.Supervisor`, which stops every worker at a failure and restarts the job on what
is left, this one never stops a survivor: the survivors re-form their exchange without the lost
slice within a step (the quorum server sees its connection close) and take over its part of the
global batch, and the replacement, started after `restart_delay_s`, heals from a live slice at a
step boundary and takes its part back. Each slice writes into `<workdir>/slices/<id>/` (events,
metrics, its own checkpoints, and its output in `output.log`, `output.p<p>.log` for its process
p > 0: no pipe through this process, so a slice outlives it). A slice is lost when any of its
processes exits non-zero (the others are ended with it), and done when all of them have exited 0.
The job is done when every slice is; it fails after more than `max_restarts` failures in all.
The quorum server lives in this process; the workers keep their last quorum while it is away
(`elastic.trainer`). Started again on the same workdir with the same run token (`RJ_RUN_TOKEN` or
`RJ_RUN_TOKEN_FILE`), it takes over the slices still running (`elastic_state`): same quorum
address, no slice restarted.

With `elastic.standby` (the default) it also keeps one warm standby slice: a slice's processes
started ahead that wait, idle, at the join point (`<workdir>/standby/`: their output and events
until they are given a slice). A lost slice's identity goes to it at once (no restart delay: it
heals and joins within about a second), and a new standby is started; only when none is running
is a replacement started cold. A standby that dies is started again; at the run's end it is
ended by its pids. Until it is given a slice the standby runs under SCHED_IDLE
(`elastic.standby_idle_cpu`, `standby_cpu`): on a host shared with the slices its start-up takes
only the CPU they leave idle.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
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
    elastic_state,
    processes,
    protocol,
    standby_cpu,
)
from resilient_jax.control.elastic_slice import SliceProcesses, output_file, runtime_env
from resilient_jax.control.line_server import ConnectionLimits, PortGuard
from resilient_jax.control.quorum import QuorumServer
from resilient_jax.control.refusals import RefusalReports
from resilient_jax.control.run_result import SupervisorResult
from resilient_jax.control.supervisor_core import Refused, SupervisorCore
from resilient_jax.control.worker_env import shared_env
from resilient_jax.events import EventLog

# argv of slice `slice_id`'s worker, whose workdir is the given one
ArgvFor = Callable[[int, str], Sequence[str]]


def slice_workdir(workdir: str, slice_id: int) -> str:
    return os.path.join(workdir, "slices", str(slice_id))


def standby_workdir(workdir: str) -> str:
    return os.path.join(workdir, "standby")


STANDBY = -1  # the slice id `argv_for` is called with for the standby (it has none yet)
STANDBY_AFTER_S = 30.0  # the next standby starts when the last has joined, or this long after


class TakeoverError(ValueError):
    """The slices still running in the workdir cannot be taken over (another run token)."""


class ElasticSupervisor(SupervisorCore):
    """Runs `elastic.slices` slices on this machine and replaces the ones that fail while the
    others train on (the elastic quorum on `supervisor_core`). Construction keeps its arguments;
    `open` (or `run`) touches the workdir, the token file and the network. A stop request
    (SIGINT or SIGTERM) reaches every slice once as SIGTERM: they save and stop, and nothing
    replaces them."""

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
        self._processes = processes_per_slice
        self._config = config
        self._slices = int(config.elastic.slices)
        self._argv_for = argv_for
        self._workdir = workdir
        self._restart_delay_s = restart_delay_s
        limit = config.coordinator.max_restarts if max_restarts is None else max_restarts
        self._max_restarts = int(limit)
        self._token_given = token
        self._devices_per_process = devices_per_process
        self._opened = False
        self.workers: dict[int, SliceProcesses] = {}
        self.adopted: list[int] = []
        self._standby_enabled = bool(config.elastic.standby)
        self.standby: SliceProcesses | None = None
        self._standby_at: float | None = None  # when to start the next standby
        # the slice given to the last standby, its pid, when
        self._joining: tuple[int, int, float] | None = None
        self._reconnected = False
        self._restart_at: dict[int, float] = {}
        self._done: set[int] = set()
        self._replacements = 0
        self._failures = 0  # slices' and standbys' non-zero exits
        self._stopping = False  # a stop was requested: nothing is replaced any more

    def open(self) -> ElasticSupervisor:
        """Reads what a supervisor before this one left in the workdir and listens for the
        slices (`run` opens it when nobody did). Raises `TakeoverError` for slices running with
        another token and `OSError` when the job's quorum address is taken; nothing stays open."""
        if self._opened:
            return self
        given = self._token_given
        self._token = given or agent_protocol.read_token(os.environ) or secrets.token_hex(16)
        os.makedirs(self._workdir, exist_ok=True)
        self._events = EventLog(self._workdir, process="supervisor", source="supervisor")
        # A job whose supervisor died: its running slices are taken over, on the same address.
        self._previous = elastic_state.read_state(self._workdir)
        self._adoptable = self._previous.running() if self._previous else {}
        self._refuse_foreign_takeover()
        self.quorum = self._quorum_server()
        try:
            self._env = self._slice_env(self._devices_per_process)
            self._standby_idle = self._standby_enabled and _idle_cpu_usable(self._config, self._say)
        except BaseException:
            self.quorum.close()
            raise
        self._listening_since = time.monotonic()
        self._opened = True
        return self

    def _refuse_foreign_takeover(self) -> None:
        """Raises TakeoverError when the slices to take over run with another run token."""
        if not self._adoptable:
            return
        assert self._previous is not None
        if self._previous.token_sha256 != elastic_state.token_digest(self._token):
            raise TakeoverError(
                f"slices {sorted(self._adoptable)} of {self._workdir} run with another run token: "
                "start the supervisor again with the job's RJ_RUN_TOKEN or RJ_RUN_TOKEN_FILE"
            )

    def _quorum_server(self) -> QuorumServer:
        """The slices' quorum server, listening on the address of the slices it takes over (they
        reconnect there), else on a free loopback port."""
        host, port = "127.0.0.1", 0
        if self._adoptable:
            assert self._previous is not None
            host, port = protocol.split_address(self._previous.address)
        refusals = RefusalReports(self._events, self._say)
        config = self._config
        return QuorumServer(
            self._token,
            host,
            port,
            join_timeout_s=float(config.elastic.join_timeout_s),
            expected=self._slices,
            # the first quorum waits for every slice to have started (or this long)
            settle_s=float(config.coordinator.startup_timeout_s),
            guard=PortGuard.reporting_to(
                refusals, ConnectionLimits.from_config(config.coordinator)
            ),
        )

    def _slice_env(self, devices_per_process: int) -> dict[str, str]:
        """The environment every process of every slice (and the standby) starts with."""
        # One executable cache for the job's slices (they compile the same programs for the
        # same local devices): a replacement loads its steps instead of compiling them.
        cache = compile_cache.cache_env(self._config.coordinator, self._workdir)
        env = shared_env(os.environ, "", os.getpid(), self._token, devices_per_process, cache)
        env.pop(env_vars.SUPERVISOR_ADDRESS, None)  # no heartbeats: the quorum server sees them
        env.pop(env_vars.SUPERVISOR_PID, None)  # a slice outlives this process
        env[env_vars.QUORUM_ADDRESS] = self.quorum.address
        return env

    def start_slice(self, slice_id: int) -> None:
        workdir = slice_workdir(self._workdir, slice_id)
        worker = self._spawn(slice_id, workdir, {env_vars.ELASTIC_SLICE: str(slice_id)})
        self.workers[slice_id] = worker
        self._save_state()
        self._events.emit(
            EventType.ELASTIC_SLICE_START, slice=slice_id, pid=worker.pid, **_pids(worker)
        )
        self._say(f"slice {slice_id} started ({_describe(worker)}, output in {workdir}/output.log)")

    def start_standby(self) -> None:
        self._standby_at = None
        workdir = standby_workdir(self._workdir)
        self.standby = self._spawn(STANDBY, workdir, {env_vars.ELASTIC_STANDBY: "1"})
        if self._standby_idle:  # before their first threads: every thread they make inherits it
            for pid in self.standby.pids:
                standby_cpu.lower(pid)
        self._save_state()
        self._events.emit(
            EventType.ELASTIC_STANDBY_START, pid=self.standby.pid, **_pids(self.standby)
        )
        self._say(f"standby started ({_describe(self.standby)}, output in {workdir}/output.log)")

    def _spawn(self, slice_id: int, workdir: str, extra_env: dict[str, str]) -> SliceProcesses:
        """The slice's processes, started together (with their own JAX coordinator if several)."""
        os.makedirs(workdir, exist_ok=True)
        members = []
        for process, place in enumerate(runtime_env(self._processes)):
            with open(os.path.join(workdir, output_file(process)), "ab") as log:
                members.append(
                    subprocess.Popen(
                        list(self._argv_for(slice_id, workdir)),
                        env={**self._env, **extra_env, **place},
                        cwd=self._cwd,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # ended by PID with its children
                    )
                )
        return SliceProcesses(members)

    # The run (`supervisor_core`).

    def _open_for_run(self) -> None:
        try:
            self.open()
        except OSError as e:  # the job's quorum address is taken (its supervisor still runs?)
            reason = f"cannot listen for the slices' quorum clients: {e}"
            raise Refused(ExitCode.FAILED, reason) from e
        except ValueError as e:  # another run token, or a bad one
            raise Refused(ExitCode.BAD_INPUT, str(e)) from e

    def _supervise(self, deadline: float | None) -> SupervisorResult:
        self._take_over()
        for slice_id in range(self._slices):
            if slice_id in self.workers or slice_id in self._done:
                continue
            if self._standby_ready():  # an adopted standby: a slice lost meanwhile
                self._replacements += 1
                self._assign_standby(slice_id)
            else:
                self.start_slice(slice_id)
        if self._standby_enabled and self.standby is None and not self._done:
            self.start_standby()
        return self._watch(deadline)

    def _end(self, reason: str) -> None:
        pass  # its slices are ended by `_close`, which follows every verdict (ended once, by pid)

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
                del self.workers[slice_id]
                ended = self._after_exit(slice_id, code, now)
                if ended is not None:
                    return ended
            for slice_id, when in list(self._restart_at.items()):
                if now >= when:
                    del self._restart_at[slice_id]
                    self._replacements += 1
                    self.start_slice(slice_id)
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
        for member in worker.members:
            if isinstance(member, elastic_state.AdoptedWorker):  # its `stop` event goes there now
                member.workdir = slice_workdir(self._workdir, slice_id)
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
            **_pids(worker),
            threads_raised=raised,
        )
        self._say(f"slice {slice_id} given to the standby ({_describe(worker)})")
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
            self.start_standby()
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
        """Adopts the slices of an earlier supervisor of this job still running; one that
        finished the run (its worker's `stop` event says exit 0) stays done."""
        standby = self._previous.standby_running() if self._previous else None
        ours = self._previous is not None and self._previous.token_sha256 == (
            elastic_state.token_digest(self._token)
        )
        if standby is not None and not self._adoptable and ours:
            # Its slices are gone: the job starts afresh, on another quorum address it cannot
            # reach. Ended (this job's, by its recorded pids and start times).
            for record in standby:
                if elastic_state.start_time(record.pid) == record.started:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(record.pid, signal.SIGKILL)
        if not self._adoptable:
            self._save_state()
            return
        assert self._previous is not None
        self._done.update(self._previous.done)
        if standby is not None:
            self.standby = elastic_state.adopt(standby, standby_workdir(self._workdir))
            self._events.emit(
                EventType.ELASTIC_STANDBY_START,
                pid=self.standby.pid,
                adopted=True,
                **_pids(self.standby),
            )
            self._say(f"standby adopted ({_describe(self.standby)}, still running)")
        for slice_id, records in sorted(self._previous.slices.items()):
            slice_dir = slice_workdir(self._workdir, slice_id)
            if slice_id in self._adoptable:
                worker = elastic_state.adopt(records, slice_dir)
                self.workers[slice_id] = worker
                self.adopted.append(slice_id)
                self._events.emit(
                    EventType.ELASTIC_SLICE_ADOPTED, slice=slice_id, pid=worker.pid, **_pids(worker)
                )
                self._say(f"slice {slice_id} adopted ({_describe(worker)}, still running)")
            elif elastic_state.finished(records, slice_dir):
                self._done.add(slice_id)
        self._save_state()

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
        elastic_state.write_state(
            self._workdir,
            elastic_state.ElasticState(
                address=self.quorum.address,
                supervisor_pid=os.getpid(),
                token_sha256=elastic_state.token_digest(self._token),
                slices=elastic_state.slice_records(self.workers),
                done=sorted(self._done),
                standby=elastic_state.process_records(self.standby),
            ),
        )

    def _stop_all(self) -> None:
        workers = list(self.workers.values()) + ([self.standby] if self.standby else [])
        for worker in workers:
            worker.kill()


def _pids(worker: SliceProcesses) -> dict[str, list[int]]:
    """An event's `pids` field for a slice of several processes (none for one)."""
    return {"pids": worker.pids} if len(worker.members) > 1 else {}


def _describe(worker: SliceProcesses) -> str:
    if len(worker.members) == 1:
        return f"pid {worker.pid}"
    return "pids " + ", ".join(str(pid) for pid in worker.pids)


def _idle_cpu_usable(config: ml_collections.ConfigDict, say: Callable[[str], None]) -> bool:
    """Whether the standby runs under SCHED_IDLE until it is given a slice (`standby_cpu`):
    `elastic.standby_idle_cpu`, where this process may raise its threads back."""
    if not config.elastic.standby_idle_cpu:
        return False
    if standby_cpu.raising_permitted():
        return True
    say(
        "the standby starts at normal CPU priority: this process may not raise a thread out of "
        "SCHED_IDLE (needs CAP_SYS_NICE or RLIMIT_NICE 20, on Linux)"
    )
    return False
