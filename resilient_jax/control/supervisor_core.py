"""What every supervisor shares, whichever strategy keeps its job training: its lifetime, its stop
requests, its output and its verdict.

Two strategies run on this core:
- the restart policy (`supervisor.Supervisor`): all workers of a generation started through the
  hosts' agents; after a failure every worker stops and a new generation starts on the slices
  left (or on the same ones, or on more);
- the elastic quorum (`elastic.ElasticSupervisor`): each slice a JAX job of its own; a failed
  slice is replaced (from a warm standby where one is ready) while the others train on.

Both start their workers through the hosts' agents (`host_plane`, `hosts`: the same listener,
registry, commands and takeover after a supervisor's restart); the restart policy numbers its
starts by generation, elastic mode each slice's start (a launch) on its own.

Either one, through `run`:
1. is constructed without I/O, then `open`s: reads what an earlier supervisor left in the
   workdir, the run token, and makes its `HostPlane`. A run that cannot start raises `Refused`
   (an exit code, one line): nothing started, nothing to end, and no event log to write to;
2. routes SIGINT and SIGTERM to its `StopRequests` for the run (main thread only): the workers
   save and stop, and nothing replaces them;
3. `_supervise`s until a verdict: first `_open_hosts` (listen, start the local agents, wait for
   the hosts to be admitted), then its own way of keeping the job training. `_finish` gives the
   verdict: the workers stopped (`_end`), the agents told to leave, one `stop` event, one
   `stop (exit N): reason` line, one `SupervisorResult`;
4. `_close`s what `open` opened, the hosts' plane last, however the run ended.
"""

from __future__ import annotations

import abc
import sys
import time
from typing import IO, Any, ClassVar

from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.control import attach
from resilient_jax.control.host_plane import HostPlane
from resilient_jax.control.local_hosts import ForeignAgent
from resilient_jax.control.processes import OutputSink
from resilient_jax.control.run_result import SupervisorResult
from resilient_jax.control.stop_requests import StopRequests
from resilient_jax.events import EventLog


class Refused(Exception):
    """The run cannot start (or go on): `exit_code` and a one-line `reason`."""

    def __init__(self, exit_code: int, reason: str) -> None:
        super().__init__(reason)
        self.exit_code = exit_code
        self.reason = reason


class SupervisorCore(abc.ABC):
    """The lifetime of a supervisor's run; a strategy fills in the abstract steps."""

    NAME: ClassVar[str]  # the prefix of its lines: "[NAME] ..."

    def __init__(self, out: IO[str] | None, poll_s: float) -> None:
        self._sink = OutputSink(out if out is not None else sys.stdout)
        self._stop = StopRequests(poll_s)
        self._events: EventLog | None = None  # set by `open`
        self._plane: HostPlane | None = None  # the hosts' agents, made by `open`
        self._verdict_given = False
        self._start_time = 0.0

    def request_stop(self, signum: int) -> None:
        """Asks the run to have its workers save and stop (safe to call from a signal handler)."""
        self._stop.request(signum)

    def run(self, time_limit_s: float | None = None) -> SupervisorResult:
        """Supervises the job until its verdict, at most `time_limit_s` seconds."""
        self._start_time = time.monotonic()
        deadline = None if time_limit_s is None else self._start_time + time_limit_s
        try:
            self._open_for_run()
        except Refused as e:
            self._say(f"stop (exit {int(e.exit_code)}): {e.reason}")
            return self._result(e.exit_code, e.reason)
        restore_handlers = self._stop.install_handlers()
        try:
            try:
                return self._supervise(deadline)
            except Refused as e:
                return self._finish(e.exit_code, e.reason)
            finally:
                try:
                    self._close()
                finally:
                    if self._plane is not None:  # its agents end what is left of the workers
                        if not self._verdict_given:  # an error in the supervisor itself
                            self._plane.end("the supervisor failed")
                        self._plane.close()
        finally:
            restore_handlers()  # even if closing failed: no signal may reach a run that ended

    def _open_hosts(
        self, slices: list[int], processes_per_slice: int, timeout_s: float, enough: int
    ) -> str | None:
        """Listens for the hosts' agents, starts the local ones, and waits until every slice of
        `slices` has admitted hosts, or `timeout_s` passed with `enough` of them: None when the
        run can start, else why not. Raises `Refused` when it cannot listen, or a surviving agent
        answers to another run token."""
        assert self._plane is not None
        try:
            self._plane.open()
        except ForeignAgent as e:
            raise Refused(ExitCode.BAD_INPUT, str(e)) from e
        except (OSError, ValueError) as e:
            raise Refused(ExitCode.BAD_INPUT, f"cannot listen: {e}") from e
        reason = attach.await_hosts(
            self._plane.hosts,
            slices,
            processes_per_slice,
            timeout_s,
            enough,
            self._stop.sleep,
            self._plane.tick,
        )
        if reason and self._stop.requested:
            raise Refused(ExitCode.INTERRUPTED, reason)
        return reason

    def _finish(self, exit_code: int, reason: str) -> SupervisorResult:
        """The run's verdict: its workers stopped, its `stop` event and line, its result."""
        self._end(reason)
        if self._plane is not None:
            self._plane.end(reason)  # the agents leave
        self._verdict_given = True
        assert self._events is not None
        self._events.emit(EventType.STOP, reason=reason, exit_code=exit_code, **self._stop_fields())
        self._say(f"stop (exit {int(exit_code)}): {reason}")
        return self._result(exit_code, reason)

    def _say(self, message: str) -> None:
        self._sink.write_line(f"[{self.NAME}] {message}")

    # What a strategy provides.

    @abc.abstractmethod
    def _open_for_run(self) -> None:
        """Opens what the run needs (event log, token, listening sockets); raises `Refused`,
        with nothing left open, when it cannot start."""

    @abc.abstractmethod
    def _supervise(self, deadline: float | None) -> SupervisorResult:
        """Starts and watches the workers until the run's verdict (`_finish`'s). May raise
        `Refused`."""

    @abc.abstractmethod
    def _end(self, reason: str) -> None:
        """Stops the workers at the verdict (`reason` goes to anyone who must hear it)."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Closes what `_open_for_run` opened but the hosts' plane, and ends the workers still
        running."""

    @abc.abstractmethod
    def _stop_fields(self) -> dict[str, Any]:
        """The strategy's fields of the `stop` event (its failures, generation, replacements)."""

    @abc.abstractmethod
    def _result(self, exit_code: int, reason: str) -> SupervisorResult:
        """The run's result with the strategy's counts."""
