"""The survivor's stall at a slice kill and its pause at the replacement's join, by phase, side by
side with the code of another checkout (the change they measure against the code before it).

    python experiments/elastic_stall.py [--total_steps=60] [--fault_step=15] [--baseline=DIR]
    python experiments/elastic_stall.py --model=small [--baseline=DIR]

Two slices x 1 process x 2 CPU devices of the real trainer under the elastic supervisor (the run
helpers of `elastic.py`), configs/tiny_cpu.py or (`--model=small`) the tests' SMALL variant of it
(d_model 64, 2 layers, 32 tokens: a step of tens of milliseconds, so that "detection + one step"
is measured against a step shorter than the detection's bound; `--small_steps` steps, the kill at
`--small_fault_step`). Runs, one after the other:

- `elastic`: undisturbed; its per-step parameter digests are the reference.
- `elastic_kill`: slice 1 SIGKILLed half a step after slice 0 logged the fault step (in the middle
  of slice 0's computing of its next part, so that its exchange fails: a kill between steps only
  leaves slice 1 out of the next quorum); a cold replacement is started at once (no warm standby:
  the checkout compared with may not have one), heals from slice 0 and joins.
- `elastic_kill_baseline` (with `--baseline=DIR`): the same with the slices started from the
  checkout DIR (the supervisor and quorum server stay this one's).

From the survivor's events: the stall (kill to its next step) by phase (the kill to its failed
exchange: the rest of the part in flight; to the quorum re-formed; to the next step: the parts
computed, the update), the parts the redo computed, steps redone and lost, and the pause at the
join: over its first 3 steps in a quorum with the replacement, its time beyond each step's own work
(both parts against its median step alone, one part against its median with 2 slices); and
whether every step of both slices equals the undisturbed run's bit for bit. Writes
results/elastic_stall.json (tiny) or elastic_stall_small.json, and a PNG; prints a table. Times are
wall clock on a 2-core machine: compare the runs of one invocation.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic as el
import report
from cluster_runs import extra_overrides, supervise

from configs import small_cpu
from resilient_jax.control.elastic import ElasticSupervisor

FLAGS = flags.FLAGS
_MODEL = flags.DEFINE_enum("model", "tiny", ["tiny", "small"], "tiny_cpu, or its SMALL variant.")
_SMALL_STEPS = flags.DEFINE_integer("small_steps", 1500, "Steps per run with --model=small.")
_SMALL_FAULT = flags.DEFINE_integer("small_fault_step", 100, "Kill step with --model=small.")
_OUT = flags.DEFINE_string("out", "", "Result file (default: results/elastic_stall[_small].json).")
_BASELINE = flags.DEFINE_string(
    "baseline", "", "A checkout of another commit: its slices run the kill once more."
)

SMALL = small_cpu.MODEL  # configs/small_cpu.py, as the tests train it
KILLS = ("elastic_kill", "elastic_kill_baseline")


def total_steps() -> int:
    return _SMALL_STEPS.value if _MODEL.value == "small" else FLAGS.total_steps


def fault_step() -> int:
    return _SMALL_FAULT.value if _MODEL.value == "small" else FLAGS.fault_step


def extra() -> dict[str, Any]:
    """The slices' overrides beside `elastic.py`'s (same for this code and the baseline's)."""
    return {
        **el.ELASTIC,
        **(SMALL if _MODEL.value == "small" else {}),
        **extra_overrides(),
        "total_steps": total_steps(),
    }


def run(workdir: str, during=None, code: str = el.REPO) -> Any:
    """An elastic run whose slices run `launch/train.py` of the checkout `code`."""
    flat = extra()
    config = el.load_config({**flat, "elastic.standby": False})  # the supervisor's only
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = code  # the slices' (the supervisor copies its environment)
    try:
        supervisor = ElasticSupervisor(
            config,
            lambda slice_id, slice_dir: el.argv(slice_dir, flat),
            workdir,
            devices_per_process=2,
            out=io.StringIO(),
            restart_delay_s=0.0,  # a replacement starts at once
            cwd=code,
        )
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return supervise(supervisor, 900, during)


def kill_run(root: str, reference: dict[int, str], name: str, code: str) -> dict[str, Any]:
    workdir = os.path.join(root, name)
    killed: dict[str, float] = {}

    def kill(supervisor) -> bool:
        # Half a step after slice 0 logged the fault step: in the middle of its next part.
        steps = el.slice_events(workdir, 0, "elastic_step")
        if "at" not in killed:
            logged = [e["time"] for e in steps if fault_step() - 1 <= e["step"] <= fault_step()]
            if len(logged) < 2:
                return False
            killed["at"] = logged[1] + 0.5 * (logged[1] - logged[0])
        if time.time() < killed["at"]:
            return False
        os.kill(supervisor.workers[1].pid, signal.SIGKILL)
        killed["time"] = time.time()
        with open(os.path.join(workdir, "kill_time.json"), "w") as f:
            json.dump(killed, f)
        return True

    result = run(workdir, during=kill, code=code)
    return {"exit_code": result.exit_code, **analyze_kill(workdir, reference)}


def analyze_kill(workdir: str, reference: dict[int, str]) -> dict[str, Any]:
    """The kill run's numbers from its events. The fault time is the kill's (`kill_time.json`),
    or else the survivor's first failed exchange (a killed peer resets its connections at once)."""
    survivor = el.slice_events(workdir, 0, "elastic_step")
    failed = el.slice_events(workdir, 0, "elastic_exchange_failed")
    t_kill, fault_source = el.fault_time(workdir, failed)
    before = [e for e in survivor if e["time"] < t_kill]
    after = [e for e in survivor if e["time"] >= t_kill]
    intervals = [b["time"] - a["time"] for a, b in itertools.pairwise(survivor[2:])]
    median = statistics.median(intervals[: fault_step() - 3])
    alone = [e for e in survivor if e["slices"] == [0]]
    # Alone, from the second step on (the first is the one the kill landed in).
    alone_intervals = [b["time"] - a["time"] for a, b in itertools.pairwise(alone)]
    median_alone = statistics.median(alone_intervals) if alone_intervals else None
    quorums = el.slice_events(workdir, 0, "elastic_quorum")
    reformed = next(q for q in quorums if q["time"] >= t_kill)
    failed_after = [e for e in failed if e["time"] >= t_kill]
    t_failed = failed_after[0]["time"] if failed_after else None
    first = after[0]
    stall = first["time"] - t_kill
    digests = {e["step"]: e["digest"] for e in survivor}
    replacement = {e["step"]: e["digest"] for e in el.slice_events(workdir, 1, "elastic_step")}
    detection = reformed["time"] - (t_failed if t_failed is not None else t_kill)
    out: dict[str, Any] = {
        "fault_time_from": fault_source,
        "median_step_s": median,
        "median_step_alone_s": median_alone,
        "reform_s": reformed["time"] - t_kill,
        "stall_s": stall,
        "gap_across_fault_s": first["time"] - before[-1]["time"],
        # The stall by phase: the part in flight finished (its exchange then fails at once),
        # the quorum re-formed without slice 1 (the quorum server's answer and the group), the
        # step redone (the parts newly owned computed, the update applied).
        "stall_phases_s": {
            "kill_to_exchange_failed": None if t_failed is None else t_failed - t_kill,
            "exchange_failed_to_quorum": detection,
            "group_formed": reformed["duration_s"],
            "quorum_to_next_step": first["time"] - reformed["time"],
            "of_which_parts_computed": first.get("compute_s"),
        },
        "parts_reused_at_the_redo": first.get("reused", []),
        "parts_computed_at_the_redo": [
            p for p in first["owned"] if p not in first.get("reused", [])
        ],
        # The target's "detection + one step": the step at the new membership (alone).
        "detection_plus_step_alone_s": detection + median_alone if median_alone else None,
        "stall_in_steps_alone": stall / median_alone if median_alone else None,
        "steps_redone": len(failed),
        "steps_lost": 0
        if [e["step"] for e in survivor] == list(range(1, len(survivor) + 1))
        else None,
        "steps_alone": len(alone),
        "same_params_as_undisturbed": digests == reference
        and all(reference[s] == d for s, d in replacement.items()),
        "rejoined": any(e["slices"] == [0, 1] for e in after),
    }
    out.update(analyze_join(workdir, survivor, median, median_alone, t_kill))
    return out


def analyze_join(
    workdir: str,
    survivor: list[dict[str, Any]],
    median: float,
    median_alone: float | None,
    t_kill: float,
) -> dict[str, Any]:
    """The replacement's heal and join, and the survivor's step intervals around it. The pause
    at the join: over the first 3 steps of the survivor in a quorum with the replacement, the
    time beyond what each step's own work takes (a step computing both parts against the median
    step alone, one part against the median with 2 slices)."""
    starts = [e for e in el.read(os.path.join(workdir, "events.jsonl"))]
    spawned = [e for e in starts if e["type"] == "elastic_slice_start" and e["slice"] == 1][-1]
    pid = spawned["pid"]
    heals = [e for e in el.slice_events(workdir, 1, "elastic_heal") if e["pid"] == pid]
    steps = [e for e in el.slice_events(workdir, 1, "elastic_step") if e["pid"] == pid]
    if not heals or not steps:
        return {"rejoined": False}
    heal = heals[-1]
    sent = [e for e in el.slice_events(workdir, 0, "elastic_heal") if e["time"] >= t_kill]
    compiles = [e for e in el.slice_events(workdir, 1, "compile") if e["pid"] == pid]
    inits = [e for e in el.slice_events(workdir, 1, "init") if e["pid"] == pid]
    by_step = {e["step"]: e for e in survivor}
    # The first step with the replacement: after the steps alone (a step in flight at the kill
    # can still complete with both slices, if slice 1 sent its part before it died).
    joint = next(
        b["step"]
        for a, b in itertools.pairwise(survivor)
        if b["time"] >= t_kill and a["slices"] == [0] and b["slices"] == [0, 1]
    )
    interval = {
        s: by_step[s]["time"] - by_step[s - 1]["time"]
        for s in range(joint - 2, joint + 4)
        if s in by_step and s - 1 in by_step
    }
    # A step computing both parts is held to the median step alone, which a large state whose
    # survivor trained a single step alone before the join does not have: its pause is unknown,
    # not zero (the heal itself is measured either way).
    own_work = {1: median, 2: median_alone}
    reference = {
        s: own_work.get(len(by_step[s]["owned"])) for s in range(joint, joint + 3) if s in interval
    }
    excess = {s: interval[s] - ref for s, ref in reference.items() if ref is not None}
    late = [by_step[s]["time"] - by_step[s - 1]["time"] for s in by_step if s - 1 in by_step]
    late = late[joint + 3 :]  # steps are 1..N: index s-2 is step s; from joint + 5 on
    replacement_digests = {e["step"]: e["digest"] for e in steps}
    survivor_digests = {e["step"]: e["digest"] for e in survivor}
    pause = sum(excess.values()) if None not in reference.values() else None
    return {
        "rejoined": True,
        "joined_at_step": heal["step"],
        "first_step_in_a_quorum_with_it": joint,
        "replacement_spawn_to_heal_s": heal["time"] - spawned["time"],
        "replacement_spawn_to_first_step_s": steps[0]["time"] - spawned["time"],
        "replacement_init_s": inits[-1]["duration_s"] if inits else None,
        "replacement_compile_s": compiles[-1]["duration_s"] if compiles else None,
        "replacement_compile_cache": compiles[-1].get("cache") if compiles else None,
        "heal_received_s": heal["duration_s"],
        "heal_sent_s": sent[-1]["duration_s"] if sent else None,
        "heal_bytes": heal["bytes"],
        "survivor_step_intervals_around_join_s": {
            str(k): {"interval": v, "owned": by_step[k]["owned"], "slices": by_step[k]["slices"]}
            for k, v in interval.items()
        },
        "survivor_excess_over_own_work_s": {str(k): v for k, v in excess.items()},
        "median_step_after_join_s": statistics.median(late) if late else None,
        "join_pause_s": pause,
        "join_pause_in_steps": pause / median if pause is not None else None,
        "replicas_bitwise_equal_after_join": all(
            survivor_digests.get(s) == d for s, d in replacement_digests.items()
        ),
    }


SHOWN = (
    "median_step_s",
    "median_step_alone_s",
    "stall_s",
    "stall_in_steps_alone",
    "detection_plus_step_alone_s",
    "reform_s",
    "steps_redone",
    "parts_computed_at_the_redo",
    "same_params_as_undisturbed",
    "joined_at_step",
    "heal_received_s",
    "heal_sent_s",
    "join_pause_s",
    "join_pause_in_steps",
    "replicas_bitwise_equal_after_join",
)


def main(argv_: list[str]) -> None:
    del argv_
    root = FLAGS.analyze or tempfile.mkdtemp(prefix="elastic_stall_")
    print(f"runs under {root}")
    small = _MODEL.value == "small"
    model = "SMALL tiny_cpu (d_model 64, 2 layers, 32 tokens)" if small else "configs/tiny_cpu.py"
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "config": f"{model}, 2 slices x 1 process x 2 CPU devices, cold replacement",
        "total_steps": total_steps(),
        "fault_step": fault_step(),
    }
    if _BASELINE.value:
        results["baseline"] = _BASELINE.value
    if FLAGS.analyze:
        results["elastic"] = el.elastic_result(os.path.join(root, "elastic"), 0)
        reference = results["elastic"].pop("digests")
        for name in KILLS:
            if os.path.isdir(os.path.join(root, name)):
                kill_dir = os.path.join(root, name)
                results[name] = {"exit_code": 0, **analyze_kill(kill_dir, reference)}
    else:
        workdir = os.path.join(root, "elastic")
        results["elastic"] = el.elastic_result(workdir, run(workdir).exit_code)
        reference = results["elastic"].pop("digests")
        results[KILLS[0]] = kill_run(root, reference, KILLS[0], el.REPO)
        if _BASELINE.value:
            code = os.path.abspath(_BASELINE.value)
            results[KILLS[1]] = kill_run(root, reference, KILLS[1], code)
    name = "elastic_stall_small" if small else "elastic_stall"
    if extra_overrides():
        results["overrides"] = extra_overrides()
    report.write_json(_OUT.value or os.path.join(el.RESULTS, f"{name}.json"), results)
    print(f"elastic undisturbed: median step {results['elastic']['median_step_s']:.3f} s")
    kills = [k for k in KILLS if k in results]
    print(f"{'':<36}" + "".join(f"{k:>26}" for k in kills))
    for key in SHOWN:
        row = [results[k].get(key) for k in kills]
        print(f"{key:<36}" + "".join(f"{_show(v):>26}" for v in row))
    for k in kills:
        print(f"{k}: stall by phase {_show(results[k]['stall_phases_s'])}")
        excess = results[k].get("survivor_excess_over_own_work_s", {})
        print(f"{k}: survivor's excess over its own work at the join {_show(excess)}")
    plot(results, name)


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return str(value)


def plot(results: dict[str, Any], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["step (2 slices)", "step alone\n(both parts)", "kill -> next step", "join pause"]
    kills = [k for k in KILLS if k in results]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(kills)
    for n, k in enumerate(kills):
        r = results[k]
        values = [
            r["median_step_s"],
            r["median_step_alone_s"] or 0.0,
            r["stall_s"],
            r.get("join_pause_s") or 0.0,  # unknown (None) where no step ran alone to compare
        ]
        xs = [x + n * width for x in range(len(labels))]
        ax.bar(xs, values, width, label="this code" if k == KILLS[0] else "baseline")
    ax.set_xticks([x + width * (len(kills) - 1) / 2 for x in range(len(labels))], labels)
    ax.axhline(0.5, color="black", linestyle="--", linewidth=1, label="target stall 0.5 s")
    ax.set_ylabel("seconds")
    ax.set_title(f"Slice 1 SIGKILLed and replaced: {results['config'][:48]}")
    ax.legend()
    fig.tight_layout()
    path = os.path.splitext(_OUT.value)[0] + ".png" if _OUT.value else None
    fig.savefig(path or os.path.join(el.RESULTS, f"{name}.png"), dpi=120)


if __name__ == "__main__":
    app.run(main)
