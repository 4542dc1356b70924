"""The Kubernetes manifests are valid JobSets that run the supervisor and one agent per host, with
commands that exist: every program or module they start is in this tree and knows every flag it
is given, and the config file it names exists."""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

MANIFESTS = sorted(glob.glob(os.path.join(REPO, "launch", "k8s", "*.yaml")))


def jobsets() -> list[tuple[str, dict]]:
    out = []
    for path in MANIFESTS:
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    out.append((os.path.basename(path), doc))
    return out


def containers(jobset: dict) -> dict[str, dict]:
    """replicatedJob name -> its (only) container."""
    out = {}
    for replicated in jobset["spec"]["replicatedJobs"]:
        pod = replicated["template"]["spec"]["template"]["spec"]
        assert len(pod["containers"]) == 1, replicated["name"]
        out[replicated["name"]] = pod["containers"][0]
    return out


@functools.cache
def program_help(target: tuple[str, ...]) -> str:
    """`python TARGET --help` (a script path or `-m module`), run from the repo root. (absl's
    --help exits 1, argparse's 0: the text is what counts.)"""
    proc = subprocess.run(
        [sys.executable, *target, "--help"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=60,
    )
    text = proc.stdout + proc.stderr
    assert "--workdir" in text, f"{' '.join(target)} --help: no flags listed\n{text[-2000:]}"
    return text


def check_command(command: list[str]) -> None:
    """A `python PROGRAM FLAGS...` command: PROGRAM exists and accepts every flag."""
    assert command[0] == "python", command
    if command[1] == "-m":
        module = command[2]
        assert importlib.util.find_spec(module) is not None, f"no module {module}"
        target, flags = ("-m", module), command[3:]
    else:
        assert os.path.isfile(os.path.join(REPO, command[1])), f"no program {command[1]}"
        target, flags = (command[1],), command[2:]
    help_text = program_help(target)
    for flag in flags:
        match = re.fullmatch(r"--([a-z_]+)(\.[\w.]+)?=(.+)", flag)
        assert match, f"not a --flag=value: {flag!r}"
        name, dotted, value = match.groups()
        assert re.search(rf"--(\[no\])?{name}\b", help_text), f"{target} has no flag --{name}"
        if name == "config" and not dotted:
            assert os.path.isfile(os.path.join(REPO, value.split(":")[0])), value


@pytest.mark.parametrize("manifest", [os.path.basename(p) for p in MANIFESTS])
def test_jobset_runs_a_supervisor_and_one_agent_per_host(manifest):
    (jobset,) = [doc for name, doc in jobsets() if name == manifest]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"
    spec = jobset["spec"]
    by_name = {r["name"]: r for r in spec["replicatedJobs"]}
    supervisor = by_name.pop("supervisor")
    assert supervisor["replicas"] == 1
    assert supervisor["template"]["spec"]["parallelism"] == 1
    # The run is done when the supervisor is; a pod failure is never a restart of every pod.
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["supervisor"]}
    assert spec["failurePolicy"]["maxRestarts"] == 0
    assert all(rule["action"] == "FailJobSet" for rule in spec["failurePolicy"].get("rules", []))
    assert by_name, "no replicatedJob of host agents"
    for replicated in by_name.values():
        job = replicated["template"]["spec"]
        assert job["backoffLimit"] > 0, "a lost host's pod must be replaced, not fail the run"
        assert job["template"]["spec"]["restartPolicy"] == "Never"
    commands = {name: c["command"] for name, c in containers(jobset).items()}
    assert commands.pop("supervisor")[:2] == ["python", "launch/local_cluster.py"]
    assert "--host_agents=external" in containers(jobset)["supervisor"]["command"]
    for name, command in commands.items():
        assert command[:3] == ["python", "-m", "resilient_jax.control.agent"], name
    # Agents find the supervisor by its pod's stable DNS name, on the port it listens on.
    supervisor_dns = f"{jobset['metadata']['name']}-supervisor-0-0.{jobset['metadata']['name']}"
    port = next(
        f.rsplit(":", 1)[1]
        for f in containers(jobset)["supervisor"]["command"]
        if f.startswith("--listen=")
    )
    for command in commands.values():
        assert f"--supervisor={supervisor_dns}:{port}" in command
    assert spec["network"]["enableDNSHostnames"] is True


