"""The exception every refused input raises: exit 2, never restarted."""

from __future__ import annotations


class BadInput(Exception):
    """Input the run refuses (config, flags, workdir, data, a checkpoint of another model).

    Fatal: the process exits with `ExitCode.BAD_INPUT` and this one-line message, and the
    supervisor does not restart it, since a restart would only repeat it. Raise it (or a subclass)
    only for what the user must fix; anything else is a failure worth a restart.
    """


class ConfigError(BadInput, ValueError):
    """A configuration problem, reported as one line before any work starts."""
