"""What a host agent and the supervisor say to each other, and the run's token.

Both directions carry JSON lines (`protocol.encode`) over the one TCP connection the agent opens to
the supervisor's address; every line the agent sends carries the run's token, like a worker's
heartbeat, so the supervisor's one listener serves both.

Agent -> supervisor: `register` (who it is, the port of its local-tier server, and every worker
it runs or saw exit: a restarted supervisor rebuilds its view from these), `agent_heartbeat`,
`started` (a worker's pid, or why it could not start), `worker_exit` (code, the moment the agent's
waiter thread sees it), `probe` (the health probe's verdict).

Supervisor -> agent: `welcome` (settings the agent applies, among them the local tier it serves),
`start` (one worker: argv, env, cwd, its place), `signal` (to one worker or its process group),
`standbys` (keep this many warm), `fence` (end every worker of a generation before this one),
`fault` (a host fault to act out) and `end` (the run is over: exit with this code).

Each is a typed message (`wire`), below in that order; an agent's lines carry its host name
beside the token (`host`: what tells the supervisor's listener an agent's line from a worker's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections.abc import Mapping
from typing import Any, ClassVar

from resilient_jax.config import BadInput
from resilient_jax.contracts import env_vars
from resilient_jax.contracts.messages import AgentCommand, AgentMessage
from resilient_jax.contracts.names import Name
from resilient_jax.control import protocol, wire

# The supervisor's address, written where agents on a shared filesystem find it.
SUPERVISOR_FILE = "supervisor.json"
# Lines a supervisor sends may carry a worker's whole environment.
MAX_COMMAND_BYTES = 1 << 20


class TokenError(BadInput, ValueError):
    """No usable run token: the control channel refuses to run without one."""


def read_token(
    environ: Mapping[str, str] = os.environ, token_file: str | None = None
) -> str | None:
    """The run's token from `token_file`, else `RJ_RUN_TOKEN_FILE`, else `RJ_RUN_TOKEN`; None when
    none is set. A token file readable by others is refused: the token is the channel's password."""
    path = token_file or environ.get(env_vars.RUN_TOKEN_FILE)
    if path:
        try:
            mode = os.stat(path).st_mode
            with open(path) as f:
                token = f.read().strip()
        except OSError as e:
            raise TokenError(f"{env_vars.RUN_TOKEN_FILE}={path!r}: cannot read it ({e})") from e
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise TokenError(
                f"{env_vars.RUN_TOKEN_FILE}={path!r}: mode {stat.S_IMODE(mode):o}; allowed: 600"
            )
        if not token:
            raise TokenError(f"{env_vars.RUN_TOKEN_FILE}={path!r}: the file is empty")
        return token
    return environ.get(env_vars.RUN_TOKEN) or None


def write_supervisor_file(workdir: str, address: str, pid: int) -> None:
    path = os.path.join(workdir, SUPERVISOR_FILE)
    os.makedirs(workdir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"address": address, "pid": pid}, f)
    os.replace(path + ".tmp", path)


def read_supervisor_address(workdir: str) -> str | None:
    """The address in `<workdir>/supervisor.json`, None when there is none (yet)."""
    try:
        with open(os.path.join(workdir, SUPERVISOR_FILE)) as f:
            address = json.load(f).get("address")
    except (OSError, ValueError, AttributeError):
        return None
    return address if isinstance(address, str) else None


# Agent -> supervisor.


@dataclasses.dataclass(frozen=True)
class Register(wire.Message):
    """An agent's first line on a connection: the host it serves and every worker it runs or
    saw exit ([{"generation", "process", "pid", "exit_code"}]: a restarted supervisor rebuilds
    its view from these)."""

    TYPE: ClassVar[Name] = AgentMessage.REGISTER
    slice: int
    devices: int = 1
    slots: int = 1
    pid: int = 0
    address: str | None = None  # how other hosts reach it; None: the connection's peer address
    tier_port: int | None = None  # its local-tier server (`tier_service`)
    workers: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class AgentHeartbeat(wire.Message):
    TYPE: ClassVar[Name] = AgentMessage.AGENT_HEARTBEAT
    standbys: list[int] = dataclasses.field(default_factory=list)  # pids of its warm standbys


