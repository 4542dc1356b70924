"""The goodput report of a run directory, and the `python -m resilient_jax.goodput WORKDIR` command:
the table on stdout, `WORKDIR/goodput.json` and `WORKDIR/timeline.png`."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.events import read_events
from resilient_jax.goodput.accounting import Goodput, compute, format_table, straggler_factor
from resilient_jax.goodput.timeline import plot_timeline

GOODPUT_FILE = "goodput.json"
TIMELINE_FILE = "timeline.png"


def report(workdir: str) -> Goodput:
    """Computes goodput for a run directory and writes goodput.json and timeline.png there."""
    events = list(read_events(workdir))
    if not events:
        raise ValueError(f"{workdir}: no events.jsonl with events")
    result = compute(events, straggler_factor(workdir))
    with open(os.path.join(workdir, GOODPUT_FILE), "w") as f:
        json.dump(result.to_json(), f, indent=2)
    plot_timeline(events, result, os.path.join(workdir, TIMELINE_FILE))
    return result


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2 or argv[1].startswith("-"):
        print("usage: python -m resilient_jax.goodput WORKDIR", file=sys.stderr)
        return ExitCode.BAD_INPUT
    try:
        result = report(argv[1])
    except ValueError as e:
        print(f"goodput: {e}", file=sys.stderr)
        return ExitCode.FAILED
    print(format_table(result))
    print(f"wrote {os.path.join(argv[1], GOODPUT_FILE)} and {TIMELINE_FILE}")
    return ExitCode.FINISHED
