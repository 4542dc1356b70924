"""Cluster launch templates: the JobSet manifests parse and agree with the worker contract; the
SLURM script is valid bash and, against stand-in `srun`/`scontrol`, excludes a failed node, brings
in a spare, restarts after a preemption without counting and stops on fatal exit codes."""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest
import yaml

from resilient_jax.contracts import env_vars, exit_codes
from resilient_jax.contracts.exit_codes import ExitCode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S = os.path.join(REPO, "launch", "k8s")
SBATCH = os.path.join(REPO, "launch", "slurm", "train.sbatch")


def load(name: str) -> dict:
    with open(os.path.join(K8S, name)) as f:
        (doc,) = list(yaml.safe_load_all(f))
    return doc


def container(doc: dict) -> dict:
    (rjob,) = doc["spec"]["replicatedJobs"]
    (train,) = rjob["template"]["spec"]["template"]["spec"]["containers"]
    return train


@pytest.mark.parametrize("name", ["jobset-gpu.yaml", "jobset-tpu-multislice.yaml"])
def test_jobset_manifest_restarts_and_stops_like_the_supervisor(name):
    doc = load(name)
    assert (doc["apiVersion"], doc["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    spec = doc["spec"]
    assert spec["failurePolicy"]["maxRestarts"] > 0
    (rjob,) = spec["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    assert job["backoffLimit"] == 0  # one failed pod fails the Job: the JobSet restarts all
    fatal, preempted, disrupted = job["podFailurePolicy"]["rules"]
    assert fatal["action"] == "FailJob"
    assert sorted(fatal["onExitCodes"]["values"]) == sorted(exit_codes.FATAL)
    assert preempted["action"] == "Ignore"
    assert preempted["onExitCodes"]["values"] == [ExitCode.PREEMPTED]
    assert disrupted == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] >= 60
    train = container(doc)
    script = train["command"][-1]
    assert "launch/train.py" in script
    subprocess.run(["bash", "-n", "-c", script], check=True)
    env = {e["name"] for e in train["env"]}
    assert env_vars.NUM_SLICES in env or env_vars.NUM_SLICES in script


def test_gpu_jobset_numbers_processes_slice_by_slice():
    doc = load("jobset-gpu.yaml")
    script = container(doc)["command"][-1]
    launch = 'exec python launch/train.py --config="$CONFIG" --workdir="$WORKDIR"'
    assert launch in script
    show = script.replace(launch, 'echo "$RJ_PROCESS_ID $RJ_NUM_PROCESSES $RJ_COORDINATOR_ADDRESS"')
    (rjob,) = doc["spec"]["replicatedJobs"]
    slices, per_slice = rjob["replicas"], rjob["template"]["spec"]["parallelism"]
    ids = []
    for job_index in range(slices):
        for pod_index in range(per_slice):
            env = {
                "PATH": os.environ["PATH"],
                "NUM_SLICES": str(slices),
                "NODES_PER_SLICE": str(per_slice),
                "JOB_INDEX": str(job_index),
                "JOB_COMPLETION_INDEX": str(pod_index),
            }
            out = subprocess.run(
                ["bash", "-c", show], env=env, capture_output=True, text=True, check=True
            )
            process_id, num_processes, coordinator = out.stdout.split()
            ids.append(int(process_id))
            assert int(num_processes) == slices * per_slice
            assert coordinator.startswith(f"{doc['metadata']['name']}-slice-0-0.")
    assert ids == list(range(slices * per_slice))


def test_sbatch_script_is_valid_bash():
    subprocess.run(["bash", "-n", SBATCH], check=True)


def fake_slurm(tmp_path, exit_codes: list[int], broken_after_first: str = "") -> dict[str, str]:
    """Stand-ins for scontrol and srun; training steps exit with `exit_codes` in turn."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (tmp_path / "codes").write_text("\n".join(map(str, exit_codes)) + "\n")
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'n1\\nn2\\nn3\\n'\n")
    (bin_dir / "srun").write_text(
        textwrap.dedent(
            f"""\
            #!/bin/bash
            nodes=""
            for arg in "$@"; do
              case $arg in --nodelist=*) nodes=${{arg#--nodelist=}};; esac
            done
            if [[ "$*" == *"hostname -s"* ]]; then  # the health probe
              for n in ${{nodes//,/ }}; do
                grep -qx "$n" {tmp_path}/broken 2>/dev/null || echo "$n"
              done
              exit 0
            fi
            echo "step nodes=$nodes slices=$RJ_NUM_SLICES gen=$RJ_GENERATION \\
            coord=$JAX_COORDINATOR_ADDRESS auto=$RJ_AUTO_DISTRIBUTED args=${{*: -1}}" \\
              >> {tmp_path}/steps
            printf "%s\\n" {broken_after_first} > {tmp_path}/broken
            code=$(head -n1 {tmp_path}/codes); sed -i 1d {tmp_path}/codes
            exit "$code"
            """
        )
    )
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURM_JOB_ID": "4242",
        "CONFIG": "configs/tiny_cpu.py",
        "WORKDIR": str(tmp_path / "run"),
        "NUM_SLICES": "2",
        "TASKS_PER_NODE": "1",
        "HEALTH_CHECK": "true",
        "PROBE_TIMEOUT_S": "10",
    }


def run_sbatch(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", SBATCH, "--config.total_steps=7"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_sbatch_excludes_the_failed_node_and_uses_the_spare(tmp_path):
    env = fake_slurm(tmp_path, exit_codes=[137, 42, 0], broken_after_first="n2")
    result = run_sbatch(env)
    assert result.returncode == 0, result.stdout + result.stderr
    steps = (tmp_path / "steps").read_text().splitlines()
    assert [s.split(" coord")[0] for s in steps] == [
        "step nodes=n1,n2 slices=2 gen=0",
        "step nodes=n1,n3 slices=2 gen=1",  # n2 failed its health check; n3 was the spare
        "step nodes=n1,n3 slices=2 gen=2",  # after a preemption: the same nodes
    ]
    assert all("auto=1 args=--config.total_steps=7" in s for s in steps)
    coordinators = [s.split("coord=")[1].split()[0] for s in steps]
    assert len(set(coordinators)) == 3  # a fresh port per generation
    assert "excluding node n2" in result.stdout
    assert "restarting without counting a failure" in result.stdout


def test_sbatch_stops_on_fatal_exit_and_below_min_slices(tmp_path):
    env = fake_slurm(tmp_path, exit_codes=[3])
    result = run_sbatch(env)
    assert result.returncode == 3
    assert "stopped the run on purpose" in result.stdout

    (tmp_path / "steps").unlink()
    env = fake_slurm(tmp_path / "again", exit_codes=[1], broken_after_first="n1 n2 n3")
    result = run_sbatch({**env, "MIN_SLICES": "1"})
    assert result.returncode == 1
    assert "below MIN_SLICES=1" in result.stdout
