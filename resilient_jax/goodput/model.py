"""Goodput of a long training run under failures: an analytic model, a discrete-event Monte Carlo,
and the checkpoint intervals that maximise goodput.

Used by `experiments/goodput_sim.py`. Pure Python and numpy; nothing here touches JAX.

The run. Steps of `step_s` wall seconds each; a share `productive_fraction` of a step counts as
productive (the rest is data loading and host overhead, as `goodput.accounting` counts it).
Checkpoints are taken by step, like the checkpointer's policies: tier k saves at every multiple of
its interval. A save blocks the loop for `save_s`, then becomes durable `commit_s` later (an async
write; 0 for a synchronous save). A save that finds the previous write of its tier still in flight
waits for it, as the checkpointer does.

Interruptions.
- Failures arrive as a Poisson process in wall time with mean `Cluster.job_mtbf_s` (per-chip MTBF
  divided by the number of chips), also during recovery. Each costs `detection_s` (nothing runs),
  `restart_s` (stop, respawn, rejoin the distributed runtime), `compile_s`, and the restore from
  the newest checkpoint that survived, plus the work done since that checkpoint became durable.
  Writes in flight when the failure hits are lost.
- The local (RAM-disk) tier does not always survive. A share `host_loss_fraction` of failures
  takes a host away with its RAM disk (hardware faults; a crashed process leaves /dev/shm intact).
  The local tier holds one full copy per replica slice, so with `replicas >= 2` another slice
  still holds the lost host's shards, and the tier is lost only when the fault takes the same
  shards out of every replica (`correlated_loss_fraction` of host losses: a shared power or
  network domain). With one replica every host loss loses the tier. Then the restore comes from
  the persistent tier.
- Anomalies (loss spikes, NaN steps) arrive as a Poisson process in step time with mean
  `Cluster.anomaly_mtbf_s`. With in-band detection the step is skipped (one step of time lost).
  Without it, training goes on for `anomaly_detection_s` until someone or something notices, then
  the job rolls back: restart, compile, restore the newest persistent checkpoint older than the
  anomaly, and redo the work since.

What is not modelled: the step slowdown while a background write competes for the host and the
network; running reshaped on fewer slices while a replacement is found (a spare is assumed); hangs
as a separate class (their longer detection is folded into `detection_s`); failures that need
people (Llama 3: 3 of 419).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

HOUR = 3600.0
DAY = 86400.0

LOCAL = "local"
PERSISTENT = "persistent"

# Categories of wall time, as `goodput.accounting` names them where they overlap.
CATEGORIES = (
    "productive",
    "step_overhead",  # the non-productive part of a kept step (data wait, host work)
    "startup",
    "checkpoint_save",
    "lost_progress",
    "failure_detection",
    "restart",
    "compilation",
    "checkpoint_restore",
    "anomaly",
)

_KEEP = 3  # durable saves remembered per tier
_FAR_STEPS = 10**12  # "never" in steps, for a run with no save or end ahead

FAILURE = "failure"
ANOMALY = "anomaly"
PLANNED = "planned"  # save, stop and restart on request (scale-up, preemption notice)
CORRUPT = "corrupt"  # the newest persistent checkpoint becomes unreadable
_KIND_CATEGORY = {
    "failure": FAILURE,
    "kill": FAILURE,
    "lose_slice": FAILURE,
    "hang": FAILURE,
    "process_exit": FAILURE,
    "anomaly": ANOMALY,
    "nan": ANOMALY,
    "spike": ANOMALY,
    "planned": PLANNED,
    "scale_up": PLANNED,
    "preempt": PLANNED,
    "corrupt_checkpoint": CORRUPT,
}


# ------------------------------------------------------------------------------------ inputs


@dataclasses.dataclass(frozen=True)
class Tier:
    """One checkpoint tier's costs, in seconds."""

    save_s: float  # the loop is blocked this long per save
    commit_s: float  # after the blocking part, until the save is durable (0: synchronous)
    restore_s: float  # restoring the job from this tier


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How a framework trains through failures: its costs and mechanisms."""

    name: str
    step_s: float
    persistent: Tier
    local: Tier | None  # None: persistent checkpoints only
    detection_s: float
    restart_s: float
    compile_s: float
    anomaly_skip: bool  # True: in-band detection skips the bad step; False: roll back
    anomaly_detection_s: float = 0.0  # without in-band skip: training goes on this long, wasted
    productive_fraction: float = 1.0
    startup_s: float = 0.0  # before the first step of a run (init and first compile)
    init_s: float = 0.0  # initialising from the seed when a restart finds nothing to restore
    tail_s: float = 0.0  # after the last step of a finite run (final save, shutdown)
    # A replay's measured compile time of each recovery in order (a mesh's first is a compile,
    # later ones load it); recoveries beyond the list cost `compile_s`.
    compile_sequence_s: tuple[float, ...] = ()

    def recovery_s(self, restore_s: float) -> float:
        return self.detection_s + self.restart_s + self.compile_s + restore_s


@dataclasses.dataclass(frozen=True)
class Cluster:
    chips: int
    chip_mtbf_s: float
    host_loss_fraction: float = 0.78
    replicas: int = 2
    correlated_loss_fraction: float = 0.02
    anomaly_mtbf_s: float = math.inf  # mean step time between anomalies, for the whole job

    @property
    def job_mtbf_s(self) -> float:
        return self.chip_mtbf_s / self.chips

    @property
    def local_loss_probability(self) -> float:
        """Chance that a failure leaves no complete copy of the local tier."""
        every_replica = 1.0 if self.replicas < 2 else self.correlated_loss_fraction
        return self.host_loss_fraction * every_replica


@dataclasses.dataclass(frozen=True)
class Intervals:
    """Seconds of step time between saves, per tier (the local one is ignored without a tier)."""

    persistent_s: float
    local_s: float = math.inf

    def steps(self, step_s: float) -> tuple[int, int]:
        """(local, persistent) intervals in whole steps; 0: no periodic saves in that tier."""

        def whole(seconds: float) -> int:
            return 0 if math.isinf(seconds) else max(1, round(seconds / step_s))

        return whole(self.local_s), whole(self.persistent_s)


# -------------------------------------------------------------------------------- Young/Daly


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's optimum: sqrt(2 * C * M) (the same formula as the checkpointer's auto interval)."""
    return math.sqrt(2.0 * max(save_s, 0.0) * mtbf_s)


