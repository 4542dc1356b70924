"""What the experiments share (`experiments/report.py`): a RAM-disk folder that a killed
benchmark leaves behind is removed by the next one, never a live process's."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "experiments"))

import report  # noqa: E402


def test_a_ram_disk_folder_of_a_dead_benchmark_is_removed_and_a_live_ones_kept(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(report, "RAM_DISK", str(tmp_path))
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead_pid = int(ended.stdout)
    dead = tmp_path / f"bench_ckpt_{dead_pid}_1"
    live = tmp_path / f"bench_ckpt_{os.getppid()}_1"
    other_prefix = tmp_path / f"bench_peer_{dead_pid}_1"
    old_style = tmp_path / "bench_ckpt_0f4e484d"
    for folder in (dead, live, other_prefix, old_style):
        (folder / "step_1").mkdir(parents=True)

    first, second = report.ram_disk_dir("bench_ckpt"), report.ram_disk_dir("bench_ckpt")

    assert not dead.exists()
    assert live.exists() and other_prefix.exists() and old_style.exists()
    assert first != second
    for name in (first, second):
        assert os.path.dirname(name) == str(tmp_path)
        assert os.path.basename(name).startswith(f"bench_ckpt_{os.getpid()}_")
        assert not os.path.exists(name)  # named, not made: the tier makes it
