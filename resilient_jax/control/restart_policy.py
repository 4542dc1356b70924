"""The supervisor's decisions, kept free of processes and sockets so tests can drive them directly.

`SlicePool` knows which physical slices are healthy, which are evicted and when they come back.
`RestartPolicy` counts failures and decides between "restart after a back-off" and "stop": a retry
budget, exponential back-off, and crash-loop detection. `scale_up_pays` and
`straggler_eviction_pays` weigh a reshape's gain against what it costs.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from resilient_jax.perf.plans import readmit_gain_s


@dataclasses.dataclass
class _SliceState:
    healthy: bool = True
    returns_at: float | None = None  # when an evicted slice is healthy again; None = never
    outage_until: float | None = None  # an outage announced by fault injection


class SlicePool:
    """Physical slices 0..target+spares-1: the first `target` run, the rest wait as spares."""

    def __init__(self, target: int, spares: int, readmit_after_s: float) -> None:
        self.target = target
        self._readmit_after_s = readmit_after_s
        self._slices = {s: _SliceState() for s in range(target + spares)}

    @property
    def all_slices(self) -> list[int]:
        return sorted(self._slices)

    def healthy(self) -> list[int]:
        return [s for s, st in sorted(self._slices.items()) if st.healthy]

    def announce_outage(self, slice_id: int, until: float) -> None:
        """Fault injection says this slice's hardware is gone until `until`."""
        self._slices[slice_id].outage_until = until

    def evict(self, slice_id: int, now: float) -> float | None:
        """Marks the slice unhealthy; returns when it will be back (None: never)."""
        state = self._slices[slice_id]
        state.healthy = False
        if state.outage_until is not None and state.outage_until > now:
            state.returns_at = state.outage_until
        elif self._readmit_after_s >= 0:
            state.returns_at = now + self._readmit_after_s
        else:
            state.returns_at = None
        return state.returns_at

    def refresh(self, now: float) -> list[int]:
        """Slices whose outage has ended become healthy again; returns them."""
        back = []
        for slice_id, state in sorted(self._slices.items()):
            if not state.healthy and state.returns_at is not None and state.returns_at <= now:
                state.healthy, state.returns_at, state.outage_until = True, None, None
                back.append(slice_id)
        return back

    def readmit_suspects(self, now: float, count: int) -> list[int]:
        """Up to `count` slices out only for their cooldown (no announced outage, a return time
        set) become healthy now, those due back soonest first; returns them. For when the job
        has too few slices to run: a slice that may still be bad costs at most a failed start,
        waiting costs the rest of its cooldown."""
        suspects = sorted(
            (state.returns_at, slice_id)
            for slice_id, state in self._slices.items()
            if not state.healthy
            and state.returns_at is not None
            and not (state.outage_until is not None and state.outage_until > now)
        )
        back = sorted(slice_id for _, slice_id in suspects[:count])
        for slice_id in back:
            state = self._slices[slice_id]
            state.healthy, state.returns_at, state.outage_until = True, None, None
        return back

    def next_return(self) -> float | None:
        times = [st.returns_at for st in self._slices.values() if st.returns_at is not None]
        return min(times) if times else None

    def choose(self, current: list[int], exclude: tuple[int, ...] = ()) -> list[int]:
        """Up to `target` healthy slices: the current ones first, then spares by id; `exclude`
        asks what the choice would be without those slices."""
        healthy = [s for s in self.healthy() if s not in exclude]
        kept = [s for s in current if s in healthy]
        extra = [s for s in healthy if s not in kept]
        return (kept + extra)[: self.target]


