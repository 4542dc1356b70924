"""The absl programs' command line (`launch/train.py`, `launch/local_cluster.py`): a bad flag,
config file or config override is one line on stderr and exit 2 (`ExitCode.BAD_INPUT`), as any
bad input.

absl's own parser prints its usage and exits 1 on a bad flag, and config_flags loads the config
file lazily, so a file that fails to load would only surface later as an unrelated error.
"""

from __future__ import annotations

import os
import sys

import ml_collections
from absl import flags

from resilient_jax.contracts.exit_codes import ExitCode


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with every bad flag, config file or override reduced to one line, exit 2.

    For `app.run(main, flags_parser=parse_flags)` in a program with a `--config` file flag."""
    try:
        rest = flags.FLAGS(argv)
        flags.FLAGS["config"].value.to_dict()  # config_flags loads lazily: surface a bad file
        return rest
    except Exception as e:  # absl and config_flags raise plain errors for bad files and keys
        reason = _flag_error(argv, e)
    print(f"error: {reason}", file=sys.stderr)
    sys.exit(ExitCode.BAD_INPUT)


def _flag_error(argv: list[str], error: Exception) -> str:
    """One line naming what is wrong on the command line: the config file, an unknown config key
    (the first override the file does not define), or absl's own message."""
    path = _config_path(argv)
    try:
        config = flags.FLAGS["config"].parser.parse(path) if path else None
        if config is not None:
            config.to_dict()  # a file that failed to load gives a stand-in that raises on use
    except Exception as e:  # the config file itself does not load
        cause = e.__cause__ or e.__context__ or e
        why = "no such file" if not os.path.exists(path.split(":")[0]) else first_line(cause)
        return f"--config={path}: cannot load the config file ({why})"
    for arg in argv[1:]:
        if config is not None and arg.startswith("--config."):
            key = arg[2:].split("=", 1)[0]
            unknown = _unknown_key(config, key.split(".", 1)[1])
            if unknown:
                return f"{key} is not a known config key ({unknown})"
    return first_line(error)


def override_keys(argv: list[str]) -> set[str]:
    """The config keys the command line sets (`--config.KEY=VALUE` or `--config.KEY VALUE`), as
    dotted keys without the `config.` prefix: what the user asked for explicitly, as against what
    the config file says."""
    return {arg[len("--config.") :].split("=", 1)[0] for arg in argv if arg.startswith("--config.")}


def _config_path(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return ""


def _unknown_key(config: ml_collections.ConfigDict, dotted: str) -> str:
    """Why `dotted` names no field of `config` ("" when it does)."""
    node, prefix = config, "config"
    for part in dotted.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            known = ", ".join(sorted(node)) if isinstance(node, ml_collections.ConfigDict) else ""
            return f"{prefix} has no {part!r}" + (f"; it has: {known}" if known else "")
        node, prefix = node[part], f"{prefix}.{part}"
    return ""


def first_line(error: BaseException) -> str:
    while error.args and isinstance(error.args[0], BaseException):  # AttributeError(KeyError(..))
        error = error.args[0]
    # str() of a KeyError quotes its message; a locked ConfigDict's message goes on to list every
    # field it has after the key it refused: keep the key.
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    text = str(text).split(". Other fields present", 1)[0]
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__
