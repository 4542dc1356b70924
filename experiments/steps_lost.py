"""Steps lost per worker kill by local-tier (RAM-disk snapshot) cadence, and what a cadence costs.

    python experiments/steps_lost.py [--cadences=1,10] [--kills=6] [--devices=4]
    -> experiments/results/steps_lost.json

One training run per cadence (`checkpoint.local_every_steps`; 0: no local tier), each on the
tiny_cpu model through `launch/train.py` on `--devices` CPU devices, the runs taking turns: a
run is started (resuming its workdir), SIGKILLed at a random moment once it has logged a few
steps, and started again, which restores the newest verified copy. Steps lost by a kill: the
last step the killed process logged minus the step the next start restored. The RAM disk outlives
the killed process, as it outlives a worker on a host. Step time per cadence: the median of the
steps each run logged (`step` events, compile and restore excluded), side by side on the same
machine in the same turns.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import report
from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from resilient_jax.events import read_events  # noqa: E402

_CADENCES = flags.DEFINE_list("cadences", ["1", "10"], "local_every_steps values (0: no tier).")
_KILLS = flags.DEFINE_integer("kills", 6, "Kills per cadence.")
_DEVICES = flags.DEFINE_integer("devices", 4, "Simulated CPU devices per run.")
_AHEAD = flags.DEFINE_integer("ahead", 6, "At most this many steps after a start before a kill.")
_OUT = flags.DEFINE_string("out", "experiments/results/steps_lost.json", "Result file.")
_TIMEOUT_S = 300.0


def _starts(events: list[dict]) -> list[int]:
    return [i for i, e in enumerate(events) if e["type"] == "process_start"]


class Run:
    """One cadence's training run: started, killed and started again in its own workdir."""

    def __init__(self, root: str, cadence: int) -> None:
        self.cadence = cadence
        self.workdir = os.path.join(root, f"every{cadence}")
        self.local_dir = f"/dev/shm/steps_lost_{os.path.basename(root)}_{cadence}"
        self.lost: list[int] = []
        self.restored: list[tuple[str, int]] = []
        self.step_s: list[float] = []
        self._proc: subprocess.Popen | None = None
        self._killed_at: int | None = None
        self._earlier_starts = 0  # process_start events before the current start

    def _current(self) -> list[dict]:
        """The events of the current start (none until its process_start is logged)."""
        events = list(read_events(self.workdir))
        starts = _starts(events)
        return events[starts[-1] :] if len(starts) > self._earlier_starts else []

    def start(self) -> None:
        self._earlier_starts = len(_starts(list(read_events(self.workdir))))
        argv = [
            sys.executable,
            "launch/train.py",
            "--config=configs/tiny_cpu.py",
            f"--workdir={self.workdir}",
            "--config.total_steps=100000",
            "--config.log.progress_bar=False",
            "--config.log.tensorboard=False",
            "--config.eval.every_steps=0",
            f"--config.checkpoint.local_dir={self.local_dir if self.cadence else ''}",
            f"--config.checkpoint.local_every_steps={self.cadence}",
        ]
        devices = f"--xla_force_host_platform_device_count={_DEVICES.value}"
        env = {**os.environ, "XLA_FLAGS": devices}
        self._proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def kill_after(self, rng: random.Random) -> None:
        """Waits for a restore (after a kill) and a few steps, then SIGKILLs at a random moment."""
        assert self._proc is not None
        deadline = time.monotonic() + _TIMEOUT_S
        target = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise SystemExit(f"run every{self.cadence} exited ({self._proc.returncode})")
            events = self._current()
            steps = [e for e in events if e["type"] == "step"]
            if target is None and (steps or self._killed_at is None):
                if self._killed_at is not None:
                    self._count_restore(events)
                first = steps[0]["step"] if steps else 0
                target = first + rng.randint(2, _AHEAD.value)
            if target is not None and steps and steps[-1]["step"] >= target:
                break
            time.sleep(0.05)
        else:
            raise SystemExit(f"run every{self.cadence} made no progress in {_TIMEOUT_S:.0f}s")
        durations = [e["duration_s"] for e in steps[2:]]  # the first steps include warm-up
        time.sleep(rng.uniform(0.0, statistics.median(durations) if durations else 0.5))
        self._proc.send_signal(signal.SIGKILL)
        self._proc.wait(timeout=30)
        steps = [e for e in self._current() if e["type"] == "step"]
        self._killed_at = steps[-1]["step"]
        self.step_s += [e["duration_s"] for e in steps[2:]]

    def _count_restore(self, events: list[dict]) -> None:
        """The loss of the last kill, once the start after it has restored (or started over:
        nothing was saved yet, and its first step is logged)."""
        assert self._killed_at is not None
        restores = [e for e in events if e["type"] == "restore"]
        tier, step = (restores[0]["tier"], int(restores[0]["step"])) if restores else ("none", 0)
        self.restored.append((tier, step))
        self.lost.append(self._killed_at - step)

    def finish(self) -> None:
        """Starts once more, to read the restore that follows the last kill."""
        self.start()
        assert self._proc is not None
        deadline = time.monotonic() + _TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                events = self._current()
                if any(e["type"] in ("restore", "step") for e in events):
                    self._count_restore(events)
                    return
                if self._proc.poll() is not None:
                    raise SystemExit(f"run every{self.cadence} exited ({self._proc.returncode})")
                time.sleep(0.05)
            raise SystemExit(f"run every{self.cadence} did not restore in {_TIMEOUT_S:.0f}s")
        finally:
            self._proc.kill()
            self._proc.wait(timeout=30)
            shutil.rmtree(self.local_dir, ignore_errors=True)


def main(argv: list[str]) -> None:
    del argv
    rng = random.Random(0)
    root = tempfile.mkdtemp(prefix="steps_lost_")
    runs = [Run(root, int(c)) for c in _CADENCES.value]
    try:
        for _ in range(_KILLS.value):
            for run in runs:
                run.start()
                run.kill_after(rng)
        for run in runs:
            run.finish()
    finally:
        for run in runs:
            shutil.rmtree(run.local_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    base = next((r for r in runs if r.cadence == 0), None)
    result = {
        "devices": _DEVICES.value,
        "kills": _KILLS.value,
        "cadences": {
            str(r.cadence): {
                "steps_lost": r.lost,
                "mean_steps_lost": statistics.mean(r.lost),
                "restored": r.restored,
                "step_s": r.step_s,
                "median_step_s": med(r.step_s),
                "step_overhead_vs_no_local": (
                    med(r.step_s) / med(base.step_s) - 1.0 if base is not None else None
                ),
            }
            for r in runs
        },
    }
    print(f"{'local_every_steps':>18}{'mean lost':>11}{'max lost':>10}{'step s':>9}{'vs none':>9}")
    for r in runs:
        row = result["cadences"][str(r.cadence)]
        overhead = row["step_overhead_vs_no_local"]
        shown = f"{100 * overhead:+.1f}%" if overhead is not None else "-"
        print(
            f"{r.cadence:>18}{row['mean_steps_lost']:>11.2f}{max(r.lost):>10}"
            f"{row['median_step_s']:>9.3f}{shown:>9}"
        )
    report.write_json(_OUT.value, result)


if __name__ == "__main__":
    app.run(main)
