"""Elastic mode against the single-runtime mode: what a lost slice costs the survivors, how a
replacement heals and joins, and goodput under a slice kill a minute.

    python experiments/elastic.py [--total_steps=60] [--fault_step=15]
    python experiments/elastic.py --mode=chaos [--chaos_s=180] [--fault_every_s=60]

Runs the real trainer (`launch/train.py`, configs/tiny_cpu.py: the 3.7M-parameter model, batch
16 x 128 tokens) on 2 slices x 1 process x 2 CPU devices.

`--mode=kill` (default), five runs one after the other:

- `single_runtime`: today's default, the supervisor and one JAX runtime over both slices,
  undisturbed: the step time the elastic mode is compared with.
- `elastic`: `elastic.enabled`, undisturbed: its step time (gradient sums through the gloo
  exchange on the host) and its per-step parameter digests.
- `elastic_kill`: as `elastic`, slice 1's worker SIGKILLed once slice 0 has logged `fault_step`
  and the warm standby slice (`elastic.standby`) waits at the join point; the elastic supervisor
  gives the standby slice 1's identity at once, and it heals from slice 0 and joins. The standby
  runs under SCHED_IDLE until then (`elastic.standby_idle_cpu`, its default).
- `elastic_kill_standby_normal_cpu`: the same with `elastic.standby_idle_cpu=false`: the standby,
  and the next one started after the join, at the slices' own CPU priority (the code before).
- `elastic_kill_cold`: the same with `elastic.standby=false`: the supervisor starts a replacement
  process at once, which starts up (its steps loaded from the job's executable cache; no state
  initialised: it heals), heals from slice 0 and joins. Measured from the events, in that one
  run: the survivor's stall (from the kill to its next step; and that step interval less the
  median one), the steps redone (exchanges that failed), the replacement's time from its spawn to
  the heal and to its first step in the quorum (and from the kill to the heal), the heal's own
  transfer time, and the survivor's step intervals around the join; the pause at the join (the
  survivor's time beyond its own work over the join step, the heal's step, in which it computes
  every part while it hands the state over, and the two after it; a join step that is also the
  survivor's first step after the kill is the stall and not counted again: `analyze_join`); and
  whether every step's parameters, on both slices, equal the undisturbed run's bit for bit.

`--mode=chaos`, two runs of `--chaos_s` seconds of training each (from each run's first step;
the whole run is cut by the supervisor's time limit), one after the other:

- `undisturbed`: elastic mode, no faults.
- `kill_a_minute`: elastic mode, slice 1 SIGKILLed every `--fault_every_s` seconds (the first at
  half that), a replacement started at once each time, healing from slice 0 and joining.

Goodput ratio: the steps the job completed in the window against the undisturbed run's (the job's
progress is the newest step any slice completed). Also the goodput accounting
(`resilient_jax.goodput.accounting`) of slice 0, the slice that is never killed: productive time
over the window, badput by category (the survivor's slower steps alone show as stragglers).

Writes experiments/results/elastic.json and .png (kill) or elastic_chaos.json (chaos) and prints
a table. Times are wall clock on a shared 2-core machine: compare the scenarios of one run, not
absolute numbers across runs.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import cluster_runs  # noqa: E402
from cluster_runs import STEP_LOG_ONLY, supervise  # noqa: E402

from resilient_jax.control import ClusterSpec, Supervisor  # noqa: E402
from resilient_jax.control.elastic import ElasticSupervisor  # noqa: E402

_MODE = flags.DEFINE_enum("mode", "kill", ["kill", "chaos"], "What to measure (module doc).")
_STEPS = flags.DEFINE_integer("total_steps", 60, "Steps per run (kill mode).")
_FAULT = flags.DEFINE_integer("fault_step", 15, "Slice 1 is killed once slice 0 logged this step.")
_CHAOS_S = flags.DEFINE_float("chaos_s", 180.0, "Seconds of training per run (chaos mode).")
_EVERY_S = flags.DEFINE_float("fault_every_s", 60.0, "Seconds between kills (chaos mode).")
_ANALYZE = flags.DEFINE_string(
    "analyze", "", "Only read the runs in this directory (a previous run's root) again."
)
_BEFORE = flags.DEFINE_string(
    "before",
    "",
    "A results file of an earlier version to keep beside this run's numbers (key `before`).",
)

RESULTS = os.path.join(REPO, "experiments", "results")


def overrides() -> dict[str, Any]:
    return {
        **STEP_LOG_ONLY,
        "total_steps": _STEPS.value,
        "coordinator.compilation_cache_dir": "",
    }


def load_config(extra: dict[str, Any]):
    return cluster_runs.load_config("configs/tiny_cpu.py", {**overrides(), **extra})


def argv(workdir: str, extra: dict[str, Any]) -> list[str]:
    flat = {**overrides(), **extra}
    return [
        sys.executable,
        "launch/train.py",
        "--config=configs/tiny_cpu.py",
        f"--workdir={workdir}",
        *(f"--config.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in flat.items()),
    ]


def read(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def step_times(rows: list[dict[str, Any]]) -> list[float]:
    """step_time_s of every metrics row after the first two (compile, first exchange)."""
    return [r["step_time_s"] for r in rows if r.get("step", 0) > 2 and "step_time_s" in r]


def single_runtime(root: str) -> dict[str, Any]:
    workdir = os.path.join(root, "single_runtime")
    supervisor = Supervisor(
        load_config({}),
        ClusterSpec(2, 1, 2),
        argv(workdir, {}),
        workdir,
        out=io.StringIO(),
        cwd=REPO,
    )
    result = supervisor.run(time_limit_s=900)
    return single_runtime_result(workdir, result.exit_code)


def single_runtime_result(workdir: str, exit_code: int) -> dict[str, Any]:
    times = step_times(read(os.path.join(workdir, "metrics.jsonl")))
    return {"exit_code": exit_code, "median_step_s": statistics.median(times)}


# The job's executable cache on (its default): a replacement loads its steps, as in production.
ELASTIC = {
    "elastic.enabled": True,
    "elastic.check_every_steps": 1,
    "coordinator.compilation_cache_dir": ".jax_cache",
}


def run_elastic(
    workdir: str, during=None, extra: dict[str, Any] | None = None, time_limit_s: float = 900
) -> Any:
    flat = {**ELASTIC, **(extra or {})}
    supervisor = ElasticSupervisor(
        load_config(flat),
        lambda slice_id, slice_dir: argv(slice_dir, flat),
        workdir,
        devices_per_process=2,
        out=io.StringIO(),
        restart_delay_s=0.0,  # a replacement starts at once
        cwd=REPO,
    )
    return supervise(supervisor, time_limit_s, during)


def slice_events(workdir: str, slice_id: int, kind: str) -> list[dict[str, Any]]:
    rows = read(os.path.join(workdir, "slices", str(slice_id), "events.jsonl"))
    return [e for e in rows if e["type"] == kind]


def elastic(root: str) -> dict[str, Any]:
    workdir = os.path.join(root, "elastic")
    return elastic_result(workdir, run_elastic(workdir).exit_code)


def elastic_result(workdir: str, exit_code: int) -> dict[str, Any]:
    times = step_times(read(os.path.join(workdir, "slices", "0", "metrics.jsonl")))
    digests = [
        {e["step"]: e["digest"] for e in slice_events(workdir, s, "elastic_step")} for s in (0, 1)
    ]
    return {
        "exit_code": exit_code,
        "median_step_s": statistics.median(times),
        "replicas_bitwise_equal": digests[0] == digests[1],
        "digests": digests[0],
    }


def standby_ready(workdir: str) -> bool:
    """The run's warm standby waits at the join point."""
    rows = read(os.path.join(workdir, "standby", "events.jsonl"))
    return any(e["type"] == "elastic_standby_ready" for e in rows)


