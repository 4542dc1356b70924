"""Straggler detection in the supervisor: which process the others keep waiting for.

In a synchronous step every process waits for the slowest, so the step time each process measures
is the job's, the same everywhere; it cannot tell who is slow. What differs is *when* each process
gets a step under way (its arrival, reported with every heartbeat). The job can take step k only
once the last process has arrived at step k - 1, so a process's own time for step k is

    own(p, k) = arrival(p, k) - max over q of arrival(q, k - 1)

the time it needed to get there after the whole job could go on. A healthy job has every own time
near the step time; a straggler keeps its own time at the step time while its peers' own times
shrink by what they waited for it. `StragglerDetector` compares the medians of
these over a window: a ratio of F means the peers were ready in 1/F of the straggler's time.

What this sees: a slow host (CPU contention, a slow input pipeline, a throttled NIC between steps).
A slow accelerator delays the collective for everyone alike and shows up as a slower job instead.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

from resilient_jax.control.server import WorkerReport


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


@dataclasses.dataclass(frozen=True)
class Straggler:
    process: int
    slice: int | None
    ratio: float  # its median own time over the job's reference (lower median)
    median_s: float  # its median own time per step
    reference_s: float


class StragglerWatch:
    """Feeds one generation's arrival reports to a StragglerDetector; reports stragglers once."""

    def __init__(self, factor: float, window: int, processes: dict[int, int | None]) -> None:
        """`processes`: the generation's JAX process ids and their physical slices."""
        self._detector = StragglerDetector(factor, window)
        self._processes = dict(processes)
        self._done_step = 0  # steps up to this one were fed to the detector
        self._reported: set[int] = set()

    def update(self, reports: dict[int, WorkerReport]) -> list[Straggler]:
        """Takes in the steps every process has reported since the last call; returns the
        processes found straggling for the first time."""
        if not self._processes or any(p not in reports for p in self._processes):
            return []
        arrivals = {p: reports[p].arrivals for p in self._processes}
        common = set.intersection(*(set(a) for a in arrivals.values()))
        for step in sorted(s for s in common if s > self._done_step):
            if step - 1 in common:
                last_before = max(a[step - 1] for a in arrivals.values())
                for process, times in arrivals.items():
                    # Clock jitter between hosts can push an early arrival below zero.
                    self._detector.observe(process, max(0.0, times[step] - last_before))
            self._done_step = step
        return self._new_stragglers()

    def _new_stragglers(self) -> list[Straggler]:
        ratios = self._detector.ratios()
        flagged = [p for p, r in ratios.items() if r > self._detector.factor]
        if not flagged:
            return []
        medians = self._detector.medians()
        reference = self._detector.reference() or 0.0
        found = []
        for process in sorted(flagged):
            if process in self._reported:
                continue
            self._reported.add(process)
            found.append(
                Straggler(
                    process=process,
                    slice=self._processes.get(process),
                    ratio=ratios[process],
                    median_s=medians[process],
                    reference_s=reference,
                )
            )
        return found
