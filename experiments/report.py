"""What the experiments share: a RAM-disk folder that a killed run does not leave behind, a
training run of `launch/train.py` on one CPU device, and at their end the result file under
experiments/results/, the description of the machine it was measured on, and a matplotlib that
draws into files.

Scripts import it as `report` (an experiment runs as `python experiments/<name>.py`, which puts
this folder on the path).
"""

from __future__ import annotations

import glob
import itertools
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RAM_DISK = "/dev/shm"
_ram_disk_dirs = itertools.count(1)  # this process's folders, numbered


def ram_disk_dir(prefix: str) -> str:
    """A new folder name `/dev/shm/<prefix>_<pid>_<n>` for this process's RAM-disk tier (created
    by whoever writes it first; the caller removes it at the end). Folders of the same prefix
    whose process has died are removed first: a benchmark the OOM killer or a time limit ended
    cannot clean up, and its gigabytes of RAM disk would shrink the memory of every later run
    (four such folders once held 8.5 GB of a 24 GB host)."""
    from resilient_jax.control.local_hosts import process_gone

    for stale in glob.glob(os.path.join(RAM_DISK, f"{prefix}_*_*")):
        pid = os.path.basename(stale)[len(prefix) + 1 :].split("_", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and process_gone(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return os.path.join(RAM_DISK, f"{prefix}_{os.getpid()}_{next(_ram_disk_dirs)}")


def run_trainer(flags: list[str], workdir: str, timeout_s: float) -> float:
    """`python launch/train.py FLAGS --workdir=WORKDIR` on one CPU device, to its end; its wall
    seconds. A failed run ends the experiment with the run's last output."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "launch/train.py", *flags, f"--workdir={workdir}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode:
        raise SystemExit(f"{workdir}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def write_json(path: str, result: Any, indent: int = 2) -> None:
    """Writes `result` to `path` as JSON, creating its folder, and says so on stdout."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=indent)
    print(f"wrote {path}")


def finite(value: Any) -> Any:
    """`value` with every NaN or infinite float, at any depth, replaced by None: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def host_line(suffix: str = "") -> str:
    """The host for a result's "machine" field: name, architecture and CPU count in one line."""
    return f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs{suffix}"


def jax_machine() -> dict[str, Any]:
    """The machine of a one-process JAX experiment: the platform and the JAX devices it used."""
    import jax

    return {"platform": platform.platform(), "devices": len(jax.devices())}


def state_header(config: Any, state_bytes: int, rounds: int) -> dict[str, Any]:
    """The head of a checkpoint benchmark's result: the model and batch, the JAX devices, the host,
    the size of the state saved or restored, and the rounds each median is taken over."""
    import jax

    return {
        "config": config.model.to_dict()
        | {"global_batch_size": config.global_batch_size, "seq_len": config.data.seq_len},
        "device": jax.devices()[0].device_kind,
        "num_devices": jax.device_count(),
        "host": platform.node(),
        "state_mb": state_bytes / 1e6,
        "rounds": rounds,
    }


def pyplot():
    """matplotlib.pyplot drawing into files (the Agg backend): experiments run without a display.
    Imported on first use, so that a script's other paths do not need matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str, dpi: int = 120) -> None:
    """Saves `fig` as `path`, closes it and says so on stdout."""
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    print(f"wrote {path}")
