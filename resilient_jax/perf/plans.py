"""Which way to reconfigure a job when a slice is lost or returns, by expected cost over the rest
of the run: arithmetic only, shared by the supervisor (`control.reconfigure`) and the simulator
(`goodput.reconfiguration`).

A `Situation` says what the job knows: the steps left, the step time on each number of slices
(measured, or from `perf.step_time`), what a restart costs, the mean time between failures it has
seen, and when the lost slice returns. Each plan's cost is the expected wall time to finish the
run along its path:

- slice lost: `spare` (restart on a spare at full size), `reshape` (restart now on the slices
  left, re-admit the lost one with a second restart when it returns), `wait` (idle until it
  returns, then one restart at full size);
- slice returned: `readmit` (save, stop, restart bigger now) or `defer` (train on; the next
  failure's restart takes it in for free).

Training on n slices runs at t(n) stretched by the failures it meets: n / slice_mtbf per second,
each costing a restart and the work since the last save (`rework_s`). The lowest expected time
wins; every alternative and its cost go into the `reconfigure` event.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from resilient_jax.contracts.names import Name


class PlanKind(Name):
    SPARE = "spare"  # a spare slice takes the lost one's place
    RESHAPE = "reshape"  # restart now on the slices left
    WAIT = "wait"  # wait for the lost slice to return, then restart at full size
    READMIT = "readmit"  # a returned slice: save, stop and restart on more slices now
    DEFER = "defer"  # a returned slice: train on, take it in at the next failure's restart


@dataclasses.dataclass(frozen=True)
class Situation:
    """What the job knows when it must choose (seconds)."""

    remaining_steps: int
    slices_now: int  # slices the job trains (or trained, before the loss) on
    step_s: Mapping[int, float]  # step time on each slice count the plans use
    restart_s: float  # stopping, restarting, restoring and compiling: to the next first step
    mtbf_s: float | None  # the job's observed mean time between failures (None: none yet)
    rework_s: float = 0.0  # work a failure loses on average (half a save interval)
    return_in_s: float | None = None  # when the lost or awaited slice is back (None: unknown)
    spares: int = 0  # healthy slices ready to take a lost one's place
    wait_limit_s: float = math.inf  # how long the job may wait for a slice


@dataclasses.dataclass(frozen=True)
class Plan:
    kind: PlanKind
    slices: int  # slices the next generation trains on
    expected_s: float  # expected wall time to finish the run along this plan
    why: str

    def to_json(self) -> dict[str, object]:
        return {
            "plan": self.kind.value,
            "slices": self.slices,
            "expected_s": round(self.expected_s, 3),
            "why": self.why,
        }


def _failure_rate(sit: Situation, slices: int) -> float:
    """Failures per second while training on `slices` slices (each fails independently)."""
    if sit.mtbf_s is None or sit.mtbf_s <= 0 or math.isinf(sit.mtbf_s):
        return 0.0
    return slices / (sit.mtbf_s * max(1, sit.slices_now))


def _run_s(sit: Situation, slices: int, steps: float) -> float:
    """Expected wall time of `steps` steps on `slices` slices, failures included: each second of
    work meets r failures (r from the observed MTBF), each costing a restart and the work since
    the last save. (First order in r: the exact renewal formula, (1/r + R)(e^(rc) - 1) per save
    interval c, chose worse in the simulator, its exponential amplifying the noise of an MTBF
    observed over a few failures.)"""
    rate = _failure_rate(sit, slices)
    stretch = 1.0 + rate * (sit.restart_s + sit.rework_s)
    return steps * sit.step_s[slices] * stretch


def _steps_in(sit: Situation, slices: int, seconds: float) -> float:
    """Steps `seconds` of training on `slices` slices get done, failures included."""
    per_step = _run_s(sit, slices, 1.0)
    return seconds / per_step if per_step > 0 else math.inf


def _reshape_s(sit: Situation, smaller: int, full: int) -> float:
    """Restart on `smaller` slices; when the lost slice returns, the cheaper of re-admitting it
    then and taking it in at the next failure's restart (`on_return`)."""
    cost = sit.restart_s
    whole = _run_s(sit, smaller, sit.remaining_steps)
    if sit.return_in_s is None or full not in sit.step_s:
        return cost + whole
    until_back = max(0.0, sit.return_in_s - sit.restart_s)
    if whole <= until_back:
        return cost + whole
    done = _steps_in(sit, smaller, until_back)
    # The same per-slice failure rate, seen from `smaller` slices.
    mtbf_s = None if sit.mtbf_s is None else sit.mtbf_s * sit.slices_now / smaller
    steps = max(1, math.ceil(sit.remaining_steps - done))
    later = dataclasses.replace(sit, remaining_steps=steps, slices_now=smaller, mtbf_s=mtbf_s)
    return cost + until_back + on_return(later, full)[0].expected_s


