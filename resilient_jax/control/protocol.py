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

import dataclasses
import hmac
import json
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from resilient_jax.contracts.messages import Phase, WorkerMessage
from resilient_jax.contracts.names import Name
from resilient_jax.control import wire

M = TypeVar("M", bound=wire.Message)

MAX_ERROR_CHARS = 300

MAX_LINE_BYTES = 4096
# Per worker, the supervisor keeps the arrival times of this many recent steps.
MAX_ARRIVALS_KEPT = 64


WRONG_TOKEN = "no or wrong run token"


class ProtocolError(ValueError):
    """A line that is not a valid message from a worker of this run."""


@dataclasses.dataclass(frozen=True)
class Heartbeat(wire.Message):
    """A worker's line: who it is and how far it got, whole in every line (the supervisor keeps
    no per-connection state; a reconnecting worker needs no handshake)."""

    TYPE: ClassVar[Name] = WorkerMessage.HEARTBEAT
    generation: int
    process: int
    slice: int | None = None
    pid: int | None = None
    phase: str = Phase.INIT
    step: int | None = None
    step_time_s: float | None = None  # the median of the recent steps
    error: str | None = None  # why a worker in `error` stopped (cut to MAX_ERROR_CHARS)
    arrivals: list = dataclasses.field(default_factory=list)  # [[step, time], ...], newest last


@dataclasses.dataclass(frozen=True)
class Bye(Heartbeat):
    """A worker's last line: it closes its client on purpose, silence after this is no failure."""

    TYPE: ClassVar[Name] = WorkerMessage.BYE


@dataclasses.dataclass(frozen=True)
class FencedReply(wire.Message):
    """The answer to a line of a generation the supervisor gave up: `generation` replaced it."""

    TYPE: ClassVar[Name] = WorkerMessage.FENCED
    generation: int


def encode(message: dict[str, Any]) -> bytes:
    """A plain JSON object as one line (a typed message: `wire.encode`)."""
    return wire.frame(message)


def read(line: bytes, token: str) -> dict[str, Any]:
    """One line as a JSON object that carries this run's token; raises `ProtocolError`."""
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
    if not token_matches(message.get("token"), token):
        raise ProtocolError(WRONG_TOKEN)
    return message


def is_agent_line(message: dict[str, Any]) -> bool:
    """A host agent's line (`agent_protocol`: it names its host), not a worker's."""
    return isinstance(message.get("host"), str)


def worker_line(message: dict[str, Any]) -> Heartbeat:
    """A worker's parsed line as the message it is; raises `ProtocolError` if it is none."""
    for key in ("generation", "process"):
        if not isinstance(message.get(key), int) or isinstance(message.get(key), bool):
            raise ProtocolError(f"missing integer {key!r}")
    return typed_line(message, "heartbeat", Heartbeat, Bye)


def typed_line(message: Mapping[str, Any], what: str, *accepted: type[M]) -> M:
    """A parsed line (its token checked) as one of the `accepted` messages; raises
    `ProtocolError` naming `what` the line should have been when it is none of them."""
    try:
        return wire.decode(message, *accepted)
    except wire.UnknownMessage as e:
        raise ProtocolError(str(e)) from None
    except (KeyError, TypeError) as e:
        raise ProtocolError(f"malformed {what}: {type(e).__name__}: {e}") from None


def token_matches(sent: Any, token: str) -> bool:
    """Whether `sent` (a line's `token`, anything a peer wrote) is the run's token, in constant
    time (compared as UTF-8: `compare_digest` refuses a str that is not ASCII)."""
    return hmac.compare_digest(str(sent if sent is not None else "").encode(), token.encode())


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