# The kill runs: name, a warm standby, the standby under SCHED_IDLE until it is given a slice.
KILLS = (
    ("elastic_kill", True, True),
    ("elastic_kill_standby_normal_cpu", True, False),
    ("elastic_kill_cold", False, True),
)


def elastic_kill(
    root: str, name: str, reference: dict[int, str], standby: bool, idle_cpu: bool
) -> dict[str, Any]:
    workdir = os.path.join(root, name)
    killed: dict[str, float] = {}

    def kill(supervisor) -> bool:
        steps = slice_events(workdir, 0, "elastic_step")
        if not steps or steps[-1]["step"] < _FAULT.value:
            return False
        if standby and not standby_ready(workdir):
            return False  # a warm standby is what this run measures
        os.kill(supervisor.workers[1].pid, signal.SIGKILL)
        killed["time"] = time.time()
        with open(os.path.join(workdir, "kill_time.json"), "w") as f:
            json.dump(killed, f)
        return True

    extra = {"elastic.standby": standby, "elastic.standby_idle_cpu": idle_cpu}
    result = run_elastic(workdir, during=kill, extra=extra)
    return {"exit_code": result.exit_code, **analyze_kill(workdir, reference)}


def fault_time(workdir: str, failed: list[dict[str, Any]]) -> tuple[float, str]:
    """When the fault struck and how that is known: the kill's time (`kill_time.json`), or else
    the survivor's first failed exchange `failed` (a killed peer resets its connections at once)."""
    kill_file = os.path.join(workdir, "kill_time.json")
    if os.path.exists(kill_file):
        with open(kill_file) as f:
            return json.load(f)["time"], "kill"
    return failed[0]["time"], "first failed exchange"


