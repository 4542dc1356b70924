"""One training process from config to exit code. `launch/train.py` is a thin flag parser over this.

Resume order (where it is decided): 1. check the config, the fault spec, the worker environment
and the workdir before any work; 2. join the JAX job; 3. plan the mesh for the devices that are
alive; 4. open the data and the checkpoint tiers, refusing a checkpoint directory written by another
model; only then write `config.json` and the `process_start` event into the workdir (a supervised
run's supervisor has written its own events there already, and joining the job logs `jax_init`);
5. restore the newest verified checkpoint onto that mesh (or initialise from the seed); 6. position
the data loader where that state left off; 7. compile; 8. train, the hooks of `build_hooks` saving,
checking health and reporting progress.

How a run ends: `train` returns the exit code of a finished or deliberately stopped run. It raises
`config.BadInput` for input it refuses (config, fault spec, workdir, data, another model's
checkpoints): fatal, exit 2, never restarted. `RunError` carries the code of a checkpoint failure
(restartable). Anything else is unexpected: the launcher logs its traceback and exits
`ExitCode.FAILED`, which a supervisor restarts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import ml_collections

from resilient_jax import config as config_lib
from resilient_jax import rehearsal
from resilient_jax.chaos.faulty_step import wrap_step
from resilient_jax.chaos.hook import ChaosHook
from resilient_jax.checkpoint import Checkpointer, CheckpointError
from resilient_jax.config import BadInput
from resilient_jax.contracts import env_vars
from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.contracts.messages import Phase
from resilient_jax.control import standby
from resilient_jax.data import BatchLoader, make_source
from resilient_jax.data.position import DataPosition
from resilient_jax.data.sources import make_dataset
from resilient_jax.data.split import holdout
from resilient_jax.elastic import runtime as elastic_runtime
from resilient_jax.events import EventLog
from resilient_jax.goodput import accounting as goodput
from resilient_jax.health import HealthMonitor, Watchdog
from resilient_jax.hf.importer import HFSource
from resilient_jax.train.compile import compile_eval_step, compile_step, without_fault_scale
from resilient_jax.train.context import RunContext, prepare
from resilient_jax.train.deferred import DeferredProgram
from resilient_jax.train.eval import EvalStepFn, Evaluator
from resilient_jax.train.hooks import Hook, StopTraining
from resilient_jax.train.loop import Loop
from resilient_jax.train.metrics import MetricsLogger
from resilient_jax.train.profile import Profiler
from resilient_jax.train.state import TrainState, init_state
from resilient_jax.train.step import StepFn, document_eos_id
from resilient_jax.worker import candidates as candidates_lib
from resilient_jax.worker.candidates import CandidateCompiler
from resilient_jax.worker.client import SupervisorClient
from resilient_jax.worker.distributed import initialize_from_env, read_env

_T = TypeVar("_T")


class RunError(Exception):
    """A failure with a one-line reason and the exit code to end the process with."""

    def __init__(self, reason: str, exit_code: ExitCode) -> None:
        super().__init__(reason)
        self.exit_code = exit_code


def check_workdir(workdir: str) -> None:
    """Raises `BadInput` unless `workdir` is a directory this process can write, or can be made
    one. Runs before anything is written, so a refused workdir is left as it was."""
    if os.path.lexists(workdir) and not os.path.isdir(workdir):
        raise BadInput(f"workdir {workdir} exists and is not a directory")
    existing = workdir
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise BadInput(f"workdir {workdir} cannot be created: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == workdir else f" in {existing}"
        raise BadInput(f"workdir {workdir} cannot be written{where}: permission denied")


def write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config_lib.config_to_dict(config), f, indent=2, sort_keys=True)


def build_hooks(
    ctx: RunContext,
    *,
    checkpointer: Checkpointer,
    watchdog: Watchdog,
    client: SupervisorClient | None = None,
    chaos: ChaosHook | None = None,
    held_out: Any = None,
    eval_step: EvalStepFn | DeferredProgram | None = None,
    eval_datasets: dict[str, Any] | None = None,
    candidates: CandidateCompiler | None = None,
) -> list[Hook]:
    """The hooks of a run, in the order the loop calls them at every step:

    1. `MetricsLogger`, first, so that a step whose anomaly triggers a rollback still gets its
       `step` event and metrics row;
    2. `HealthMonitor`: skip, roll back or stop on the step's anomaly verdict;
    3. `SupervisorClient` (supervised runs): the step reaches the supervisor's heartbeats;
    4. `Watchdog`: the step counts as progress;
    5. `Evaluator` (with `eval_step`): the held-out loss of the state (and of `eval_datasets`),
       into the step's metrics row; before the checkpointer, so a run stopped after a save at
       step s has evaluated s;
    6. `Checkpointer`: saves by policy the state the hooks above have let through;
    7. `Profiler` (with `profile.steps`): starts and stops the trace between steps;
    8. `CandidateCompiler` (supervised runs on 2+ slices): after the first step, the step of the
       mesh a lost slice leads to is compiled into the cache in the background;
    9. `ChaosHook` (with `--chaos`), last, so that a fault due at step K strikes after every other
       hook has seen step K-1.

    The watchdog, the client and the checkpointer exist before the loop (they guard the start-up
    and the restore), and the evaluation step is compiled beside the train step (deferred: after
    the first train step), so they are passed in; the others are made here.
    """
    metrics = MetricsLogger(ctx)
    hooks: list[Hook] = [metrics, HealthMonitor()]
    if client is not None:
        hooks.append(client)
    hooks.append(watchdog)
    if eval_step is not None:
        hooks.append(Evaluator(ctx, held_out, eval_step, metrics, eval_datasets))
    hooks.append(checkpointer)
    profiler = Profiler.from_config(ctx.config)
    if profiler is not None:
        hooks.append(profiler)
    if candidates is not None:
        hooks.append(candidates)
    if chaos is not None:
        hooks.append(chaos)
    return hooks


def _eval_datasets(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The held-out part of each `eval.datasets` entry, by name (none with evaluation off)."""
    if not config.eval.every_steps:
        return {}
    return {
        name: holdout(make_dataset(config, path, "eval.datasets"), config.eval.fraction)[1]
        for name, path in config_lib.parse_eval_datasets(config.eval.datasets)
    }


