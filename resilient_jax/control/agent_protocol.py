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
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from typing import Any

from resilient_jax.config import BadInput
from resilient_jax.contracts import env_vars
from resilient_jax.contracts.messages import AgentMessage
from resilient_jax.control import protocol

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


def is_agent_message(message: Mapping[str, Any]) -> bool:
    return message.get("type") in tuple(AgentMessage)


def decode_command(line: bytes) -> dict[str, Any]:
    """One line from the supervisor (the agent trusts the connection it opened itself)."""
    try:
        message = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise protocol.ProtocolError(f"not JSON: {e}") from e
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise protocol.ProtocolError("not a command")
    return message
