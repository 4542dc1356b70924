"""One training process from config to exit code. `launch/train.py` is a thin flag parser over this.

Resume order (where it is decided): 1. validate the config and data before any work; 2. join the
JAX job; 3. plan the mesh for the devices that are alive; 4. restore the newest verified checkpoint
onto that mesh (or initialise from the seed); 5. position the data loader where that state left
off; 6. compile; 7. train, the hooks saving, checking health and reporting progress.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import jax
import ml_collections

from resilient_jax import config as config_lib
from resilient_jax import mesh as mesh_lib
from resilient_jax import topology as topology_lib
from resilient_jax.chaos.hook import ChaosHook
from resilient_jax.checkpoint import Checkpointer, CheckpointError
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.control.protocol import PHASE_COMPILE, PHASE_RESTORE
from resilient_jax.data import BatchLoader, make_source
from resilient_jax.events import EventLog
from resilient_jax.goodput import accounting as goodput
from resilient_jax.health import HealthMonitor, Watchdog
from resilient_jax.train.compile import compile_step
from resilient_jax.train.context import RunContext
from resilient_jax.train.hooks import Hook, StopTraining
from resilient_jax.train.loop import Loop
from resilient_jax.train.metrics import MetricsLogger
from resilient_jax.train.state import TrainState, abstract_state, init_state
from resilient_jax.worker.client import SupervisorClient
from resilient_jax.worker.distributed import initialize_from_env


class RunError(Exception):
    """A failure with a one-line reason and the exit code to end the process with."""

    def __init__(self, reason: str, exit_code: int = 1) -> None:
        super().__init__(reason)
        self.exit_code = exit_code


def write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config_lib.config_to_dict(config), f, indent=2, sort_keys=True)


def prepare(
    config: ml_collections.ConfigDict, workdir: str, events: EventLog, generation: int = 0
) -> RunContext:
    """Topology, mesh and state shapes: everything before the first step that touches no
    parameters. Raises ConfigError when the config does not fit the devices."""
    topology = mesh_lib.discover()
    plan = topology_lib.plan_mesh(config, topology, strict=generation == 0)
    mesh = mesh_lib.make_mesh(plan, topology)
    events.update_common(process=jax.process_index(), slice=topology.slice_index)
    return RunContext(
        config=config,
        workdir=workdir,
        topology=topology,
        plan=plan,
        mesh=mesh,
        events=events,
        abstract_state=abstract_state(config, mesh),
        generation=generation,
    )


def train(config: ml_collections.ConfigDict, workdir: str, chaos: str = "") -> int:
    """Runs training; returns the process exit code (0 = finished). Raises RunError on bad input."""
    try:
        config_lib.validate(config)
        faults = ChaosHook(chaos) if chaos else None
    except (config_lib.ConfigError, ValueError) as e:
        raise RunError(str(e), ExitCode.BAD_INPUT) from e
    events = EventLog(workdir, pid=os.getpid())
    hooks: list[Hook] = []
    try:
        # Heartbeats to the supervisor (if one started us) begin before the slow JAX start-up.
        client = SupervisorClient.from_env(config.coordinator)
        if client is not None:
            hooks.append(client)
        watchdog = Watchdog.from_config(config.health, events)
        watchdog.start()  # from here on a hang anywhere (init, restore, a collective) ends us
        hooks.append(watchdog)
        env = initialize_from_env(config.coordinator, events)
        generation = env.generation if env is not None else 0
        events.update_common(generation=generation)
        return _train(config, workdir, events, hooks, faults, client, generation)
    except ValueError as e:  # an inconsistent worker environment
        raise RunError(str(e), ExitCode.BAD_INPUT) from e
    finally:
        for hook in hooks:
            hook.close()


def _checked(fn):
    """Runs `fn`, turning a checkpoint failure (nothing valid to restore, a save that did not
    commit) into a RunError: the run must exit non-zero with the reason."""
    try:
        return fn()
    except CheckpointError as e:
        raise RunError(f"checkpoint: {e}", ExitCode.CHECKPOINT) from e


def _train(
    config: ml_collections.ConfigDict,
    workdir: str,
    events: EventLog,
    hooks: list[Hook],
    faults: ChaosHook | None,
    client: SupervisorClient | None,
    generation: int,
) -> int:
    def phase(name: str):
        return client.phase(name) if client is not None else contextlib.nullcontext()

    try:
        ctx = prepare(config, workdir, events, generation)
        source = make_source(config)
    except (config_lib.ConfigError, ValueError) as e:
        raise RunError(str(e), ExitCode.BAD_INPUT) from e
    if jax.process_index() == 0:
        write_config(config, workdir)
    events.emit("process_start", topology=ctx.topology.describe(), mesh=ctx.plan.describe())

    try:
        checkpointer = Checkpointer(ctx)
    except CheckpointError as e:
        raise RunError(str(e), ExitCode.BAD_INPUT) from e
    hooks.append(checkpointer)

    def restore(max_step: int | None = None) -> tuple[TrainState, dict] | None:
        restored = checkpointer.restore_latest(ctx, max_step=max_step)
        if restored is None:
            return None
        return restored.state, restored.data_position or {"next_batch": 0}

    start = time.perf_counter()
    with phase(PHASE_RESTORE):
        restored = _checked(restore)
    if restored is None:
        state, position = init_state(config, ctx.mesh), {"next_batch": 0}
        events.emit("init", duration_s=time.perf_counter() - start)
    else:
        state, position = restored
    loader = BatchLoader(config, ctx.mesh, ctx.plan, source)
    loader.seek(position)
    with phase(PHASE_COMPILE):
        step_fn = compile_step(ctx)
    # MetricsLogger first: a step that triggers a rollback still gets its `step` event.
    hooks[:0] = [MetricsLogger(ctx), HealthMonitor()]
    if faults is not None:
        hooks.append(faults)
    try:
        _checked(lambda: Loop(ctx, step_fn, loader, hooks, restore).run(state))
        exit_code, reason = 0, "finished"
    except StopTraining as stop:
        exit_code, reason = stop.exit_code, stop.reason
    except RunError as e:
        events.emit("stop", reason=str(e), exit_code=e.exit_code)
        raise
    finally:
        loader.close()
    events.emit("stop", reason=reason, exit_code=exit_code)
    if jax.process_index() == 0:
        goodput.print_summary(workdir)
    return exit_code
