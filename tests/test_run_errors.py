"""How a run ends when it cannot go on. A workdir it cannot use is refused as a new user would meet
it: exit 2, one line on stderr naming the problem, nothing in the workdir changed (no config.json,
no events.jsonl). An unexpected error is a failure to restart from, never "bad input"."""

from __future__ import annotations

import hashlib
import os
import pathlib

import pytest
from conftest import SMALL, as_flags, run_python, tiny_config

from resilient_jax.contracts.exit_codes import ExitCode

# SMALL's 20 steps, as the other 8-device runs of the session: their programs are compiled once.
FAST = {**SMALL, "checkpoint.local_dir": ""}


def launch(workdir: str | pathlib.Path, overrides: dict | None = None):
    return run_python(
        [
            "launch/train.py",
            "--config=configs/tiny_cpu.py",
            f"--workdir={workdir}",
            *as_flags({**FAST, **(overrides or {})}),
        ],
        timeout=300,
    )


def snapshot(root: pathlib.Path) -> dict[str, tuple[int, str]]:
    """Every file under `root` with its modification time and content hash."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            files[str(path.relative_to(root))] = (path.stat().st_mtime_ns, digest)
    return files


def assert_refused(result, *phrases: str) -> None:
    assert result.returncode == ExitCode.BAD_INPUT, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and all(p in line for p in phrases), result.stderr


def test_workdir_that_is_a_file(tmp_path):
    workdir = tmp_path / "run"
    workdir.write_text("notes\n")
    assert_refused(launch(workdir), str(workdir), "is not a directory")
    assert workdir.read_text() == "notes\n"


def test_workdir_under_a_file(tmp_path):
    (tmp_path / "notes").write_text("notes\n")
    assert_refused(launch(tmp_path / "notes" / "run"), "cannot be created", "is not a directory")


def test_unwritable_workdir(tmp_path):
    unwritable = tmp_path / "run"
    unwritable.mkdir()
    (unwritable / "notes").write_text("notes\n")
    before = snapshot(unwritable)
    unwritable.chmod(0o555)
    try:
        # Root ignores permission bits; procfs refuses everyone.
        workdir = pathlib.Path("/proc/sys") if os.access(unwritable, os.W_OK) else unwritable
        if os.access(workdir, os.W_OK):
            pytest.skip("no directory this user cannot write")
        assert_refused(launch(workdir), str(workdir), "cannot be written")
    finally:
        unwritable.chmod(0o755)
    assert snapshot(unwritable) == before


def test_workdir_with_another_models_checkpoints_is_left_untouched(tmp_path):
    from resilient_jax.run import train

    workdir = tmp_path / "run"
    # The first run in this process (its outcome is not what is tested; the refusal is).
    assert train(tiny_config(**{"checkpoint.every_steps": 10}), str(workdir)) == 0
    before = snapshot(workdir)
    assert "config.json" in before and "events.jsonl" in before
    assert any(name.startswith("checkpoints/") for name in before)

    other_model = launch(workdir, {"checkpoint.every_steps": 10, "model.d_ff": 96})
    assert_refused(other_model, "holds a different model")
    assert snapshot(workdir) == before


def test_unexpected_error_is_a_restartable_failure_with_its_traceback(tmp_path):
    # A ValueError from deep inside training is a bug, not bad input: ExitCode.FAILED, which a
    # supervisor restarts, with the traceback in the log and the reason as the last line.
    argv = ["launch/train.py", "--config=configs/tiny_cpu.py", f"--workdir={tmp_path}"]
    code = "\n".join(
        [
            "import runpy, sys",
            "from resilient_jax.train import loop",
            "def run(self, state):",
            "    raise ValueError('deep library bug')",
            "loop.Loop.run = run",
            f"sys.argv = {[*argv, *as_flags(FAST)]!r}",
            "runpy.run_path('launch/train.py', run_name='__main__')",
        ]
    )
    result = run_python(["-c", code], timeout=300)
    assert result.returncode == ExitCode.FAILED, result.stderr[-3000:]
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "error: ValueError: deep library bug"
