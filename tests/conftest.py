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


# The tiny default made smaller still, for fast tests (as dotted config keys).
SMALL = {
    "model.d_model": 64,
    "model.num_layers": 2,
    "model.num_heads": 2,
    "model.num_kv_heads": 2,
    "model.head_dim": 32,
    "model.d_ff": 128,
    "data.seq_len": 32,
    "total_steps": 20,
    "log.progress_bar": False,
    "log.tensorboard": False,
}


def as_flags(overrides: dict) -> list[str]:
    """`--config.KEY=VALUE` flags for the launcher."""
    return [
        f"--config.{key}={str(value).lower() if isinstance(value, bool) else value}"
        for key, value in overrides.items()
    ]


def tiny_config(**overrides):
    """configs/tiny_cpu.py with SMALL and no RAM-disk tier; dotted keys as further overrides."""
    from configs.tiny_cpu import get_config
    from resilient_jax.config import apply_overrides

    config = apply_overrides(get_config(), {**SMALL, "checkpoint.local_dir": ""})
    return apply_overrides(config, overrides)


def event(time: float, type: str, process: int | str | None = 0, **fields) -> dict:
    """One events.jsonl row for hand-built event logs; `process=None` leaves the field out."""
    row = {"time": time, "type": type, **fields}
    if process is not None:
        row["process"] = process
    return row
