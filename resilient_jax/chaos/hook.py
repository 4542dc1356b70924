"""The worker side of `--chaos` (the spec is in `resilient_jax.chaos.spec`): `ChaosHook` acts out
the faults that hit a process (kill, hang, slow, lose_slice, corrupt_checkpoint) from the loop's
hook calls, and gives `resilient_jax.chaos.faulty_step.wrap_step` the loss scale of the faults
that hit a step (nan, spike).

Steps are the step numbers the run logs (the `step` of `StepInfo`, of the metrics and of `step`
events): a fault at step K fires just before step K is taken, so `nan:step=5` makes the step
logged as 5 NaN and `kill:process=0,step=5` kills process 0 after step 4. Process faults fire in
`after_step` of step K-1 (or in `on_start` when K is the first step this process takes); loss
faults fire when the wrapped step K is called.

A fault with a step fires at the first step >= K that its target takes: a process or slice that
was not running at step K (evicted, or the run resumed past K) gets it when it next runs. Only
nan and spike fire at exactly step K (they must hit every process at one step, see below).

Each fault fires once per run, even across restarts (`resilient_jax.chaos.record`). Every
injected fault writes a `chaos` event first.

Faults that change the loss (nan, spike) must hit every process at the same step, or replicated
values would diverge. With explicit steps that holds by construction. For a random schedule,
which is timed by the clock, process 0 decides when the time has come and writes the step, a few
steps ahead, into `chaos_fired.json`, which every process polls (a `stat` per step).

The `chaos` event of a `lose_slice` names the slice and its `for_s` as it happens; the supervisor
reads it from the event log.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from resilient_jax.chaos import corrupt
from resilient_jax.chaos.record import FiredRecord, is_spent
from resilient_jax.chaos.spec import Fault, parse
from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.faults import HOST_FAULT_KINDS, LOSS_KINDS, FaultKind
from resilient_jax.train.hooks import Hook, StepInfo

if TYPE_CHECKING:
    from resilient_jax.train.context import RunContext
    from resilient_jax.train.state import TrainState

SCHEDULE_AHEAD_STEPS = 4  # synchronous processes are at most a couple of steps apart


def _block_forever() -> None:
    while True:
        threading.Event().wait(3600)


class ChaosHook(Hook):
    """Injects the faults of a spec. `local_checkpoint_dir`: this process's local tier root
    (holding `<step>/state`), also corrupted by `corrupt_checkpoint`. Put it last among the
    hooks, so that a fault due at step K strikes after every other hook has seen step K-1."""

    def __init__(
        self,
        spec: str,
        *,
        local_checkpoint_dir: str | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        block_forever: Callable[[], None] = _block_forever,
    ) -> None:
        self.faults = parse(spec)
        self._local_dir = local_checkpoint_dir
        self._clock = clock
        self._sleep = sleep
        self._block_forever = block_forever
        self._ctx: RunContext | None = None
        self._done: set[str] = set()  # fired or spent in this process
        self._slow_factor = 1.0
        self._record: FiredRecord | None = None
        self._start_time = 0.0
        self._last_step_end: float | None = None
        self._last_sleep = 0.0

    def on_start(self, ctx: RunContext, state: TrainState) -> None:
        self._ctx = ctx
        if not self.faults:
            return
        self._open(ctx)  # pins the run's start time for random schedules
        self._last_step_end = self._clock()
        first_step = int(jax.device_get(state.step)) + 1
        if first_step <= ctx.config.total_steps:
            self._fire(ctx, first_step, loss=False)

    def after_step(self, ctx: RunContext, state: TrainState, info: StepInfo) -> None:
        if not self.faults:
            return
        self._slow_down()
        if info.step < ctx.config.total_steps:  # the loop takes no step past the last
            self._fire(ctx, info.step + 1, loss=False)

    def loss_scale(self, step: int) -> float:
        """The factor on the loss of `step` (NaN, a spike factor, or 1.0), firing the loss faults
        due at it. Called by the wrapped step just before it takes `step`."""
        if not self.faults:
            return 1.0
        if self._ctx is None:
            raise RuntimeError("ChaosHook.on_start must run before the wrapped step")
        return self._fire(self._ctx, step, loss=True)

    def _open(self, ctx: RunContext) -> FiredRecord:
        if self._record is None:
            self._record = FiredRecord(ctx.workdir)
            data = self._record.update(lambda d: d.setdefault("start_time", self._clock()))
            self._start_time = data["start_time"]
        return self._record

    def _fire(self, ctx: RunContext, step: int, *, loss: bool) -> float:
        """Fires the loss faults (`loss`) or the process faults due at `step` that target this
        process; returns the product of their factors on the loss."""
        record = self._open(ctx)
        scale = 1.0
        for fault in self.faults:
            if (fault.kind in LOSS_KINDS) != loss or fault.key in self._done:
                continue
            if fault.kind in HOST_FAULT_KINDS:  # the supervisor has the host's agent act it out
                continue
            if not self._due(fault, ctx, step, record):
                continue
            self._done.add(fault.key)
            if not self._targets_me(fault, ctx):
                continue
            if self._claim(fault, ctx, step, record):
                scale *= self._inject(fault, ctx, step)
        return scale

    def _due(self, fault: Fault, ctx: RunContext, step: int, record: FiredRecord) -> bool:
        if fault.step is not None:
            return step == fault.step if fault.kind in LOSS_KINDS else step >= fault.step
        elapsed = self._clock() - self._start_time
        if fault.kind not in LOSS_KINDS:
            return elapsed >= (fault.at_s or 0.0)
        scheduled = record.read_if_changed()["scheduled"].get(fault.key)
        if scheduled is None and ctx.topology.process_index == 0 and elapsed >= fault.at_s:
            at_step = step + SCHEDULE_AHEAD_STEPS
            record.update(lambda d: d["scheduled"].setdefault(fault.key, at_step))
            return False
        return scheduled == step

    def _targets_me(self, fault: Fault, ctx: RunContext) -> bool:
        topo = ctx.topology
        process = fault.target_process(topo.num_processes)
        if process is not None:
            return process == topo.process_index
        slice_ = fault.target_slice(topo.num_slices)
        if slice_ is not None:
            return slice_ == topo.slice_index
        return True

    def _claim(self, fault: Fault, ctx: RunContext, step: int, record: FiredRecord) -> bool:
        """Records this process firing `fault`, unless it is spent; True if it should fire."""
        me, pid, generation = ctx.topology.process_index, os.getpid(), ctx.generation
        claimed = False

        def change(data: dict[str, Any]) -> None:
            nonlocal claimed
            if is_spent(data, fault, generation, me, pid):
                return
            data["fired"].setdefault(fault.key, {})[str(me)] = {
                "generation": generation,
                "pid": pid,
                "step": step,
                "time": self._clock(),
            }
            claimed = True

        record.update(change)
        return claimed

    def _inject(self, fault: Fault, ctx: RunContext, step: int) -> float:
        """Acts out one fault; returns its factor on the step's loss."""
        info: dict[str, Any] = {"kind": fault.kind, "fault": fault.text, "step": step}
        if fault.kind in (FaultKind.SPIKE, FaultKind.SLOW):
            info["factor"] = fault.factor
        elif fault.kind == FaultKind.HANG:
            info["mode"] = fault.mode
        elif fault.kind == FaultKind.LOSE_SLICE:
            info.update(slice=ctx.topology.slice_index, for_s=fault.for_s)
        elif fault.kind == FaultKind.CORRUPT_CHECKPOINT:
            files, corrupted = self._corrupt(ctx)
            info.update(checkpoint=corrupted, files=len(files))
        ctx.events.emit(EventType.CHAOS, **info)

        if fault.kind == FaultKind.NAN:
            return float("nan")
        if fault.kind == FaultKind.SPIKE:
            return fault.factor
        if fault.kind == FaultKind.SLOW:
            self._slow_factor = fault.factor
        elif fault.kind == FaultKind.HANG:
            if fault.mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                self._block_forever()
        elif fault.kind in (FaultKind.KILL, FaultKind.LOSE_SLICE):
            os.kill(os.getpid(), signal.SIGKILL)
        return 1.0

    def _corrupt(self, ctx: RunContext) -> tuple[list[str], list[str]]:
        roots = [self._local_dir] if self._local_dir else []
        if ctx.topology.process_index == 0:  # the persistent tier is shared: one writer
            persistent = corrupt.persistent_checkpoint_root(ctx.config, ctx.workdir)
            roots += [persistent] if persistent else []
        return corrupt.corrupt_newest(roots)

    def _slow_down(self) -> None:
        """Stretches this process's step time by the slow factor, measured without our sleep."""
        now = self._clock()
        if self._slow_factor > 1.0 and self._last_step_end is not None:
            natural = max(0.0, now - self._last_step_end - self._last_sleep)
            self._last_sleep = (self._slow_factor - 1.0) * natural
            self._sleep(self._last_sleep)
        self._last_step_end = now
