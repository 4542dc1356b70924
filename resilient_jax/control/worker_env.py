"""The environment a supervised worker starts with: what every worker of the job shares, and its
own place in one generation. The worker reads it back in `resilient_jax.worker` (names in
`resilient_jax.contracts.env_vars`)."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from resilient_jax.contracts import env_vars

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def free_port() -> int:
    """A TCP port free on loopback now: each generation's JAX coordinator gets a fresh one, so a
    survivor of the previous generation can never join the next."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shared_env(
    environ: Mapping[str, str],
    supervisor_address: str,
    supervisor_pid: int,
    token: str,
    devices_per_process: int,
    cache_env: Mapping[str, str],
) -> dict[str, str]:
    """What every worker of the job gets, whatever its place (also a standby's start): `environ`
    with the supervisor's address, the run token, and one simulated slice's CPU devices."""
    env = dict(environ)
    flags = [
        f for f in env.get(env_vars.XLA_FLAGS, "").split() if not f.startswith(_DEVICE_COUNT_FLAG)
    ]
    flags.append(f"{_DEVICE_COUNT_FLAG}={devices_per_process}")
    env.update(
        {
            env_vars.SUPERVISOR_ADDRESS: supervisor_address,
            env_vars.SUPERVISOR_PID: str(supervisor_pid),
            env_vars.RUN_TOKEN: token,
            env_vars.XLA_FLAGS: " ".join(flags),
            env_vars.PYTHONUNBUFFERED: "1",
        }
    )
    env.setdefault(env_vars.JAX_PLATFORMS, "cpu")  # simulated slices are host devices
    for key, value in cache_env.items():
        env.setdefault(key, value)  # a cache configured in our own environment wins
    # The supervisor tells each worker its place: JAX must not detect a cluster around it.
    env.pop(env_vars.AUTO_DISTRIBUTED, None)
    return env


def placement_env(
    coordinator_host: str,
    coordinator_port: int,
    num_processes: int,
    process: int,
    num_slices: int,
    slice_id: int,
    generation: int,
) -> dict[str, str]:
    """A worker's place in one generation: its JAX process id among `num_processes` (numbered
    slice by slice), the physical slice it runs on, and the JAX coordinator (process 0's host)."""
    return {
        env_vars.COORDINATOR_ADDRESS: f"{coordinator_host}:{coordinator_port}",
        env_vars.NUM_PROCESSES: str(num_processes),
        env_vars.PROCESS_ID: str(process),
        env_vars.NUM_SLICES: str(num_slices),
        env_vars.SLICE: str(slice_id),
        env_vars.GENERATION: str(generation),
    }
