"""The accelerator check: one command that measures, on a lent GPU, what the CPU benchmarks
cannot: MFU, the device-to-host side of a save, device memory and compile times.

    python experiments/gpu_check.py            # one GPU, configs/llama_1b.py shapes in bf16
    python experiments/gpu_check.py --smoke    # the same code paths on CPU, tiny shapes
    -> experiments/results/gpu_check.json (--out)

It runs within `--budget_s` (7.5 min) and never initialises the device itself; its phases run in
child processes one after another, each given the GPU alone:

1. `measure` (`gpu_measure.py`, one process): the train step compiled cold; device memory in
   steady training and at a save step, copying and keeping the state, against `--plan`'s
   prediction (`train.memory_plan`); steady tokens/s and MFU of the run's loop with all its hooks
   against a bare loop of the same compiled step; the blocking time of each checkpoint tier,
   kept and copying, against the device-to-host copy of the same state alone and plain Orbax
   async and sync; a restore from each tier. It ends training the restart runs' config (the
   local tier every 2 steps) with the run's loop and SIGKILLs itself at the first step after a
   local save has committed.
2. `restart_warm`: the trainer (`launch/train.py`) started at once on that workdir and on the
   executable cache the measuring process compiled into (warm): kill -> first step, and -> the
   first step past the last one done before the kill (productive), with the restart's phases
   (process start, restore, compile or load) from its events. It is SIGKILLed there too.
3. `restart_cold`: the same restart with an empty executable cache (compile time on the
   device). Skipped, with an estimate from the measured compile time, when it does not fit.

A phase that does not fit in the time left is skipped and says so in the phase table and the
JSON; the figures of the phases done are kept. `--layers` shrinks the model's depth (recorded)
when a full-depth run does not fit. On CPU (`--smoke`) `memory_stats()` is None: memory figures
are null, with a note. Every float in the JSON is finite or null.

Targets (checked in `targets` of the JSON, null where not measured): MFU >= 45%; loop overhead
<= 1% of the bare step; a save's blocking time <= 1.2 x the device-to-host copy and <= 0.5 x plain
Orbax async; peak memory at a save step within 10% of the plan; kill -> first productive step
with a warm cache <= 2 x the steady step time + the restore.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any

import ml_collections
from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import report  # noqa: E402
from cluster_runs import load_config, trainer_argv  # noqa: E402

from configs import small_cpu  # noqa: E402
from resilient_jax.contracts import env_vars  # noqa: E402
from resilient_jax.control import compile_cache  # noqa: E402
from resilient_jax.events import read_events  # noqa: E402
from resilient_jax.perf import model_size  # noqa: E402

_SMOKE = flags.DEFINE_bool("smoke", False, "On CPU with tiny shapes: every code path, quickly.")
_OUT = flags.DEFINE_string(
    "out", os.path.join(REPO, "experiments", "results", "gpu_check.json"), "Result file."
)
_BUDGET_S = flags.DEFINE_float("budget_s", 450.0, "Wall time for everything, in seconds.")
_CONFIG = flags.DEFINE_string("config", "configs/llama_1b.py", "Config file.")
_LAYERS = flags.DEFINE_integer("layers", 0, "Transformer blocks (0: the config's).")
_STEPS = flags.DEFINE_integer("steps", 8, "Measured steps per side of the throughput phase.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Most measured rounds of each save kind.")
_SCRATCH = flags.DEFINE_string("scratch", "", "Folder for checkpoints on disk (default: tmp).")
_LOG_DIR = flags.DEFINE_string(
    "keep_logs_in", "", "Folder for the processes' logs (gpu_measure.log, trainer.log)."
)

# What every run of the check sets: no output that costs a step's time, no evaluation inside the
# measured steps, one step kept on each tier (a step of llama_1b is 12 GB on disk and in RAM).
COMMON: dict[str, Any] = {
    "log.every_steps": 1,
    "log.progress_bar": False,
    "log.tensorboard": False,
    "eval.every_steps": 0,
    "checkpoint.keep": 1,
    "checkpoint.local_keep": 1,
}
# The smallest model that still takes every path (two microbatches, the local tier, the cache).
SMOKE: dict[str, Any] = {
    **small_cpu.MODEL,
    "model.num_layers": 1,
    "model.remat": "none",
    "model.compute_dtype": "float32",
    "global_batch_size": 4,
    "per_device_batch_size": 2,
}
LOCAL_EVERY = 2  # the restart runs' local-tier interval (steps)
RESTARTS = ("restart_warm", "restart_cold")
START_S = 20.0  # a trainer process's start (Python, imports, JAX), for the estimates
SHM = "/dev/shm"
# States the local tiers hold at once at most: a step of each of the measured tier settings (3)
# and of the loop's own, and one being written.
SHM_COPIES = 5
MEM_FRACTION = "0.9"  # of the GPU's memory for JAX's allocator (default 0.75): a save holds more


def local_storage(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """Where the local tiers write, and the room there and for the persistent saves: the RAM disk
    if it holds a few copies of the state (the tiers, their writes in flight), else a folder on
    the scratch disk (recorded: the local tier's figures are then a disk's)."""
    state_bytes = 12 * model_size.num_params(config.model)  # float32 params, Adam's two moments
    scratch = _SCRATCH.value or tempfile.gettempdir()
    free = {path: shutil.disk_usage(path).free for path in (SHM, scratch) if os.path.isdir(path)}
    on_shm = free.get(SHM, 0) >= SHM_COPIES * state_bytes
    return {
        "state_bytes_estimate": state_bytes,
        "free_bytes": free,
        "local_tier_parent": SHM if on_shm else scratch,
        "local_tier_on": "RAM disk" if on_shm else f"disk: {SHM} holds < {SHM_COPIES} states",
    }


def child_env(smoke: bool) -> dict[str, str]:
    """The environment of the check's processes: the repository importable (the trainer runs as
    `launch/train.py`, which does not put it on the path), one CPU device for the smoke run, and
    room on a GPU for a save step's extra state."""
    env = dict(os.environ)
    path = (REPO, env.get(env_vars.PYTHONPATH))
    env[env_vars.PYTHONPATH] = os.pathsep.join(p for p in path if p)
    if smoke:  # one CPU device, whatever the caller's simulated device count
        env[env_vars.JAX_PLATFORMS] = "cpu"
        env[env_vars.XLA_FLAGS] = "--xla_force_host_platform_device_count=1"
    else:
        env.setdefault(env_vars.XLA_PYTHON_CLIENT_MEM_FRACTION, MEM_FRACTION)
    return env


