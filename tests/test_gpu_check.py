"""experiments/gpu_check.py --smoke: the accelerator check runs every phase on CPU and writes
strict JSON, so the command a lent GPU runs has not rotted in between. Slow (23 s of a 2-core
machine): CI runs it with the slow tests."""

from __future__ import annotations

import hashlib
import json
import pathlib

import pytest
from conftest import REPO, run_python

PHASES = [
    "measure.setup",
    "measure.memory",
    "measure.throughput",
    "measure.saves",
    "measure.restore",
    "measure.kill",
    "measure",
    "restart_warm",
    "restart_cold",
]
SAVE_KINDS = {
    "device_to_host",
    "snapshot",
    "local",
    "local_copy",
    "persistent",
    "orbax_async",
    "orbax_sync",
}


def source_digest() -> str:
    """A hash of the package's Python source, as the executable cache's key covers it."""
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(REPO, "resilient_jax").rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _refuse(constant: str) -> None:
    raise AssertionError(f"{constant} in the result: not strict JSON")


@pytest.mark.slow
def test_smoke_runs_every_phase(tmp_path):
    out = tmp_path / "gpu_check.json"
    digest_before = source_digest()
    proc = run_python(
        ["experiments/gpu_check.py", "--smoke", f"--out={out}", f"--scratch={tmp_path}"],
        timeout=420,  # about 20 s on 2 idle cores; minutes when they are shared
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text(), parse_constant=_refuse)

    assert [p["phase"] for p in result["phases"]] == PHASES
    assert {p["status"] for p in result["phases"]} == {"done"}, result["phases"]
    assert result["smoke"] is True and result["device"] == "cpu"
    assert result["jax_version"] and not result["layers_shrunk"]

    # CPU devices keep no allocator statistics: null, and said so; the plan is there regardless.
    memory = result["memory"]
    assert memory["steady"]["memory_stats"] is None and "None on cpu" in memory["note"]
    plan = memory["plan"]
    assert plan["save_peak_kept"] == plan["total"] + plan["checkpoint"]
    assert set(memory["at_save"]) >= {"kept", "device_copy"}
    assert memory["steady"]["live_array_bytes"] >= result["setup"]["state_bytes"]

    throughput = result["throughput"]
    assert throughput["framework_step_s"] > 0 and throughput["bare_step_s"] > 0
    assert throughput["mfu"] == {"framework": None, "bare": None}  # no peak FLOP/s for a CPU
    assert "Checkpointer" in throughput["hooks"] and "Watchdog" in throughput["hooks"]

    saves = result["saves"]
    assert saves["rounds"] >= 1 and saves["dropped_for_disk"] == []
    assert set(saves["blocking_s"]) >= SAVE_KINDS  # and any kind checkpoint_saves adds
    assert all(saves["blocking_s"].values()), saves["blocking_s"]
    assert all(saves["commit_s"][k] for k in ("local", "persistent", "local_copy", "orbax_async"))
    assert {"local", "persistent", "local_copy"} <= set(saves["ratios"])
    assert all(result["restore"][tier][0] > 0 for tier in ("local", "persistent"))

    # The measuring process compiled the step into the cache the warm restart loads (unless the
    # package's source changed in between: the code is part of the key); the cold one compiles.
    restart = result["restart"]
    assert result["setup"]["compile_cache"] == "miss"
    if source_digest() == digest_before:
        assert restart["warm"]["compile_cache"] == "hit"
    assert restart["cold"]["compile_cache"] == "miss"
    killed = result["killed"]
    assert killed["last_step"] > killed["saved_step"]
    # The warm restart resumes from the save the killed process had committed last, or from one
    # it started at its last step whose write ended before the kill landed.
    assert killed["saved_step"] <= restart["warm"]["restored_step"] <= killed["last_step"]
    assert restart["warm"]["steps_lost"] == killed["last_step"] - restart["warm"]["restored_step"]
    for run in (restart["warm"], restart["cold"]):
        assert run["restore_tier"] == "local" and run["steps_lost"] >= 0
        assert run["kill_to_productive_step_s"] >= run["kill_to_first_step_s"] > 0

    targets = result["targets"]
    assert targets["mfu >= 0.45"] == {"value": None, "met": None}
    assert targets["kept peak within 10% of plan"] == {"value": None, "met": None}
    assert targets["local save <= 1.2 x device_to_host"]["value"] > 0