def young_daly_waste(save_s: float, interval_s: float, mtbf_s: float, recovery_s: float) -> float:
    """First-order expected share of time wasted: C/tau + tau/(2M) + R/M."""
    return save_s / interval_s + interval_s / (2.0 * mtbf_s) + recovery_s / mtbf_s


def young_daly_intervals(strategy: Strategy, cluster: Cluster) -> Intervals:
    """Young's formula per tier, each tier seeing the failures it is restored from."""
    m = cluster.job_mtbf_s
    if strategy.local is None:
        return Intervals(persistent_s=young_daly_interval_s(strategy.persistent.save_s, m))
    p = cluster.local_loss_probability
    local = young_daly_interval_s(strategy.local.save_s, m / max(1.0 - p, 1e-12))
    persistent = young_daly_interval_s(strategy.persistent.save_s, m / max(p, 1e-12))
    return Intervals(persistent_s=persistent, local_s=local)


# ---------------------------------------------------------------------------- analytic model


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Shares of wall time by category (they sum to 1); goodput is the productive share."""

    shares: dict[str, float]

    @property
    def goodput(self) -> float:
        return self.shares["productive"]


def _survival(span: tuple[float, float], x: float) -> float:
    """P(X > x) for X ~ U[span]."""
    lo, hi = span
    return min(1.0, max(0.0, (hi - x) / (hi - lo)))


def _widened(span: tuple[float, float]) -> tuple[float, float]:
    # A point mass as a very narrow uniform keeps the integrals below piecewise smooth.
    return span[0], max(span[1], span[0] + 1e-9)


def _piecewise_integral(fn: Callable[[float], float], edges: Iterable[float]) -> float:
    """Simpson's rule on each piece between sorted edges: exact for piecewise quadratics."""
    total = 0.0
    for lo, hi in itertools.pairwise(sorted(set(edges))):
        total += (hi - lo) * (fn(lo) + 4 * fn((lo + hi) / 2) + fn(hi)) / 6
    return total


def _mean_min_uniform(a: tuple[float, float], b: tuple[float, float]) -> float:
    """E[min(X, Y)] for independent X ~ U[a], Y ~ U[b] (a, b >= 0): the integral of the
    product of the survival functions."""
    a, b = _widened(a), _widened(b)
    return _piecewise_integral(lambda x: _survival(a, x) * _survival(b, x), (0.0, *a, *b))


