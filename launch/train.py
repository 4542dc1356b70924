"""Train one JAX process of an experiment.

    python launch/train.py --config=configs/tiny_cpu.py --workdir=/tmp/run [--config.total_steps=50]

Under `launch/local_cluster.py`, SLURM or a JobSet, each worker runs this same command; the
environment tells it which JAX job to join. Exits 0 when training finished; 2 on bad input (one line
on stderr saying what and why, nothing written to the workdir); on anything unexpected 1 with the
traceback and a one-line reason (a failure the supervisor may restart); see `ExitCode`.

    python launch/train.py --config=configs/llama_7b.py --plan \
        --cluster=devices=64,memory_gb=80,slices=8

checks a config against a described cluster instead of training: bytes per device of parameters,
optimizer state, gradients, activations and checkpoint, on the whole cluster and after losing one
or two slices, and whether each fits (`resilient_jax.train.memory_plan`). It traces shapes only, on
the CPU backend, so it takes seconds and never touches an accelerator; it needs no --workdir.
"""

from __future__ import annotations

import os
import sys
import traceback

import jax
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from resilient_jax import config as config_lib
from resilient_jax import executables
from resilient_jax.config import BadInput, command_line
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.contracts.generation_file import Fenced
from resilient_jax.hf.importer import configure as configure_from_hf
from resilient_jax.run import RunError, train
from resilient_jax.train import memory_plan

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (configs/*.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, logs, metrics.")
_CHAOS = flags.DEFINE_string(
    "chaos", "", "Faults to inject, e.g. 'nan:step=15;kill:process=1,step=40' (see chaos/)."
)
_PLAN = flags.DEFINE_bool(
    "plan", False, "Print the memory plan of the config on --cluster instead of training."
)
_CLUSTER = flags.DEFINE_string(
    "cluster", "", f"The cluster --plan describes: {memory_plan.CLUSTER_SYNTAX}."
)
flags.mark_flags_as_required(["config"])


def _print_plan(config: ml_collections.ConfigDict, cluster: str) -> ExitCode:
    if not cluster:
        raise BadInput(f"--plan needs --cluster={memory_plan.CLUSTER_SYNTAX}")
    spec = memory_plan.parse_cluster(cluster)
    # Shapes only: on the CPU backend no accelerator is initialised, let alone its memory taken.
    jax.config.update("jax_platforms", "cpu")
    config_lib.validate(config)
    print(memory_plan.format_plan(memory_plan.plan(config, spec)))
    return ExitCode.FINISHED


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    try:
        # checkpoint.init_from_hf alone sets the model and tokenizer (explicit overrides must
        # agree): a refused directory ends the run here, before anything starts.
        configure_from_hf(_CONFIG.value, command_line.override_keys(sys.argv))
        if _PLAN.value:
            code = _print_plan(_CONFIG.value, _CLUSTER.value)
        else:
            if _CLUSTER.value:
                raise BadInput("--cluster describes the cluster of --plan: add --plan or drop it")
            if not _WORKDIR.value:
                raise BadInput("--workdir is required to train (only --plan runs without one)")
            # A worker: JAX's cache off for good, so every executable stored for a restart
            # comes from a compile (`executables.supersede_jax_cache`).
            executables.supersede_jax_cache()
            code = train(_CONFIG.value, os.path.abspath(_WORKDIR.value), chaos=_CHAOS.value)
    except BadInput as e:  # the user must fix it: restarting would only repeat it
        print(f"error: {e}", file=sys.stderr)
        code = ExitCode.BAD_INPUT
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        code = e.exit_code
    except Fenced as e:  # the supervisor gave this generation up: it writes nothing more
        print(f"error: {e}", file=sys.stderr)
        code = ExitCode.FAILED
    except Exception as e:  # unexpected: the traceback for the log, then one line saying what
        traceback.print_exc()
        print(f"error: {type(e).__name__}: {command_line.first_line(e)}", file=sys.stderr)
        code = ExitCode.FAILED
    if code != ExitCode.FINISHED:
        # After a failure JAX's exit-time shutdown barrier can wait minutes for peers stuck in a
        # collective and then abort everyone, hiding which process failed: leave at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(ExitCode.FINISHED)


if __name__ == "__main__":
    app.run(main, flags_parser=command_line.parse_flags)
