"""How the job goes on when a slice is lost or returns: the plans, their expected cost over the
rest of the run, and the choice (`coordinator.reconfiguration`), recorded as a `reconfigure` event.

`Reconfigurer` keeps what the run measured (`policy.ReshapeLedger`: the step time on each slice
count, the cost of each restart, seeded from the run's own event log when the supervisor restarts)
and prices each plan with `perf.plans`: step times measured where the job ran on that many slices,
else predicted by `perf.step_time` (with `coordinator.step_time_calibration`) and scaled to the
measured one, restart cost measured (else `coordinator.restart_cost_s`), MTBF from the run's own
failures. Policies:

- `cost`: the plan with the lowest expected time to the end of the run;
- `reshape`: a spare if there is one, else restart at once on the slices left; a returned slice
  is re-admitted when `policy.scale_up_pays` (with `scale_up_when_faster`);
- `wait`: as `reshape`, but without a spare it waits for a lost slice that returns within
  `wait_for_slices_s`.

Every decision's event carries the chosen plan and every alternative with its expected cost,
whichever policy chose.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import ml_collections

from resilient_jax.config import ConfigError
from resilient_jax.contracts.event_types import EventType
from resilient_jax.control.cluster import ClusterSpec, plan_for
from resilient_jax.control.generation import Generation
from resilient_jax.control.restart_policy import ReshapeLedger, scale_up_pays
from resilient_jax.control.server import WorkerReport
from resilient_jax.events import EventLog, read_events
from resilient_jax.perf import plans as plans_lib
from resilient_jax.perf.plans import Plan, PlanKind
from resilient_jax.perf.step_time import ACCELERATOR_DEFAULT, Calibration, Workload, predict

# A generation's step time counts once it is this many steps past its first.
_STEPS_BEFORE_STEP_TIME = 5


def load_calibration(config: ml_collections.ConfigDict) -> Calibration:
    """`coordinator.step_time_calibration` (a `train.calibrate` JSON), or the default."""
    path = str(config.coordinator.step_time_calibration)
    if not path:
        return ACCELERATOR_DEFAULT
    try:
        return Calibration.load(path)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(
            f"config.coordinator.step_time_calibration={path!r} is invalid: {e}"
        ) from e


def restart_costs_from_log(workdir: str) -> list[float]:
    """Each restart's cost in the run's event log: from the supervisor's `restart` event (less
    the time it spent stopping the old generation before) to the new generation's first step."""
    started: dict[int, float] = {}
    costs = []
    for event in read_events(workdir):
        generation = event.get("generation")
        if not isinstance(generation, int):
            continue
        if event["type"] == EventType.RESTART and event.get("source") == "supervisor":
            started[generation] = float(event["time"]) - float(event.get("stopping_s") or 0.0)
        elif event["type"] == EventType.STEP and generation in started:
            costs.append(float(event["time"]) - started.pop(generation))
    return costs


