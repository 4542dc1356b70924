"""The train step compiled ahead of a fault for the mesh the fault would leave, so that the
reshaped restart loads it from the executable cache instead of compiling on the recovery path.

    python -m resilient_jax.precompile CONFIG_JSON WORKDIR

Started by `worker.candidates.CandidateCompiler` beside the training workers of a generation on
S >= 2 slices: one such process per worker of the first S - 1 slices, with the environment of the
job those workers would form after losing a slice (the same hosts, devices and process numbering
as the supervisor's reshaped generation, a fresh coordinator port). Each joins that job, plans its
mesh with the workers' own code (`run.prepare`), and compiles the train step, its non-donating
twin (`train.keep`) and evaluation's step, when on, into this process's executable cache under
the key a restarted worker computes (`executables.program_key`). Entries already there are left
alone. It runs at the lowest CPU priority and writes its `compile` events to
`WORKDIR/precompile/events.jsonl`, never the run's own log (its time is not the run's). Exit 0
when done; anything else is a failure of this helper only, never of the run.
"""

from __future__ import annotations

import json
import os
import sys
import time

import ml_collections

from resilient_jax import executables
from resilient_jax.contracts.event_types import EventType
from resilient_jax.events import EventLog
from resilient_jax.train import compile as compile_lib
from resilient_jax.train.context import prepare
from resilient_jax.train.keep import KEEP_PROGRAM
from resilient_jax.worker.candidates import SUBDIR
from resilient_jax.worker.distributed import initialize_from_env

_JOIN_TIMEOUT_S = 120.0


def compile_candidate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, bool]:
    """Joins the candidate job of this process's environment and stores its steps in the cache;
    returns, by program, whether it had to compile (False: the cache held it)."""
    directory = executables.default_dir()
    if not directory:
        raise ValueError("no executable cache: JAX_COMPILATION_CACHE_DIR is unset")
    executables.supersede_jax_cache()
    events = EventLog(os.path.join(workdir, SUBDIR), process=os.environ.get("RJ_PROCESS_ID"))
    # A peer whose worker died before starting its helper must not hold this one for the run's
    # whole start-up budget (the config itself stays as it is: it is part of the key).
    coordinator = config.coordinator.copy_and_resolve_references()
    coordinator.startup_timeout_s = min(coordinator.startup_timeout_s, _JOIN_TIMEOUT_S)
    initialize_from_env(coordinator, events)
    # A restart after a failure plans its mesh non-strictly (generation > 0): so does this.
    ctx = prepare(config, workdir, events, generation=1)
    programs = {
        "train": compile_lib.train_lowering(ctx),
        KEEP_PROGRAM: compile_lib.train_lowering(ctx, donate=False),  # the step after a save
    }
    if config.eval.every_steps:
        programs["eval"] = compile_lib.eval_lowering(ctx)
    compiled: dict[str, bool] = {}
    for program, lower in programs.items():
        start = time.perf_counter()
        key = executables.program_key(program, config, ctx.mesh, ctx.plan.describe())
        compiled[program] = executables.compile_ahead(key, lower, directory)
        events.emit(
            EventType.COMPILE,
            program=program,
            duration_s=time.perf_counter() - start,
            cache="ahead" if compiled[program] else "present",
            mesh=ctx.plan.describe(),
        )
    return compiled


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m resilient_jax.precompile CONFIG_JSON WORKDIR", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        config = ml_collections.ConfigDict(json.load(f))
    compile_candidate(config, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
