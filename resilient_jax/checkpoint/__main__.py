"""`python -m resilient_jax.checkpoint inspect DIR`: the steps each tier holds, their sizes, whether
they verify, and the config fingerprint and mesh each was written with.

DIR is a run directory (with config.json or checkpoints/) or a persistent checkpoint directory.
Exit status: 0 if every step verifies (or --no-verify), 1 if any does not, 2 on bad usage.

`python -m resilient_jax.checkpoint stack-layers DIR [--out OUT]`: rewrites the persistent steps of
DIR written when each layer had parameters of its own in the stacked layout
(`resilient_jax.checkpoint.stack_layers`); without --out in place, the original kept as
DIR.per_layer. Exit status: 0 when converted or already stacked, 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resilient_jax.checkpoint")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="list and verify the checkpoints of a run")
    inspect.add_argument("dir", help="run directory or persistent checkpoint directory")
    inspect.add_argument("--no-verify", action="store_true", help="skip reading array data")
    inspect.add_argument("--local-dir", default=None, help="local tier root (default: config's)")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    stack = commands.add_parser(
        "stack-layers", help="convert a checkpoint written before the layers were stacked"
    )
    stack.add_argument("dir", help="persistent checkpoint directory or run directory")
    stack.add_argument(
        "--out", default=None, help="write the converted steps here (default: in place)"
    )
    args = parser.parse_args(argv)
    if args.command == "stack-layers":
        from absl import logging

        from resilient_jax.checkpoint import stack_layers

        # Orbax reports every read and write at INFO and WARNING: the command prints a line a step.
        previous = logging.get_verbosity()
        logging.set_verbosity(logging.ERROR)
        try:
            return stack_layers.main(args.dir, args.out)
        finally:
            logging.set_verbosity(previous)

    from resilient_jax.checkpoint import report
    from resilient_jax.checkpoint.persistent import read_run_id

    where = report.locate(args.dir, args.local_dir)
    verify = not args.no_verify
    persistent, notes = report.persistent_rows(where.persistent, verify)
    run_id = read_run_id(where.persistent)
    local_rows, local_notes = report.local_rows(where.local_run, verify, run_id)
    rows, notes = persistent + local_rows, notes + local_notes
    if args.json:
        print(json.dumps({"rows": [dataclasses.asdict(r) for r in rows], "notes": notes}))
    else:
        print(f"persistent: {where.persistent}\nlocal:      {where.local_run or '-'}")
        print(report.render(rows, notes))
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
