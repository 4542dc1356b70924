"""The progress line of a preparation: input read, MB/s, documents/s, tokens/s and the ETA.

On a terminal it redraws every second; in a log file (a Slurm or Kubernetes task) it writes a
line every 30 s instead of filling the log with redraws.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    def __init__(self, total_bytes: int, groups: int, show: bool = True) -> None:
        interactive = sys.stderr.isatty()
        self._bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            desc=f"tokenizing {groups} input group{'s' * (groups != 1)}",
            file=sys.stderr,
            disable=not show,
            mininterval=1.0 if interactive else 30.0,
            dynamic_ncols=interactive,
        )
        self._start = time.perf_counter()
        self.documents = 0
        self.tokens = 0

    def resumed(self, shards: int, text_bytes: int) -> None:
        """A group continues after `shards` shards an earlier run wrote."""
        if shards:
            self._bar.write(
                f"continuing after {shards} finished shard{'s' * (shards != 1)} "
                f"({text_bytes / 1e6:,.1f} MB of text)",
                file=sys.stderr,
            )

    def advance(self, disk_bytes: int, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(
            f"{self.documents / elapsed:,.0f} docs/s, {self.tokens / elapsed / 1e6:,.2f}M tok/s",
            refresh=False,
        )
        self._bar.update(disk_bytes)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
