"""Worker-side hang detection: if no step completes in time, say so and exit non-zero.

A process stuck in a collective with a dead peer, or in a deadlocked input pipeline, never raises
anything; only a clock notices. A daemon thread holds a deadline that every completed step pushes
forward. Before the first step of a (re)start the budget is `startup_timeout_s`, because restore and
compilation take much longer than a step. When the deadline passes the thread writes a
`failure_detected` event (cause `hang`) and ends the process with `os._exit(ExitCode.HUNG)`:
`sys.exit` from a thread would end only that thread, and the main thread is stuck, so nothing
short of `_exit` lets the supervisor see the failure and act.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.train.hooks import Hook, StepInfo

if TYPE_CHECKING:
    from resilient_jax.events import EventLog
    from resilient_jax.train.context import RunContext
    from resilient_jax.train.state import TrainState


class Watchdog(Hook):
    def __init__(
        self,
        events: EventLog,
        timeout_s: float,
        startup_timeout_s: float,
        *,
        exit_code: int = ExitCode.HUNG,
        exit_fn: Callable[[int], Any] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._events = events
        self._exit_code = exit_code
        self._exit_fn = exit_fn
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._deadline = float("inf")
        self._last_progress = clock()
        self._phase = "startup"
        self._step: int | None = None
        self.fired = False

    @classmethod
    def from_config(cls, health: Any, events: EventLog) -> Watchdog:
        return cls(events, health.watchdog_timeout_s, health.watchdog_startup_timeout_s)

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def start(self) -> None:
        """Arms the startup budget; call it as early as possible (before restore and compile)."""
        if not self.enabled or self._thread is not None:
            return
        self._arm(self.startup_timeout_s, "startup")
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    def pet(self, step: int | None = None) -> None:
        """Progress was made: the next step has `timeout_s` to complete."""
        if step is not None:
            self._step = step
        self._arm(self.timeout_s, "step")

    def suspend(self) -> None:
        """No deadline until `resume`: a standby slice waiting idle for its identity is not hung."""
        self._arm(float("inf"), "standby")

    def resume(self) -> None:
        """The startup budget again, from now."""
        self._arm(self.startup_timeout_s, "startup")

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def on_start(self, ctx: RunContext, state: TrainState) -> None:
        if self._thread is None:
            self.start()
        else:
            self._arm(self.startup_timeout_s, "startup")  # the first step compiles again

    def after_step(self, ctx: RunContext, state: TrainState, info: StepInfo) -> None:
        self.pet(info.step)

    def on_metrics(self, ctx: RunContext, step: int, metrics: dict[str, float]) -> None:
        self.pet()

    def on_end(self, ctx: RunContext, state: TrainState, info: StepInfo | None) -> None:
        self.stop()

    def close(self) -> None:
        self.stop()

    def _arm(self, budget_s: float, phase: str) -> None:
        with self._lock:
            now = self._clock()
            self._last_progress = now
            self._deadline = now + budget_s
            self._phase = phase

    def _watch(self) -> None:
        while not self._stopped:
            with self._lock:
                remaining = self._deadline - self._clock()
            if remaining <= 0:
                self._fire()
                return
            self._wake.wait(min(remaining, 10.0))  # finite: a suspended deadline is infinite

    def _fire(self) -> None:
        with self._lock:
            stalled = self._clock() - self._last_progress
            phase, step = self._phase, self._step
        self.fired = True
        budget = self.startup_timeout_s if phase == "startup" else self.timeout_s
        reason = f"watchdog: no step completed for {stalled:.1f} s ({phase} budget {budget:g} s)"
        try:
            self._events.emit(
                EventType.FAILURE_DETECTED,
                cause="hang",
                phase=phase,
                step=step,
                latency_s=round(stalled, 3),
                timeout_s=budget,
                reason=reason,
            )
        finally:
            print(reason, file=sys.stderr, flush=True)
            self._exit_fn(self._exit_code)
