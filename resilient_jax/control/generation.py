"""One generation as the supervisor tracks it: its record, how a watch over it ends, and what its
workers' exits say.

A generation is one start of all workers on a set of physical slices. Its watch ends in an
`Outcome`; the supervisor then stops it and, unless the run is over, starts the next one for a
`RestartReason`.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence

from resilient_jax.contracts import exit_codes
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.contracts.names import Name
from resilient_jax.control import detector
from resilient_jax.control.hosts import RemoteWorker
from resilient_jax.control.processes import describe_exit
from resilient_jax.control.stragglers import Straggler, StragglerWatch

# How long a software error waits for news of a peer's death that caused it (see `blame`).
SETTLE_S = 0.2


class Outcome(enum.Enum):
    """What ends the watch over a generation."""

    COMPLETE = "complete"  # every worker finished training
    FAILURE = "failure"  # a worker failed: restart on what is left
    FATAL = "fatal"  # a worker stopped the run on purpose (exit_codes.FATAL)
    PREEMPTED = "preempted"  # a worker saved and left on a preemption notice
    SCALE_UP = "scale_up"  # a returned slice is worth re-admitting
    STRAGGLER = "straggler"  # a slow slice is worth evicting
    INTERRUPTED = "interrupted"  # the supervisor itself was asked to stop
    TIME_LIMIT = "time_limit"


class RestartReason(Name):
    """Why a generation started (the `reason` of a `restart` event)."""

    FAILURE = "failure"
    PREEMPTION = "preemption"
    SCALE_UP = "scale_up"
    STRAGGLER = "straggler"


@dataclasses.dataclass(frozen=True)
class Watched:
    """How a watch ended, with the failure or straggler that ended it."""

    outcome: Outcome
    failure: detector.Failure | None = None
    straggler: Straggler | None = None


@dataclasses.dataclass
class Generation:
    """One start of all workers, and what the supervisor has seen of it so far."""

    number: int = -1
    slices: list[int] = dataclasses.field(default_factory=list)
    workers: list[RemoteWorker] = dataclasses.field(default_factory=list)
    started: float = 0.0  # when stopping the previous generation began: a restart's cost from it
    stragglers: StragglerWatch | None = None
    fault_times: dict[int, float] = dataclasses.field(default_factory=dict)  # process -> when hit
    max_step: int | None = None  # the highest step any of its workers reported
    first_step: int | None = None
    scale_up_deferred: bool = False  # said so already

    def worker(self, process: int | None) -> RemoteWorker | None:
        return next((w for w in self.workers if w.process == process), None)


def poll_exits(
    workers: Sequence[RemoteWorker], now: float, poll_s: float
) -> tuple[dict[int, float], bool, Watched | None]:
    """The running workers (process -> when started), whether any finished training, and the
    outcome an exit calls for (None: no worker failed or was preempted)."""
    running: dict[int, float] = {}
    finished = False
    # Each worker is polled once, so the verdict comes from one picture of the job: a peer that
    # dies between two looks must not pass for the first to fail.
    codes = [(worker, worker.poll()) for worker in workers]
    # A worker that stops the run on purpose outranks its peers, which may fail a moment later in
    # a collective with it: look at fatal exits first, then deaths by a signal, then preemptions
    # (the peers' errors follow from any of them).
    order = sorted(codes, key=lambda wc: _rank(wc[1]))
    for worker, code in order:
        if code is None:
            running[worker.process] = worker.started_at
        elif code == ExitCode.FINISHED:
            finished = True
        else:  # it exited since the last poll
            return running, finished, _exit_outcome(worker.process, code, now - poll_s)
    return running, finished, None


def _exit_outcome(process: int, code: int, since: float) -> Watched:
    """What the exit of `process` with `code` (not 0) calls for."""
    if code in exit_codes.PREEMPTED_STATUSES:
        return Watched(Outcome.PREEMPTED)
    failure = detector.Failure(
        detector.FailureCause.EXIT,
        process,
        f"process {process} {describe_exit(code)}",
        since=since,
        exit_code=code,
    )
    return Watched(Outcome.FATAL if code in exit_codes.FATAL else Outcome.FAILURE, failure)


def _rank(code: int | None) -> int:
    """Which exit explains the others: a fatal code, a death by a signal, a preemption, then
    the rest (errors, the finished and the running)."""
    if code in exit_codes.FATAL:
        return 0
    if not _alive(code):
        return 1
    return 2 if code in exit_codes.PREEMPTED_STATUSES else 3


def _alive(code: int | None) -> bool:
    """False for a worker killed by a signal (not a preemption's SIGTERM)."""
    return code is None or code >= 0 or code in exit_codes.PREEMPTED_STATUSES


def blame(workers: Sequence[RemoteWorker], watched: Watched, poll_s: float) -> Watched:
    """The failure to act on. A peer's death reaches the supervisor through its host's agent, and
    the survivors' errors in a collective with it (an error report, an exit code) may arrive a
    moment earlier: before blaming such a software error, wait `SETTLE_S` for what caused it: a
    peer that stopped the run on purpose (a fatal exit code), else one killed by a signal, else a
    preempted one (then the generation was preempted, not failed). A fatal exit is never
    replaced."""
    failure = watched.failure
    if (
        failure is None
        or watched.outcome == Outcome.FATAL
        or not (failure.cause == detector.FailureCause.ERROR or (failure.exit_code or 0) > 0)
    ):
        return watched
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        peers = [(w, w.poll()) for w in workers if w.process != failure.process]
        peers = sorted([(w, c) for w, c in peers if c is not None], key=lambda wc: _rank(wc[1]))
        if peers and _rank(peers[0][1]) < 3:
            worker, code = peers[0]
            return _exit_outcome(worker.process, code, failure.since)
    return watched