def keep_log(path: str, name: str = "") -> None:
    """Copies a process's log into `--keep_logs_in` (as `name`, default its own), if given."""
    if _LOG_DIR.value and os.path.exists(path):
        os.makedirs(_LOG_DIR.value, exist_ok=True)
        shutil.copy(path, os.path.join(_LOG_DIR.value, name or os.path.basename(path)))


def stop(proc: subprocess.Popen) -> None:
    """SIGKILLs `proc`'s process group (it was started in a session of its own) and reaps it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class OutOfTime(Exception):
    """The check's time ran out before a phase was done: the phase is stopped, not failed."""


def run_trainer_until(
    argv: list[str], env: dict[str, str], workdir: str, log: Any, step: int, deadline: float
) -> tuple[float, float, list[dict[str, Any]]]:
    """Starts the trainer and SIGKILLs it once its events show a step past `step`: (start time,
    kill time, its events). Raises RuntimeError if it exits first, OutOfTime at the deadline."""
    started = time.time()
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        while True:
            if past(step)([e for e in read_events(workdir) if e["time"] >= started]):
                stop(proc)
                killed = time.time()
                # What it did up to the kill, the steps after the check included.
                return started, killed, [e for e in read_events(workdir) if e["time"] >= started]
            if proc.poll() is not None:
                log.flush()
                with open(log.name) as f:
                    tail = f.read().strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"the trainer exited with {proc.returncode}: {tail[0][:200]}")
            if time.time() > deadline:
                raise OutOfTime(f"stopped at the deadline, step {step} not reached")
            time.sleep(0.05)
    finally:
        stop(proc)


def steps_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "step"]


def restart_figures(
    killed: float, started: float, events: list[dict[str, Any]], last_step: int
) -> dict[str, Any]:
    """A restarted trainer's path from the kill of its predecessor to its first steps."""
    first = {}
    for e in events:
        first.setdefault(e["type"], e)
    if "restore" not in first or "compile" not in first:
        raise RuntimeError(f"the restarted trainer logged no restore or compile: {sorted(first)}")
    restore, compile_ = first["restore"], first["compile"]
    steps = steps_of(events)
    progress = next(e for e in steps if e["step"] > last_step)
    return {
        "kill_to_first_step_s": steps[0]["time"] - killed,
        "kill_to_productive_step_s": progress["time"] - killed,
        "process_start_s": first["process_start"]["time"] - started,
        "restore_s": restore["duration_s"],
        "restore_tier": restore["tier"],
        "restored_step": restore["step"],
        "steps_lost": last_step - restore["step"],
        "compile_s": compile_["duration_s"],
        "compile_cache": compile_.get("cache"),
        "restart_gap_s": started - killed,  # the kill to the new process (a supervisor's share)
    }