def analyze_kill(workdir: str, reference: dict[int, str]) -> dict[str, Any]:
    """The kill run's numbers from its events. The fault time is the kill's (`kill_time.json`),
    or else the survivor's first failed exchange (a killed peer resets its connections at once)."""
    survivor = slice_events(workdir, 0, "elastic_step")
    failed = slice_events(workdir, 0, "elastic_exchange_failed")
    t_kill, fault_source = fault_time(workdir, failed)
    before = [e for e in survivor if e["time"] < t_kill]
    after = [e for e in survivor if e["time"] >= t_kill]
    intervals = [b["time"] - a["time"] for a, b in itertools.pairwise(survivor[2:])]
    median = statistics.median(intervals[: _FAULT.value - 3])
    alone = [e for e in survivor if e["slices"] == [0]]
    alone_intervals = [b["time"] - a["time"] for a, b in itertools.pairwise(alone)]
    quorums = slice_events(workdir, 0, "elastic_quorum")
    reformed = next(q for q in quorums if q["time"] >= t_kill)
    digests = {e["step"]: e["digest"] for e in survivor}
    replacement = {e["step"]: e["digest"] for e in slice_events(workdir, 1, "elastic_step")}
    out: dict[str, Any] = {
        "fault_time_from": fault_source,
        "median_step_s": median,
        "median_step_alone_s": statistics.median(alone_intervals) if alone_intervals else None,
        "reform_s": reformed["time"] - t_kill,
        "stall_s": after[0]["time"] - t_kill,
        "gap_across_fault_s": after[0]["time"] - before[-1]["time"],
        "steps_redone": len(failed),
        "steps_alone": len(alone),
        "same_params_as_undisturbed": digests == reference
        and all(reference[s] == d for s, d in replacement.items()),
        "rejoined": any(e["slices"] == [0, 1] for e in after),
    }
    out.update(analyze_join(workdir, survivor, median, out["median_step_alone_s"], t_kill))
    return out


