"""The in-process half of `gpu_check.py`: one JAX process measuring, on the config's model,

1. `setup`: the train step compiled with an empty executable cache (for the config of the
   parent's restart runs, into their cache), the state initialised;
2. `memory`: device memory (`memory_stats()`) in steady training, then at a save step copying
   the state to host, copying it on the device and keeping it (in that order: the peak is a
   high-water mark), against what `train.memory_plan` (`launch/train.py --plan`) predicts;
3. `throughput`: steady steps of the run's `Loop` with the hooks `run.build_hooks` gives a run
   (metrics, health, watchdog, the checkpointer with the config's own save schedule), then the
   same compiled step in a bare loop on one batch: tokens/s and MFU of each;
4. `saves`: the blocking time of each save kind of `checkpoint_saves` (the tiers, kept and
   copying; plain Orbax async and sync; the device copy and the device-to-host copy alone);
5. `restore`: each tier's newest step restored through a fresh checkpointer;
6. `kill`: the restart runs' config trained by the run's loop in `--restart_workdir` until a
   local save has committed and a step more; then this process SIGKILLs itself, and the parent
   restarts the trainer there.

Every phase is written to `--out` as soon as it ends, so the parent keeps what was measured if
this process is stopped; a phase that fails is recorded with its reason, and one whose estimated
cost does not fit before the deadline is skipped and says so (with every phase after it but the
kill). The deadline is `--deadline` (Unix time) less what the end needs: `--reserve_s` for the
parent's process starts, and from the first measurements on the cold restart's compile, a few
steps and the state's writes and reads.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from absl import app, flags, logging

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import report  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "configs/llama_1b.py", "Config file, from the repository.")
_OVERRIDES = flags.DEFINE_string("override_json", "{}", "JSON object of dotted config keys.")
_COMPILE_OVERRIDES = flags.DEFINE_string(
    "compile_override_json", "{}", "JSON: the restart runs' further keys, for the compiled step."
)
_OUT = flags.DEFINE_string("out", None, "Result file (JSON), rewritten after every phase.")
_DEADLINE = flags.DEFINE_float("deadline", 0.0, "Unix time by which this process must be done.")
_RESERVE_S = flags.DEFINE_float("reserve_s", 0.0, "Fixed seconds the parent needs after this.")
_STEPS = flags.DEFINE_integer("steps", 10, "Measured steps per side of the throughput phase.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Most measured rounds of each save kind.")
_RESTART_WORKDIR = flags.DEFINE_string(
    "restart_workdir", "", "Workdir of the run killed at the end (default: a temporary one)."
)
_LOCAL_PARENT = flags.DEFINE_string("local_parent", "/dev/shm", "Where the local tiers go.")
_SCRATCH = flags.DEFINE_string("scratch", "", "Folder for the persistent saves (default: tmp).")

# The order saves are timed in each round: copies first, the tiers, then plain Orbax; a kind
# `checkpoint_saves` adds later is timed last.
PREFERRED_ORDER = (
    "device_to_host",
    "snapshot",
    "local",
    "local_copy",
    "local_host",
    "persistent",
    "persistent_host",
    "orbax_async",
    "orbax_sync",
)
# A save step's memory, in the order of the peak each is expected to reach (the peak counter is a
# high-water mark): copied to host (keep_state=never), copied on the device, kept on the device.
MEMORY_MODES = (("host_copy", "local_host"), ("device_copy", "local_copy"), ("kept", "local"))
# The save kinds that leave a step on the scratch disk until the next save of the same kind (the
# plain Orbax saves are deleted after each), and those of them a disk too small for all can lose,
# in that order (`persistent` stays: the restore phase reads it).
KEPT_ON_DISK = ("persistent", "persistent_host")
DROPPED_FOR_DISK = ("persistent_host",)
MEMORY_KEYS = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "bytes_reserved")


class Phases:
    """The phases run so far, their durations and the result, written to `path` after each; and
    the deadline they are checked against."""

    def __init__(self, path: str, deadline: float) -> None:
        self.path, self.deadline = path, deadline
        self.result: dict[str, Any] = {"phases": []}

    def remaining(self) -> float:
        return self.deadline - time.time()

    def run(self, name: str, estimate_s: float, body: Callable[[], dict[str, Any]]) -> bool:
        """Runs `body` if `estimate_s` fits before the deadline; its dict becomes
        `result[name]`. A skipped phase is recorded with the reason."""
        if estimate_s > self.remaining():
            self.add(
                name, 0.0, f"skipped: needs ~{estimate_s:.0f} s, {self.remaining():.0f} s left"
            )
            return False
        start = time.perf_counter()
        status = "done"
        try:
            self.result[name] = body()
        except Exception as e:  # the phase's figures are lost, not the others'
            traceback.print_exc()
            status = f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        elapsed = time.perf_counter() - start
        self.add(name, elapsed, status)
        print(f"[gpu_measure] {name}: {elapsed:.1f} s, {status}", flush=True)
        return status == "done"

    def skipped(self, name: str) -> bool:
        """Whether the phase `name` was skipped for want of time."""
        return any(
            p["phase"] == name and p["status"].startswith("skipped") for p in self.result["phases"]
        )

    def add(self, name: str, elapsed: float, status: str) -> None:
        """Records a phase and writes the result file."""
        self.result["phases"].append({"phase": name, "s": round(elapsed, 2), "status": status})
        self.write()

    def write(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(report.finite(self.result), f, indent=2, allow_nan=False)
        os.replace(tmp, self.path)


def memory_stats(device: Any) -> dict[str, int] | None:
    """The device's allocator figures, or None where the backend keeps none (CPU)."""
    stats = device.memory_stats()
    if not stats:
        return None
    return {key: int(stats[key]) for key in MEMORY_KEYS if key in stats}


