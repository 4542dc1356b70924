"""A host's health probe, run by its agent before the host is admitted or re-admitted.

A host joins only if it can do what a worker needs: write the workdir and the local checkpoint
tier, has free disk, and (when asked) start a JAX process that sees the devices a worker expects.
The JAX check runs in a child process, so the agent itself never loads JAX.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping

_JAX_PROBE = "import jax; print(jax.local_device_count())"
_JAX_PROBE_TIMEOUT_S = 300.0  # a cold JAX import on a loaded host takes tens of seconds


def _writable(path: str) -> str | None:
    """None when a file can be created and removed in `path`, else why not."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as e:
        return f"{path} is not writable ({e.strerror or e})"
    return None


def probe_host(
    workdir: str,
    local_dir: str,
    min_free_gb: float,
    jax_devices: int | None,
    env: Mapping[str, str],
) -> tuple[bool, str]:
    """(healthy, what was checked or what failed)."""
    for path in (workdir, local_dir):
        if path:
            why = _writable(path)
            if why:
                return False, why
    free_gb = shutil.disk_usage(workdir).free / 2**30
    if free_gb < min_free_gb:
        return (
            False,
            f"{free_gb:.1f} GiB free in {workdir}, below probe_min_free_gb={min_free_gb:g}",
        )
    checked = f"workdir and local tier writable, {free_gb:.0f} GiB free"
    if jax_devices is None:
        return True, checked
    try:
        done = subprocess.run(
            [sys.executable, "-c", _JAX_PROBE],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=_JAX_PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"a JAX process did not start: {e}"
    lines = done.stdout.split()
    seen = int(lines[-1]) if done.returncode == 0 and lines and lines[-1].isdigit() else None
    if seen != jax_devices:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"a JAX process sees {seen} devices, expected {jax_devices} ({tail})"
    return True, f"{checked}, JAX sees {seen} devices"
