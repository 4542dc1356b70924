"""How the supervisor and its workers talk: heartbeat lines, their framing and their check. The
names of the messages and of the phases a worker reports are in `contracts.messages`.

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

from resilient_jax.contracts.messages import WorkerMessage

MAX_ERROR_CHARS = 300

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
    if message.get("type") not in (WorkerMessage.HEARTBEAT, WorkerMessage.BYE):
        raise ProtocolError(f"unknown message type {message.get('type')!r}")
    return message


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