def live_bytes() -> int:
    """Bytes of every live JAX array, on all devices."""
    import jax

    return int(sum(x.nbytes for x in jax.live_arrays()))


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    import jax
    import jax.numpy as jnp
    from checkpoint_saves import SAVE_KINDS, TIERS, SaveKinds, context
    from cluster_runs import load_config
    from step_timing import bare_block, model_flops_utilization

    from resilient_jax import executables
    from resilient_jax.checkpoint import Checkpointer
    from resilient_jax.data import BatchLoader, make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.events import EventLog, read_events
    from resilient_jax.health import Watchdog
    from resilient_jax.run import build_hooks, compile_step, prepare, write_config
    from resilient_jax.train import memory_plan
    from resilient_jax.train.compile import without_fault_scale
    from resilient_jax.train.hooks import Hook, StepInfo
    from resilient_jax.train.loop import Loop
    from resilient_jax.train.metrics import peak_flops_per_device
    from resilient_jax.train.state import init_state

    executables.supersede_jax_cache()  # as a run does: part of its programs' cache keys
    config = load_config(_CONFIG.value, json.loads(_OVERRIDES.value))
    root = tempfile.mkdtemp(prefix="gpu_measure_", dir=_SCRATCH.value or None)
    local_root = os.path.join(_LOCAL_PARENT.value, f"gpu_measure_{uuid.uuid4().hex[:8]}")
    config.checkpoint.local_dir = local_root
    phases = Phases(_OUT.value, _DEADLINE.value - _RESERVE_S.value)  # refined in `setup`
    device = jax.devices()[0]
    phases.result |= {
        "device": device.device_kind,
        "platform": device.platform,
        "num_devices": jax.device_count(),
        "jax": jax.__version__,
    }
    phases.write()
    tokens = config.global_batch_size * config.data.seq_len
    save_order = [k for k in PREFERRED_ORDER if k in SAVE_KINDS]
    save_order += [k for k in SAVE_KINDS if k not in save_order]
    memory_modes = [(mode, kind) for mode, kind in MEMORY_MODES if kind in SAVE_KINDS]
    run: dict[str, Any] = {}  # what the phases hand on: context, step, loader, state
    step = 0

    def train_step(state: Any) -> Any:
        nonlocal step
        state, _ = run["step_fn"](state, run["batch"], jnp.float32(1.0))
        step += 1
        return state

    def info() -> StepInfo:
        return StepInfo(step, step - 1, DataPosition(next_batch=step), 0.0)

    def setup() -> dict[str, Any]:
        # Compiled for the parent's restart runs' config (`--compile_override_json`): the executable
        # cache (JAX_COMPILATION_CACHE_DIR) then holds what their trainer loads. The loop and the
        # saves here run the config's own schedule on that program, keeping through its keeper.
        compiled_for = _RESTART_WORKDIR.value or os.path.join(root, "killed_run")
        compile_config = load_config(
            _CONFIG.value, json.loads(_OVERRIDES.value) | json.loads(_COMPILE_OVERRIDES.value)
        )
        ctx_compile = run["ctx_compile"] = prepare(
            compile_config, compiled_for, EventLog(compiled_for)
        )
        start = time.perf_counter()
        run["step_fn"] = compile_step(ctx_compile)
        compile_s = time.perf_counter() - start
        run["step_fn"].start_loading()  # the non-donating twin, beside the initialisation
        ctx = context(config, os.path.join(root, "run"), local_root, True, 0)
        ctx.config.update_from_flattened_dict(  # the config's own save schedule, in the loop
            {
                "checkpoint.local_every_steps": config.checkpoint.local_every_steps,
                "checkpoint.local_auto_interval": config.checkpoint.local_auto_interval,
                "checkpoint.every_steps": config.checkpoint.every_steps,
            }
        )
        ctx.keeper = ctx_compile.keeper
        start = time.perf_counter()
        state = jax.block_until_ready(init_state(config, ctx.mesh))
        init_s = time.perf_counter() - start
        run["loader"] = BatchLoader(config, ctx.mesh, ctx.plan, make_source(config))
        _, run["batch"] = run["loader"].next()
        run["ctx"], run["state"] = ctx, state
        state_bytes = run["state_bytes"] = sum(x.nbytes for x in jax.tree.leaves(state))
        run["compile_s"], run["init_s"] = compile_s, init_s
        phases.deadline = _DEADLINE.value - restarts_need_s()
        (compile_event,) = [e for e in read_events(compiled_for) if e["type"] == "compile"]
        return {
            "compile_s": compile_s,
            "compile_cache": compile_event.get("cache"),
            # The layers are scanned: this compile is one layer's program whatever the depth.
            "num_layers": compile_config.model.num_layers,
            "scan_unroll": compile_config.model.scan_unroll,
            "remat": compile_config.model.remat,
            "init_s": init_s,
            "state_bytes": state_bytes,
            "tokens_per_step": tokens,
            "mesh": ctx.plan.describe(),
        }

    def memory() -> dict[str, Any]:
        state = run["state"]
        # Before the steady steps: a compile's autotuning on a GPU allocates device memory too.
        start = time.perf_counter()
        run["step_fn"].load_keeping()
        keep_wait_s = time.perf_counter() - start
        for _ in range(3):
            start = time.perf_counter()
            state = jax.block_until_ready(train_step(state))
            run["step_s"] = time.perf_counter() - start  # the last: compiled and warm
        phases.deadline = _DEADLINE.value - restarts_need_s()
        steady = {"memory_stats": memory_stats(device), "live_array_bytes": live_bytes()}
        saves = run["saves"] = SaveKinds(config, root, local_root, run["ctx"].keeper)
        saves.on_start(state)
        at_save: dict[str, Any] = {}
        for mode, kind in memory_modes:
            saves.save(kind, state, info(), record=False)
            during = {"memory_stats": memory_stats(device), "live_array_bytes": live_bytes()}
            state = jax.block_until_ready(train_step(state))  # keeps or donates the saved state
            after = memory_stats(device)
            saves.wait()
            at_save[mode] = {"after_save": during, "after_next_step": after}
        run["state"] = state
        capacity = (steady["memory_stats"] or {}).get("bytes_limit")
        cluster = memory_plan.ClusterSpec(
            devices=jax.device_count(), memory_gb=(capacity or 80e9) / memory_plan.GB
        )
        predicted = memory_plan.plan(config, cluster).candidates[0].memory
        prediction = {
            "params": predicted.params,
            "optimizer": predicted.optimizer,
            "gradients": predicted.gradients,
            "weights": predicted.weights,
            "activations": predicted.activations,
            "total": predicted.total,
            "checkpoint": predicted.checkpoint,
            # A save step that keeps the state (or copies it on the device) holds one more
            # params + optimizer state while the tiers read it; a copy to host holds none.
            "save_peak_kept": predicted.save_peak_kept,
        }
        predicted_peak = {
            "host_copy": predicted.total,
            "device_copy": predicted.save_peak_kept,
            "kept": predicted.save_peak_kept,
        }
        result: dict[str, Any] = {
            "steady": steady,
            "at_save": at_save,
            "keep_program_wait_s": keep_wait_s,  # compiled from the end of `setup` on
            "plan": prediction,
            "plan_capacity_bytes": capacity,
        }
        if steady["memory_stats"] is None:
            result["note"] = f"memory_stats() is None on {device.platform}: no device figures"
            return result
        peaks = {
            "steady": steady["memory_stats"]["peak_bytes_in_use"],
            **{m: s["after_next_step"]["peak_bytes_in_use"] for m, s in at_save.items()},
        }
        result["peak_bytes"] = peaks
        result["peak_over_plan"] = {
            "steady": peaks["steady"] / prediction["total"],
            **{m: peaks[m] / predicted_peak[m] for m in at_save},
        }
        return result

    class StepClock(Hook):
        """When the loop finished each step's hooks: the steady time per step between them."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def after_step(self, ctx, state, info) -> None:
            self.times.append(time.perf_counter())

    def throughput() -> dict[str, Any]:
        nonlocal step
        ctx, state = run["ctx"], run["state"]
        steps = _STEPS.value
        clock = StepClock()
        watchdog = Watchdog.from_config(config.health, ctx.events)
        checkpointer = Checkpointer(ctx, handle_sigterm=False).open()
        hooks = [*build_hooks(ctx, checkpointer=checkpointer, watchdog=watchdog), clock]
        start_step = int(jax.device_get(state.step))
        ctx.config.total_steps = start_step + 2 + steps  # 2 warm-up steps, then measured
        watchdog.start()
        try:
            start = time.perf_counter()
            loop_step = without_fault_scale(run["step_fn"])  # as a run without faults has it
            state, _ = Loop(ctx, loop_step, run["loader"], hooks, lambda m: None).run(state)
            loop_s = time.perf_counter() - start
        finally:
            for hook in hooks:
                hook.close()
        step = int(jax.device_get(state.step))
        framework_s = (clock.times[-1] - clock.times[1]) / steps
        # The final save (the loop's end: persistent, waited for until committed) and the start.
        end_s = loop_s - (clock.times[-1] - start)
        state, _ = bare_block(run["step_fn"], state, run["batch"], 2)  # warm-up
        state, bare_s = bare_block(run["step_fn"], state, run["batch"], steps)
        step += 2 + steps
        run["state"] = state
        shutil.rmtree(ctx.workdir, ignore_errors=True)  # the final save: disk for the next phase
        mfu = {
            "framework": model_flops_utilization(ctx, framework_s),
            "bare": model_flops_utilization(ctx, bare_s),
        }
        return {
            "steps": steps,
            "framework_step_s": framework_s,
            "bare_step_s": bare_s,
            "overhead": framework_s / bare_s - 1.0,
            "framework_tokens_per_s": tokens / framework_s,
            "bare_tokens_per_s": tokens / bare_s,
            "mfu": mfu,
            "peak_flops_per_device": peak_flops_per_device(config.log.peak_flops_per_device),
            "loop_end_s": end_s,
            "hooks": [type(h).__name__ for h in hooks],
        }

    def saves_phase() -> dict[str, Any]:
        saves = run["saves"]
        state = run["state"]
        order, dropped = kinds_for_disk(save_order, shutil.disk_usage(root).free)
        blocking: dict[str, list[float]] = {kind: [] for kind in order}
        round_s: list[float] = []
        # No warm-up round: the memory phase's saves (each local tier setting, the device copy)
        # and the throughput phase's final save (the persistent tier) compiled and started what
        # a first save needs; only plain Orbax saves here for the first time.
        for r in range(_ROUNDS.value):
            if r > 0 and max(round_s) > phases.remaining() - restore_s():
                break  # another round would not fit: keep the time for the restores
            start = time.perf_counter()
            for kind in order:
                saves.wait()
                state = jax.block_until_ready(train_step(state))  # the save timed alone
                blocking[kind].append(saves.save(kind, state, info()))
                saves.drop_plain()
            saves.wait()
            round_s.append(time.perf_counter() - start)
        saves.drop_plain()
        run["state"] = state
        med = {k: statistics.median(v) for k, v in blocking.items() if v}
        ratios = {}
        if "device_to_host" in med and "orbax_async" in med:
            ratios = {
                kind: {
                    "over_device_to_host": med[kind] / med["device_to_host"],
                    "over_orbax_async": med[kind] / med["orbax_async"],
                }
                for kind in TIERS
            }
        return {
            "order": order,
            "dropped_for_disk": dropped,
            "disk_free_bytes": shutil.disk_usage(root).free,
            "rounds": len(round_s),
            "round_s": round_s,
            "blocking_s": blocking,
            "median_blocking_s": med,
            "commit_s": saves.commit_s(),
            "ratios": ratios,
        }

    def kinds_for_disk(order: list[str], free: int) -> tuple[list[str], list[str]]:
        """`order` without the kinds a disk with `free` bytes cannot hold beside the others
        (each kept kind's step, one step being written and one plain Orbax save, with 10% to
        spare), and those dropped."""
        kept = [k for k in order if k in KEPT_ON_DISK]
        dropped = []
        for kind in DROPPED_FOR_DISK:
            if (len(kept) + 2) * run["state_bytes"] <= 0.9 * free:
                break
            if kind in kept:
                kept.remove(kind)
                dropped.append(kind)
        return [k for k in order if k not in dropped], dropped

    def restore() -> dict[str, Any]:
        saves = run.pop("saves")
        saves.close()
        return {tier: [saves.restore(config, tier)] for tier in ("local", "persistent")}

    class KillAfterSave(Hook):
        """SIGKILLs this process at the first step after a local save has committed, once the
        result file says when and at which step."""

        def __init__(self, since: float) -> None:
            self.since = since

        def after_step(self, ctx, state, info) -> None:
            saved = [
                e["step"]
                for e in read_events(ctx.workdir)
                if e["type"] == "save_committed" and e["time"] >= self.since
            ]
            if not saved or info.step <= max(saved):
                return
            phases.result["killed"] = {
                "time": time.time(),
                "last_step": info.step,
                "saved_step": max(saved),
                "workdir": ctx.workdir,
            }
            phases.add("kill", time.time() - self.since, "done")  # then SIGKILLed
            shutil.rmtree(local_root, ignore_errors=True)  # what this process alone used
            shutil.rmtree(root, ignore_errors=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def train_then_kill() -> dict[str, Any]:
        """The restart runs' config trained by the run's loop with every hook (local saves every
        few steps), until `KillAfterSave` ends this process: the parent restarts the trainer on
        its workdir. Returns only if the loop ended first (a failure)."""
        ctx = run["ctx_compile"]
        write_config(ctx.config, ctx.workdir)  # what the trainer checks its workdir against
        state = run.get("state")
        if state is None or any(x.is_deleted() for x in jax.tree.leaves(state)):
            state = init_state(config, ctx.mesh)  # a failed phase may have donated it
        step0 = int(jax.device_get(state.step))
        loader = BatchLoader(
            ctx.config,
            ctx.mesh,
            ctx.plan,
            make_source(ctx.config),
            DataPosition(next_batch=step0),
        )
        watchdog = Watchdog.from_config(ctx.config.health, ctx.events)
        hooks = [
            *build_hooks(
                ctx, checkpointer=Checkpointer(ctx, handle_sigterm=False).open(), watchdog=watchdog
            ),
            KillAfterSave(time.time()),
        ]
        ctx.config.total_steps = step0 + 20 * ctx.config.checkpoint.local_every_steps
        watchdog.start()
        loop_step = without_fault_scale(run["step_fn"])
        Loop(ctx, loop_step, loader, hooks, lambda m: None).run(state)
        raise RuntimeError(f"no local save committed by step {ctx.config.total_steps}")

    def restarts_need_s() -> float:
        """What the end needs after the measurements: the kill phase here (a few steps and a
        local save) and the parent's warm restart (its process start, `--reserve_s`; a restore),
        about 12 steps and 4 writes or reads of the state at 2 GB/s in all. The cold restart
        runs only if time is left."""
        steps = 12 * run.get("step_s", 0.0)
        return _RESERVE_S.value + steps + 4 * write_s() / 2

    def restore_s() -> float:
        """A guess at the restore phase: the state read back from each tier."""
        return 2 * write_s()

    def write_s() -> float:
        """A guess at writing the state once to disk (1 GB/s), for the estimates."""
        return run["state_bytes"] / 1e9

    # Each phase: its estimated cost, what it needs from the phases before it, its body.
    plan = (
        ("setup", lambda: 0.0, (), setup),
        ("memory", lambda: 0.0, ("state",), memory),  # measures the step time the estimates use
        (
            "throughput",
            lambda: (2 * _STEPS.value + 4) * run["step_s"] + write_s(),
            ("state", "step_s"),
            throughput,
        ),
        (
            "saves",
            lambda: len(save_order) * run["step_s"] + 5 * write_s(),
            ("state", "saves"),
            saves_phase,
        ),
        ("restore", restore_s, ("saves",), restore),
    )
    try:
        for name, estimate, needs, body in plan:
            missing = [need for need in needs if need not in run]
            if missing:  # an earlier phase failed
                phases.add(name, 0.0, f"skipped: no {', '.join(missing)} from an earlier phase")
            elif not phases.run(name, estimate(), body) and phases.skipped(name):
                break  # out of time: so are the phases after it
        if "saves" in run:
            run.pop("saves").close()
        shutil.rmtree(local_root, ignore_errors=True)  # RAM-disk room for the kill's saves
        if "step_fn" in run:  # the restart runs need it whatever else was measured
            phases.run("kill", 0.0, train_then_kill)
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    flags.mark_flag_as_required("out")
    app.run(main)
