"""A replaced host restores the newest local step from a peer's RAM disk, on the network-namespace
test bed: three hosts, each with its own address and its own RAM disk (a tmpfs mounted over
`checkpoint.local_dir` in the host's private mount namespace), slices 0 and 1 training and slice 2
a spare. Slice 1's host is killed (agent and worker, SIGKILL) after local saves newer than the last
persistent step; the spare, whose RAM disk is empty, takes its place. The job restores that local
step, the spare's worker fetching every piece from slice 0's host over the bridge, and the final
parameters equal those of an undisturbed run bit for bit (the mesh is the same 2 x 2).

Slow; skipped with the reason when not root or without `ip netns`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from conftest import REPO, SMALL, as_flags, plain_orbax_state, run_python

from resilient_jax.events import read_events

pytestmark = pytest.mark.slow

TOTAL_STEPS = 30
PERSISTENT_EVERY = 10
LOCAL_EVERY = 2
FAULT_STEP = 13  # local steps 12 (and maybe 14) are newer than persistent step 10
DEVICES = 2
OVERRIDES = {
    **SMALL,
    "total_steps": TOTAL_STEPS,
    "global_batch_size": 8,
    "checkpoint.every_steps": PERSISTENT_EVERY,
    "checkpoint.local_every_steps": LOCAL_EVERY,
    "checkpoint.local_auto_interval": False,
    "checkpoint.peer_timeout_s": 10.0,
    "log.every_steps": 1,
    "coordinator.heartbeat_interval_s": 0.25,
    "coordinator.heartbeat_timeout_s": 2.0,
    "coordinator.agent_timeout_s": 2.0,
    "coordinator.jax_heartbeat_timeout_s": 5,
    "coordinator.hang_floor_s": 5.0,
    "coordinator.first_step_timeout_s": 60.0,
    "coordinator.startup_timeout_s": 120.0,
    "coordinator.kill_grace_s": 0.5,
    "coordinator.backoff_s": 0.1,
    "coordinator.standby_workers": False,
    "coordinator.reconfiguration": "reshape",  # the spare at once
}


def final_params(workdir) -> dict:
    """The final step's parameters, read with plain Orbax: {key path: numpy array}."""
    prefix = "['params']"
    state = plain_orbax_state(workdir, TOTAL_STEPS)
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


@pytest.fixture
def local_dir():
    path = f"/dev/shm/rj-peer-e2e-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(600)
def test_a_replaced_host_restores_the_newest_local_step_from_a_peer(
    netns_testbed, tmp_path, local_dir
):
    testbed = netns_testbed
    flags = [f"--config.checkpoint.local_dir={local_dir}", *as_flags(OVERRIDES)]
    reference = tmp_path / "reference"
    result = run_python(
        [
            "launch/local_cluster.py",
            "--config=configs/tiny_cpu.py",
            f"--workdir={reference}",
            "--num_slices=2",
            "--processes_per_slice=1",
            f"--devices_per_process={DEVICES}",
            f"--config.checkpoint.local_dir={local_dir}-reference",
            *as_flags(OVERRIDES),
        ],
        timeout=300,
        env={"PYTHONPATH": REPO},
    )
    shutil.rmtree(f"{local_dir}-reference", ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]

    workdir = tmp_path / "run"
    workdir.mkdir()
    token = tmp_path / "token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)
    env = {"PYTHONPATH": REPO, "RJ_RUN_TOKEN_FILE": str(token), "JAX_PLATFORMS": "cpu"}
    procs: list[subprocess.Popen] = []

    def log(name: str) -> str:
        path = tmp_path / f"{name}.log"
        return path.read_text()[-4000:] if path.exists() else ""

    try:
        with open(tmp_path / "supervisor.log", "w") as out:
            supervisor = subprocess.Popen(
                [
                    sys.executable,
                    "launch/local_cluster.py",
                    "--config=configs/tiny_cpu.py",
                    f"--workdir={workdir}",
                    "--num_slices=2",
                    "--spare_slices=1",
                    "--processes_per_slice=1",
                    f"--devices_per_process={DEVICES}",
                    "--host_agents=external",
                    f"--listen={testbed.head_address}:0",
                    *flags,
                ],
                cwd=REPO,
                env={**testbed.env, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        procs.append(supervisor)
        deadline = time.monotonic() + 60
        while not (workdir / "supervisor.json").exists():
            assert time.monotonic() < deadline and supervisor.poll() is None, log("supervisor")
            time.sleep(0.05)
        time.sleep(0.1)  # written by rename: complete once it exists
        address = json.loads((workdir / "supervisor.json").read_text())["address"]
        for slice_id, host in enumerate(testbed.hosts):
            # Each host's own RAM disk: a tmpfs over local_dir in its private mount namespace,
            # gone with the host's last process.
            argv = [
                "sh",
                "-c",
                'mkdir -p "$0" && mount -t tmpfs -o size=512m rjpeer "$0" && exec "$@"',
                local_dir,
                sys.executable,
                "-m",
                "resilient_jax.control.agent",
                f"--workdir={workdir}",
                f"--supervisor={address}",
                f"--host={host}",
                f"--slice={slice_id}",
                "--slots=1",
                f"--devices={DEVICES}",
            ]
            procs.append(testbed.popen(host, argv, str(tmp_path / f"agent-{host}.log"), env))

        deadline = time.monotonic() + 240
        while not any(
            e["type"] == "step" and e["step"] >= FAULT_STEP for e in read_events(str(workdir))
        ):
            assert time.monotonic() < deadline, log("supervisor")
            assert supervisor.poll() is None, log("supervisor")
            time.sleep(0.05)
        testbed.script("netns", "kill", testbed.hosts[1])  # slice 1's host: agent and worker
        try:
            code = supervisor.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not finish\n{log('supervisor')}")
        assert code == 0, log("supervisor")
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    events = list(read_events(str(workdir)))
    restarts = [e for e in events if e["type"] == "restart"]
    assert restarts and restarts[-1]["slices"] == [0, 2], restarts
    after = [e for e in events if e["time"] > restarts[-1]["time"]]
    restores = [e for e in after if e["type"] == "restore"]
    assert restores and {(e["tier"], e["step"]) for e in restores} == {
        ("local", restores[0]["step"])
    }, restores
    restored = restores[0]["step"]
    assert PERSISTENT_EVERY < restored < 2 * PERSISTENT_EVERY, restores
    persistent_before = [
        e["step"]
        for e in events
        if e["type"] == "save_committed"
        and e["tier"] == "persistent"
        and e["time"] < restarts[-1]["time"]
    ]
    assert restored > max(persistent_before, default=0), persistent_before  # newer than persistent
    fetches = [e for e in after if e["type"] == "local_fetch"]
    (fetch,) = fetches  # only the spare's worker lacked pieces
    assert fetch["step"] == restored and fetch["process"] == 1 and fetch["bytes"] > 0, fetch
    # From slice 0's host, over the bridge (slice 1's host is gone).
    assert [p.rsplit(":", 1)[0] for p in fetch["peers"]] == [testbed.address(testbed.hosts[0])]
    reference_params, params = final_params(reference), final_params(workdir)
    assert reference_params.keys() == params.keys()
    for key, value in reference_params.items():
        assert np.array_equal(value, params[key]), key
