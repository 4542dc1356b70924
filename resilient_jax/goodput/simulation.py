"""The run that `goodput.model` describes, as a discrete-event Monte Carlo: seeded Poisson failures
and anomalies (`simulate`, `monte_carlo`), or a recorded run's interruptions replayed in order
(`simulate(trace=...)`, built by `goodput.replay`). Time advances from one save boundary or
interruption to the next, so a simulated month costs about as much as its saves."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.faults import FaultKind, SupervisorFaultKind
from resilient_jax.goodput.model import (
    CATEGORIES,
    LOCAL,
    PERSISTENT,
    Cluster,
    Intervals,
    Strategy,
    Tier,
)

_KEEP = 3  # durable saves remembered per tier
_FAR_STEPS = 10**12  # "never" in steps, for a run with no save or end ahead

# What an interruption does to the run.
FAILURE = "failure"  # the job dies: detect, restart, restore, redo the work since the save
ANOMALY = "anomaly"  # a bad step: skipped in-band, or a rollback without in-band detection
PLANNED = "planned"  # save, stop and restart on request (scale-up, preemption notice)
CORRUPT = "corrupt"  # the newest persistent checkpoint becomes unreadable
# Interruption kinds a trace may name: the model's own categories, the chaos fault kinds, and
# what a recorded run shows (a crash, a supervisor's preemption notice, a scale-up).
_KIND_CATEGORY = {
    FAILURE: FAILURE,
    ANOMALY: ANOMALY,
    PLANNED: PLANNED,
    FaultKind.KILL: FAILURE,
    FaultKind.LOSE_SLICE: FAILURE,
    FaultKind.HANG: FAILURE,
    FaultKind.NAN: ANOMALY,
    FaultKind.SPIKE: ANOMALY,
    FaultKind.CORRUPT_CHECKPOINT: CORRUPT,
    "process_exit": FAILURE,
    SupervisorFaultKind.PREEMPT: PLANNED,
    EventType.SCALE_UP: PLANNED,
}


# ------------------------------------------------------------------------------ Monte Carlo


@dataclasses.dataclass(frozen=True)
class Interruption:
    """One entry of a failure trace: fires at `time_s` (wall seconds from the run's start) or
    just before step `step` is taken (once), whichever is given; a failure at a step may strike
    `into_step_s` seconds into that step (work lost; saves in flight keep committing)."""

    kind: str  # a key of _KIND_CATEGORY
    time_s: float | None = None
    step: int | None = None
    local_lost: bool = False  # this failure takes the local tier with it
    into_step_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in _KIND_CATEGORY:
            allowed = ", ".join(sorted(_KIND_CATEGORY))
            raise ValueError(f"interruption kind {self.kind!r}; allowed: {allowed}")
        if (self.time_s is None) == (self.step is None):
            raise ValueError("an interruption needs exactly one of time_s and step")

    @property
    def category(self) -> str:
        return _KIND_CATEGORY[self.kind]

    @property
    def at_s(self) -> float:
        return math.inf if self.time_s is None else self.time_s


@dataclasses.dataclass(frozen=True)
class SimResult:
    wall_s: float
    seconds: dict[str, float]  # CATEGORIES; they sum to wall_s
    steps: int  # steps on the final timeline
    steps_lost: int
    failures: int
    anomalies: int
    restores: dict[str, int]  # restores per tier ("none": from scratch)

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "goodput": self.goodput,
            "wall_s": self.wall_s,
            "badput": {c: v / self.wall_s for c, v in self.seconds.items() if c != "productive"},
            "steps": self.steps,
            "steps_lost": self.steps_lost,
            "failures": self.failures,
            "anomalies": self.anomalies,
            "restores": self.restores,
        }


@dataclasses.dataclass
class _TierRun:
    name: str
    tier: Tier
    every: int  # steps between saves
    durable: list[int] = dataclasses.field(default_factory=list)
    pending: tuple[int, float] | None = None  # (step, time it becomes durable)

    def settle(self, now: float) -> None:
        if self.pending is not None and self.pending[1] <= now:
            self.commit(self.pending[0])
            self.pending = None

    def commit(self, step: int) -> None:
        self.durable.append(step)
        # Older saves matter only as fall-backs from a corrupted newest one; keep a few, as the
        # checkpointer does.
        if len(self.durable) > _KEEP:
            del self.durable[0]

    def abandon(self, now: float) -> None:
        """A failure: what was durable stays, the write in flight is gone."""
        self.settle(now)
        self.pending = None

    def newest(self, limit: int | None) -> int | None:
        candidates = [d for d in self.durable if limit is None or d <= limit]
        return max(candidates) if candidates else None

    def drop_after(self, step: int) -> None:
        self.durable = [d for d in self.durable if d <= step]


class _Run:
    """One simulated run. Time advances from one save boundary or interruption to the next."""

    def __init__(
        self,
        strategy: Strategy,
        cluster: Cluster,
        intervals: Intervals,
        rng: np.random.Generator,
        trace: Sequence[Interruption] | None,
        horizon_s: float,
        total_steps: int | None,
    ) -> None:
        self.s, self.cluster, self.rng = strategy, cluster, rng
        self.horizon_s, self.total_steps = horizon_s, total_steps
        local_every, persistent_every = intervals.steps(strategy.step_s)
        self.tiers = [_TierRun(PERSISTENT, strategy.persistent, persistent_every)]
        if strategy.local is not None and local_every:
            # Local first: at a shared step the cheap save goes first, as in the checkpointer.
            self.tiers.insert(0, _TierRun(LOCAL, strategy.local, local_every))
        self.t = 0.0
        self.pos = 0
        self.recoveries = 0
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.steps_lost = self.failures = self.anomalies = 0
        self.restores: dict[str, int] = {}
        self.trace = trace
        timed = sorted((i for i in trace or () if i.step is None), key=lambda i: i.at_s)
        self.failures_timed = [i for i in timed if i.category == FAILURE]
        self.timed = [i for i in timed if i.category != FAILURE]  # fired between steps
        # A fault at step K fires just before step K is taken: after K - 1 steps.
        self.by_step: dict[int, list[Interruption]] = {}
        for i in trace or ():
            if i.step is not None:
                self.by_step.setdefault(max(0, i.step - 1), []).append(i)
        if trace is None:
            self.next_failure_t = self._draw(cluster.job_mtbf_s)
        else:
            self.next_failure_t = self._next_traced_failure_t()
        # Seconds of step time until the next anomaly (a trace schedules its own).
        self.anomaly_budget = self._draw(cluster.anomaly_mtbf_s) if trace is None else math.inf

    # ----------------------------------------------------------------- randomness and trace

    def _draw(self, mean: float) -> float:
        return float(self.rng.exponential(mean)) if math.isfinite(mean) else math.inf

    def _next_traced_failure_t(self) -> float:
        return self.failures_timed[0].at_s if self.failures_timed else math.inf

    def _take_failure(self) -> bool:
        """Consumes the pending timed failure; returns whether it loses the local tier."""
        self.failures += 1
        if self.trace is None:
            self.next_failure_t = self.t + self._draw(self.cluster.job_mtbf_s)
            return bool(self.rng.random() < self.cluster.local_loss_probability)
        failure = self.failures_timed.pop(0)
        self.next_failure_t = self._next_traced_failure_t()
        return failure.local_lost

    # ------------------------------------------------------------------------------ driving

    def run(self) -> SimResult:
        self._spend([("startup", self.s.startup_s)])
        while not self._finished():
            self._advance()
        if self.total_steps is not None:
            # The final save and shutdown; a measured tail includes the final save.
            self.t += self.s.tail_s
            self.seconds["checkpoint_save"] += self.s.tail_s
        kept = self.pos * self.s.step_s
        self.seconds["productive"] = kept * self.s.productive_fraction
        self.seconds["step_overhead"] = kept * (1 - self.s.productive_fraction)
        # Whatever is not accounted for went into steps (and their partial ends) that were redone.
        self.seconds["lost_progress"] = 0.0
        self.seconds["lost_progress"] = max(0.0, self.t - sum(self.seconds.values()))
        return SimResult(
            wall_s=self.t,
            seconds=dict(self.seconds),
            steps=self.pos,
            steps_lost=self.steps_lost,
            failures=self.failures,
            anomalies=self.anomalies,
            restores=dict(self.restores),
        )

    def _finished(self) -> bool:
        if self.total_steps is not None:
            return self.pos >= self.total_steps
        return self.t >= self.horizon_s

    def _boundary(self) -> int:
        """The next step count at which something happens: a save, a traced fault, the end."""
        saves = [(self.pos // t.every + 1) * t.every for t in self.tiers if t.every]
        ends = [] if self.total_steps is None else [self.total_steps]
        later = [k for k in self.by_step if k > self.pos]
        # Without saves, traced faults or an end in sight, run until the next timed event.
        return min([*saves, *ends, *later], default=self.pos + _FAR_STEPS)

    def _advance(self) -> None:
        step_s = self.s.step_s
        if self.pos in self.by_step:
            for entry in self.by_step.pop(self.pos):
                self._fire(entry)
            return
        if self.timed and self.timed[0].at_s <= self.t:
            self._fire(self.timed.pop(0))
            return
        target = self._boundary()
        n = target - self.pos
        t_timed = min(self.next_failure_t, self.timed[0].at_s if self.timed else math.inf)
        if self.total_steps is None:
            t_timed = min(t_timed, self.horizon_s)
        # Full steps before the anomalous one, when one of the next n steps is.
        anomaly_at = n
        if self.anomaly_budget < n * step_s:
            anomaly_at = max(0, math.floor(self.anomaly_budget / step_s))
        t_anomaly = self.t + (anomaly_at + 1) * step_s if anomaly_at < n else math.inf
        t_reach = self.t + n * step_s
        if t_timed < min(t_anomaly, t_reach):
            self._run_steps(max(0, math.floor((t_timed - self.t) / step_s)))
            self.t = t_timed
            if t_timed == self.next_failure_t:
                self._failure(self._take_failure())
            return
        if t_anomaly <= t_reach:
            self._run_steps(anomaly_at)
            self._anomaly()
            return
        self._run_steps(n)
        self._save_due()

    def _run_steps(self, n: int) -> None:
        self.pos += n
        self.t += n * self.s.step_s
        self.anomaly_budget -= n * self.s.step_s

    # ------------------------------------------------------------------------------- events

    def _fire(self, entry: Interruption) -> None:
        category = entry.category
        if category == FAILURE:
            self.failures += 1
            self.t += max(0.0, entry.into_step_s)  # the partial step: lost progress
            self._failure(entry.local_lost)
        elif category == ANOMALY:
            self._anomaly()
        elif category == PLANNED:
            self._planned()
        elif category == CORRUPT:
            persistent = self.tiers[-1]
            persistent.settle(self.t)
            if persistent.durable:
                persistent.durable.pop()

    def _anomaly(self) -> None:
        """The step about to be taken is anomalous."""
        self.anomalies += 1
        if self.trace is None:
            self.anomaly_budget = self._draw(self.cluster.anomaly_mtbf_s)
        if self.s.anomaly_skip:
            self._spend([("anomaly", self.s.step_s)])
            return
        # Roll back to a save made before the bad step; the steps since are redone.
        self._interrupt(("anomaly", self.s.step_s + self.s.anomaly_detection_s), False, self.pos)

    def _failure(self, local_lost: bool) -> None:
        self._interrupt(("failure_detection", self.s.detection_s), local_lost, None)

    def _planned(self) -> None:
        """Save-and-stop: a persistent save at the current step, then a restart from it."""
        persistent = self.tiers[-1]
        persistent.settle(self.t)
        wait = persistent.pending[1] - self.t if persistent.pending else 0.0
        # The workers exit only once the save is durable.
        save = wait + self.s.persistent.save_s + self.s.persistent.commit_s
        if not self._spend([("checkpoint_save", save)]):
            return
        persistent.pending = None
        persistent.commit(self.pos)
        self._interrupt(("failure_detection", 0.0), False, None)

    def _save_due(self) -> None:
        if self.total_steps is not None and self.pos >= self.total_steps:
            return  # the final save is part of the run's tail
        for tier in self.tiers:
            if self.pos == 0 or not tier.every or self.pos % tier.every:
                continue
            tier.settle(self.t)
            if tier.pending is not None:  # its previous write in flight: skipped, as in a run
                continue
            if not self._spend([("checkpoint_save", tier.tier.save_s)]):
                return
            tier.settle(self.t)
            if tier.tier.commit_s > 0:
                tier.pending = (self.pos, self.t + tier.tier.commit_s)
            else:
                tier.commit(self.pos)

    def _spend(self, phases: Iterable[tuple[str, float]]) -> bool:
        """Spends wall time on phases in order; a failure in the middle is handled at once.
        Returns whether all of it was spent."""
        if self._spend_until_failure(phases):
            return True
        self._failure(self._take_failure())
        return False

    def _spend_until_failure(self, phases: Iterable[tuple[str, float]]) -> bool:
        """Spends wall time on phases in order up to the next failure, if one comes first
        (the clock then stands at the failure, which is left to the caller)."""
        for category, duration in phases:
            end = self.t + duration
            if self.next_failure_t < end:
                self.seconds[category] += self.next_failure_t - self.t
                self.t = self.next_failure_t
                return False
            self.seconds[category] += duration
            self.t = end
        return True

    def _interrupt(self, first: tuple[str, float], local_lost: bool, limit: int | None) -> None:
        """Restores the newest surviving checkpoint (at most `limit`) and spends the recovery,
        in the order a worker goes through it; a failure during the recovery starts it over."""
        while True:
            restore_s = self._roll_back(local_lost, limit)
            sequence = self.s.compile_sequence_s
            compile_s = (
                sequence[self.recoveries] if self.recoveries < len(sequence) else self.s.compile_s
            )
            self.recoveries += 1
            phases = [
                first,
                ("restart", self.s.restart_s),
                ("checkpoint_restore", restore_s),
                ("compilation", compile_s),
            ]
            if self._spend_until_failure(phases):
                return
            local_lost = self._take_failure()
            first, limit = ("failure_detection", self.s.detection_s), None

    def _roll_back(self, local_lost: bool, limit: int | None) -> float:
        """Moves the run back to the newest surviving save (at most `limit`); returns the
        restore's cost (from scratch: initialising from the seed)."""
        for tier in self.tiers:
            tier.abandon(self.t)
            if tier.name == LOCAL and local_lost:
                tier.durable.clear()
        best: tuple[int, str, float] = (0, "none", self.s.init_s)
        for tier in self.tiers:  # local first: it wins ties, being the faster restore
            step = tier.newest(limit)
            if step is not None and step > best[0]:
                best = (step, tier.name, tier.tier.restore_s)
        step, name, restore_s = best
        self.steps_lost += self.pos - step
        self.pos = step
        for tier in self.tiers:
            tier.drop_after(step)
        self.restores[name] = self.restores.get(name, 0) + 1
        return restore_s


def simulate(
    strategy: Strategy,
    cluster: Cluster,
    intervals: Intervals,
    *,
    seed: int = 0,
    horizon_s: float | None = None,
    total_steps: int | None = None,
    trace: Sequence[Interruption] | None = None,
) -> SimResult:
    """Discrete-event run. Poisson failures and anomalies (seeded) unless a `trace` is given.
    Ends at `horizon_s` of wall time or after `total_steps` steps (one of them is needed)."""
    if horizon_s is None and total_steps is None:
        raise ValueError("simulate needs horizon_s or total_steps")
    rng = np.random.default_rng(seed)
    horizon = math.inf if horizon_s is None else horizon_s
    return _Run(strategy, cluster, intervals, rng, trace, horizon, total_steps).run()


@dataclasses.dataclass(frozen=True)
class MonteCarlo:
    goodput: float  # mean over the replicas
    stderr: float
    failures: int  # simulated, all replicas together
    wall_s: float


def monte_carlo(
    strategy: Strategy,
    cluster: Cluster,
    intervals: Intervals,
    *,
    failures: int = 2000,
    max_saves: int = 400_000,
    replicas: int = 4,
    seed: int = 0,
) -> MonteCarlo:
    """Goodput over about `failures` expected failures, split into seeded replicas. The horizon
    is cut so that no more than about `max_saves` saves are simulated (time is spent per save)."""
    local_s = intervals.local_s if strategy.local is not None else math.inf
    shortest = min(intervals.persistent_s, local_s)
    horizon = min(failures * cluster.job_mtbf_s, max_saves * shortest) / replicas
    runs = [
        simulate(strategy, cluster, intervals, seed=seed + r, horizon_s=horizon)
        for r in range(replicas)
    ]
    return summarize(runs)


def summarize(runs: list[SimResult]) -> MonteCarlo:
    """The mean goodput of seeded replica runs, with its standard error."""
    values = [r.goodput for r in runs]
    n = len(runs)
    stderr = float(np.std(values, ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    return MonteCarlo(
        goodput=float(np.mean(values)),
        stderr=stderr,
        failures=sum(r.failures for r in runs),
        wall_s=sum(r.wall_s for r in runs),
    )