def _become_slice(ctx: RunContext, watchdog: Watchdog) -> str:
    """A warm standby slice: waits, idle, at the join point for the slice it replaces, then takes
    its identity (id, workdir, event log, output). Returns the slice's workdir."""
    waiting = time.monotonic()
    ctx.events.emit(EventType.ELASTIC_STANDBY_READY)
    watchdog.suspend()
    try:
        role = standby.wait_on_quorum(
            os.environ.get(env_vars.QUORUM_ADDRESS, ""),
            os.environ.get(env_vars.RUN_TOKEN, ""),
            give_up_s=float(ctx.config.elastic.quorum_timeout_s),
        )
    except standby.NoSupervisor as e:
        raise RunError(str(e), ExitCode.FAILED) from e
    watchdog.resume()
    standby.become(role, process=jax.process_index())
    slice_id = elastic_runtime.slice_id()  # the role's, now in the environment
    ctx.events.move(role.workdir)
    ctx.events.update_common(slice=slice_id)
    ctx.workdir = role.workdir
    ctx.events.emit(
        EventType.ELASTIC_STANDBY_ASSIGNED, slice=slice_id, waited_s=time.monotonic() - waiting
    )
    return role.workdir


def _checked(fn: Callable[[], _T]) -> _T:
    """Runs `fn`, turning a checkpoint failure (nothing valid to restore, a save that did not
    commit) into a RunError: the run must exit non-zero with the reason."""
    try:
        return fn()
    except BadInput:  # another model's checkpoints: fatal as it is
        raise
    except CheckpointError as e:
        raise RunError(f"checkpoint: {e}", ExitCode.CHECKPOINT) from e