def _probability_less(a: tuple[float, float], b: tuple[float, float]) -> float:
    """P(X < Y) for independent X ~ U[a], Y ~ U[b]: X's density times Y's survival function."""
    a, b = _widened(a), _widened(b)
    inside = [x for x in b if a[0] < x < a[1]]
    return _piecewise_integral(lambda x: _survival(b, x) / (a[1] - a[0]), (*a, *inside))


def _inflated(recovery_s: float, rate: float) -> float:
    """Expected wall time of a recovery of `recovery_s` that starts over at each failure."""
    return math.expm1(rate * recovery_s) / rate if rate > 0 else recovery_s


def analytic(strategy: Strategy, cluster: Cluster, intervals: Intervals) -> Breakdown:
    """First-order renewal model: a cycle is a running phase ended by an interruption, then the
    recovery. The age of the newest durable save of a tier at a random running moment is
    uniform over [commit, commit + wall time between saves]; valid while intervals << MTBF."""
    if not math.isfinite(intervals.persistent_s):
        raise ValueError("the analytic model needs a finite persistent interval")
    s = strategy
    persistent_s = intervals.persistent_s
    local = s.local if math.isfinite(intervals.local_s) else None
    local_s = intervals.local_s
    save_per_step_s = s.persistent.save_s / persistent_s
    if local is not None:
        save_per_step_s += local.save_s / local_s
    fail_rate = 1.0 / cluster.job_mtbf_s
    anomaly_rate = 1.0 / cluster.anomaly_mtbf_s  # per second of step time
    # Share of steps skipped in-band: those with at least one anomaly in them.
    skipped_share = -math.expm1(-anomaly_rate * s.step_s) if s.anomaly_skip else 0.0
    # Wall time while running per second of kept step time (saves go by kept steps).
    stretch = 1.0 / (1.0 - skipped_share) + save_per_step_s

    age_persistent = (s.persistent.commit_s, s.persistent.commit_s + persistent_s * stretch)
    mean_age_persistent = sum(age_persistent) / 2
    kinds: list[tuple[float, dict[str, float], float]] = []  # (rate, recovery phases, lost)

    def phases(restore_s: float, detection: tuple[str, float]) -> dict[str, float]:
        return {
            detection[0]: detection[1],
            "restart": s.restart_s,
            "compilation": s.compile_s,
            "checkpoint_restore": restore_s,
        }

    detect = ("failure_detection", s.detection_s)
    if local is None:
        kinds.append((fail_rate, phases(s.persistent.restore_s, detect), mean_age_persistent))
    else:
        p = cluster.local_loss_probability
        age_local = (local.commit_s, local.commit_s + local_s * stretch)
        newest = _mean_min_uniform(age_local, age_persistent)
        # The newest surviving save is restored, from whichever tier holds it.
        local_newer = _probability_less(age_local, age_persistent)
        restore = local_newer * local.restore_s + (1 - local_newer) * s.persistent.restore_s
        kinds.append(((1 - p) * fail_rate, phases(restore, detect), newest))
        kinds.append((p * fail_rate, phases(s.persistent.restore_s, detect), mean_age_persistent))
    if not s.anomaly_skip and anomaly_rate > 0:
        detection = ("anomaly", s.step_s + s.anomaly_detection_s)
        rollback = phases(s.persistent.restore_s, detection)
        kinds.append((anomaly_rate / stretch, rollback, mean_age_persistent))

    total_rate = sum(rate for rate, _, _ in kinds)
    running = 1.0 / total_rate
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for rate, recovery, lost in kinds:
        weight = rate / total_rate
        length = sum(recovery.values())
        inflation = _inflated(length, fail_rate) / length if length > 0 else 1.0
        for category, duration in recovery.items():
            seconds[category] += weight * duration * inflation
        seconds["lost_progress"] += weight * min(lost, running)
    good = (running - seconds["lost_progress"]) / stretch
    seconds["checkpoint_save"] = good * save_per_step_s
    seconds["anomaly"] += good * skipped_share / (1.0 - skipped_share)
    seconds["productive"] = good * s.productive_fraction
    seconds["step_overhead"] = good * (1 - s.productive_fraction)
    wall = sum(seconds.values())
    return Breakdown({c: v / wall for c, v in seconds.items()})


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
            # A save that finds its tier's previous write in flight waits for it.
            wait = tier.pending[1] - self.t if tier.pending else 0.0
            if not self._spend([("checkpoint_save", wait + tier.tier.save_s)]):
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
    values = [r.goodput for r in runs]
    stderr = float(np.std(values, ddof=1) / math.sqrt(replicas)) if replicas > 1 else 0.0
    return MonteCarlo(
        goodput=float(np.mean(values)),
        stderr=stderr,
        failures=sum(r.failures for r in runs),
        wall_s=sum(r.wall_s for r in runs),
    )