class RestartPolicy:
    """Counts failures (preemptions and scale-ups are not failures) and says when to give up.

    A crash loop is `crash_loop_limit` failures in a row where no generation got past the step
    at which the previous one failed: the same step keeps failing, so restarting again is futile.
    Only failures that may lie in the program count: errors, and hangs of the whole job. A lost
    slice (a process killed, silent or stuck on its own) is a hardware fault independent of the
    step; its slice is evicted, and it counts only against `max_restarts`. Under frequent faults
    such losses can keep a job from passing a step for a while without any bug.
    Back-off: the first failure of a streak restarts at once (a lost slice is the common case and
    waiting does not help it); each further one waits `backoff_s`, doubling up to `backoff_max_s`.
    """

    def __init__(self, coordinator_config: ml_collections.ConfigDict) -> None:
        c = coordinator_config
        self._max_restarts = int(c.max_restarts)
        self._crash_loop_limit = int(c.crash_loop_limit)
        self._backoff_s = float(c.backoff_s)
        self._backoff_max_s = float(c.backoff_max_s)
        self.failures = 0
        self.streak = 0
        self.streak_step: int | None = None  # the step the last failure of the streak reached
        self._last_was_hardware = False

    def record_failure(self, step: int | None, hardware: bool = False) -> None:
        """`step`: the highest step the failed generation reported (None: none); `hardware`: a
        lost slice, which leaves the crash-loop streak as it is."""
        self.failures += 1
        self._last_was_hardware = hardware
        if hardware:
            return
        reached = -1 if step is None else step
        if self.streak_step is not None and reached <= self.streak_step:
            self.streak += 1
        else:
            self.streak, self.streak_step = 1, reached

    def stop_reason(self) -> str | None:
        """Why the job must stop instead of restarting, or None."""
        if self.streak >= self._crash_loop_limit:
            where = "start-up" if self.streak_step == -1 else f"step {self.streak_step}"
            return (
                f"crash loop: {self.streak} failures in a row without getting past {where} "
                f"(crash_loop_limit={self._crash_loop_limit})"
            )
        if self.failures > self._max_restarts:
            return (
                f"retry budget spent: {self.failures} failures > max_restarts={self._max_restarts}"
            )
        return None

    def backoff(self) -> float:
        if self._last_was_hardware or self.streak <= 1:
            return 0.0
        return min(self._backoff_max_s, self._backoff_s * 2 ** (self.streak - 2))


@dataclasses.dataclass
class ReshapeLedger:
    """What the job measured about reshaping: the step time on each number of slices, and what a
    restart costs (stopping the workers to the next generation's first step)."""

    step_time_s: dict[int, float] = dataclasses.field(default_factory=dict)
    restart_costs_s: list[float] = dataclasses.field(default_factory=list)

    def restart_cost_s(self) -> float | None:
        costs = sorted(self.restart_costs_s)
        return costs[len(costs) // 2] if costs else None


def scale_up_pays(
    ledger: ReshapeLedger,
    slices_now: int,
    slices_after: int,
    mtbf_s: float | None,
    remaining_steps: int | None,
) -> tuple[bool, str]:
    """Whether re-admitting slices now gets more steps done before the next failure.

    Staying gives H / t_now steps over the horizon H; growing gives (H - restart) / t_after. So
    growing pays when H x (t_now / t_after - 1) > restart cost, with H the observed mean time
    between failures (unbounded before the first), capped by the time the remaining steps take.
    Unmeasured bigger meshes and restart costs are tried (that measures them)."""
    t_after = ledger.step_time_s.get(slices_after)
    cost = ledger.restart_cost_s()
    if t_after is None:
        return True, f"the step time on {slices_after} slices is not measured yet"
    if cost is None:
        return True, "no restart cost measured yet"
    t_now = ledger.step_time_s.get(slices_now)
    if t_now is None:
        return False, f"waiting for the step time on {slices_now} slices"
    gain, horizon = readmit_gain_s(t_now, t_after, mtbf_s, remaining_steps)
    pace = f"{t_now:.3g}s/step now, {t_after:.3g}s/step on {slices_after} slices"
    if gain > cost:
        return True, f"{pace}: saves {gain:.0f}s over {horizon:.0f}s > restart {cost:.1f}s"
    return False, f"{pace}: saves {max(gain, 0.0):.1f}s over {horizon:.0f}s <= restart {cost:.1f}s"


def straggler_eviction_pays(ratio: float, slices_now: int, slices_after: int) -> tuple[bool, str]:
    """Whether evicting a slice that takes `ratio` times its peers' step time makes the job faster,
    leaving `slices_after` of `slices_now` slices: a spare takes its place, or the others alone
    step faster than the job waiting for it (the step time grows by N / N_after on fewer devices,
    so the ratio must exceed that)."""
    if slices_after >= slices_now:
        return True, "a spare slice replaces it"
    needed = slices_now / slices_after
    if ratio > needed:
        return True, f"the other {slices_after} slice(s) alone are faster (ratio > {needed:.2f})"
    return False, f"the other {slices_after} slice(s) alone are slower (ratio <= {needed:.2f})"