@dataclasses.dataclass(frozen=True)
class Started(wire.Message):
    """A worker's start: its pid (`standby`: a warm standby became it), or why it did not."""

    TYPE: ClassVar[Name] = AgentMessage.STARTED
    generation: int
    process: int
    pid: int | None = None
    standby: bool = False
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class WorkerExit(wire.Message):
    TYPE: ClassVar[Name] = AgentMessage.WORKER_EXIT
    generation: int
    process: int
    exit_code: int  # Popen's: -N for a signal
    pid: int | None = None


@dataclasses.dataclass(frozen=True)
class ProbeResult(wire.Message):
    """The host health probe's verdict (`probe`)."""

    TYPE: ClassVar[Name] = AgentMessage.PROBE
    ok: bool
    detail: str = ""


AGENT_MESSAGES = (Register, AgentHeartbeat, Started, WorkerExit, ProbeResult)


# Supervisor -> agent.


@dataclasses.dataclass(frozen=True)
class Welcome(wire.Message):
    """The run's settings for the agent (heartbeat, orphan and save-grace times, the local tier
    it serves and that port's limits) and what its health probe checks, `probe_now` or not."""

    TYPE: ClassVar[Name] = AgentCommand.WELCOME
    settings: dict[str, Any]
    probe: dict[str, Any]
    probe_now: bool = False


@dataclasses.dataclass(frozen=True)
class Start(wire.Message):
    """Start one worker: its command line, working directory, place in the job (`placement`: its
    environment) and the devices it sees; the agent adds the run's shared environment. `output`:
    a file its output is appended to instead of the host's log; without `heartbeats` it is not
    told the supervisor's address (an elastic slice: the quorum server hears from it)."""

    TYPE: ClassVar[Name] = AgentCommand.START
    generation: int
    process: int
    slice: int
    argv: list[str]
    placement: dict[str, str]
    devices: int
    cwd: str | None = None
    cache_env: dict[str, str] = dataclasses.field(default_factory=dict)
    output: str | None = None
    heartbeats: bool = True


@dataclasses.dataclass(frozen=True)
class SignalWorkers(wire.Message):
    """A signal (its name) to the workers of `generation` (None: all), `process` (None: all),
    to each one's process group if `group`."""

    TYPE: ClassVar[Name] = AgentCommand.SIGNAL
    signal: str
    generation: int | None = None
    process: int | None = None
    group: bool = False


@dataclasses.dataclass(frozen=True)
class Standbys(wire.Message):
    """Keep `count` warm standbys started with `argv` (-1: one per worker slot; 0: none); with
    `idle_cpu`, under SCHED_IDLE until each is given a place (`processes.spawn_standby`)."""

    TYPE: ClassVar[Name] = AgentCommand.STANDBYS
    count: int
    argv: list[str] = dataclasses.field(default_factory=list)
    devices: int = 1
    cwd: str | None = None
    cache_env: dict[str, str] = dataclasses.field(default_factory=dict)
    idle_cpu: bool = False


@dataclasses.dataclass(frozen=True)
class Fence(wire.Message):
    """End every worker of a generation before `below`."""

    TYPE: ClassVar[Name] = AgentCommand.FENCE
    below: int


@dataclasses.dataclass(frozen=True)
class Fault(wire.Message):
    """A host fault to act out (`contracts.faults.FaultKind`), for `duration_s` if it ends."""

    TYPE: ClassVar[Name] = AgentCommand.FAULT
    kind: str
    duration_s: float | None = None


@dataclasses.dataclass(frozen=True)
class End(wire.Message):
    """The run is over: the agent exits with `exit_code`."""

    TYPE: ClassVar[Name] = AgentCommand.END
    exit_code: int = 0
    reason: str = ""


COMMANDS = (Welcome, Start, SignalWorkers, Standbys, Fence, Fault, End)


def decode_command(line: bytes) -> wire.Message:
    """One line from the supervisor as its command (the agent trusts the connection it opened
    itself); raises `ProtocolError` for a line that is none."""
    try:
        return wire.decode(json.loads(line), *COMMANDS)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise protocol.ProtocolError(f"not JSON: {e}") from e
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise protocol.ProtocolError(f"not a command ({type(e).__name__}: {e})") from e


def decode_agent_line(line: Mapping[str, Any]) -> wire.Message:
    """A host agent's parsed line (its token checked) as its message; raises `ProtocolError`."""
    return protocol.typed_line(line, "agent message", *AGENT_MESSAGES)