# ----------------------------------------------------------------------------- optimisation


_TIER_WORTH = 1e-4  # goodput a tier must add to be kept


@dataclasses.dataclass(frozen=True)
class Optimum:
    intervals: Intervals  # whole steps, in seconds of step time
    breakdown: Breakdown

    @property
    def goodput(self) -> float:
        return self.breakdown.goodput


def _maximise(
    fn: Callable[[Sequence[float]], float],
    bounds: Sequence[tuple[float, float]],
    points: int = 25,
    rounds: int = 5,
) -> list[float]:
    """Grid search in log space, zooming in on the best cell each round (robust to the
    kinks that commit latencies put into the goodput surface)."""
    ranges = [(math.log(lo), math.log(max(hi, lo))) for lo, hi in bounds]
    best: list[float] = [math.exp(lo) for lo, _ in ranges]
    for _ in range(rounds):
        axes = [np.linspace(lo, hi, points) for lo, hi in ranges]
        score = -math.inf
        for logs in itertools.product(*axes):
            value = fn([math.exp(x) for x in logs])
            if value > score:
                score, best = value, [math.exp(x) for x in logs]
        width = [2 * (hi - lo) / (points - 1) for lo, hi in ranges]
        ranges = [
            (max(lo, math.log(b) - w), min(hi, math.log(b) + w))
            for (lo, hi), b, w in zip(ranges, best, width, strict=True)
        ]
    return best


def _snap(seconds: float, step_s: float) -> list[float]:
    """The whole-step intervals either side of `seconds`."""
    low = max(1, math.floor(seconds / step_s))
    return [low * step_s, (low + 1) * step_s]


def optimise(strategy: Strategy, cluster: Cluster) -> Optimum:
    """Intervals (whole steps) that maximise the analytic goodput. A tier's interval is kept at
    or above its commit time: closer saves only queue behind the write in flight. With two tiers
    the local one may come out switched off (`local_s` infinite) when it does not pay."""
    best = _optimise(strategy, cluster)
    if strategy.local is not None:
        alone = _optimise(dataclasses.replace(strategy, local=None), cluster)
        # A tier that adds less than this to goodput is not worth running (and its optimal
        # interval is then somewhere out beyond the MTBF, which says nothing).
        if alone.goodput > best.goodput - _TIER_WORTH:
            return alone
    return best


def _optimise(strategy: Strategy, cluster: Cluster) -> Optimum:
    s = strategy
    m = cluster.job_mtbf_s
    persistent_lo = max(s.step_s, s.persistent.commit_s)
    bounds = [(persistent_lo, max(100.0 * m, 10 * persistent_lo))]
    if s.local is not None:
        local_lo = max(s.step_s, s.local.commit_s)
        bounds.append((local_lo, max(100.0 * m, 10 * local_lo)))

    def intervals(x: Sequence[float]) -> Intervals:
        return Intervals(persistent_s=x[0], local_s=x[1] if len(x) > 1 else math.inf)

    def score(x: Sequence[float]) -> float:
        return analytic(s, cluster, intervals(x)).goodput

    best = _maximise(score, bounds)
    snapped = max(
        (list(x) for x in itertools.product(*(_snap(b, s.step_s) for b in best))), key=score
    )
    chosen = intervals(snapped)
    return Optimum(chosen, analytic(s, cluster, chosen))


# --------------------------------------------------------------------- defaults at scale

# Llama 3 405B (The Llama 3 Herd of Models, 2024, section 3.3.4): 419 unexpected interruptions in
# a 54-day snapshot on 16,384 H100s, so one per 3.1 h; about 78% attributed to confirmed or
# suspected hardware issues.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_CHIP_MTBF_S = LLAMA3_DAYS * DAY * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS
LLAMA3_HARDWARE_FRACTION = 0.78


