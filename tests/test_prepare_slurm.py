"""launch/slurm/prepare.sbatch on the Slurm test bed: an array job of three tasks on two nodes
prepares a corpus; the task that finds every group done writes the manifest, and the store is
byte for byte the one a single process prepares.

Slow: needs root and `ip netns` (skipped with the reason otherwise); installs slurm-wlm with
apt-get when it is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import REPO

from resilient_jax.data import corpus, store
from resilient_jax.data.prepare import Settings, prepare

pytestmark = pytest.mark.slow

SETTINGS = Settings(tokenizer="bundled", shard_tokens=3000, group_bytes=1)  # a group per file


@pytest.mark.timeout(400)
@pytest.mark.parametrize("slurm_cluster", [2], indirect=True)
def test_an_array_job_prepares_the_single_process_store(slurm_cluster, tmp_path):
    testbed = slurm_cluster
    texts = [d.decode() for d in corpus.bundled_documents()]
    (tmp_path / "in").mkdir()
    for part in range(5):
        with open(tmp_path / "in" / f"part-{part}.jsonl", "w") as f:
            for text in texts[part::5]:
                f.write(json.dumps({"text": text}) + "\n")
    single = prepare(str(tmp_path / "in"), str(tmp_path / "single"), SETTINGS, workers=0)
    out = tmp_path / "array"
    env = {
        **testbed.env,
        "PYTHONPATH": REPO,
        "PYTHON": sys.executable,
        "INPUT": str(tmp_path / "in"),
        "OUTPUT": str(out),
        "TOKENIZER": "bundled",
    }
    submit = subprocess.run(
        ["sbatch", "--parsable", "--array=0-2", f"--output={tmp_path}/task-%a.out",
         f"--chdir={REPO}", "launch/slurm/prepare.sbatch",
         "--shard_tokens=3000", "--group_mb=0", "--workers=1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip()

    def queued() -> bool:
        proc = subprocess.run(["squeue", "-h", "-o", "%i"], env=testbed.env, capture_output=True,
                              text=True, timeout=30)  # fmt: skip
        return any(line.split("_")[0] == job for line in proc.stdout.split())

    deadline = time.monotonic() + 300
    try:
        while queued() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job], env=testbed.env, capture_output=True)
    logs = {i: (tmp_path / f"task-{i}.out").read_text() for i in range(3)}
    for i, text in logs.items():
        assert f"task {i} of 3" in text and f"task {i} exit 0" in text, text
    manifest = store.read_json(os.path.join(out, store.MANIFEST))
    assert manifest["digest"] == single["digest"] and len(manifest["shards"]) > 5
    assert sum(single["digest"] in text for text in logs.values()) >= 1  # the finishing task's
