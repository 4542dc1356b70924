"""Typed messages: every line the control plane's processes send each other is one of these.

A message is a frozen dataclass that names its `type` (a name of `contracts.messages`) in `TYPE`;
its fields are the payload, checked against their annotations when a line is read. One encode
(`encode`: the type, the envelope a channel adds, such as the run token, and the fields, as one
JSON line) and one decode (`decode`: a parsed line into the first of the message classes the
receiver accepts whose `TYPE` it carries) serve every channel: workers and supervisor
(`protocol`), host agents and supervisor (`agent_protocol`), elastic slices and their quorum
server (`quorum_protocol`), peers' local tiers (`tier_service`).

What a receiver refuses, and how it says so, stays the channel's: `decode` raises `KeyError` for
a missing field, `TypeError` for a field of another type and `ValueError` for a type the
receiver does not take.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from resilient_jax.contracts.names import Name


@dataclasses.dataclass(frozen=True)
class Message:
    """The base of every typed message; a subclass sets `TYPE`."""

    TYPE: ClassVar[Name]

    def fields(self) -> dict[str, Any]:
        """The payload as JSON values (nested dataclasses as objects)."""
        return dataclasses.asdict(self)


M = TypeVar("M", bound=Message)


class UnknownMessage(ValueError):
    """A line whose `type` is none of those the receiver takes."""


def encode(message: Message, **envelope: Any) -> bytes:
    """`message` as one JSON line: its type, then the channel's `envelope` (the run token; a host
    agent's name), then its fields."""
    return frame({"type": message.TYPE, **envelope, **message.fields()})


def frame(line: Mapping[str, Any]) -> bytes:
    """A JSON object as one line: compact, newline-terminated (every channel's framing)."""
    return (json.dumps(line, separators=(",", ":")) + "\n").encode()


def decode(line: Mapping[str, Any], *accepted: type[M]) -> M:
    """The message a parsed line holds: an instance of the first class in `accepted` whose `TYPE`
    the line's `type` is. Keys that are no field (the envelope) are ignored; a field that is not
    there takes its default, or raises `KeyError` if it has none."""
    kind = line.get("type")
    for cls in accepted:
        if kind == cls.TYPE:
            return _build(cls, line)
    raise UnknownMessage(f"unknown message type {str(kind)[:40]!r}")


def _build(cls: Any, line: Mapping[str, Any]) -> Any:
    hints = _hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in line:
            values[field.name] = _checked(field.name, line[field.name], hints[field.name])
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise KeyError(field.name)
    return cls(**values)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _checked(name: str, value: Any, hint: Any) -> Any:
    """`value` as the field's type: an int where a float is expected becomes one; anything else
    of another type raises `TypeError`."""
    is_union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    for option in typing.get_args(hint) if is_union else (hint,):
        if option is type(None):
            if value is None:
                return None
            continue
        expected = typing.get_origin(option) or option
        if isinstance(value, bool) and expected is not bool:
            continue  # JSON's true is no number
        if expected is float and isinstance(value, int):
            try:
                return float(value)
            except OverflowError:
                raise TypeError(f"{name!r} is out of a float's range") from None
        if dataclasses.is_dataclass(expected) and isinstance(value, Mapping):
            return _build(expected, value)  # a nested message part, checked alike
        if isinstance(value, expected):
            return value
    raise TypeError(f"{name!r} is a {type(value).__name__}, not {hint}")