def on_loss(sit: Situation, healthy: int) -> list[Plan]:
    """The plans after losing a slice, `healthy` slices left of `sit.slices_now`; cheapest first.

    `sit.step_s` must hold `healthy` (when > 0) and `sit.slices_now`."""
    full = sit.slices_now
    plans: list[Plan] = []
    if sit.spares > 0:
        cost = sit.restart_s + _run_s(sit, full, sit.remaining_steps)
        plans.append(Plan(PlanKind.SPARE, full, cost, f"a spare restores {full} slices"))
    if healthy > 0 and healthy in sit.step_s:
        back = "unknown" if sit.return_in_s is None else f"{sit.return_in_s:.0f}s"
        why = (
            f"{healthy} slices at {sit.step_s[healthy]:.3g}s/step now; the lost one is back in "
            f"{back}"
        )
        plans.append(Plan(PlanKind.RESHAPE, healthy, _reshape_s(sit, healthy, full), why))
    if sit.return_in_s is not None and sit.return_in_s <= sit.wait_limit_s:
        cost = sit.return_in_s + sit.restart_s + _run_s(sit, full, sit.remaining_steps)
        why = f"idle {sit.return_in_s:.0f}s, then {full} slices at {sit.step_s[full]:.3g}s/step"
        plans.append(Plan(PlanKind.WAIT, full, cost, why))
    return sorted(plans, key=lambda p: p.expected_s)


def on_return(sit: Situation, bigger: int) -> list[Plan]:
    """The plans when slices have returned and the job could train on `bigger` slices instead
    of `sit.slices_now`; cheapest first. `sit.step_s` must hold both counts."""
    now = sit.slices_now
    readmit = sit.restart_s + _run_s(sit, bigger, sit.remaining_steps)
    plans = [
        Plan(PlanKind.READMIT, bigger, readmit, f"restart now on {bigger} slices"),
    ]
    whole = _run_s(sit, now, sit.remaining_steps)
    rate = _failure_rate(sit, now)
    if rate == 0.0:  # no failure expected: deferring means never
        defer, why = whole, f"train on {now} slices to the end (no failure expected)"
    else:
        # The next failure's restart takes the slice in: on average after 1 / rate seconds.
        until = 1.0 / rate
        if whole <= until:
            defer, why = whole, f"the run ends before the next failure (in ~{until:.0f}s)"
        else:
            done = _steps_in(sit, now, until)
            defer = until + _run_s(sit, bigger, sit.remaining_steps - done)
            why = f"take it in at the next failure's restart (in ~{until:.0f}s)"
    plans.append(Plan(PlanKind.DEFER, now, defer, why))
    return sorted(plans, key=lambda p: p.expected_s)


def readmit_gain_s(
    t_now: float, t_after: float, mtbf_s: float | None, remaining_steps: int | None
) -> tuple[float, float]:
    """(seconds saved, horizon): training at `t_after` instead of `t_now` s/step until the next
    failure (after the observed MTBF; never before the first), or the end of the run if sooner.
    `control.restart_policy.scale_up_pays` re-admits a slice when the saving beats a restart."""
    horizon = math.inf if mtbf_s is None else mtbf_s
    if remaining_steps is not None:
        horizon = min(horizon, remaining_steps * t_now)
    return horizon * (t_now / t_after - 1.0), horizon
