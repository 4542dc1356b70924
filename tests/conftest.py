"""Test set-up: 8 simulated CPU devices in this process, and helpers for subprocess runs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(
    args: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Runs `python ARGS` from the repo root; killed (by PID, via its process group) on timeout."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"python {' '.join(args)} timed out after {timeout}s\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def tiny_config(**overrides):
    """The tiny default made smaller still, for fast tests; dotted keys as overrides."""
    from configs.tiny_cpu import get_config

    config = get_config()
    config.model.d_model = 64
    config.model.num_layers = 2
    config.model.num_heads = 2
    config.model.num_kv_heads = 2
    config.model.head_dim = 32
    config.model.d_ff = 128
    config.data.seq_len = 32
    config.total_steps = 20
    config.log.progress_bar = False
    config.log.tensorboard = False
    config.checkpoint.local_dir = ""
    for key, value in overrides.items():
        node = config
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return config