class RestartRuns:
    """Phases 2 and 3 (module docstring): the trainer's runs, their folders and their config.

    `extra` are the keys the runs add to the check's overrides (the local tier every
    `LOCAL_EVERY` steps, no persistent saves); `measure` compiles its step for that config into
    `warm_cache`, so the warm restart loads it, and trains in `workdir` until it kills itself."""

    def __init__(
        self, config_file: str, overrides: dict[str, Any], env: dict[str, str], local_parent: str
    ) -> None:
        # Every process of the check writes under these two, the measuring one too: removed at
        # the end whatever ended a process (the measuring one may be stopped at the deadline).
        self.scratch = tempfile.mkdtemp(prefix="gpu_check_", dir=_SCRATCH.value or None)
        self.local_base = os.path.join(local_parent, os.path.basename(self.scratch) + "_local")
        self.local_dir = os.path.join(self.local_base, "run")
        self.workdir = os.path.join(self.scratch, "run")
        self.warm_cache = os.path.join(self.scratch, "cache_warm")
        self.extra = {
            "checkpoint.local_dir": self.local_dir,
            "checkpoint.local_every_steps": LOCAL_EVERY,
            "checkpoint.local_auto_interval": False,
            "checkpoint.every_steps": 0,
        }
        self.argv = trainer_argv(
            "launch/train.py", config_file, self.workdir, {**overrides, **self.extra}
        )
        self.env = env

    def with_cache(self, cache: str) -> dict[str, str]:
        """The environment with the executable cache in `cache`, as a supervisor passes it."""
        coordinator = ml_collections.ConfigDict({"compilation_cache_dir": cache})
        return self.env | compile_cache.cache_env(coordinator, self.workdir)

    def close(self) -> None:
        keep_log(os.path.join(self.scratch, "trainer.log"))
        shutil.rmtree(self.local_base, ignore_errors=True)
        shutil.rmtree(self.scratch, ignore_errors=True)

    def run(self, deadline: float, result: dict[str, Any]) -> None:
        """The warm restart after the measuring process killed itself, then, if it fits, the
        cold restart after the warm one is killed: into `result["restart"]`, their phases into
        `result["phases"]`."""
        phases = result["phases"]
        killed = result.get("killed")
        if killed is None:
            status = "skipped: the measuring process did not kill itself after a save"
            phases += [{"phase": p, "s": 0.0, "status": status} for p in RESTARTS]
            return
        restart: dict[str, Any] = result.setdefault("restart", {})
        warm = self.with_cache(self.warm_cache)
        last = killed["last_step"]
        with open(os.path.join(self.scratch, "trainer.log"), "w") as log:
            start = time.perf_counter()
            try:
                began, killed_at, events = run_trainer_until(
                    self.argv, warm, self.workdir, log, last, deadline
                )
                restart["warm"] = restart_figures(killed["time"], began, events, last)
                phases.append(_done("restart_warm", start))
            except (RuntimeError, OutOfTime) as e:
                phases.append(_ended("restart_warm", start, e))
                status = "skipped: the warm restart did not finish"
                phases.append({"phase": "restart_cold", "s": 0.0, "status": status})
                return
            last = last_step(events)
            compile_s = result.get("setup", {}).get("compile_s", 0.0)
            estimate = restart["warm"]["kill_to_productive_step_s"] + compile_s
            start = time.perf_counter()
            if estimate > deadline - time.time():
                why = f"skipped: needs ~{estimate:.0f} s, {deadline - time.time():.0f} s left"
                phases.append({"phase": "restart_cold", "s": 0.0, "status": why})
                restart["cold_estimate"] = {  # the warm restart with a compile instead of a load
                    "kill_to_productive_step_s": estimate - restart["warm"]["compile_s"],
                    "from": "the warm restart + the measured cold compile - the warm load",
                }
                return
            cold = self.with_cache(os.path.join(self.scratch, "cache_cold"))
            try:
                began, _, events = run_trainer_until(
                    self.argv, cold, self.workdir, log, last, deadline
                )
                restart["cold"] = restart_figures(killed_at, began, events, last)
                phases.append(_done("restart_cold", start))
            except (RuntimeError, OutOfTime) as e:
                phases.append(_ended("restart_cold", start, e))


def last_step(events: list[dict[str, Any]]) -> int:
    """The last step a run's events show done: logged, or saved (a step is saved before the
    loop logs it)."""
    done = [e["step"] for e in events if e["type"] in ("step", "save_committed")]
    return max(done)