def analyze_join(
    workdir: str,
    survivor: list[dict[str, Any]],
    median: float,
    median_alone: float | None,
    t_kill: float,
) -> dict[str, Any]:
    """The replacement's heal and join, and the survivor's step intervals around it. With a warm
    standby, its "spawn" is the supervisor giving it slice 1 (it was started long before).

    The join step is the heal's step: the handover, in which the survivor computes every part
    (as alone) while it sends the state, and the replacement trains its own part from the next
    step. The pause at the join is the survivor's time beyond its own work over the join step and
    the two after it: a step of every part against its median step alone, a step of its own part
    against its median with 2 slices. A join step that is also the survivor's first step after the
    kill (the standby joined the first quorum without slice 1's old worker) is the stall, measured
    as such, and is not counted again here. A run with no step alone (a warm standby) has no
    median step alone: its join step is held against the median with 2 slices, which counts the
    part the survivor computes for the replacement in that step as pause (an upper bound)."""
    starts = [e for e in read(os.path.join(workdir, "events.jsonl"))]
    spawned = [e for e in starts if e["type"] == "elastic_slice_start" and e["slice"] == 1][-1]
    pid = spawned["pid"]
    heals = [e for e in slice_events(workdir, 1, "elastic_heal") if e["pid"] == pid]
    steps = [e for e in slice_events(workdir, 1, "elastic_step") if e["pid"] == pid]
    if not heals or not steps:
        return {"rejoined": False}
    heal = heals[-1]
    compiles = [e for e in slice_events(workdir, 1, "compile") if e["pid"] == pid]
    inits = [e for e in slice_events(workdir, 1, "init") if e["pid"] == pid]
    # The survivor's step intervals: the last ones before the join, the join step, the next.
    joined = heal["step"]
    by_step = {e["step"]: e for e in survivor}
    intervals = {
        s: by_step[s]["time"] - by_step[s - 1]["time"]
        for s in range(joined - 2, joined + 4)
        if s in by_step and s - 1 in by_step
    }
    first_after_kill = next(e["step"] for e in survivor if e["time"] >= t_kill)
    excess = {}
    for s in range(joined, joined + 3):
        if s not in intervals or s == first_after_kill:
            continue
        every_part = len(by_step[s]["owned"]) == 2
        excess[s] = intervals[s] - (median_alone if every_part and median_alone else median)
    pause = sum(excess.values())
    after = [by_step[s]["time"] - by_step[s - 1]["time"] for s in by_step if s - 1 in by_step]
    after = after[joined + 3 :]  # steps are 1..N: index s-2 is step s; from joined + 5 on
    replacement_digests = {e["step"]: e["digest"] for e in steps}
    survivor_digests = {e["step"]: e["digest"] for e in survivor}
    # A standby's own start-up (spawned to waiting at the join point), long before the kill.
    started = [e for e in starts if e["type"] == "elastic_standby_start" and e["pid"] == pid]
    ready = [
        e
        for e in read(os.path.join(workdir, "standby", "events.jsonl"))
        if e["type"] == "elastic_standby_ready" and e["pid"] == pid
    ]
    standby_start_s = ready[0]["time"] - started[0]["time"] if started and ready else None
    return {
        "rejoined": True,
        "joined_at_step": joined,
        "replacement_was_standby": bool(spawned.get("standby")),
        "standby_start_to_ready_s": standby_start_s,
        "replacement_kill_to_heal_s": heal["time"] - t_kill,
        "replacement_spawn_to_heal_s": heal["time"] - spawned["time"],
        "replacement_spawn_to_first_step_s": steps[0]["time"] - spawned["time"],
        "replacement_init_s": inits[-1]["duration_s"] if inits else None,
        "replacement_compile_s": compiles[-1]["duration_s"] if compiles else None,
        "replacement_compile_cache": compiles[-1].get("cache") if compiles else None,
        "heal_transfer_s": heal["duration_s"],
        "heal_bytes": heal["bytes"],
        "survivor_step_intervals_around_join_s": {str(k): v for k, v in intervals.items()},
        "median_step_after_join_s": statistics.median(after) if after else None,
        "join_step_is_the_stall": joined == first_after_kill,
        "survivor_excess_over_own_work_s": {str(k): v for k, v in excess.items()},
        "join_pause_s": pause,
        "join_pause_in_steps": pause / median,
        "replicas_bitwise_equal_after_join": all(
            survivor_digests.get(s) == d for s, d in replacement_digests.items()
        ),
    }


# ------------------------------------------------------------------ chaos: a kill a minute


def job_progress(workdir: str) -> list[tuple[float, int]]:
    """(time, step) of every step the job completed first (any slice), in time order."""
    rows = sorted(
        (e["time"], e["step"]) for s in (0, 1) for e in slice_events(workdir, s, "elastic_step")
    )
    progress, newest = [], 0
    for t, step in rows:
        if step > newest:
            progress.append((t, step))
            newest = step
    return progress


def chaos_run(workdir: str, kill: bool) -> dict[str, Any]:
    """`--chaos_s` seconds of training from the first step; with `kill`, slice 1 SIGKILLed every
    `--fault_every_s` seconds (the first at half that)."""
    every, window = _EVERY_S.value, _CHAOS_S.value
    kills: list[float] = []
    state: dict[str, float] = {}

    def during(supervisor) -> bool:
        if "first" not in state:
            first = slice_events(workdir, 0, "elastic_step")[:1]
            if not first:
                return False
            state["first"] = first[0]["time"]
        due = state["first"] + every / 2 + every * len(kills)
        if due < state["first"] + window and time.time() >= due and 1 in supervisor.workers:
            os.kill(supervisor.workers[1].pid, signal.SIGKILL)
            kills.append(time.time())
        return False

    # Startup (compile) before the first step is not in the window: the limit leaves it 75 s.
    result = run_elastic(
        workdir,
        during=during if kill else None,
        extra={"total_steps": 100_000},
        time_limit_s=window + 75,
    )
    del result  # ended by the time limit, as intended
    with open(os.path.join(workdir, "kills.json"), "w") as f:
        json.dump(kills, f)
    return analyze_chaos(workdir, kills)


