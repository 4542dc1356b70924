"""Compiling ahead of a fault: beside the training workers of a generation on S >= 2 slices, the
job those workers would form after losing a slice compiles its step (`resilient_jax.precompile`)
into the executable cache, so that the reshaped restart loads it instead of compiling.

Losing any one slice leads to the same candidate: S - 1 slices, processes numbered slice by slice
from 0, the same devices per process; so one candidate job covers every single-slice loss. It is
formed by the workers of the first S - 1 slices, each starting one helper process on its own host
after its first step completed (the generation's own step is compiled by then and the host is
training). Process 0 picks the candidate job's coordinator port on its host and publishes it in
JAX's key-value store; the others read it with a bounded wait. The helpers run at the lowest CPU
priority in their own session: a worker killed by a fault leaves its helper to finish (bounded by
its join timeout and one compile), so a later reshape finds the entry; a worker that ends
normally (`close`) ends a helper still running. A spare swapped in for a lost slice keeps the
mesh, whose step the running generation has stored already.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile

import jax
import ml_collections
from jax._src import distributed  # the coordination-service client; no public handle exists

from resilient_jax import executables
from resilient_jax.config import config_to_dict
from resilient_jax.contracts import env_vars
from resilient_jax.control import protocol
from resilient_jax.train.context import RunContext
from resilient_jax.train.hooks import Hook
from resilient_jax.worker.distributed import WorkerEnv

SUBDIR = "precompile"  # under the workdir: the helpers' config and events
_PORT_KEY = "rj/precompile/port/{generation}"
_PORT_WAIT_MS = 60_000
# What only the training workers need: the helper never talks to the supervisor.
_WORKER_ONLY = (
    env_vars.SUPERVISOR_ADDRESS,
    env_vars.SUPERVISOR_PID,
    env_vars.RUN_TOKEN,
    env_vars.RUN_TOKEN_FILE,
)


def candidate_env(env: WorkerEnv, port: int, environ: dict[str, str]) -> dict[str, str] | None:
    """The helper's environment: its place in the job of S - 1 slices (None: this process has
    none, being on the last slice, or the job has a single slice)."""
    slices = env.num_slices - 1
    processes = slices * env.processes_per_slice
    if slices < 1 or env.process_id >= processes:
        return None
    host, _ = protocol.split_address(env.coordinator_address or "")
    child = {k: v for k, v in environ.items() if k not in _WORKER_ONLY}
    child.update(
        {
            env_vars.COORDINATOR_ADDRESS: f"{host}:{port}",
            env_vars.NUM_PROCESSES: str(processes),
            env_vars.PROCESS_ID: str(env.process_id),
            env_vars.NUM_SLICES: str(slices),
            env_vars.GENERATION: str(env.generation + 1),
        }
    )
    return child


def eligible(config: ml_collections.ConfigDict, env: WorkerEnv | None) -> bool:
    """Whether this worker takes part in compiling the candidate mesh."""
    return (
        bool(config.coordinator.precompile_candidates)
        and env is not None
        and env.coordinator_address is not None
        and env.num_slices >= 2
        and executables.default_dir() is not None
        and jax.devices()[0].platform != "tpu"  # one process holds a TPU host's chips
        and candidate_env(env, 0, {}) is not None
    )


class CandidateCompiler(Hook):
    """Starts this worker's share of the candidate job after the generation's first step."""

    def __init__(self, env: WorkerEnv) -> None:
        self._env = env
        self._child: subprocess.Popen[bytes] | None = None
        self._started = False

    def on_metrics(self, ctx: RunContext, step: int, metrics: dict[str, float]) -> None:
        if self._started:
            return
        self._started = True
        try:
            port = self._agree_on_port()
            child_env = candidate_env(self._env, port, dict(os.environ))
            assert child_env is not None
            config_file = _write_config(ctx.config, ctx.workdir)
            helper = [sys.executable, "-m", "resilient_jax.precompile", config_file, ctx.workdir]
            self._child = subprocess.Popen(
                ["nice", "-n", "19", *helper],  # the lowest priority: training's CPU comes first
                env=child_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                # Its own session: a worker killed for a restart leaves it to finish its entry.
                start_new_session=True,
            )
        except Exception as e:  # a helper that cannot start costs a compile later, not the run
            logging.warning("compiling the candidate mesh ahead: not started (%s)", e)

    def _agree_on_port(self) -> int:
        client = distributed.global_state.client
        key = _PORT_KEY.format(generation=self._env.generation)
        if self._env.process_id == 0:
            port = _free_port(self._env.coordinator_address or "")
            client.key_value_set(key, str(port))
            return port
        return int(client.blocking_key_value_get(key, _PORT_WAIT_MS))

    def close(self) -> None:
        if self._child is not None and self._child.poll() is None:
            self._child.kill()
            self._child.wait()


def _free_port(coordinator_address: str) -> int:
    host, _ = protocol.split_address(coordinator_address)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host if protocol.is_loopback(host) else "", 0))
        return sock.getsockname()[1]


def _write_config(config: ml_collections.ConfigDict, workdir: str) -> str:
    """The run's config, for the helper, under `WORKDIR/precompile/` (one file per process)."""
    directory = os.path.join(workdir, SUBDIR)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"config-p{jax.process_index()}.json")
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False) as f:
        json.dump(config_to_dict(config), f)
    os.replace(f.name, path)
    return path
