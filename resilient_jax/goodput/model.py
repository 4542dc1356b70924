"""Goodput of a long training run under failures: the analytic model, Young/Daly's intervals, and
the checkpoint intervals that maximise goodput. `goodput.simulation` runs the same system as a
discrete-event Monte Carlo. Pure Python; nothing here touches JAX.

The run. Steps of `step_s` wall seconds each; a share `productive_fraction` of a step counts as
productive (the rest is data loading and host overhead, as `goodput.accounting` counts it).
Checkpoints are taken by step, like the checkpointer's policies: tier k saves at every multiple of
its interval. A save blocks the loop for `save_s`, then becomes durable `commit_s` later (an async
write; 0 for a synchronous save). A save that finds the previous write of its tier still in flight
is skipped, as the checkpointer does.

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

import numpy as np

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


# A kind of interruption: (rate, wall seconds of each recovery phase, progress lost).
_Interruption = tuple[float, dict[str, float], float]


def _mean_cycle(kinds: list[_Interruption], fail_rate: float) -> tuple[float, dict[str, float]]:
    """The mean running phase of a cycle, and the seconds by category that its interruption
    costs on average: the recovery phases (inflated by failures during the recovery) and the
    progress lost."""
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
    return running, seconds


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
    kinds: list[_Interruption] = []

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

    running, seconds = _mean_cycle(kinds, fail_rate)
    good = (running - seconds["lost_progress"]) / stretch
    seconds["checkpoint_save"] = good * save_per_step_s
    seconds["anomaly"] += good * skipped_share / (1.0 - skipped_share)
    seconds["productive"] = good * s.productive_fraction
    seconds["step_overhead"] = good * (1 - s.productive_fraction)
    wall = sum(seconds.values())
    return Breakdown({c: v / wall for c, v in seconds.items()})


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
    or above its commit time: closer saves are skipped while the write is in flight. With two
    tiers the local one may come out switched off (`local_s` infinite) when it does not pay."""
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
