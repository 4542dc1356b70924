"""Elastic mode (`elastic.enabled`) in the goodput model: a discrete-event Monte Carlo of slices
that train on through the loss of one of them, beside `goodput.simulation`'s single-runtime run.

The run. `slices` slices, each its own runtime, train data-parallel; a step is `step_s` of
compute with every slice present (the single runtime's step, the productive time) plus
`exchange_s` of host-side exchange (amortised over the sync interval). While slices are missing,
the survivors take over their rows: a step's compute takes `slices / live` times as long.

A failure takes one live slice (failures arrive as a Poisson process, at the job's rate scaled by
the share of slices alive). The survivors lose the round in flight (`round_steps` steps per sync;
the part of it done so far) and `detection_s`, then train on without it: no restart, no restore,
no compile. A replacement is ready `replace_s` later (allocation, start, its own compile, while
the others train on) and joins at the next round boundary, the survivors pausing `heal_s` while
it copies the state from one of them. Only when no slice is left does the job restart as a
whole (`fallback_s`: restart, restore and compile, and the work since the newest checkpoint,
folded in). Checkpoints are kept for such restarts; their blocking part is `save_s_per_step`.

Not modelled: a failure of the quorum server (the slices keep their last membership); a slow
slice (a straggler holds every exchange back); the change of the trained function that a sync
interval brings (goodput counts steps, not their quality).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from resilient_jax.goodput.model import Cluster
from resilient_jax.goodput.simulation import MonteCarlo, SimResult, summarize

# Wall-time categories of an elastic run (they sum to the wall time).
ELASTIC_CATEGORIES = (
    "productive",
    "exchange",  # the host-side exchange of every step
    "checkpoint_save",
    "degraded",  # survivors computing a missing slice's rows
    "failure_detection",
    "lost_progress",  # the part of the round in flight at a failure, redone
    "heal",  # survivors pausing while a replacement copies the state
    "restart",  # every slice lost: a whole-job restart
)


@dataclasses.dataclass(frozen=True)
class ElasticStrategy:
    name: str
    step_s: float  # compute of a step with every slice present (productive)
    exchange_s: float  # host-side exchange per step, amortised over the sync interval
    slices: int
    detection_s: float  # survivors' stall until they have re-formed without a lost slice
    replace_s: float  # until a replacement slice is ready to heal (the others train on)
    heal_s: float  # the survivors' pause while a replacement copies the state
    round_steps: int = 1  # steps per sync: a failure redoes the round in flight
    save_s_per_step: float = 0.0  # checkpoints' blocking part, per step
    fallback_s: float = 0.0  # every slice lost: a whole-job restart

    def __post_init__(self) -> None:
        if self.slices < 2:
            raise ValueError(f"elastic mode needs 2 or more slices, got {self.slices}")

    def step_wall_s(self, live: int) -> float:
        return self.step_s * self.slices / live + self.exchange_s + self.save_s_per_step


def _rounds(seconds: float, round_s: float, to_int) -> float:
    """Whole rounds in `seconds` (rounded by `to_int`, at least 0); inf stays inf."""
    return math.inf if math.isinf(seconds) else max(0, to_int(seconds / round_s))


class _ElasticRun:
    def __init__(
        self, s: ElasticStrategy, cluster: Cluster, rng: np.random.Generator, horizon_s: float
    ) -> None:
        self.s, self.cluster, self.rng, self.horizon_s = s, cluster, rng, horizon_s
        self.t = 0.0
        self.live = s.slices
        self.ready: list[float] = []  # when each missing slice's replacement is ready
        self.seconds = dict.fromkeys(ELASTIC_CATEGORIES, 0.0)
        self.steps = self.failures = 0
        self.next_failure_t = self._draw()

    def _draw(self) -> float:
        # Only live slices fail: the job's rate scaled by the share alive (memoryless).
        mean = self.cluster.job_mtbf_s * self.s.slices / self.live
        return self.t + float(self.rng.exponential(mean))

    def run(self) -> SimResult:
        s = self.s
        while self.t < self.horizon_s:
            round_s = s.round_steps * s.step_wall_s(self.live)
            ready = min(self.ready, default=math.inf)
            # Whole rounds before each event: a failure strikes inside round k_fail + 1; a ready
            # replacement joins at the first boundary after it is ready.
            k_fail = _rounds(self.next_failure_t - self.t, round_s, math.floor)
            k_join = _rounds(ready - self.t, round_s, math.ceil)
            k_end = max(1, _rounds(self.horizon_s - self.t, round_s, math.ceil))
            k = min(k_fail, k_join, k_end)
            self._train(k * s.round_steps)
            if k == k_end and k < min(k_fail + 1, k_join + 1):
                break
            if k_join <= k_fail:
                self._join()
            else:
                self._failure()
        wall = self.t
        return SimResult(
            wall_s=wall,
            seconds=dict(self.seconds),
            steps=self.steps,
            steps_lost=0,  # the round in flight is counted in lost_progress seconds
            failures=self.failures,
            anomalies=0,
            restores={},
        )

    def _train(self, steps: int) -> None:
        s = self.s
        self.steps += steps
        self.t += steps * s.step_wall_s(self.live)
        self.seconds["productive"] += steps * s.step_s
        self.seconds["degraded"] += steps * s.step_s * (s.slices / self.live - 1)
        self.seconds["exchange"] += steps * s.exchange_s
        self.seconds["checkpoint_save"] += steps * s.save_s_per_step

    def _spend(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds
        self.t += seconds

    def _failure(self) -> None:
        self.failures += 1
        self._spend("lost_progress", max(0.0, self.next_failure_t - self.t))
        self._spend("failure_detection", self.s.detection_s)
        self.live -= 1
        if self.live == 0:  # nothing left to train on: the whole job restarts
            self._spend("restart", self.s.fallback_s)
            self.live, self.ready = self.s.slices, []
        else:
            self.ready.append(self.t + self.s.replace_s)
        self.next_failure_t = self._draw()

    def _join(self) -> None:
        self.ready.remove(min(self.ready))
        self._spend("heal", self.s.heal_s)
        self.live += 1
        self.next_failure_t = self._draw()


def simulate_elastic(
    strategy: ElasticStrategy, cluster: Cluster, *, horizon_s: float, seed: int = 0
) -> SimResult:
    """One seeded elastic run of `horizon_s` wall seconds (about; it ends at a round boundary)."""
    rng = np.random.default_rng(seed)
    return _ElasticRun(strategy, cluster, rng, horizon_s).run()


def monte_carlo_elastic(
    strategy: ElasticStrategy,
    cluster: Cluster,
    *,
    failures: int = 2000,
    replicas: int = 4,
    seed: int = 0,
) -> MonteCarlo:
    """Goodput over about `failures` expected failures, in seeded replicas (as
    `simulation.monte_carlo`)."""
    horizon = failures * cluster.job_mtbf_s / replicas
    runs = [
        simulate_elastic(strategy, cluster, horizon_s=horizon, seed=seed + r)
        for r in range(replicas)
    ]
    return summarize(runs)