def analyze_chaos(workdir: str, kills: list[float]) -> dict[str, Any]:
    from resilient_jax.goodput import accounting

    progress = job_progress(workdir)
    start = progress[0][0]
    end = start + _CHAOS_S.value
    if progress[-1][0] < end - 1.0:
        raise RuntimeError(f"{workdir}: the run ended {end - progress[-1][0]:.0f} s early")
    steps = max(step for t, step in progress if t <= end) - progress[0][1]
    events = [
        e
        for e in read(os.path.join(workdir, "slices", "0", "events.jsonl"))
        if start <= e["time"] <= end
    ]
    goodput = accounting.compute(events)
    # The run's own rate with both slices (steps of the window in a quorum of both, not the
    # first one after a join): what the window would have trained without faults, under the same
    # background load as the faults met.
    own = [e for e in slice_events(workdir, 0, "elastic_step") if start <= e["time"] <= end]
    together = [
        b["time"] - a["time"]
        for a, b in itertools.pairwise(own)
        if a["slices"] == b["slices"] == [0, 1] and a["quorum_id"] == b["quorum_id"]
    ]
    median_together = statistics.median(together)
    joins = [
        e["time"]
        for e in slice_events(workdir, 1, "elastic_heal")
        if e["role"] == "received" and start <= e["time"] <= end
    ]
    return {
        "window_s": _CHAOS_S.value,
        "kills": len([k for k in kills if k <= end]),
        "joins": len(joins),
        "steps_in_window": steps,
        "steps_per_s": steps / _CHAOS_S.value,
        "median_step_both_slices_s": median_together,
        "goodput_vs_own_rate": steps * median_together / _CHAOS_S.value,
        "kill_to_join_s": [j - k for k, j in zip(sorted(kills), sorted(joins), strict=False)],
        "steps_redone": len(
            [e for e in slice_events(workdir, 0, "elastic_exchange_failed") if e["time"] <= end]
        ),
        "slice0_goodput": goodput.goodput,
        "slice0_badput_s": {
            k: round(v, 2) for k, v in goodput.to_json()["badput_s"].items() if v > 0.005
        },
    }


def chaos_main(root: str) -> None:
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "config": "configs/tiny_cpu.py (3.7M params), 2 slices x 1 process x 2 CPU devices, "
        "elastic mode, executable cache on",
        "window_s": _CHAOS_S.value,
        "fault_every_s": _EVERY_S.value,
    }
    for name, kill in (("undisturbed", False), ("kill_a_minute", True)):
        workdir = os.path.join(root, name)
        if _ANALYZE.value:
            kill_file = os.path.join(workdir, "kills.json")
            kills = []
            if os.path.exists(kill_file):
                with open(kill_file) as f:
                    kills = json.load(f)
            results[name] = analyze_chaos(workdir, kills)
        else:
            results[name] = chaos_run(workdir, kill)
    base, chaos = results["undisturbed"], results["kill_a_minute"]
    results["goodput_ratio"] = chaos["steps_in_window"] / base["steps_in_window"]
    results["goodput_ratio_own_rate"] = chaos["goodput_vs_own_rate"] / base["goodput_vs_own_rate"]
    add_before(results)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "elastic_chaos.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(
        f"{'run':<14} {'steps':>6} {'steps/s':>8} {'step (2 slices) s':>18} "
        f"{'vs own rate':>11} {'kills':>5} {'joins':>5} {'slice0 goodput':>15}"
    )
    for name in ("undisturbed", "kill_a_minute"):
        r = results[name]
        print(
            f"{name:<14} {r['steps_in_window']:>6} {r['steps_per_s']:>8.3f} "
            f"{r['median_step_both_slices_s']:>18.3f} {r['goodput_vs_own_rate']:>11.3f} "
            f"{r['kills']:>5} {r['joins']:>5} {r['slice0_goodput']:>15.3f}"
        )
    print(
        f"goodput ratio (steps in {_CHAOS_S.value:.0f} s against undisturbed): "
        f"{results['goodput_ratio']:.3f}; against the run's own rate with both slices, relative "
        f"to the undisturbed run's: {results['goodput_ratio_own_rate']:.3f}"
    )
    print(f"kill to join: {[round(x, 1) for x in chaos['kill_to_join_s']]} s")
    print(f"slice 0 badput (s): {chaos['slice0_badput_s']}")


