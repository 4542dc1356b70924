"""Errors of the checkpoint engine."""

from __future__ import annotations

from resilient_jax.config import BadInput


class CheckpointError(RuntimeError):
    """A checkpoint problem the run cannot continue past; the message is one line."""


class ForeignCheckpoint(CheckpointError, BadInput):
    """The checkpoint directory holds another model's steps: fatal, the user must point the run
    elsewhere (or say `checkpoint.init_from` on purpose)."""


class InvalidCheckpoint(Exception):
    """One step of one tier cannot be used (missing piece, bad checksum, unreadable file).

    Restore reports it as a `checkpoint_invalid` event and falls back to the next candidate.
    """
