"""The environment a supervised worker starts with: what every worker of the job shares, and its
own place in one generation. The worker reads it back in `resilient_jax.worker` (names in
`resilient_jax.contracts.env_vars`)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from resilient_jax.contracts import env_vars

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# glibc 2.35+: malloc advises the kernel to back its large chunks (XLA:CPU's step temporaries, a
# restore's host buffers) with transparent huge pages. Older glibc ignores an unknown tunable.
_HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb"
_THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def free_port() -> int:
    """A TCP port free on loopback now: each generation's JAX coordinator gets a fresh one, so a
    survivor of the previous generation can never join the next."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def huge_page_malloc(
    environ: Mapping[str, str], thp_mode_file: str = _THP_MODE_FILE
) -> dict[str, str]:
    """`environ` with glibc's malloc set to ask for transparent huge pages, for a process started
    with it: past a gigabyte of state, XLA:CPU's step and the checkpoint's host buffers take fresh
    memory every time, and 4 KB pages cost a fault each (a 3.2 GB state's step 7.2 s with them,
    5.0 s with huge pages: experiments/README.md). Unchanged where the environment already sets
    `glibc.malloc.hugetlb` (`=0` turns it off), where the kernel's transparent huge pages are
    `never` or absent, and off glibc."""
    env = dict(environ)
    tunables = env.get(env_vars.GLIBC_TUNABLES, "")
    if _HUGE_PAGE_TUNABLE in tunables or not _glibc() or not _thp_available(thp_mode_file):
        return env
    setting = f"{_HUGE_PAGE_TUNABLE}=1"
    env[env_vars.GLIBC_TUNABLES] = f"{tunables}:{setting}" if tunables else setting
    return env


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):  # not a glibc system
        return False


def _thp_available(mode_file: str) -> bool:
    """Whether the kernel hands out transparent huge pages when asked (`always` or `madvise`)."""
    try:
        with open(mode_file) as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


def shared_env(
    environ: Mapping[str, str],
    supervisor_address: str,
    supervisor_pid: int,
    token: str,
    devices_per_process: int,
    cache_env: Mapping[str, str],
) -> dict[str, str]:
    """What every worker of the job gets, whatever its place (also a standby's start): `environ`
    with the supervisor's address, the run token, one simulated slice's CPU devices and malloc's
    huge pages (`huge_page_malloc`)."""
    env = huge_page_malloc(environ)
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