def add_before(results: dict[str, Any]) -> None:
    """`--before`'s results (without their own `before`), for a side-by-side comparison."""
    if not _BEFORE.value:
        return
    with open(_BEFORE.value) as f:
        before = json.load(f)
    before.pop("before", None)
    results["before"] = {"file": _BEFORE.value, **before}


def main(argv_: list[str]) -> None:
    del argv_
    root = _ANALYZE.value or tempfile.mkdtemp(prefix="elastic_")
    print(f"runs under {root}")
    if _MODE.value == "chaos":
        chaos_main(root)
        return
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "config": "configs/tiny_cpu.py (3.7M params), 2 slices x 1 process x 2 CPU devices",
        "total_steps": _STEPS.value,
        "fault_step": _FAULT.value,
    }
    if _ANALYZE.value:
        results["single_runtime"] = single_runtime_result(os.path.join(root, "single_runtime"), 0)
        results["elastic"] = elastic_result(os.path.join(root, "elastic"), 0)
        reference = results["elastic"].pop("digests")
        for name, _, _ in KILLS:
            if os.path.isdir(os.path.join(root, name)):
                kill_dir = os.path.join(root, name)
                results[name] = {"exit_code": 0, **analyze_kill(kill_dir, reference)}
    else:
        results["single_runtime"] = single_runtime(root)
        results["elastic"] = elastic(root)
        reference = results["elastic"].pop("digests")
        for name, standby, idle_cpu in KILLS:
            results[name] = elastic_kill(root, name, reference, standby, idle_cpu)
    single, plain = results["single_runtime"], results["elastic"]
    results["step_time_ratio_elastic_to_single"] = plain["median_step_s"] / single["median_step_s"]
    add_before(results)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "elastic.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"{'scenario':<18} {'median step s':>14}")
    kills = [name for name, _, _ in KILLS if name in results]
    for name in ("single_runtime", "elastic", *kills):
        print(f"{name:<32} {results[name]['median_step_s']:>14.3f}")
    print(f"elastic / single-runtime step time: {results['step_time_ratio_elastic_to_single']:.2f}")
    columns = {"elastic_kill": "standby", "elastic_kill_standby_normal_cpu": "standby, normal cpu"}
    print(f"  {'':<36}" + "".join(f"{columns.get(k, 'cold'):>20}" for k in kills))
    for key, value in results["elastic_kill"].items():
        if isinstance(value, dict):
            continue
        row = [results[k].get(key) for k in kills]
        cells = [v if not isinstance(v, float) else round(v, 3) for v in row]
        print(f"  {key:<36}" + "".join(f"{c!s:>20}" for c in cells))
    plot(results)


def plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = results["elastic_kill"]
    labels = [
        "step (2 slices)",
        "step alone\n(both parts)",
        "fault -> quorum\nre-formed",
        "fault -> next step",
        "heal transfer",
        "survivor's\nstep at join",
    ]
    join_step = k.get("survivor_step_intervals_around_join_s", {}).get(
        str(k.get("joined_at_step", 0) + 1), 0.0
    )
    values = [
        k["median_step_s"],
        k["median_step_alone_s"] or 0.0,
        k["reform_s"],
        k["stall_s"],
        k.get("heal_transfer_s", 0.0),
        join_step,
    ]
    colors = ["grey", "grey", "tab:green", "tab:red", "tab:green", "tab:orange"]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.bar(labels, values, color=colors)
    ax.axhline(0.5, color="black", linestyle="--", linewidth=1, label="target 0.5 s")
    ax.set_ylabel("seconds")
    ax.set_title("Elastic mode: slice 1 SIGKILLed and replaced (tiny_cpu, 2 slices)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "elastic.png"), dpi=120)


if __name__ == "__main__":
    app.run(main)
