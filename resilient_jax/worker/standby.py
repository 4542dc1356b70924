"""A worker started ahead of need: it pays for Python's imports while the job trains, then waits
for its place in a generation and runs the worker program as if it had been started with it.

    python -m resilient_jax.worker.standby --preload=MOD,... -- WORKER_ARGV...

WORKER_ARGV is the worker command without the interpreter: `launch/train.py --config=...` or
`-m package.module --flag=...`. The supervisor starts standbys with the environment every worker
of the job shares (JAX platform, device count, compilation cache: read when JAX is imported);
when it needs a worker it writes the standby's role on its stdin (`control.standby`: one typed
line, the worker's whole environment, its place in the job). End of input before that line (the
supervisor no longer needs it, or died) ends the standby with exit 0. Elastic mode's standby slice
is the same concept with another transport (`control.standby`).

Importing the trainer's dependencies (JAX, Flax, Optax, Orbax, Grain) takes a couple of CPU
seconds per process; a restart that finds standbys ready skips them. Nothing imported here may
touch a JAX backend: `jax.distributed.initialize` must still come first in the worker.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys

from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.control import standby

_PRELOAD_FLAG = "--preload="


def parse_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(modules to preload, worker argv) from `[--preload=a,b] -- WORKER_ARGV...`."""
    if "--" not in argv:
        raise ValueError("usage: standby [--preload=MOD,...] -- WORKER_ARGV...")
    split = argv.index("--")
    preload: list[str] = []
    for arg in argv[:split]:
        if not arg.startswith(_PRELOAD_FLAG):
            raise ValueError(f"unknown standby argument {arg!r}")
        preload = [m for m in arg[len(_PRELOAD_FLAG) :].split(",") if m]
    worker = argv[split + 1 :]
    if not worker or (worker[0] == "-m" and len(worker) < 2):
        raise ValueError("standby: no worker program after --")
    return preload, worker


def run_worker(worker: list[str]) -> None:
    """Runs the worker program as `python WORKER_ARGV...` would (as `__main__`)."""
    if worker[0] == "-m":
        sys.argv = [worker[1], *worker[2:]]
        runpy.run_module(worker[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(worker)
        sys.path.insert(0, os.path.dirname(os.path.abspath(worker[0])))  # as Python does
        runpy.run_path(worker[0], run_name="__main__")


def main(argv: list[str]) -> int:
    try:
        preload, worker = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    for module in preload:
        importlib.import_module(module)
    role = standby.wait_on_stdin()
    if role is None:  # not needed after all: nothing to do, nothing failed
        return ExitCode.FINISHED
    standby.become(role)
    # The worker gets what a freshly started one gets on stdin: nothing.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, sys.stdin.fileno())
    os.close(devnull)
    run_worker(worker)
    return ExitCode.FINISHED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
