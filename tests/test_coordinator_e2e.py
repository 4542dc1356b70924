"""End to end with the real trainer: 2 slices x 1 process x 2 CPU devices, the slice-1 worker
SIGKILLed mid-run. The supervisor evicts the slice, the job finishes on one slice (a reshaped
mesh restoring the last checkpoint), and the final loss equals an undisturbed run's."""

from __future__ import annotations

import io
import os
import runpy
import sys

import pytest

from resilient_jax.coordinator import ClusterSpec, Supervisor, SupervisorAction
from resilient_jax.events import read_events

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OVERRIDES = {
    "model.d_model": 64,
    "model.num_layers": 2,
    "model.num_heads": 2,
    "model.num_kv_heads": 2,
    "model.head_dim": 32,
    "model.d_ff": 128,
    "data.seq_len": 32,
    "total_steps": 30,
    "global_batch_size": 8,
    "checkpoint.every_steps": 10,
    "checkpoint.local_dir": "",
    "log.progress_bar": False,
    "log.tensorboard": False,
    "coordinator.heartbeat_timeout_s": 2.0,
    "coordinator.jax_heartbeat_timeout_s": 5,
    "coordinator.startup_timeout_s": 120.0,
    "coordinator.kill_grace_s": 0.5,
    "coordinator.readmit_after_s": -1.0,
}


pytestmark = pytest.mark.slow


def run_trainer(workdir, actions=()) -> tuple[int, list[dict]]:
    config = runpy.run_path(os.path.join(REPO, "configs", "tiny_cpu.py"))["get_config"]()
    for key, value in OVERRIDES.items():
        node = config
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    argv = [
        sys.executable,
        "launch/train.py",
        "--config=configs/tiny_cpu.py",
        f"--workdir={workdir}",
        *(f"--config.{k}={v}" for k, v in OVERRIDES.items()),
    ]
    supervisor = Supervisor(
        config,
        ClusterSpec(2, 1, 2),
        argv,
        str(workdir),
        actions=actions,
        out=io.StringIO(),
        cwd=REPO,
    )
    result = supervisor.run(time_limit_s=400)
    events = list(read_events(str(workdir)))
    for pid in [e["pid"] for e in events if e["type"] == "process_start" and "source" in e]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    return result.exit_code, events


def final_loss(events: list[dict]) -> float:
    return [e for e in events if e["type"] == "step" and e["step"] == 30][-1]["loss"]


@pytest.mark.timeout(900)
def test_killed_slice_reshapes_and_matches_the_undisturbed_loss(tmp_path):
    kill = SupervisorAction("kill", slice=1, at_step=15)
    code, events = run_trainer(tmp_path / "faulty", actions=[kill])
    assert code == 0
    sup = [e for e in events if e.get("source") == "supervisor"]
    (failure,) = [e for e in sup if e["type"] == "failure_detected"]
    assert (failure["cause"], failure["slice"], failure["exit_code"]) == ("exit", 1, -9)
    (restart,) = [e for e in sup if e["type"] == "restart"]
    assert restart["slices"] == [0]
    assert (restart["mesh"]["replica"], restart["mesh"]["fsdp"]) == (1, 2)
    restore = [e for e in events if e["type"] == "restore" and e["time"] > restart["time"]]
    assert restore and restore[0]["step"] in (10, 15)

    code, clean = run_trainer(tmp_path / "clean")
    assert code == 0
    assert final_loss(events) == pytest.approx(final_loss(clean), rel=1e-5)