class Reconfigurer:
    def __init__(
        self,
        config: ml_collections.ConfigDict,
        cluster: ClusterSpec,
        workdir: str,
        events: EventLog,
        say: Callable[[str], None],
    ) -> None:
        self._config, self._cluster = config, cluster
        self._c = config.coordinator
        self.policy = str(self._c.reconfiguration)
        self._events, self._say = events, say
        self._calibration = load_calibration(config)
        self._work = Workload.from_config(config)
        self.ledger = ReshapeLedger(restart_costs_s=restart_costs_from_log(workdir))
        self._first_start_s: float | None = None

    # What the run measured.

    def measure(self, gen: Generation, now: float, reports: dict[int, WorkerReport]) -> None:
        """The restart's cost at a generation's first step, then the generation's step time (the
        slowest process's median, once it has a few steps)."""
        assert gen.max_step is not None
        if gen.first_step is None:
            gen.first_step = gen.max_step
            if gen.number > 0:
                self.ledger.restart_costs_s.append(now - gen.started)
            else:  # a first start costs what a restart does, less the restore
                self._first_start_s = now - gen.started
        medians = [r.step_time_s for r in reports.values() if r.step_time_s is not None]
        if medians and gen.max_step - gen.first_step >= _STEPS_BEFORE_STEP_TIME:
            self.ledger.step_time_s[len(gen.slices)] = max(medians)

    def step_times(self, counts: Iterable[int], current: int) -> dict[int, float]:
        """Step time on each slice count: measured, else the model's scaled to a measured one
        (the current count's first), else the model's own."""
        measured = self.ledger.step_time_s
        anchor = current if current in measured else next(iter(sorted(measured)), None)
        out = {}
        for n in sorted(set(counts)):
            if n in measured:
                out[n] = measured[n]
            elif anchor is not None:
                out[n] = measured[anchor] * self._predict(n) / self._predict(anchor)
            else:
                out[n] = self._predict(n)
        return out

    def _predict(self, slices: int) -> float:
        return predict(self._calibration, self._work, plan_for(self._config, slices, self._cluster))

    def restart_s(self) -> float:
        """The median measured restart, else the first start's cost, else the config's."""
        measured = self.ledger.restart_cost_s()
        if measured is not None:
            return measured
        return self._first_start_s or float(self._c.restart_cost_s)

    # Decisions.

    def after_loss(
        self,
        gen: Generation,
        healthy: int,
        available: int,
        return_in_s: float | None,
        mtbf_s: float | None,
    ) -> PlanKind | None:
        """How to go on after losing a slice of `gen`: `healthy` slices of it can train without
        it (0: too few), `available` with the spares; the lost one is back in `return_in_s`.
        None: no plan applies (the supervisor waits for slices as before)."""
        now = len(gen.slices)
        counts = [n for n in (healthy, now, available) if n > 0]
        sit = self._situation(gen, now, counts, mtbf_s, return_in_s, spares=available >= now)
        options = plans_lib.on_loss(sit, healthy)
        if not options:
            return None
        by_kind = {p.kind: p for p in options}
        if self.policy == "cost":
            chosen = options[0]
        elif PlanKind.SPARE in by_kind:
            chosen = by_kind[PlanKind.SPARE]
        elif self.policy == "wait" and PlanKind.WAIT in by_kind:
            chosen = by_kind[PlanKind.WAIT]
        elif PlanKind.RESHAPE in by_kind:
            chosen = by_kind[PlanKind.RESHAPE]
        else:
            return None  # the fixed policies wait for slices only as they always did
        self._record("slice_lost", gen, sit, chosen, options)
        return chosen.kind

    def readmit(self, gen: Generation, bigger: int, mtbf_s: float | None) -> bool:
        """Whether to restart `gen` on `bigger` slices now that slices returned (records the
        decision once per generation when it defers, and when it re-admits)."""
        assert gen.max_step is not None
        now = len(gen.slices)
        remaining = int(self._config.total_steps) - gen.max_step
        if remaining <= 0:
            # The generation is saving its final step: a restart would only stop again.
            return False
        sit = self._situation(gen, now, (now, bigger), mtbf_s, None, spares=False)
        options = plans_lib.on_return(sit, bigger)
        if not self._c.scale_up_when_faster:
            pays, why = True, "coordinator.scale_up_when_faster is off"
        elif self.policy == "cost":
            pays, why = options[0].kind == PlanKind.READMIT, options[0].why
        else:
            pays, why = scale_up_pays(self.ledger, now, bigger, mtbf_s, remaining)
        kind = PlanKind.READMIT if pays else PlanKind.DEFER
        chosen = next(p for p in options if p.kind == kind)
        readmit = chosen.kind == PlanKind.READMIT
        # The fixed rule waits for a measured step time on the current mesh before it defers.
        settled = self.policy == "cost" or now in self.ledger.step_time_s
        if not self._c.scale_up_when_faster:
            settled = False  # nothing is weighed: nothing to record unless it re-admits
        if readmit or (settled and not gen.scale_up_deferred):
            self._record("slice_returned", gen, sit, chosen, options)
        if not readmit and settled and not gen.scale_up_deferred:
            gen.scale_up_deferred = True
            self._events.emit(
                EventType.SCALE_UP_DEFERRED, generation=gen.number, step=gen.max_step, why=why
            )
            self._say(f"a returned slice waits: re-admitting it does not pay yet ({why})")
        return readmit

    def _situation(
        self,
        gen: Generation,
        slices_now: int,
        counts: Iterable[int],
        mtbf_s: float | None,
        return_in_s: float | None,
        spares: bool,
    ) -> plans_lib.Situation:
        step_s = self.step_times(counts, slices_now)
        every = int(self._config.checkpoint.local_every_steps or 0) or int(
            self._config.checkpoint.every_steps or 0
        )
        return plans_lib.Situation(
            remaining_steps=max(1, int(self._config.total_steps) - (gen.max_step or 0)),
            slices_now=slices_now,
            step_s=step_s,
            restart_s=self.restart_s(),
            mtbf_s=mtbf_s,
            rework_s=every / 2 * step_s[slices_now],
            return_in_s=return_in_s,
            spares=1 if spares else 0,
            wait_limit_s=float(self._c.wait_for_slices_s),
        )

    def _record(
        self,
        trigger: str,
        gen: Generation,
        sit: plans_lib.Situation,
        chosen: Plan,
        options: list[Plan],
    ) -> None:
        alternatives = [p.to_json() for p in options if p is not chosen]
        self._events.emit(
            EventType.RECONFIGURE,
            trigger=trigger,
            policy=self.policy,
            generation=gen.number,
            step=gen.max_step,
            plan=chosen.kind.value,
            slices=chosen.slices,
            expected_s=round(chosen.expected_s, 3),
            why=chosen.why,
            alternatives=alternatives,
            step_s={str(n): round(t, 5) for n, t in sit.step_s.items()},
            restart_s=round(sit.restart_s, 3),
            mtbf_s=None if sit.mtbf_s is None else round(sit.mtbf_s, 3),
            return_in_s=None if sit.return_in_s is None else round(sit.return_in_s, 3),
            remaining_steps=sit.remaining_steps,
        )
        costs = ", ".join(f"{p.kind.value} {p.expected_s:.1f}s" for p in options)
        self._say(f"{trigger.replace('_', ' ')}: {chosen.kind.value} ({self.policy}; {costs})")