@pytest.mark.parametrize("manifest", [os.path.basename(p) for p in MANIFESTS])
def test_jobset_commands_exist_with_their_flags(manifest):
    (jobset,) = [doc for name, doc in jobsets() if name == manifest]
    for container in containers(jobset).values():
        check_command(container["command"])


def test_tpu_workers_derive_the_multislice_variables_from_their_place():
    from resilient_jax.contracts import env_vars
    from resilient_jax.worker.distributed import megascale_env, read_env

    def place(process: int, num_processes: int, num_slices: int) -> dict[str, str]:
        env = read_env(
            {
                env_vars.COORDINATOR_ADDRESS: "10.0.0.7:8476",
                env_vars.NUM_PROCESSES: str(num_processes),
                env_vars.PROCESS_ID: str(process),
                env_vars.NUM_SLICES: str(num_slices),
            }
        )
        return megascale_env(env, "8081")

    # 3 slices of 4 hosts: process 9 is on the generation's slice 2; slice 0's host coordinates.
    assert place(9, 12, 3) == {
        "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.7:8081",
        "MEGASCALE_NUM_SLICES": "3",
        "MEGASCALE_SLICE_ID": "2",
        "MEGASCALE_PORT": "8081",
    }
    # After an eviction the same host may sit in another slice position of fewer slices.
    assert place(5, 8, 2)["MEGASCALE_SLICE_ID"] == "1"
    assert place(5, 8, 2)["MEGASCALE_NUM_SLICES"] == "2"
    assert place(2, 4, 1) == {}  # one slice: no cross-slice transfers


def test_slurm_script_gives_the_supervisor_and_agents_only_flags_they_know():
    """Every `--name=` in launch/slurm/train.sbatch is Slurm's own or a flag of the supervisor
    (launch/local_cluster.py) or the host agent it starts."""
    path = os.path.join(REPO, "launch", "slurm", "train.sbatch")
    subprocess.run(["bash", "-n", path], check=True)  # valid bash before anything else
    with open(path) as f:
        script = f.read()
    assert "launch/local_cluster.py" in script and "-m resilient_jax.control.agent" in script
    slurm_flags = {"nodes", "ntasks", "nodelist", "time", "signal", "output"}
    known = program_help(("launch/local_cluster.py",)) + program_help(
        ("-m", "resilient_jax.control.agent")
    )
    used = set(re.findall(r"--([a-z_]+)=", script)) - slurm_flags
    assert {"listen", "host_agents", "supervisor", "slice", "host"} <= used
    for name in sorted(used):
        assert re.search(rf"--{name}\b", known), f"train.sbatch passes --{name}, known to neither"


def _prepare_help() -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_jax.data.prepare", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "--task_index" in proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_the_data_preparation_launchers_pass_only_flags_prepare_knows():
    """launch/slurm/prepare.sbatch and the Kubernetes Indexed Job run the prepare command with
    its own flags, one task per array index / completion index."""
    known = _prepare_help()
    path = os.path.join(REPO, "launch", "slurm", "prepare.sbatch")
    subprocess.run(["bash", "-n", path], check=True)
    with open(path) as f:
        script = f.read()
    assert '--task_index="$TASK"' in script and "SLURM_ARRAY_TASK_COUNT" in script
    commands = "\n".join(line for line in script.splitlines() if not line.startswith("#"))
    for name in sorted(set(re.findall(r"--([a-z_]+)=", commands))):
        assert re.search(rf"--{name}\b", known), f"prepare.sbatch passes --{name}"
    with open(os.path.join(REPO, "launch", "k8s", "data", "prepare-indexed-job.yaml")) as f:
        job = yaml.safe_load(f)
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    container = job["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[:3] == ["python", "-m", "resilient_jax.data.prepare"]
    flags = dict(flag[2:].split("=", 1) for flag in command[3:])
    for name in flags:
        assert re.search(rf"--{name}\b", known), f"the Indexed Job passes --{name}"
    assert int(flags["num_tasks"]) == job["spec"]["completions"]
    assert flags["task_index"] == "$(TASK_INDEX)"
    assert [e["name"] for e in container["env"]] == ["TASK_INDEX"]
