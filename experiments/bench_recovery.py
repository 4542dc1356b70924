"""Recovery after a lost slice: time from the fault to the first productive step, by phase.

    python experiments/bench_recovery.py [--total_steps=60] [--fault_step=33] [--scenarios=a,b]

Runs the real trainer (`launch/train.py`, configs/tiny_cpu.py made smaller, as in the tests)
under the supervisor as 2 slices x 1 process x 2 CPU devices, SIGKILLs the slice-1 worker at
`fault_step`, and reads the run's events back. The recovery paths, side by side:

- `ram_no_cache`, `ram_cold_cache`, `ram`: our path, restoring from the local RAM-disk tier
  (saved every `local_every` steps); the lost slice is evicted and the job goes on, reshaped, on
  one slice. They differ in JAX's persistent compilation cache
  (`coordinator.compilation_cache_dir`): off; on but empty (the first reshape of a run to this
  size: the one-slice step is compiled anew); on and holding the one-slice step (`ram`: the
  defaults after an earlier reshape to this size, or in a later run of the config; the
  `ram_cold_cache` run filled it).
- `ram_precompiled`: as `ram_cold_cache` (no step for one slice in the cache when the run starts)
  with `coordinator.precompile_candidates` on (the default): the one-slice step is compiled in
  the background before the fault (`resilient_jax.precompile`), so the reshape loads it. The
  result records whether that compile had finished when the fault struck.
- `ram_no_standby`: as `ram`, without standby workers (`coordinator.standby_workers`): the
  restart starts Python and imports the trainer's dependencies on its critical path.
- `persistent`: the same with the RAM tier off: restore from the persistent Orbax tier (saved
  every `persistent_every` steps), warm cache.
- `baseline`: the common practice: nothing notices the dead process until JAX's own heartbeat
  timeout (default 100 s) aborts the survivors; then everything restarts, on a replacement node
  (a spare slice here, so the mesh is the same), from the last persistent checkpoint, without a
  compilation cache. Its restart, JAX init, restore and compile are measured in a run like that;
  its detection is NOT waited for but modelled: the survivors' abort delay after a peer's SIGKILL
  is measured with the JAX heartbeat timeout set to a few short values and extrapolated linearly
  to 100 s. Its stopping phase is zero (JAX aborted everyone). No standby workers either.

Phases (seconds from the fault): detection (fault -> `failure_detected`), stopping (survivors
stopped), restart (back-off and spawning), process start (Python and imports until JAX init
begins), jax_init, restore, compile (the train step's; a hit loads it from the executable cache,
keyed without tracing), first step (compile done -> the first step completed: the loop logs the
first step of a process as soon as it has run; the hooks' start, the data loader's first batch
and the wait for the slowest peer at the first collective are in it). "to progress" is the first
step past the last one logged before the fault.
Steps lost = last step logged before the fault - restored step.

Host-level scenarios (`host_scenarios.py`), with the `ram` settings: `host_lost` (the agent of
slice 1 and its worker SIGKILLed), `host_frozen` (both SIGSTOPped), each with its time to detect;
`supervisor_restart` (the supervisor SIGKILLed at the fault step and started again: the agents
keep the workers training and re-attach; no worker restart, no step lost).

Writes experiments/results/bench_recovery.json and .png and prints a table. `--scenarios` runs a
subset and merges its results into an existing JSON (each scenario records when it ran).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import report  # noqa: E402
from cluster_runs import (  # noqa: E402
    SUPERVISED_SMALL,
    extra_overrides,
    load_config,
    trainer_argv,
)
from host_scenarios import host_detection, supervisor_restart  # noqa: E402

from resilient_jax.contracts import env_vars  # noqa: E402
from resilient_jax.contracts.faults import HOST_FAULT_KINDS, FaultKind  # noqa: E402
from resilient_jax.control import ClusterSpec, Supervisor, SupervisorAction  # noqa: E402
from resilient_jax.control.worker_env import free_port  # noqa: E402
from resilient_jax.events import read_events  # noqa: E402

_TOTAL = flags.DEFINE_integer("total_steps", 60, "Steps of each run.")
_FAULT = flags.DEFINE_integer("fault_step", 33, "The slice-1 worker is killed at this step.")
_LOCAL_EVERY = flags.DEFINE_integer("local_every", 5, "RAM-tier save interval (steps).")
_PERSISTENT_EVERY = flags.DEFINE_integer("persistent_every", 20, "Persistent save interval.")
_JAX_TIMEOUTS = flags.DEFINE_list("jax_timeouts", ["3", "6", "10"], "For the baseline model.")
_WORKER = flags.DEFINE_string("worker", "launch/train.py", "The worker program.")
_SCENARIOS = flags.DEFINE_list("scenarios", [], "Run only these (default: all).")
_DOWNTIME = flags.DEFINE_float("supervisor_downtime_s", 1.0, "supervisor_restart: time it is gone.")
_OUT = flags.DEFINE_string(
    "out", os.path.join(REPO, "experiments", "results", "bench_recovery.json"), "Result file."
)

CONFIG_FILE = "configs/tiny_cpu.py"
PHASES = (
    "detection",
    "stopping",
    "restart",
    "process_start",
    "jax_init",
    "restore",
    "compile",
    "first_step",
)
BASE_OVERRIDES = SUPERVISED_SMALL


def run_scenario(
    name: str,
    overrides: dict[str, Any],
    cluster: ClusterSpec,
    log_dir: str,
    fault: FaultKind = FaultKind.KILL,
    fault_step: int | None = None,
) -> dict[str, Any]:
    overrides = {
        **BASE_OVERRIDES,
        **extra_overrides(),
        "total_steps": _TOTAL.value,
        **overrides,
    }
    workdir = tempfile.mkdtemp(prefix=f"rj_bench_{name}_")
    argv = trainer_argv(_WORKER.value, CONFIG_FILE, workdir, overrides)
    kill = SupervisorAction(fault, slice=1, at_step=fault_step or _FAULT.value)
    with open(os.path.join(log_dir, f"{name}.log"), "w") as log:
        supervisor = Supervisor(
            load_config(CONFIG_FILE, overrides),
            cluster,
            argv,
            workdir,
            actions=[kill],
            out=log,
            cwd=REPO,
        )
        result = supervisor.run(time_limit_s=600)
    events = list(read_events(workdir))
    # The background compile of the candidate mesh logs apart from the run.
    events += list(read_events(os.path.join(workdir, "precompile")))
    shutil.rmtree(workdir, ignore_errors=True)
    local_dir = overrides.get("checkpoint.local_dir")
    if local_dir:
        shutil.rmtree(local_dir, ignore_errors=True)
    if result.exit_code:
        raise RuntimeError(f"scenario {name} failed: {result.reason} (see {log_dir}/{name}.log)")
    if fault in HOST_FAULT_KINDS:
        return {**host_detection(events), **breakdown(events)}
    return breakdown(events)


def breakdown(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Phase durations of the first recovery in a run's events."""
    sup = [e for e in events if e.get("source") == "supervisor"]
    workers = [e for e in events if e.get("source") != "supervisor"]
    fault = next(e for e in sup if e["type"] == "fault_injected")
    detected = next(e for e in sup if e["type"] == "failure_detected")
    restart = next(e for e in sup if e["type"] == "restart")
    gen = restart["generation"]
    spawned = min(e["time"] for e in sup if e["type"] == "process_start" and e["generation"] == gen)
    after = [e for e in workers if e["time"] > restart["time"]]

    def first(kind: str) -> dict[str, Any]:
        return min((e for e in after if e["type"] == kind), key=lambda e: e["time"])

    jax_init, restore = first("jax_init"), first("restore")
    compile_ = min(
        (e for e in after if e["type"] == "compile" and e.get("program", "train") == "train"),
        key=lambda e: e["time"],
    )
    first_step = first("step")
    before = [e["step"] for e in workers if e["type"] == "step" and e["time"] <= fault["time"]]
    last_step = max(before)
    regained = min(e["time"] for e in after if e["type"] == "step" and e["step"] > last_step)
    t0 = fault["time"]
    phases = {
        "detection": detected["time"] - t0,
        "stopping": restart["stopping_s"],
        "restart": spawned - detected["time"] - restart["stopping_s"],
        "process_start": jax_init["time"] - jax_init["duration_s"] - spawned,
        "jax_init": jax_init["duration_s"],
        "restore": restore["duration_s"],
        "compile": compile_["duration_s"],
    }
    phases["first_step"] = first_step["time"] - compile_["time"]
    total = first_step["time"] - t0
    ahead = [e for e in events if e.get("cache") == "ahead" and e.get("program") == "train"]
    return {
        "compile_cache": compile_.get("cache"),
        "precompiled_before_fault": bool(ahead) and min(e["time"] for e in ahead) < t0,
        "phases_s": {k: round(v, 3) for k, v in phases.items()},
        "other_s": round(total - sum(phases.values()), 3),  # gaps between the phases
        "fault_to_first_step_s": round(total, 3),
        "fault_to_regained_progress_s": round(regained - t0, 3),
        "restore_tier": restore.get("tier"),
        "restored_step": restore.get("step"),
        "last_step_before_fault": last_step,
        "steps_lost": last_step - restore.get("step", 0),
        "new_mesh": restart["mesh"],
        "slices_after": restart["slices"],
    }


