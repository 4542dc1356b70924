"""A warm standby slice's wait for the identity of the slice it replaces.

In elastic mode the supervisor keeps a spare slice started ahead (`elastic.standby`; each of its
processes waits here alike, and all are given the same identity): it has imported everything,
built its runtime, loaded its steps from the job's executable cache and opened its exchange, and
waits here, on a connection to the quorum server, blocked in a read (no CPU) until the supervisor
gives it a dead slice's identity (`control.QuorumMessage.ASSIGN`). It then becomes that slice (its
workdir, events, output) and joins the next quorum, healing from a live slice. A restarted
supervisor listens on the same address: the standby connects again and registers again; a
supervisor away for longer than `give_up_s` ends it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping

from resilient_jax.contracts import env_vars
from resilient_jax.control import protocol, wire
from resilient_jax.control.elastic_slice import output_file
from resilient_jax.control.line_client import LineConnection
from resilient_jax.control.quorum_protocol import Assign, StandbyReady

RETRY_S = 0.5  # how often an absent quorum server is tried again


class NoSupervisor(RuntimeError):
    """No quorum server to wait on for `give_up_s`: the job is over, or its supervisor gone."""


@dataclasses.dataclass(frozen=True)
class Assignment:
    slice_id: int
    workdir: str


def is_standby(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(env_vars.ELASTIC_STANDBY) == "1"


def wait_for_assignment(
    address: str, token: str, give_up_s: float, pid: int | None = None
) -> Assignment:
    """Registers as a ready standby and blocks until an identity comes; reconnects while the
    server is away, and raises NoSupervisor after `give_up_s` without one."""
    protocol.split_address(address)  # a malformed address is refused here, not retried
    pid = os.getpid() if pid is None else pid
    away_since = time.monotonic()
    while True:
        message = _register_and_wait(address, token, pid)
        if isinstance(message, Assign):
            return Assignment(message.slice, message.workdir)
        if message is not None:
            away_since = time.monotonic()  # a server answered: the wait starts again
        if time.monotonic() - away_since > give_up_s:
            raise NoSupervisor(
                f"standby: no elastic supervisor at {address} for {give_up_s:.0f} s "
                "(elastic.quorum_timeout_s)"
            )
        time.sleep(RETRY_S)


def become(assignment: Assignment, environ: dict[str, str] | None = None, process: int = 0) -> None:
    """Takes the assigned slice's identity in this process (`process` of the slice's): its id in
    the environment (what an elastic slice reads) and its output file as stdout and stderr."""
    environ = os.environ if environ is None else environ
    environ[env_vars.ELASTIC_SLICE] = str(assignment.slice_id)
    environ.pop(env_vars.ELASTIC_STANDBY, None)
    os.makedirs(assignment.workdir, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(
        os.path.join(assignment.workdir, output_file(process)),
        os.O_WRONLY | os.O_APPEND | os.O_CREAT,
        0o644,
    )
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _register_and_wait(address: str, token: str, pid: int) -> Assign | bool | None:
    """Registers with the quorum server and blocks (no timeout, no CPU) for its answer: the
    assignment, False for a server that closed the connection (it went away) or said something
    else, None for none to reach."""
    try:
        conn = LineConnection.open(address, timeout_s=1.0)
    except OSError:
        return None
    with conn:
        try:
            conn.send(StandbyReady(pid), token=token)
            return wire.decode(json.loads(conn.read_line(timeout_s=None)), Assign)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