def past(step: int) -> Callable[[list[dict[str, Any]]], bool]:
    """Whether a run's events show a step after `step`."""
    return lambda events: any(e["step"] > step for e in steps_of(events))


def _done(name: str, start: float) -> dict[str, Any]:
    return {"phase": name, "s": round(time.perf_counter() - start, 2), "status": "done"}


def _ended(name: str, start: float, why: Exception) -> dict[str, Any]:
    """A phase that did not finish: out of time (skipped) or failed."""
    status = f"skipped: {why}" if isinstance(why, OutOfTime) else f"failed: {why}"
    return {"phase": name, "s": round(time.perf_counter() - start, 2), "status": status}


def measure(
    config_file: str, overrides: dict[str, Any], restarts: RestartRuns, deadline: float
) -> dict[str, Any]:
    """Phase 1 in a child process; its result file as far as it got."""
    fd, out = tempfile.mkstemp(prefix="gpu_measure_", suffix=".json", dir=restarts.scratch)
    os.close(fd)  # the child writes it
    # The warm restart's process start, on top of what the child reserves once it has measured.
    reserve = START_S
    argv = [
        sys.executable,
        os.path.join(REPO, "experiments", "gpu_measure.py"),
        f"--config={config_file}",
        f"--override_json={json.dumps(overrides)}",
        f"--compile_override_json={json.dumps(restarts.extra)}",
        f"--out={out}",
        f"--deadline={deadline}",
        f"--reserve_s={reserve}",
        f"--steps={_STEPS.value}",
        f"--rounds={_ROUNDS.value}",
        f"--local_parent={restarts.local_base}",
        f"--restart_workdir={restarts.workdir}",
        f"--scratch={restarts.scratch}",
    ]
    start = time.perf_counter()
    log_path = f"{out}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=restarts.with_cache(restarts.warm_cache),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.time() - reserve))
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop(proc)
    result: dict[str, Any] = {"phases": []}
    with open(out) as f:
        text = f.read()
    os.remove(out)
    if text:  # empty: the child stopped before its first phase ended
        result = json.loads(text)
    # It ends by SIGKILLing itself after a local save (the restarts' fault), once that is written;
    # an exit 0 means it could not get there, which its phases say.
    if code == 0 or (code == -signal.SIGKILL and "killed" in result):
        status = "done"
    elif code is None:
        status = "stopped at its deadline"
    else:
        with open(log_path) as f:
            tail = f.read().strip().splitlines()[-1:] or ["no output"]
        status = f"failed (exit {code}): {tail[0][:200]}"
    keep_log(log_path, "gpu_measure.log")
    os.remove(log_path)
    phases = [{**p, "phase": f"measure.{p['phase']}"} for p in result.pop("phases")]
    result["phases"] = [*phases, _done("measure", start) | {"status": status}]
    return result


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """Each target of the module docstring: the measured value and whether it is met (null:
    not measured)."""

    def check(value: float | None, ok: Callable[[float], bool]) -> dict[str, Any]:
        return {"value": value, "met": None if value is None else bool(ok(value))}

    throughput = result.get("throughput", {})
    saves = result.get("saves", {}).get("ratios", {})
    memory = result.get("memory", {}).get("peak_over_plan", {})
    warm = result.get("restart", {}).get("warm")
    step_s = throughput.get("framework_step_s")
    bound = 2 * step_s + warm["restore_s"] if step_s is not None and warm else None
    out = {
        "mfu >= 0.45": check(throughput.get("mfu", {}).get("framework"), lambda v: v >= 0.45),
        "loop overhead <= 0.01": check(throughput.get("overhead"), lambda v: v <= 0.01),
    }
    for tier in ["local", "persistent", *(t for t in saves if t not in ("local", "persistent"))]:
        ratios = saves.get(tier, {})
        out[f"{tier} save <= 1.2 x device_to_host"] = check(
            ratios.get("over_device_to_host"), lambda v: v <= 1.2
        )
        out[f"{tier} save <= 0.5 x orbax_async"] = check(
            ratios.get("over_orbax_async"), lambda v: v <= 0.5
        )
    for mode in ("steady", "kept", "device_copy", "host_copy"):
        out[f"{mode} peak within 10% of plan"] = check(
            memory.get(mode), lambda v: abs(v - 1.0) <= 0.1
        )
    value = warm["kill_to_productive_step_s"] if warm else None
    out["warm kill -> productive step <= 2 x step + restore"] = check(
        value, lambda v: bound is not None and v <= bound
    )
    return out