def train(config: ml_collections.ConfigDict, workdir: str, chaos: str = "") -> int:
    """Runs training; returns the exit code of a finished (0) or deliberately stopped run.

    Raises `BadInput` on input it refuses, `RunError` on a checkpoint failure (see the module
    docstring); anything else it raises is unexpected. JAX's own compilation cache stays as the
    caller set it (a worker process turns it off: `launch/train.py`); the executables this run
    stores are compiled with it bypassed either way (`executables`).
    """
    config_lib.validate(config)
    faults = ChaosHook(chaos) if chaos else None
    read_env()  # a launcher's worker environment that does not add up is refused here, early
    check_workdir(workdir)
    events = EventLog(workdir, pid=os.getpid())
    # What the run opens is closed on the way out, the last opened first.
    with contextlib.ExitStack() as lifetime:
        # Heartbeats to the supervisor (if one started us) begin before the slow JAX start-up.
        client = SupervisorClient.from_env(config.coordinator, workdir=workdir)
        if client is not None:
            lifetime.callback(client.close)
            if client.fence is not None:
                events.fence_with(client.fence)  # a superseded generation appends nothing
        watchdog = Watchdog.from_config(config.health, events)
        watchdog.start()  # from here on a hang anywhere (init, restore, a collective) ends us
        lifetime.callback(watchdog.close)
        if faults is not None:
            lifetime.callback(faults.close)
        env = initialize_from_env(config.coordinator, events)
        generation = env.generation if env is not None else 0
        events.update_common(generation=generation)
        candidates = None
        if env is not None and candidates_lib.eligible(config, env):
            candidates = CandidateCompiler(env)
            lifetime.callback(candidates.close)
        return _train(
            config, workdir, events, lifetime, faults, client, watchdog, generation, candidates
        )


@dataclasses.dataclass
class _Inputs:
    """What the run reads, each refused here if unusable, before anything is written."""

    source: Any  # the training examples, the held-out share taken out
    held_out: Any
    eval_datasets: dict[str, Any]
    replay: Any  # rehearsal's old data (None without rehearsal)
    hf_source: HFSource | None  # checkpoint.init_from_hf


def _open_inputs(config: ml_collections.ConfigDict) -> _Inputs:
    # The validation split is held out of training whether or not evaluation runs.
    source, held_out = holdout(make_source(config), config.eval.fraction)
    # data.document_mask without an end-of-text token: refused here, before anything is written
    # (the step that needs the token may come from the executable cache, never traced).
    document_eos_id(config)
    return _Inputs(
        source,
        held_out,
        _eval_datasets(config),
        rehearsal.open_replay(config),
        HFSource.from_config(config),
    )


def _train(
    config: ml_collections.ConfigDict,
    workdir: str,
    events: EventLog,
    lifetime: contextlib.ExitStack,
    faults: ChaosHook | None,
    client: SupervisorClient | None,
    watchdog: Watchdog,
    generation: int,
    candidates: CandidateCompiler | None,
) -> int:
    ctx = prepare(config, workdir, events, generation)
    is_standby = config.elastic.enabled and standby.is_standby_slice()
    if config.elastic.enabled and not is_standby:  # the job's slice, not the runtime's (always 0)
        events.update_common(slice=elastic_runtime.slice_id())
    inputs = _open_inputs(config)
    # Elastic mode's exchange and programs close after the checkpointer, which saves through them.
    elastic = lifetime.enter_context(contextlib.ExitStack())
    warm = None
    if is_standby:  # built ahead; then idle until given the identity of the slice it replaces
        warm = elastic.enter_context(contextlib.closing(elastic_runtime.warm_up(ctx, standby=True)))
        workdir = _become_slice(ctx, watchdog)
    checkpointer = _checked(lambda: lifetime.enter_context(Checkpointer(ctx)))
    # The workdir is accepted: only from here on does the run write into it.
    if jax.process_index() == 0:
        write_config(config, workdir)
    events.emit(EventType.PROCESS_START, topology=ctx.topology.describe(), mesh=ctx.plan.describe())
    with contextlib.ExitStack() as loop_scope:  # what only the loop uses ends with it
        step_fn, loader, state, session = _start(
            ctx, inputs, checkpointer, faults, client, warm, loop_scope
        )
        if session is not None:
            elastic.enter_context(contextlib.closing(session))
        # Not needed before the first evaluation: loaded beside training, not before it.
        eval_step = None
        if config.eval.every_steps:
            eval_step = DeferredProgram(lambda: compile_eval_step(ctx, background=True))
            loop_scope.callback(eval_step.join)
        hooks = build_hooks(
            ctx,
            checkpointer=checkpointer,
            watchdog=watchdog,
            client=client,
            chaos=faults,
            held_out=inputs.held_out,
            eval_step=eval_step,
            eval_datasets=inputs.eval_datasets,
            candidates=candidates,
        )
        # The hooks close in the loop's order (`build_hooks`), before what was opened ahead of
        # them unwinds (closing twice is a no-op).
        lifetime.callback(_close_all, hooks)
        exit_code, reason = _run_loop(ctx, step_fn, loader, hooks, checkpointer, state)
    events.emit(EventType.STOP, reason=reason, exit_code=exit_code)
    if jax.process_index() == 0:
        goodput.print_summary(workdir)
    return exit_code


