"""A stand-in training program that speaks the worker side of the protocol, without a model.

    python -m resilient_jax.testing.sim_worker --config=CONFIG.py --workdir=DIR

It exercises the supervisor the way `launch/train.py` does, in about a second per start: joins the
JAX job from the environment, reports heartbeats and progress, runs one cross-process collective per
step, saves its state every `checkpoint.every_steps`, resumes from the last save after a restart and
handles preemption (SIGTERM: save at the step all processes agree on, exit ExitCode.PREEMPTED).
Of the trainer's `--chaos` faults it acts out `slow` (a straggler), the one that needs no model.

Its state follows the trainer's contract: step s reduces the global batch of rows
[s*B, (s+1)*B) (B = global_batch_size), each process summing its share, so the final `value` is
the same whatever the process count and however often the job was reshaped. `--sim_*` flags
inject faults from inside a worker (a software error, a hung main thread, a lost slice).
"""

from __future__ import annotations

import json
import os
import signal
import time

from absl import app, flags
from ml_collections import config_flags

from resilient_jax.chaos import spec as chaos_spec
from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.contracts.faults import HOST_FAULT_KINDS, FaultKind
from resilient_jax.contracts.messages import Phase
from resilient_jax.events import EventLog
from resilient_jax.worker.client import SupervisorClient
from resilient_jax.worker.distributed import WorkerEnv, initialize_from_env

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.", required=True)
_STEP_TIME = flags.DEFINE_float("sim_step_time_s", 0.05, "Seconds of simulated work per step.")
_START_TIME = flags.DEFINE_float(
    "sim_start_s", 0.0, "Seconds of simulated start-up (a compile) before the first step."
)
_CRASH_AT = flags.DEFINE_integer("sim_crash_at_step", -1, "Fail before this step.")
_CRASH_CODE = flags.DEFINE_integer(
    "sim_crash_exit_code", 0, "0: fail by raising; else leave at once with this exit code."
)
_LOSE_SLICE_FOR = flags.DEFINE_float(
    "sim_lose_slice_for_s",
    0.0,
    "> 0: instead of failing, announce a slice outage of this length and SIGKILL this process, "
    "as the chaos hook's lose_slice does.",
)
_HANG_AT = flags.DEFINE_integer("sim_hang_at_step", -1, "Hang (heartbeats go on) before this step.")
_FAULT_PROCESS = flags.DEFINE_integer("sim_fault_process", 0, "Process the --sim_* faults hit.")
_FAULT_GENERATION = flags.DEFINE_integer(
    "sim_fault_generation", -1, "Generation the --sim_* faults hit (-1: every one)."
)
_CHAOS = flags.DEFINE_string(
    "chaos", "", "Fault spec as launch/train.py takes it; only `slow` faults are acted out."
)

STATE_FILE = "sim_state.json"


def _load(workdir: str) -> dict:
    path = os.path.join(workdir, STATE_FILE)
    if not os.path.exists(path):
        return {"step": 0, "value": 0.0}
    with open(path) as f:
        return json.load(f)


def _save(workdir: str, state: dict) -> None:
    path = os.path.join(workdir, STATE_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)  # atomic: a crash mid-save leaves the previous state


def _slow_faults(spec: str) -> list[chaos_spec.Fault]:
    faults = chaos_spec.parse(spec)
    acted = (FaultKind.SLOW, *HOST_FAULT_KINDS)  # host faults are the supervisor's
    other = sorted({f.kind.value for f in faults if f.kind not in acted})
    if other:
        raise app.UsageError(f"the stand-in worker acts out only `slow` faults, not {other}")
    return faults


def _step_time(slow: list[chaos_spec.Fault], process: int, num_processes: int, step: int) -> float:
    factor = 1.0
    for fault in slow:
        if fault.target_process(num_processes) == process and step >= (fault.step or 1):
            factor *= fault.factor
    return _STEP_TIME.value * factor


