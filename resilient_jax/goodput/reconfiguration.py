"""A multi-slice run through slice losses and returns, as a seeded discrete-event simulation, under
a reconfiguration policy: the cost-aware planner of `perf.plans` or a fixed rule.

Each training slice fails independently (exponential, mean `slice_mtbf_s` of training); a failed
slice is out for an exponential repair time (mean `repair_s`), known when it fails (an announced
outage). A failure loses the work since the last save (every `save_every_steps` steps) and forces a
restart (`restart_s`, stop to the next first step). Spares take a lost slice's place; a repaired
slice becomes a spare. Policies:

- `reshape`: after a loss, a spare if there is one, else restart at once on the slices left; a
  returned slice is re-admitted when the speed-up over the observed time between failures pays for
  the restart (the supervisor's rule, `control.restart_policy.scale_up_pays`);
- `wait`: after a loss, a spare if there is one, else wait for the lost slice when it is back
  within `wait_limit_s`, else reshape; returns as `reshape`;
- `cost`: `perf.plans.on_loss` / `on_return` with the run's observed MTBF and the true step
  times: the cheapest expected path to the end of the run.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Mapping

import numpy as np

from resilient_jax.config.validation import RECONFIGURATION_POLICIES as POLICIES
from resilient_jax.perf import plans as plans_lib
from resilient_jax.perf.plans import PlanKind


@dataclasses.dataclass(frozen=True)
class Scenario:
    slices: int  # the job's target slice count
    spares: int
    step_s: Mapping[int, float]  # step time on 1..slices slices
    total_steps: int
    slice_mtbf_s: float  # each training slice's mean time between failures
    repair_s: float  # mean time a failed slice is out
    restart_s: float
    save_every_steps: int
    wait_limit_s: float = math.inf


@dataclasses.dataclass(frozen=True)
class Outcome:
    wall_s: float
    goodput: float  # ideal time (total_steps on all slices, nothing failing) / wall time
    failures: int
    restarts: int
    decisions: dict[str, int]  # plan kind -> times chosen


class _Run:
    def __init__(self, sc: Scenario, policy: str, seed: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}; one of {', '.join(POLICIES)}")
        self.sc, self.policy = sc, policy
        self.rng = np.random.default_rng(seed)
        self.now = 0.0
        self.done = 0.0  # steps on the current timeline
        self.saved = 0  # the newest saved step
        self.running = sc.slices
        self.spares = sc.spares
        self.returns: list[float] = []  # repair ends (a heap)
        self.failures = 0
        self.restarts = 0
        self.decisions: dict[str, int] = {}

    # What the policies see.

    def _mtbf_s(self) -> float | None:
        return self.now / self.failures if self.failures else None

    def _situation(self, slices_now: int, return_in_s: float | None) -> plans_lib.Situation:
        sc = self.sc
        return plans_lib.Situation(
            remaining_steps=max(1, math.ceil(sc.total_steps - self.done)),
            slices_now=slices_now,
            step_s=sc.step_s,
            restart_s=sc.restart_s,
            mtbf_s=self._mtbf_s(),
            rework_s=sc.save_every_steps / 2 * sc.step_s[slices_now],
            return_in_s=return_in_s,
            spares=self.spares,
            wait_limit_s=sc.wait_limit_s,
        )

    def _choose(self, kind: PlanKind) -> PlanKind:
        self.decisions[kind.value] = self.decisions.get(kind.value, 0) + 1
        return kind

    # The run.

    def run(self) -> Outcome:
        sc = self.sc
        while self.done < sc.total_steps:
            if self.running == 0:  # nothing to train on: wait for a repair
                self._idle_until(self.returns[0])
                self._take_returns()
                self._restart(min(sc.slices, self.spares))
                continue
            step_s = sc.step_s[self.running]
            finish = self.now + (sc.total_steps - self.done) * step_s
            fail = self.now + self.rng.exponential(sc.slice_mtbf_s / self.running)
            back = self.returns[0] if self.returns else math.inf
            end = min(finish, fail, back)
            self.done += (end - self.now) / step_s
            every = sc.save_every_steps
            self.saved = max(self.saved, int(self.done) // every * every)
            self.now = end
            if end == finish:
                self.done = sc.total_steps
            elif end == fail:
                self._failure()
            else:
                self._take_returns()
                self._on_return()
        ideal = sc.total_steps * sc.step_s[sc.slices]
        return Outcome(self.now, ideal / self.now, self.failures, self.restarts, self.decisions)

    def _failure(self) -> None:
        sc = self.sc
        self.failures += 1
        self.done = float(self.saved)
        before = self.running
        self.running -= 1
        repair = self.rng.exponential(sc.repair_s)
        heapq.heappush(self.returns, self.now + repair)
        self._take_returns()
        healthy = self.running
        if self.spares > 0 and healthy < sc.slices:
            kind = self._choose(self._loss_plan(before, healthy, repair, spare=True))
        else:
            kind = self._choose(self._loss_plan(before, healthy, repair, spare=False))
        if kind == PlanKind.WAIT:
            self._idle_until(self.now + repair)
            self._take_returns()
        self._restart(min(sc.slices, self.running + self.spares))

    def _loss_plan(self, before: int, healthy: int, repair: float, spare: bool) -> PlanKind:
        sc = self.sc
        if self.policy == "cost":
            sit = self._situation(before, repair)
            options = plans_lib.on_loss(sit, healthy)
            if options:
                return options[0].kind
            return PlanKind.WAIT
        if spare:
            return PlanKind.SPARE
        if self.policy == "wait" and repair <= sc.wait_limit_s:
            return PlanKind.WAIT
        return PlanKind.RESHAPE if healthy > 0 else PlanKind.WAIT

    def _on_return(self) -> None:
        sc = self.sc
        if self.running >= sc.slices or self.spares == 0:
            return
        bigger = min(sc.slices, self.running + self.spares)
        sit = self._situation(self.running, None)
        if self.policy == "cost":
            readmit = plans_lib.on_return(sit, bigger)[0].kind == PlanKind.READMIT
        else:
            readmit = _scale_up_pays(sit, bigger)
        self._choose(PlanKind.READMIT if readmit else PlanKind.DEFER)
        if readmit:  # a planned stop saves first: nothing lost
            self.saved = int(self.done)
            self.done = float(self.saved)
            self._restart(bigger)

    def _restart(self, slices: int) -> None:
        """Stop, restart on `slices` (spares taken first), restore: `restart_s` without steps."""
        take = slices - self.running
        self.spares -= take
        self.running = slices
        self.restarts += 1
        self._idle_until(self.now + self.sc.restart_s)
        self._take_returns()

    def _idle_until(self, when: float) -> None:
        self.now = max(self.now, when)

    def _take_returns(self) -> None:
        while self.returns and self.returns[0] <= self.now:
            heapq.heappop(self.returns)
            self.spares += 1


def _scale_up_pays(sit: plans_lib.Situation, bigger: int) -> bool:
    """`control.restart_policy.scale_up_pays` on true step times."""
    t_now, t_after = sit.step_s[sit.slices_now], sit.step_s[bigger]
    gain, _ = plans_lib.readmit_gain_s(t_now, t_after, sit.mtbf_s, sit.remaining_steps)
    return gain > sit.restart_s


def simulate(sc: Scenario, policy: str, seed: int) -> Outcome:
    """One seeded run of `sc` under `policy`."""
    return _Run(sc, policy, seed).run()