def jax_abort_delay(timeout_s: int, workdir: str) -> float:
    """Seconds from SIGKILL of one of two processes until JAX aborts the survivor.

    Two stand-in workers (one gloo collective per step) without a supervisor, as a plain
    multi-controller JAX job runs: nothing but JAX's own heartbeat notices the dead peer.
    """
    config = os.path.join(workdir, "config.py")
    with open(config, "w") as f:
        f.write(
            "from resilient_jax.config import default_config\n\n\n"
            "def get_config():\n    c = default_config()\n    c.total_steps = 100000\n"
            "    c.global_batch_size = 2\n    c.checkpoint.every_steps = 10\n"
            f"    c.coordinator.jax_heartbeat_timeout_s = {timeout_s}\n"
            f"    c.coordinator.heartbeat_timeout_s = {timeout_s / 2}\n    return c\n"
        )
    port = free_port()
    procs = []
    try:
        for process in (0, 1):
            env = {
                **os.environ,
                env_vars.COORDINATOR_ADDRESS: f"127.0.0.1:{port}",
                env_vars.NUM_PROCESSES: "2",
                env_vars.PROCESS_ID: str(process),
                env_vars.XLA_FLAGS: "--xla_force_host_platform_device_count=1",
                env_vars.JAX_PLATFORMS: "cpu",
            }
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "resilient_jax.testing.sim_worker",
                        f"--config={config}",
                        f"--workdir={workdir}",
                        "--sim_step_time_s=0.02",
                    ],
                    env=env,
                    cwd=REPO,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        state = os.path.join(workdir, "sim_state.json")
        deadline = time.monotonic() + 60
        while not os.path.exists(state):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the stand-in workers did not start")
            time.sleep(0.05)
        killed = time.monotonic()
        procs[1].kill()
        procs[0].wait(timeout=3 * timeout_s + 30)
        return time.monotonic() - killed
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def baseline_detection_model() -> dict[str, Any]:
    samples = []
    for timeout in map(int, _JAX_TIMEOUTS.value):
        with tempfile.TemporaryDirectory(prefix="rj_bench_jax_") as workdir:
            samples.append((timeout, jax_abort_delay(timeout, workdir)))
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_d = sum(d for _, d in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    slope = sum((t - mean_t) * (d - mean_d) for t, d in samples) / var if var else 1.0
    intercept = mean_d - slope * mean_t
    return {
        "measured": [
            {"jax_heartbeat_timeout_s": t, "survivor_abort_s": round(d, 3)} for t, d in samples
        ],
        "fit": {"slope": round(slope, 4), "intercept_s": round(intercept, 3)},
        "default_timeout_s": 100,
        "modelled_detection_s": round(intercept + slope * 100, 2),
    }


def plot(results: dict[str, Any], path: str) -> None:
    plt = report.pyplot()
    names = [n for n, r in results["scenarios"].items() if "phases_s" in r]  # with a restart
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.5 * len(names)))
    for i, name in enumerate(names):
        left = 0.0
        scenario = results["scenarios"][name]
        for j, phase in enumerate((*PHASES, "other")):
            width = scenario["phases_s"].get(phase, scenario["other_s"] if phase == "other" else 0)
            ax.barh(i, width, left=left, color=plt.cm.tab10(j), label=phase if i == 0 else None)
            left += width
        ax.text(left, i, f" {left:.1f} s, {scenario['steps_lost']} steps lost", va="center")
    ax.set_yticks(range(len(names)), names)
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlabel("seconds from the fault to the first step after recovery (symlog)")
    ax.legend(ncol=9, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    report.save_figure(fig, path, dpi=120)


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    tier: str  # ram | persistent: the newest checkpoint recovery can use
    cache: str  # off | cold | warm: JAX's persistent compilation cache at the fault
    spare: bool = False  # a spare slice replaces the lost one (same mesh after the restart)
    standby: bool = True  # workers started ahead of the restart (coordinator.standby_workers)
    # The candidate mesh compiled ahead of the fault (coordinator.precompile_candidates).
    precompile: bool = False
    # The fault's step and the run's length, when not --fault_step and --total_steps: the
    # background compile runs at the lowest priority and needs time on the 2 shared cores.
    fault_step: int | None = None
    total_steps: int | None = None
    modelled_detection: bool = False  # detection by JAX's default heartbeat, modelled
    what: str = ""
    fault: FaultKind = FaultKind.KILL  # what hits slice 1 at the fault step


SCENARIOS = (
    Scenario("ram_no_cache", "ram", "off", what="RAM tier, compilation cache off"),
    Scenario(
        "ram_cold_cache",
        "ram",
        "cold",
        what="RAM tier, empty compilation cache (the first reshape of a run to this size)",
    ),
    Scenario(
        "ram_precompiled",
        "ram",
        "cold",
        precompile=True,
        fault_step=150,
        total_steps=180,
        what="framework defaults: RAM tier, an empty cache at the start, the one-slice step "
        "compiled in the background before the fault",
    ),
    Scenario(
        "ram",
        "ram",
        "warm",
        what="RAM tier, compilation cache holding this mesh's step from an earlier run",
    ),
    Scenario(
        "ram_no_standby",
        "ram",
        "warm",
        standby=False,
        what="as ram, without standby workers (the restart starts Python and imports)",
    ),
    Scenario("persistent", "persistent", "warm", what="persistent tier only, warm cache"),
    Scenario(
        "baseline",
        "persistent",
        "off",
        spare=True,
        standby=False,
        modelled_detection=True,
        what="common practice: persistent checkpoints only, no compilation cache, survivors "
        "aborted by JAX's default 100 s heartbeat (modelled), all restart on a replacement",
    ),
    Scenario(
        "host_lost",
        "ram",
        "warm",
        fault=FaultKind.LOSE_HOST,
        what="as ram, the whole host lost: its agent and worker SIGKILLed",
    ),
    Scenario(
        "host_frozen",
        "ram",
        "warm",
        fault=FaultKind.FREEZE_HOST,
        what="as ram, the whole host frozen: its agent and worker SIGSTOPped",
    ),
)
SUPERVISOR_RESTART = "supervisor_restart"


def scenario_overrides(scenario: Scenario, shm: str, cache_dir: str) -> dict[str, Any]:
    overrides: dict[str, Any] = {"checkpoint.every_steps": _PERSISTENT_EVERY.value}
    if scenario.tier == "ram":
        overrides["checkpoint.local_dir"] = shm
        overrides["checkpoint.local_every_steps"] = _LOCAL_EVERY.value
    else:
        overrides["checkpoint.local_dir"] = ""
    # An absolute path: the cold scenario fills the cache the warm ones then find.
    overrides["coordinator.compilation_cache_dir"] = "" if scenario.cache == "off" else cache_dir
    overrides["coordinator.standby_workers"] = scenario.standby
    overrides["coordinator.precompile_candidates"] = scenario.precompile
    return overrides


def with_modelled_detection(measured: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """The measured restart of a baseline run, with detection replaced by JAX's heartbeat abort:
    JAX aborts every survivor, so there is nothing left to stop."""
    phases = dict(measured["phases_s"])
    replaced = phases["detection"] + phases["stopping"]
    phases["detection"], phases["stopping"] = model["modelled_detection_s"], 0.0
    shift = phases["detection"] - replaced
    return {
        **measured,
        "phases_s": phases,
        "measured_detection_s": measured["phases_s"]["detection"],
        "fault_to_first_step_s": round(measured["fault_to_first_step_s"] + shift, 3),
        "fault_to_regained_progress_s": round(measured["fault_to_regained_progress_s"] + shift, 3),
        "detection_model": model,
    }


def print_table(scenarios: dict[str, dict[str, Any]]) -> None:
    columns = ("detection", "stopping", "process_start", "restore", "compile")
    header = f"{'scenario':<18}" + "".join(f"{c:>14}" for c in columns)
    header += f"{'to 1st step':>13}{'to progress':>13}{'lost':>6}  tier"
    print(header)
    for name, r in scenarios.items():
        if "phases_s" not in r:  # the supervisor restart: nothing restarts
            print(
                f"{name:<18}{'reattach ' + format(r['time_to_reattach_s'], '.2f'):>28}"
                f"{'':>42}{r['fault_to_first_step_s']:>13.2f}{'':>13}{r['steps_lost']:>6}  "
                f"({r['worker_restarts']} worker restarts)"
            )
            continue
        row = f"{name:<18}" + "".join(f"{r['phases_s'][c]:>14.2f}" for c in columns)
        row += f"{r['fault_to_first_step_s']:>13.2f}{r['fault_to_regained_progress_s']:>13.2f}"
        cache = r.get("compile_cache") or "-"
        print(row + f"{r['steps_lost']:>6}  {r['restore_tier']}, compile {cache}")


def main(argv: list[str]) -> None:
    del argv
    log_dir = tempfile.mkdtemp(prefix="rj_bench_logs_")
    shm = report.ram_disk_dir("rj_bench")
    cache_dir = tempfile.mkdtemp(prefix="rj_bench_jax_cache_")
    scenarios: dict[str, dict[str, Any]] = {}
    wanted = set(_SCENARIOS.value) or {s.name for s in SCENARIOS} | {SUPERVISOR_RESTART}
    known = {s.name for s in SCENARIOS} | {SUPERVISOR_RESTART}
    if wanted - known:
        raise app.UsageError(f"--scenarios={sorted(wanted - known)}; allowed: {sorted(known)}")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        for scenario in SCENARIOS:
            if scenario.name not in wanted:
                continue
            cluster = ClusterSpec(
                num_slices=2,
                processes_per_slice=1,
                devices_per_process=2,
                spare_slices=1 if scenario.spare else 0,
            )
            # A cold cache compiled ahead of the fault must not find what other scenarios left.
            own_cache = scenario.precompile and scenario.cache == "cold"
            scenario_cache = tempfile.mkdtemp(prefix="rj_bench_jax_cache_") if own_cache else None
            overrides = scenario_overrides(scenario, shm, scenario_cache or cache_dir)
            if scenario.total_steps:
                overrides["total_steps"] = scenario.total_steps
            try:
                measured = run_scenario(
                    scenario.name, overrides, cluster, log_dir, scenario.fault, scenario.fault_step
                )
            finally:
                if scenario_cache:
                    shutil.rmtree(scenario_cache, ignore_errors=True)
            if scenario.modelled_detection:
                measured = with_modelled_detection(measured, baseline_detection_model())
            scenarios[scenario.name] = {
                "what": scenario.what,
                "cache": scenario.cache,
                "ran": when,
                **measured,
            }
        if SUPERVISOR_RESTART in wanted:
            ram = next(s for s in SCENARIOS if s.name == "ram")
            overrides = {
                **BASE_OVERRIDES,
                **extra_overrides(),
                "total_steps": _TOTAL.value,
                **scenario_overrides(ram, shm, cache_dir),
            }
            scenarios[SUPERVISOR_RESTART] = {
                "ran": when,
                **supervisor_restart(
                    CONFIG_FILE, overrides, _FAULT.value, _DOWNTIME.value, log_dir
                ),
            }
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    results = {
        "what": "fault (SIGKILL of the slice-1 worker) to first step after recovery, by phase",
        "machine": report.host_line(),
        "python": platform.python_version(),
        "setup": {
            "cluster": "2 slices x 1 process x 2 CPU devices (simulated slices)",
            "config": CONFIG_FILE,
            "overrides": {**BASE_OVERRIDES, **extra_overrides()},
            "total_steps": _TOTAL.value,
            "fault_step": _FAULT.value,
            "local_every": _LOCAL_EVERY.value,
            "persistent_every": _PERSISTENT_EVERY.value,
        },
        "notes": [
            "baseline detection is modelled, not waited for: see its detection_model",
            "all but baseline continue on 1 slice (reshaped mesh, more microbatches); "
            "baseline restarts on 2 (a spare stands in for the replaced node)",
            "warm cache: the compilation cache already holds the reshaped mesh's step, as after "
            "an earlier reshape to this size in the same run or an earlier run of the config",
        ],
        "scenarios": scenarios,
        "logs": log_dir,
    }
    if _SCENARIOS.value and os.path.exists(_OUT.value):  # a subset: merged into the last results
        with open(_OUT.value) as f:
            previous = json.load(f)
        results["scenarios"] = {**previous.get("scenarios", {}), **scenarios}
    report.write_json(_OUT.value, results)
    plot(results, os.path.splitext(_OUT.value)[0] + ".png")
    print_table(scenarios)


if __name__ == "__main__":
    app.run(main)
