"""Train one JAX process of an experiment.

    python launch/train.py --config=configs/tiny_cpu.py --workdir=/tmp/run [--config.total_steps=50]

Under `launch/local_cluster.py`, SLURM or a JobSet, each worker runs this same command; the
environment tells it which JAX job to join. Exits 0 when training finished, 2 on bad input (one line
on stderr saying what and why), and another non-zero code with a one-line reason on any failure.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from resilient_jax.train.run import RunError, train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (configs/*.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, logs, metrics.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    try:
        code = train(_CONFIG.value, os.path.abspath(_WORKDIR.value))
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        code = e.exit_code
    sys.exit(code)


if __name__ == "__main__":
    app.run(main)