def _start(
    ctx: RunContext,
    inputs: _Inputs,
    checkpointer: Checkpointer,
    faults: ChaosHook | None,
    client: SupervisorClient | None,
    warm: elastic_runtime.Warm | None,
    loop_scope: contextlib.ExitStack,
) -> tuple[StepFn, Any, TrainState, elastic_runtime.ElasticSession | None]:
    """The step function, the loader and the state the loop starts from: restored (or initialised)
    and compiled; in elastic mode, joined to the live slices (which may heal the state instead),
    with the elastic session. What the loop alone uses (the loader, the compiled step) closes with
    `loop_scope`."""
    config = ctx.config

    def phase(name: str) -> contextlib.AbstractContextManager[Any]:
        return client.phase(name) if client is not None else contextlib.nullcontext()

    def load() -> tuple[TrainState, DataPosition]:
        """The newest verified checkpoint's state, or (none) a fresh one from the seed."""
        start = time.perf_counter()
        with phase(Phase.RESTORE):
            restored = _checked(lambda: checkpointer.restore_latest(ctx))
        if restored is not None:
            return restored.state, restored.data_position
        state = init_state(config, ctx.mesh)
        if inputs.hf_source is not None:  # a fresh start: parameters from the HF directory
            state = state.replace(params=inputs.hf_source.load_params(ctx.abstract_state.params))
        ctx.events.emit(
            EventType.INIT,
            duration_s=time.perf_counter() - start,
            source=config.checkpoint.init_from_hf or None,
        )
        return state, DataPosition()

    if config.elastic.enabled and not config.rehearsal.mode:
        # Joins first: a slice that a live one heals receives its state and never loads one
        # (`load` runs only when no slice of the job has a state).
        return _join(ctx, inputs.source, load, warm, phase, loop_scope)
    state, position = load()
    # Continual pretraining: the rehearsal share joins the data (a synthetic set is generated
    # from the starting parameters first, if it is not complete yet).
    source = rehearsal.training_source(
        config, ctx.workdir, inputs.source, inputs.replay, state.params, int(state.step), ctx.events
    )
    if config.elastic.enabled:
        loaded = state, position
        return _join(ctx, source, lambda: loaded, None, phase, loop_scope)
    loader = BatchLoader(config, ctx.mesh, ctx.plan, source, position)
    loop_scope.callback(loader.close)
    with phase(Phase.COMPILE):
        compiled = compile_step(ctx)
    # A process that exits while XLA compiles in a thread aborts: the loop's end waits for them.
    loop_scope.callback(compiled.close)
    step_fn = wrap_step(compiled, faults) if faults is not None else without_fault_scale(compiled)
    return step_fn, loader, state, None


def _join(
    ctx: RunContext,
    source: Any,
    load: Callable[[], tuple[TrainState, DataPosition]],
    warm: elastic_runtime.Warm | None,
    phase: Callable[[str], contextlib.AbstractContextManager[Any]],
    loop_scope: contextlib.ExitStack,
) -> tuple[StepFn, Any, TrainState, elastic_runtime.ElasticSession]:
    """Elastic mode's start: joins the quorum (healed by a live slice, or `load`ing)."""
    with phase(Phase.COMPILE):
        step_fn, loader, state, session = elastic_runtime.start(ctx, source, load, warm)
    loop_scope.callback(loader.close)
    return step_fn, loader, state, session


def _run_loop(
    ctx: RunContext,
    step_fn: StepFn,
    loader: Any,
    hooks: list[Hook],
    checkpointer: Checkpointer,
    state: TrainState,
) -> tuple[int, str]:
    """Trains until the end or a deliberate stop; (exit code, reason)."""

    def restore(max_step: int | None = None) -> tuple[TrainState, DataPosition] | None:
        restored = checkpointer.restore_latest(ctx, max_step=max_step)
        return None if restored is None else (restored.state, restored.data_position)

    try:
        _checked(lambda: Loop(ctx, step_fn, loader, hooks, restore).run(state))
        return ExitCode.FINISHED, "finished"
    except StopTraining as stop:
        return stop.exit_code, stop.reason
    except RunError as e:
        ctx.events.emit(EventType.STOP, reason=str(e), exit_code=e.exit_code)
        raise


def _close_all(hooks: list[Hook]) -> None:
    for hook in hooks:
        hook.close()
