"""What the supervisor and its workers say to each other: phases and heartbeat messages.

Workers learn their place in the job from environment variables the supervisor sets
(`resilient_jax.contracts.env_vars`) and end with an exit code it understands
(`resilient_jax.contracts.exit_codes`). They report
to the supervisor over TCP with JSON lines, one self-contained message per line (identity, token
and the latest progress in every line), so the supervisor keeps no per-connection state and a
reconnecting worker needs no handshake.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

# Phases a worker reports. Before its first step in a generation a worker is starting (JAX init,
# restore, compile); "done" (the final save and exit) is slow on purpose. "ready": compiled and
# restored, taking the generation's first step (which sets up the collectives). Only "train" is
# judged by step time. "error": the worker hit an error it cannot recover from. It says so at
# once because it may not manage to exit: JAX's exit-time shutdown barrier waits for peers that
# are stuck in a collective.
PHASE_INIT = "init"
PHASE_RESTORE = "restore"
PHASE_COMPILE = "compile"
PHASE_READY = "ready"
PHASE_TRAIN = "train"
PHASE_DONE = "done"
PHASE_ERROR = "error"
PHASES = (
    PHASE_INIT,
    PHASE_RESTORE,
    PHASE_COMPILE,
    PHASE_READY,
    PHASE_TRAIN,
    PHASE_DONE,
    PHASE_ERROR,
)
MAX_ERROR_CHARS = 300

MSG_HEARTBEAT = "heartbeat"
MSG_BYE = "bye"  # the worker closes its client on purpose: silence after this is no failure
# Supervisor -> worker, the one line it ever sends one: the answer to a heartbeat of a generation
# the supervisor gave up ({"type": "fenced", "generation": the current one}); the worker stops.
MSG_FENCED = "fenced"
MAX_LINE_BYTES = 4096
# Per worker, the supervisor keeps the arrival times of this many recent steps.
MAX_ARRIVALS_KEPT = 64


WRONG_TOKEN = "no or wrong run token"


class ProtocolError(ValueError):
    """A line that is not a valid message from a worker of this run."""


def encode(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


def decode(line: bytes, token: str) -> dict[str, Any]:
    """Parses one line and checks it carries this run's token."""
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"message longer than {MAX_LINE_BYTES} bytes")
    try:
        message = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        # The type only: the detail (which byte where) is noise, and one reason per kind keeps
        # the summaries of refused connections short (`refusals`).
        raise ProtocolError(f"not JSON ({type(e).__name__})") from e
    if not isinstance(message, dict):
        raise ProtocolError("not a JSON object")
    if not hmac.compare_digest(str(message.get("token", "")), token):
        raise ProtocolError(WRONG_TOKEN)
    if isinstance(message.get("host"), str):
        return message  # a host agent's line (`agent_protocol`): the server hands it on
    for key in ("generation", "process"):
        if not isinstance(message.get(key), int):
            raise ProtocolError(f"missing integer {key!r}")
    if message.get("type") not in (MSG_HEARTBEAT, MSG_BYE):
        raise ProtocolError(f"unknown message type {message.get('type')!r}")
    return message


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
