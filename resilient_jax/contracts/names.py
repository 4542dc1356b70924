"""The base of every named value that is written to a file, an event or a message."""

from __future__ import annotations

import enum


class Name(str, enum.Enum):
    """A `str` Enum: members compare equal to the strings read back from a file, serialise to JSON
    as plain strings, and `str()` and f-strings give the plain value too (Python 3.10 and 3.11
    would print `Class.MEMBER`)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