def print_figures(result: dict[str, Any]) -> None:
    """The headline figures, one line each (the JSON has every sample)."""
    lines = [f"{result.get('device', '?')}, jax {result['jax_version']}"]
    if "setup" in result:
        setup = result["setup"]
        lines.append(
            f"state {setup['state_bytes'] / 1e9:.2f} GB; train step compiled in "
            f"{setup['compile_s']:.1f} s ({setup.get('num_layers', '?')} layers scanned, unroll "
            f"{setup.get('scan_unroll', '?')}, remat {setup.get('remat', '?')}), state "
            f"initialised in {setup['init_s']:.1f} s"
        )
    if "throughput" in result:
        t = result["throughput"]
        mfu = {k: "-" if v is None else f"{100 * v:.1f}%" for k, v in t["mfu"].items()}
        lines += [
            f"loop with hooks: {t['framework_step_s']:.4f} s/step, "
            f"{t['framework_tokens_per_s']:,.0f} tokens/s, MFU {mfu['framework']}",
            f"bare jit loop:   {t['bare_step_s']:.4f} s/step, "
            f"{t['bare_tokens_per_s']:,.0f} tokens/s, MFU {mfu['bare']}",
        ]
    if "saves" in result:
        med = result["saves"]["median_blocking_s"]
        lines.append("save blocking s: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    if "peak_bytes" in result.get("memory", {}):
        memory, plan = result["memory"], result["memory"]["plan"]
        lines.append(
            f"peak GB (plan: steady {plan['total'] / 1e9:.1f}, kept save "
            f"{plan['save_peak_kept'] / 1e9:.1f}): "
            + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in memory["peak_bytes"].items())
        )
    if "restore" in result:
        lines.append(
            "restore s: " + ", ".join(f"{k} {v[0]:.2f}" for k, v in result["restore"].items())
        )
    for kind, r in result.get("restart", {}).items():
        if "kill_to_productive_step_s" in r and "compile_s" in r:
            lines.append(
                f"kill -> productive step, {kind} cache: {r['kill_to_productive_step_s']:.1f} s "
                f"(process start {r['process_start_s']:.1f}, restore {r['restore_s']:.1f}, "
                f"compile {r['compile_s']:.1f}, {r['compile_cache']})"
            )
    print("\n" + "\n".join(lines))


def print_tables(result: dict[str, Any]) -> None:
    print_figures(result)
    print(f"\n{'phase':28}{'s':>8}  status")
    for p in result["phases"]:
        print(f"{p['phase']:28}{p['s']:>8.1f}  {p['status']}")
    print(f"\n{'target':52}{'value':>10}  met")
    for name, t in result["targets"].items():
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        met = "-" if t["met"] is None else ("yes" if t["met"] else "NO")
        print(f"{name:52}{value:>10}  {met}")


def main(argv: list[str]) -> None:
    del argv
    t0 = time.time()
    deadline = t0 + _BUDGET_S.value
    smoke = _SMOKE.value
    overrides = {**COMMON, **(SMOKE if smoke else {})}
    if _LAYERS.value:
        overrides["model.num_layers"] = _LAYERS.value
    env = child_env(smoke)
    result: dict[str, Any] = {
        "what": "one accelerator: throughput and MFU, saves, device memory, restore, restarts",
        "smoke": smoke,
        "config": _CONFIG.value,
        "overrides": overrides,
        "layers_shrunk": bool(_LAYERS.value),
        "machine": report.host_line(),
        "python": platform.python_version(),
        "jax_version": metadata.version("jax"),
        "jaxlib_version": metadata.version("jaxlib"),
        "budget_s": _BUDGET_S.value,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
    }
    if not smoke:
        result["xla_python_client_mem_fraction"] = env[env_vars.XLA_PYTHON_CLIENT_MEM_FRACTION]
    storage = local_storage(load_config(_CONFIG.value, overrides))
    result["storage"] = storage
    restarts = RestartRuns(_CONFIG.value, overrides, env, storage["local_tier_parent"])
    try:
        result |= measure(_CONFIG.value, overrides, restarts, deadline)
        restarts.run(deadline, result)
    finally:
        restarts.close()
    result["total_s"] = time.time() - t0
    result["targets"] = targets(result)
    report.write_json(_OUT.value, report.finite(result))
    print_tables(result)
    failed = [p["phase"] for p in result["phases"] if p["status"].startswith("failed")]
    if failed:
        sys.exit(f"gpu_check: phase(s) {', '.join(failed)} failed (see the phase table)")


if __name__ == "__main__":
    app.run(main)
