"""The multi-host test bed itself (launch/testbed/): namespaces with their own addresses and
hostnames carry a JAX job over real addresses, and the Slurm cluster on them behaves as a cluster
does when a node dies (a `--no-kill` job keeps its other nodes, the node returns to service).

Slow: each needs root and `ip netns` (skipped with the reason otherwise); the Slurm test installs
slurm-wlm with apt-get when it is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, as_flags

pytestmark = pytest.mark.slow

SIM_STEPS = 30
SIM_BATCH = 12


def expected_sim_value(steps: int, batch: int) -> float:
    """The stand-in worker's final value: step s adds the sum of rows [s*B, (s+1)*B) times 1e-6."""
    return sum(float(sum(range((s - 1) * batch, s * batch))) * 1e-6 for s in range(1, steps + 1))


@pytest.mark.timeout(240)
def test_jax_processes_on_three_hosts_meet_over_bridge_addresses(netns_testbed, tmp_path):
    testbed = netns_testbed
    names = testbed.script("netns", "status")
    for host in testbed.hosts:
        assert f"{host} {testbed.address(host)}/24 link=up" in names
    # Each host sees its own hostname, resolving to its own bridge address (what gloo binds).
    hostname = subprocess.run(
        testbed.exec_argv(
            testbed.hosts[1],
            [
                sys.executable,
                "-c",
                "import socket; n = socket.gethostname(); print(n, socket.gethostbyname(n))",
            ],
        ),
        env=testbed.env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    assert hostname == [testbed.hosts[1], testbed.address(testbed.hosts[1])]

    workdir = tmp_path / "run"
    workdir.mkdir()
    coordinator = f"{testbed.address(testbed.hosts[0])}:7476"
    procs = []
    for process, host in enumerate(testbed.hosts):
        env = {
            "PYTHONPATH": REPO,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
            "RJ_COORDINATOR_ADDRESS": coordinator,
            "RJ_NUM_PROCESSES": str(len(testbed.hosts)),
            "RJ_PROCESS_ID": str(process),
            "RJ_NUM_SLICES": str(len(testbed.hosts)),
            "RJ_SLICE": str(process),
            "RJ_GENERATION": "0",
        }
        argv = [
            sys.executable,
            "-m",
            "resilient_jax.testing.sim_worker",
            "--config=configs/tiny_cpu.py",
            f"--workdir={workdir}",
            *as_flags({"total_steps": SIM_STEPS, "global_batch_size": SIM_BATCH}),
        ]
        procs.append(testbed.popen(host, argv, str(tmp_path / f"{host}.log"), env))
    deadline = time.monotonic() + 180
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail("the job across namespaces did not finish in 180 s")
    logs = {host: (tmp_path / f"{host}.log").read_text() for host in testbed.hosts}
    assert [p.returncode for p in procs] == [0, 0, 0], logs
    with open(workdir / "sim_state.json") as f:
        state = json.load(f)
    assert state["step"] == SIM_STEPS
    assert state["value"] == pytest.approx(expected_sim_value(SIM_STEPS, SIM_BATCH), rel=1e-12)


NO_KILL_JOB = """#!/bin/bash
#SBATCH --no-kill
# One step across the allocation that outlives a node: srun keeps the other tasks.
srun --overlap --no-kill --kill-on-bad-exit=0 --label bash -c 'sleep {sleep_s}; hostname' &
wait $!
echo "step exit $?"
scontrol show job "$SLURM_JOB_ID" | grep -o ' NodeList=[^ ]*'
"""


def slurm(testbed, *argv: str) -> str:
    return subprocess.run(
        argv, env=testbed.env, capture_output=True, text=True, timeout=30, check=True
    ).stdout


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout} s")
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_slurm_no_kill_job_keeps_its_other_nodes_and_a_crashed_node_returns(
    slurm_cluster, tmp_path
):
    testbed = slurm_cluster
    first, _, lost = testbed.hosts
    script = tmp_path / "job.sbatch"
    script.write_text(NO_KILL_JOB.format(sleep_s=12))
    out = tmp_path / "job.out"
    job = slurm(
        testbed,
        "sbatch",
        "--parsable",
        f"--nodes={len(testbed.hosts)}",
        f"--output={out}",
        str(script),
    ).strip()

    def step_running() -> bool:
        return f"{job}.0" in slurm(testbed, "squeue", "-h", "-s", "-o", "%i")

    wait_until(step_running, 60, "running step")
    testbed.script("slurm", "crash", lost)
    crashed_at = time.monotonic()

    def node_down() -> bool:
        return lost in slurm(testbed, "sinfo", "-h", "-N", "-t", "down", "-o", "%N")

    wait_until(node_down, 30, f"DOWN state for {lost}")
    detected_s = time.monotonic() - crashed_at

    def job_gone() -> bool:
        return job not in slurm(testbed, "squeue", "-h", "-o", "%i")

    wait_until(job_gone, 90, "end of the job")
    text = out.read_text()
    survivors = [h for h in testbed.hosts if h != lost]
    for index, host in enumerate(survivors):
        assert f"{index}: {host}" in text, text
    assert f": {lost}" not in text
    assert "step exit 0" in text, text
    assert f"NodeList={first},{survivors[1]}" in text or f"NodeList={testbed.name}n[1-2]" in text
    # Slurm's own detection: SlurmdTimeout=4 s plus its ping cycle.
    assert detected_s < 20, detected_s
    # The node comes back (ReturnToService=2) once its slurmd starts again.
    testbed.script("slurm", "boot", lost)

    def node_idle() -> bool:
        return lost in slurm(testbed, "sinfo", "-h", "-N", "-t", "idle", "-o", "%N")

    wait_until(node_idle, 30, f"return to service of {lost}")
    assert slurm(testbed, "squeue", "-h", "-t", "all", "-o", "%i").split() == [job]
    assert os.path.exists(testbed.env["SLURM_CONF"])
