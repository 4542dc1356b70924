"""Continual pretraining: the rehearsal set a base model writes resumes after an interruption or a
kill with the same bytes, the training data mixes it in at the configured ratio, replay samples
only the old data's training part, and bad rehearsal settings are refused in one line."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, SMALL, as_flags, run_python, tiny_config

from resilient_jax import config as config_lib
from resilient_jax import rehearsal
from resilient_jax.config import BadInput, ConfigError
from resilient_jax.data.rehearsal import GeneratedSet, read_manifest, replay_sample, with_rehearsal
from resilient_jax.decode import Decoder
from resilient_jax.events import EventLog
from resilient_jax.train.state import make_model

SYNTHETIC = {
    "checkpoint.init_from": "/nonexistent/base",  # only named in the spec by generate()
    "rehearsal.mode": "synthetic",
    "rehearsal.sequences": 10,
    "rehearsal.chunk_sequences": 4,
}


def chunk_bytes(directory: str) -> dict[str, bytes]:
    paths = sorted(glob.glob(os.path.join(directory, "chunk_*.npy")))
    return {os.path.basename(p): open(p, "rb").read() for p in paths}


@pytest.fixture(scope="module")
def base_params():
    config = tiny_config()
    tokens = jnp.zeros((1, config.data.seq_len), jnp.int32)
    return jax.jit(make_model(config).init)(jax.random.key(3), tokens)["params"]


def test_generation_interrupted_resumes_with_the_same_bytes(tmp_path, base_params, monkeypatch):
    config = tiny_config(**SYNTHETIC)
    straight = str(tmp_path / "straight")
    rehearsal.generate(config, straight, base_params, EventLog(None))
    expected = chunk_bytes(straight)
    assert len(expected) == 3 and read_manifest(straight)["complete"]
    rows = GeneratedSet(straight, config.data.seq_len)
    assert len(rows) == 10 and rows[9].shape == (config.data.seq_len + 1,)
    assert len({bytes(rows[i]) for i in range(10)}) == 10  # every sequence its own draw

    interrupted = str(tmp_path / "interrupted")
    real = Decoder.generate_rows
    calls = []

    def failing_on_the_second_chunk(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process stops between two chunks
        return real(self, *args)

    monkeypatch.setattr(Decoder, "generate_rows", failing_on_the_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        rehearsal.generate(config, interrupted, base_params, EventLog(None))
    assert not read_manifest(interrupted)["complete"] and len(chunk_bytes(interrupted)) == 1
    calls.clear()
    monkeypatch.setattr(Decoder, "generate_rows", real)
    counted = []
    monkeypatch.setattr(
        Decoder, "generate_rows", lambda self, *a: counted.append(1) or real(self, *a)
    )
    rehearsal.generate(config, interrupted, base_params, EventLog(None))
    assert len(counted) == 2  # the committed chunk is not generated again
    assert chunk_bytes(interrupted) == expected


def test_a_set_made_with_other_settings_is_refused(tmp_path, base_params):
    directory = str(tmp_path / "set")
    rehearsal.generate(tiny_config(**SYNTHETIC), directory, base_params, EventLog(None))
    other = tiny_config(**{**SYNTHETIC, "rehearsal.temperature": 0.5})
    with pytest.raises(BadInput, match="made with other settings"):
        rehearsal.generate(other, directory, base_params, EventLog(None))


def test_rehearsal_share_of_the_stream_and_replay_sample():
    config = tiny_config(**{"rehearsal.mode": "replay", "rehearsal.sequences": 50})
    sample = replay_sample(config)
    assert len(sample) == 50
    # Only the training part of the old data is replayed: its last eval.fraction stays held out.
    from resilient_jax.data import make_source
    from resilient_jax.data.split import holdout

    _, held = holdout(make_source(config), config.eval.fraction)
    held_rows = {bytes(held[i]) for i in range(len(held))}
    assert not any(bytes(sample[i]) in held_rows for i in range(len(sample)))
    new = [np.full(33, 1, np.int32)] * 100
    mixed = with_rehearsal(new, sample, 0.25).stream(seed=0)
    from_rehearsal = sum(int(mixed[k][0] != 1 or mixed[k][1] != 1) for k in range(400))
    assert from_rehearsal == 100  # the fixed interleaving: exactly a quarter


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"rehearsal.mode": "forget"}, "rehearsal.mode"),
        ({"rehearsal.mode": "synthetic"}, "rehearsal.mode"),  # no base model to write it
        ({"rehearsal.mode": "replay", "rehearsal.ratio": 1.0}, "rehearsal.ratio"),
        ({"rehearsal.mode": "replay", "rehearsal.old_data": "/no/such"}, "rehearsal.old_data"),
        ({**SYNTHETIC, "rehearsal.top_p": 0.0}, "rehearsal.top_p"),
        ({**SYNTHETIC, "rehearsal.chunk_sequences": 0}, "rehearsal.chunk_sequences"),
        ({"eval.datasets": "old:/x"}, "eval.datasets"),
        ({"eval.datasets": "a=,a="}, "eval.datasets"),
    ],
)
def test_bad_rehearsal_settings_are_refused(overrides, key):
    with pytest.raises(ConfigError, match=f"config.{key}=") as e:
        config_lib.validate(tiny_config(**overrides))
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_generation_killed_resumes_with_the_same_bytes(tmp_path):
    """A run from a base checkpoint is SIGKILLed while its base model writes the rehearsal set;
    the restarted run completes it, byte for byte the set of an uninterrupted run, and trains."""
    base = str(tmp_path / "base")
    flags = as_flags({**SMALL, "checkpoint.local_dir": "", "total_steps": 4})
    done = run_python(
        [
            "launch/train.py",
            "--config=configs/tiny_cpu.py",
            f"--workdir={base}",
            *flags,
            "--config.checkpoint.every_steps=4",
        ],
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    continual = [
        "--config=configs/tiny_cpu.py",
        *flags,
        f"--config.checkpoint.init_from={base}/checkpoints",
        "--config.rehearsal.mode=synthetic",
        "--config.rehearsal.sequences=96",
        "--config.rehearsal.chunk_sequences=4",
        "--config.data.seq_len=128",  # longer sequences: each chunk takes a while
        "--config.model.max_seq_len=128",
    ]
    straight = str(tmp_path / "straight")
    done = run_python(["launch/train.py", f"--workdir={straight}", *continual], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    killed = str(tmp_path / "killed")
    proc = subprocess.Popen(
        [sys.executable, "launch/train.py", f"--workdir={killed}", *continual],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    try:
        while len((read_manifest(f"{killed}/rehearsal") or {"chunks": {}})["chunks"]) < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    partial = read_manifest(f"{killed}/rehearsal")
    assert not partial["complete"], "the kill came too late to interrupt the generation"
    done = run_python(["launch/train.py", f"--workdir={killed}", *continual], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert chunk_bytes(f"{killed}/rehearsal") == chunk_bytes(f"{straight}/rehearsal")
    assert len(chunk_bytes(f"{straight}/rehearsal")) == 24
