"""How a process ends, as its exit code: the one channel a dead process still has.

The supervisor (and a cluster's restart policy) reads these: `FATAL` codes stop the whole job,
because restarting would only repeat them; `PREEMPTED` is a deliberate stop after a save and is
restarted without counting as a failure; every other non-zero code is a failure to recover from.
"""

from __future__ import annotations

import enum
import signal


class ExitCode(enum.IntEnum):
    FINISHED = 0  # training reached total_steps
    FAILED = 1  # anything unexpected (a crash): restartable; the traceback is in the log
    BAD_INPUT = 2  # config, flags, data, workdir or a foreign checkpoint: fatal, fix the input
    HEALTH_GAVE_UP = 3  # anomalies kept coming after the last rollback allowed: fatal
    HUNG = 4  # the watchdog saw no progress for too long: restartable
    CHECKPOINT = 5  # nothing valid to restore, or a save that never committed: restartable
    SUPERVISOR_LOST = 6  # a host agent saw no supervisor for coordinator.orphan_timeout_s
    # The persistent tier was unreachable for longer than checkpoint.persistent_outage_limit_s
    # (after a final local save): restartable; a restart resumes from the local tier.
    STORAGE_UNREACHABLE = 7
    PREEMPTED = 42  # asked to stop (SIGTERM, scale-up): saved and left; restart freely
    TIME_LIMIT = 124  # the supervisor's time limit ran out (as `timeout` reports it)
    INTERRUPTED = 130  # SIGINT/SIGTERM to the supervisor itself (128 + SIGINT)


# Codes that end the job instead of restarting it, with the reason the supervisor prints.
FATAL: dict[int, str] = {
    ExitCode.BAD_INPUT: "bad input (config, flags, data or checkpoint)",
    ExitCode.HEALTH_GAVE_UP: "health checks gave up (anomalies after the last rollback)",
}

# A worker killed by SIGTERM before it could save counts as preempted too (Popen reports a signal
# as its negative number; a shell as 128 + the number).
PREEMPTED_STATUSES = (ExitCode.PREEMPTED, -signal.SIGTERM, 128 + signal.SIGTERM)