def _restore(client: SupervisorClient | None, workdir: str, events: EventLog) -> dict:
    """The last saved state, read between the restore and ready phases the supervisor watches."""
    if client:
        client.set_phase(Phase.RESTORE)
    state = _load(workdir)
    events.emit(EventType.RESTORE, step=state["step"])
    if _START_TIME.value > 0:
        if client:
            client.set_phase(Phase.COMPILE)
        time.sleep(_START_TIME.value)
    if client:
        client.set_phase(Phase.READY)
    return state


def _commit(workdir: str, events: EventLog, process: int, step: int, value: float) -> None:
    """Saves the state at `step`; process 0 alone writes (the state is the same on every one)."""
    if process == 0:
        if events.fence is not None:  # the commit of a superseded generation: refused
            events.fence.check()
        _save(workdir, {"step": step, "value": value})
        events.emit(EventType.SAVE, step=step)


def _act_out_faults(step: int, env: WorkerEnv | None, events: EventLog) -> None:
    """The --sim_* faults due before `step`, in the process and generation they hit."""
    if step == _CRASH_AT.value:
        if _LOSE_SLICE_FOR.value > 0:
            slice_index = env.slice_index if env else 0
            events.emit(
                EventType.CHAOS,
                kind=FaultKind.LOSE_SLICE,
                slice=slice_index,
                for_s=_LOSE_SLICE_FOR.value,
            )
            os.kill(os.getpid(), signal.SIGKILL)
        if _CRASH_CODE.value:
            os._exit(_CRASH_CODE.value)  # as a worker that stops the run on purpose does
        raise RuntimeError(f"simulated software error before step {step}")
    if step == _HANG_AT.value:
        while True:  # the main thread is stuck; the client's thread keeps heartbeating
            time.sleep(1.0)


def main(argv: list[str]) -> int:
    del argv
    config = _CONFIG.value
    workdir = _WORKDIR.value
    slow = _slow_faults(_CHAOS.value)
    client = SupervisorClient.from_env(config.coordinator, workdir=workdir)
    events = EventLog(workdir)
    if client is not None and client.fence is not None:
        events.fence_with(client.fence)
    env = initialize_from_env(config.coordinator, events)

    import jax  # after initialize_from_env: nothing may touch the backend before it
    import numpy as np
    from jax.experimental import multihost_utils

    process = jax.process_index()
    num_processes = jax.process_count()
    events.update_common(process=process, generation=env.generation if env else 0, pid=os.getpid())
    batch = config.global_batch_size
    rows = batch // num_processes
    distributed = env is not None

    state = _restore(client, workdir, events)
    generation = env.generation if env else 0
    faulty = process == _FAULT_PROCESS.value and _FAULT_GENERATION.value in (-1, generation)
    last = time.monotonic()
    for step in range(state["step"] + 1, config.total_steps + 1):
        if faulty:
            _act_out_faults(step, env, events)
        first = (step - 1) * batch + process * rows
        partial = np.float64(np.arange(first, first + rows, dtype=np.float64).sum())
        if distributed:
            partial = float(np.sum(multihost_utils.process_allgather(np.array([partial]))))
        state["value"] += float(partial) * 1e-6
        time.sleep(_step_time(slow, process, num_processes, step))
        now = time.monotonic()
        if client:
            client.report_step(step, now - last)
        last = now
        every = config.checkpoint.every_steps
        if distributed and multihost_utils.reached_preemption_sync_point(step):
            _commit(workdir, events, process, step, state["value"])
            events.emit(EventType.STOP, reason="preempted", step=step)
            return ExitCode.PREEMPTED
        if every and step % every == 0:
            _commit(workdir, events, process, step, state["value"])
    if client:
        client.set_phase(Phase.DONE)
    _commit(workdir, events, process, config.total_steps, state["value"])
    if client:
        client.close()
    return ExitCode.FINISHED


if __name__ == "__main__":
    app.run(main)
