"""A standby: a process started ahead of need that waits, idle, to be given a role, then becomes it.

One concept, used twice:
- **the restart path's standby** (`worker.standby`): a host agent keeps one per worker slot. It has
  imported the trainer; its place in the job (and so `jax.distributed.initialize`) is known only
  when a generation starts. The agent, which started it and outlives supervisors, writes its
  `Role` on the standby's stdin (`wait_on_stdin`): the worker's whole environment.
- **elastic mode's standby slice** (`run._become_slice`): the elastic supervisor keeps one. A slice
  is a JAX job of its own, so the standby warms much further (its runtime, its loaded programs,
  its exchange). Its `Role` (the slice it replaces: its id in the environment, its workdir) comes
  from the quorum server (`wait_on_quorum`), which a restarted supervisor serves again.

Either way the role is one typed message (`Role`), taken with `become`, and the spawner can run
the standby under the idle CPU policy until it gives the role (`standby_cpu`: on by default for
elastic mode's, whose start-up is about 20 s of CPU; off for the restart path's, whose imports
are short, `coordinator.standby_idle_cpu`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import MutableMapping
from typing import IO, ClassVar

from resilient_jax.contracts import env_vars
from resilient_jax.contracts.messages import StandbyMessage
from resilient_jax.contracts.names import Name
from resilient_jax.control import protocol, wire
from resilient_jax.control.elastic_slice import output_file
from resilient_jax.control.line_client import LineConnection
from resilient_jax.control.quorum_protocol import StandbyReady

RETRY_S = 0.5  # how often an absent quorum server is tried again


@dataclasses.dataclass(frozen=True)
class Role(wire.Message):
    """Become this: `env` set in the environment (with `whole_env`, the whole environment: a
    restart-path worker's place in the job); with `workdir`, output appended to the process's
    file there (an elastic slice's)."""

    TYPE: ClassVar[Name] = StandbyMessage.ROLE
    env: dict[str, str]
    whole_env: bool = False
    workdir: str = ""


class NoSupervisor(RuntimeError):
    """No quorum server to wait on for `give_up_s`: the job is over, or its supervisor gone."""


def is_standby_slice(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether this process belongs to elastic mode's standby slice (until it becomes a slice)."""
    return environ.get(env_vars.ELASTIC_STANDBY) == "1"


def wait_on_stdin(stream: IO[str] | None = None) -> Role | None:
    """The role written on stdin by the agent that started this standby, or None at end of input
    (the agent no longer needs it, or died). Blocks in the read: no CPU."""
    line = (sys.stdin if stream is None else stream).readline()
    if not line.strip():
        return None
    return wire.decode(json.loads(line), Role)


def wait_on_quorum(address: str, token: str, give_up_s: float, pid: int | None = None) -> Role:
    """Registers with the quorum server as a ready standby and blocks (no CPU) until it sends a
    role; reconnects while the server is away, and raises NoSupervisor after `give_up_s` without
    one."""
    protocol.split_address(address)  # a malformed address is refused here, not retried
    pid = os.getpid() if pid is None else pid
    away_since = time.monotonic()
    while True:
        message = _register_and_wait(address, token, pid)
        if isinstance(message, Role):
            return message
        if message is not None:
            away_since = time.monotonic()  # a server answered: the wait starts again
        if time.monotonic() - away_since > give_up_s:
            raise NoSupervisor(
                f"standby: no elastic supervisor at {address} for {give_up_s:.0f} s "
                "(elastic.quorum_timeout_s)"
            )
        time.sleep(RETRY_S)


def become(role: Role, process: int = 0, environ: MutableMapping[str, str] | None = None) -> None:
    """Takes `role` in this process (`process`: its index in an elastic slice, which names its
    output file): the environment, then the output. It is a standby no longer."""
    environ = os.environ if environ is None else environ
    if role.whole_env:
        environ.clear()
    environ.update({str(k): str(v) for k, v in role.env.items()})
    environ.pop(env_vars.ELASTIC_STANDBY, None)
    if not role.workdir:
        return
    os.makedirs(role.workdir, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(
        os.path.join(role.workdir, output_file(process)),
        os.O_WRONLY | os.O_APPEND | os.O_CREAT,
        0o644,
    )
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _register_and_wait(address: str, token: str, pid: int) -> Role | bool | None:
    """Registers with the quorum server and blocks (no timeout, no CPU) for its answer: the role,
    False for a server that closed the connection (it went away) or said something else, None
    for none to reach."""
    try:
        conn = LineConnection.open(address, timeout_s=1.0)
    except OSError:
        return None
    with conn:
        try:
            conn.send(StandbyReady(pid), token=token)
            return wire.decode(json.loads(conn.read_line(timeout_s=None)), Role)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
