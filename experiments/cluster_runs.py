"""What the local-cluster experiments share: the experiment's config with overrides, and the
command line of the trainer that their supervisor (or launcher) runs as workers."""

from __future__ import annotations

import ast
import os
import runpy
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ml_collections
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the config files import resilient_jax

from configs import small_cpu  # noqa: E402

# Config overrides a driver (`growth.py`) passes to a cluster benchmark, on top of its own: the
# model's shapes of one state size, e.g. `--overrides=model.d_model=768,model.num_layers=8`.
_OVERRIDES = flags.DEFINE_list(
    "overrides", [], "KEY=VALUE config overrides on top of the benchmark's own (a model's size)."
)


def extra_overrides() -> dict[str, Any]:
    """`--overrides` as a dict, each value a Python literal where it reads as one."""
    out: dict[str, Any] = {}
    for item in _OVERRIDES.value:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--overrides item {item!r} is not KEY=VALUE")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


# A measured run's logging: a metrics row every step, no progress bar, TensorBoard, evaluation or
# checkpoint to add their time to the steps.
STEP_LOG_ONLY: dict[str, Any] = {
    "log.every_steps": 1,
    "log.progress_bar": False,
    "log.tensorboard": False,
    "eval.every_steps": 0,
    "checkpoint.every_steps": 0,
    "checkpoint.local_every_steps": 0,
}


# A supervised tiny_cpu run whose failures are found and restarted fast: the small model, its
# batch, no progress bar or TensorBoard, quick heartbeats and kills, no re-admission.
SUPERVISED_SMALL: dict[str, Any] = {
    **small_cpu.MODEL,
    "global_batch_size": 8,
    "log.progress_bar": False,
    "log.tensorboard": False,
    "coordinator.heartbeat_interval_s": 0.25,
    "coordinator.heartbeat_timeout_s": 2.0,
    "coordinator.jax_heartbeat_timeout_s": 5,
    "coordinator.hang_floor_s": 30.0,
    "coordinator.startup_timeout_s": 120.0,
    "coordinator.kill_grace_s": 0.5,
    "coordinator.readmit_after_s": -1.0,
}


def load_config(config_file: str, overrides: dict[str, Any]) -> ml_collections.ConfigDict:
    """`config_file` (relative to the repository) with `--config.key=value` style overrides."""
    config = runpy.run_path(os.path.join(REPO, config_file))["get_config"]()
    config.update_from_flattened_dict(overrides)
    return config


def trainer_argv(
    worker: str, config_file: str, workdir: str, overrides: dict[str, Any], chaos: str = ""
) -> list[str]:
    """The worker command: `worker` (a script relative to the repository) with the config, the
    workdir, the overrides as flags and an optional `--chaos` spec."""
    argv = [
        sys.executable,
        worker,
        f"--config={config_file}",
        f"--workdir={workdir}",
        *(f"--config.{k}={v}" for k, v in overrides.items()),
    ]
    return argv + ([f"--chaos={chaos}"] if chaos else [])


def supervise(
    supervisor: Any, time_limit_s: float, during: Callable[[Any], bool] | None = None
) -> Any:
    """`supervisor.run(time_limit_s)` in a thread, calling `during(supervisor)` every 10 ms until
    it returns True once (a fault injected at the right moment); the run's result."""
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(r=supervisor.run(time_limit_s)))
    thread.start()
    while thread.is_alive():
        if during is not None and during(supervisor):
            during = None
        time.sleep(0.01)
    thread.join()
    return result["r"]
