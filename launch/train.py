"""Train one JAX process of an experiment.

    python launch/train.py --config=configs/tiny_cpu.py --workdir=/tmp/run [--config.total_steps=50]

Under `launch/local_cluster.py`, SLURM or a JobSet, each worker runs this same command; the
environment tells it which JAX job to join. Exits 0 when training finished, 2 on bad input (one line
on stderr saying what and why), and another non-zero code with a one-line reason on any failure.
"""

from __future__ import annotations

import os
import sys
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.run import RunError, train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (configs/*.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, logs, metrics.")
_CHAOS = flags.DEFINE_string(
    "chaos", "", "Faults to inject, e.g. 'nan:step=15;kill:process=1,step=40' (see chaos.py)."
)
flags.mark_flags_as_required(["config", "workdir"])


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with every bad flag, config file or override reduced to one line, exit 2."""
    try:
        rest = flags.FLAGS(argv)
        _CONFIG.value.to_dict()  # config_flags loads lazily: surface a bad file here
        return rest
    except flags.Error as e:
        reason = str(e)
    except Exception as e:  # config_flags raises plain errors for bad files and unknown keys
        cause = e.__cause__ or e.__context__ or e
        reason = f"{type(e).__name__}: {e}" + (f" ({cause})" if cause is not e else "")
        if "loading config file" in str(e):
            path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "")
            why = "no such file" if not os.path.exists(path.split(":")[0]) else str(cause)
            reason = f"--config={path}: cannot load the config file ({why})"
        elif isinstance(cause, KeyError) or "override" in str(e).lower():
            key = next((a for a in argv if a.startswith("--config.")), "")
            reason = f"{key.split('=')[0][2:]} is not a known config key"
    print(f"error: {reason.splitlines()[0]}", file=sys.stderr)
    sys.exit(ExitCode.BAD_INPUT)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    try:
        code = train(_CONFIG.value, os.path.abspath(_WORKDIR.value), chaos=_CHAOS.value)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        code = e.exit_code
    except Exception as e:  # a crash: the traceback for the log, then one line saying what
        traceback.print_exc()
        print(
            f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            file=sys.stderr,
        )
        code = 1
    if code != 0:
        # After a failure JAX's exit-time shutdown barrier can wait minutes for peers stuck in a
        # collective and then abort everyone, hiding which process failed: leave at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(0)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
