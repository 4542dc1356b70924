"""Which processes are slow: each process's recent step times against the job's typical one.

In synchronous data parallelism every process waits for the slowest, so a straggler costs the
whole job; the coordinator feeds the step time each process measures for its own work and asks
for `stragglers()` to decide on an eviction.
"""

from __future__ import annotations

import collections
import statistics


def _low_median(values: list[float]) -> float:
    # The lower middle value: with two processes the healthy one is the reference, so one of
    # two can be flagged (the plain median would sit halfway between them).
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


class StragglerDetector:
    """A process is a straggler when the median of its last `window` step times exceeds
    `factor` times the lower median over all processes of those medians.

    No verdict on a process before it has a full window, so one slow step (a save, a compile)
    never evicts anyone.
    """

    def __init__(self, factor: float, window: int) -> None:
        if factor <= 1.0:
            raise ValueError(f"straggler factor must be > 1, got {factor}")
        if window < 1:
            raise ValueError(f"straggler window must be >= 1, got {window}")
        self.factor = factor
        self.window = window
        self._times: dict[int, collections.deque[float]] = {}

    def observe(self, process: int, step_time: float) -> None:
        times = self._times.setdefault(process, collections.deque(maxlen=self.window))
        times.append(float(step_time))

    def forget(self, process: int) -> None:
        """Drop a process's history (it left the job or was replaced)."""
        self._times.pop(process, None)

    def medians(self) -> dict[int, float]:
        """Median step time of every process with a full window."""
        return {p: statistics.median(t) for p, t in self._times.items() if len(t) == self.window}

    def reference(self) -> float | None:
        """The typical process's median step time (the lower median of the medians); None with
        fewer than two full-window processes (nothing to compare with)."""
        medians = self.medians()
        return _low_median(list(medians.values())) if len(medians) >= 2 else None

    def ratios(self) -> dict[int, float]:
        """Each full-window process's median over the reference; empty without a reference."""
        medians, reference = self.medians(), self.reference()
        if reference is None:
            return {}
        if reference <= 0:
            return {p: (float("inf") if m > 0 else 1.0) for p, m in medians.items()}
        return {p: m / reference for p, m in medians.items()}

    def stragglers(self) -> list[int]:
        return sorted(p for p, r in self.ratios().items() if r > self.factor)