@dataclasses.dataclass(frozen=True)
class AtScale:
    """Costs of a 405B-parameter run on an H100-class cluster, from published figures where they
    exist and stated assumptions where they do not (`sources()` says which is which)."""

    chip_mtbf_s: float = LLAMA3_CHIP_MTBF_S
    host_loss_fraction: float = LLAMA3_HARDWARE_FRACTION
    correlated_loss_fraction: float = 0.02
    anomaly_mtbf_s: float = 72 * HOUR  # PaLM 540B: ~20 loss spikes over a run of about 2 months
    params: float = 405e9
    bytes_per_param: float = 14.0  # bf16 weights + fp32 master weights + fp32 Adam m and v
    tokens_per_step: float = 16e6  # Llama 3 405B's final global batch
    peak_flops: float = 989e12  # H100 SXM dense bf16
    mfu: float = 0.40  # Llama 3 405B: 38-43%
    replica_chips: int = 2048  # chips holding one full copy of the state
    chips_per_host: int = 8
    d2h_bytes_per_s: float = 25e9  # per chip; PCIe Gen5 x16 (64 GB/s peak) shared by 8 GPUs
    ram_disk_bytes_per_s: float = 10e9  # per host, host memory into /dev/shm
    storage_write_per_host: float = 1e9
    storage_write_total: float = 2e12  # Llama 3: Tectonic, 2 TB/s sustained
    storage_read_per_host: float = 2e9
    storage_read_total: float = 7e12  # Llama 3: Tectonic, 7 TB/s peak
    persistent_commit_overhead_s: float = 10.0
    persistent_restore_overhead_s: float = 30.0
    local_restore_overhead_s: float = 5.0
    compile_s: float = 180.0  # a cold XLA compile of the step
    framework_compile_s: float = 30.0  # a hit in the persistent compilation cache
    framework_detection_s: float = 10.0
    framework_restart_s: float = 60.0
    baseline_detection_s: float = 100.0  # JAX's default heartbeat timeout
    baseline_restart_s: float = 600.0
    baseline_anomaly_detection_s: float = 600.0

    def state_bytes(self) -> float:
        return self.params * self.bytes_per_param

    def replicas(self, chips: int) -> int:
        return max(1, chips // self.replica_chips)

    def step_s(self, chips: int) -> float:
        flops = 6.0 * self.params * self.tokens_per_step
        return flops / (chips * self.peak_flops * self.mfu)

    def cluster(self, chips: int) -> Cluster:
        return Cluster(
            chips=chips,
            chip_mtbf_s=self.chip_mtbf_s,
            host_loss_fraction=self.host_loss_fraction,
            replicas=self.replicas(chips),
            correlated_loss_fraction=self.correlated_loss_fraction,
            anomaly_mtbf_s=self.anomaly_mtbf_s,
        )

    def _tiers(self, chips: int) -> tuple[Tier, float, float]:
        """(the local tier, persistent write time, persistent restore time)."""
        hosts = max(1, chips // self.chips_per_host)
        per_chip = self.state_bytes() / min(chips, self.replica_chips)
        d2h = per_chip / self.d2h_bytes_per_s
        local = Tier(
            save_s=d2h,
            commit_s=per_chip * self.chips_per_host / self.ram_disk_bytes_per_s,
            restore_s=self.local_restore_overhead_s + d2h,
        )
        write_rate = min(hosts * self.storage_write_per_host, self.storage_write_total)
        write = self.state_bytes() / write_rate + self.persistent_commit_overhead_s
        # Every replica reads a full copy of the state.
        read_rate = min(hosts * self.storage_read_per_host, self.storage_read_total)
        read = self.state_bytes() * self.replicas(chips) / read_rate
        return local, write, read + self.persistent_restore_overhead_s

    def strategies(self, chips: int) -> dict[str, Strategy]:
        """framework: two tiers, async persistent saves, fast detection, in-band anomaly skip.
        baseline: persistent only, synchronous saves, heartbeat-timeout detection, a full job
        restart, rollback on anomalies. baseline_async: the baseline with async saves, to show
        what the rest of the framework adds on top of async checkpointing."""
        local, write, read = self._tiers(chips)
        step = self.step_s(chips)
        framework = Strategy(
            name="framework",
            step_s=step,
            persistent=Tier(local.save_s, write, read),
            local=local,
            detection_s=self.framework_detection_s,
            restart_s=self.framework_restart_s,
            compile_s=self.framework_compile_s,
            anomaly_skip=True,
        )
        baseline = Strategy(
            name="baseline",
            step_s=step,
            persistent=Tier(local.save_s + write, 0.0, read),
            local=None,
            detection_s=self.baseline_detection_s,
            restart_s=self.baseline_restart_s,
            compile_s=self.compile_s,
            anomaly_skip=False,
            anomaly_detection_s=self.baseline_anomaly_detection_s,
        )
        baseline_async = dataclasses.replace(
            baseline, name="baseline_async", persistent=Tier(local.save_s, write, read)
        )
        return {s.name: s for s in (framework, baseline, baseline_async)}

    def sources(self) -> dict[str, str]:
        return {
            "chip_mtbf_s": "Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 "
            "GPUs (job MTBF 3.09 h), scaled per chip",
            "host_loss_fraction": "Llama 3: ~78% of unexpected interruptions attributed to "
            "confirmed or suspected hardware issues; assumed to take the host's RAM disk away",
            "correlated_loss_fraction": "assumption: share of host losses that hit the same "
            "shards in every replica slice (shared power or network domain)",
            "anomaly_mtbf_s": "PaLM 540B: loss spikes roughly 20 times in a run of about two "
            "months; one per 72 h of step time, independent of cluster size",
            "params, bytes_per_param": "405B parameters x 14 B (bf16 weights, fp32 master "
            "weights, fp32 Adam moments): 5.67 TB of checkpoint",
            "tokens_per_step, mfu, peak_flops": "Llama 3 405B: 16M-token batches at 38-43% MFU "
            "on H100 (989 TFLOP/s bf16); step time = 6 N tokens / (chips x peak x MFU); the "
            "global batch is held fixed across cluster sizes",
            "replica_chips": "assumption: one full copy of the state per 2,048 chips (2.8 GB a "
            "chip, within Llama 3's 1 MB-4 GB per GPU checkpoint shards)",
            "d2h_bytes_per_s": "assumption: 25 GB/s device-to-host per chip (PCIe Gen5 x16, "
            "64 GB/s peak, shared by 8 GPUs); the blocking part of every async save",
            "ram_disk_bytes_per_s": "assumption: 10 GB/s per host into /dev/shm (local commit)",
            "storage_write": "Llama 3: Tectonic sustains 2 TB/s; assumption: 1 GB/s per host "
            "writing; +10 s per save for metadata and the commit across thousands of processes",
            "storage_read": "Llama 3: Tectonic peaks at 7 TB/s; assumption: 2 GB/s per host, "
            "every replica reads a full copy, +30 s for listing, opening and verifying",
            "local_restore_overhead_s": "assumption: 5 s to agree on the step, fetch a lost "
            "host's shards from a peer replica and check CRCs",
            "compile_s": "assumption: 180 s to compile a 405B step cold (the baseline: JAX's "
            "compilation cache is off by default)",
            "framework_compile_s": "assumption: 30 s to load the step from the persistent "
            "compilation cache the framework enables (coordinator.compilation_cache_dir)",
            "framework_detection_s": "coordinator heartbeat timeout 5 s (config default) plus "
            "hangs (NCCL watchdog class, 1.7% in Llama 3) caught by the 300 s watchdog",
            "framework_restart_s": "assumption: respawn workers on allocated hosts with a hot "
            "spare for a lost one; MegaScale (NSDI'24) reports job initialisation under 30 s at "
            "more than 10,000 GPUs",
            "baseline_detection_s": "JAX's default heartbeat timeout, 100 s (FIELD_NOTES)",
            "baseline_restart_s": "assumption: job resubmitted through the scheduler, nodes "
            "replaced, containers started, every process re-initialised; MegaScale reports "
            "1,047 s of initialisation at 2,048 GPUs before its optimisations",
            "baseline_anomaly_detection_s": "assumption: an alert on the smoothed loss, then the "
            "job is stopped; PaLM rolled back ~100 steps before each spike",
            "not modelled": "slowdown from background writes; running reshaped while waiting "
            "for a spare; failures needing people",
        }
