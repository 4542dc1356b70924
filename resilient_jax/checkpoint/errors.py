"""Errors of the checkpoint engine."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint problem the run cannot continue past; the message is one line."""


class InvalidCheckpoint(Exception):
    """One step of one tier cannot be used (missing piece, bad checksum, unreadable file).

    Restore reports it as a `checkpoint_invalid` event and falls back to the next candidate.
    """
