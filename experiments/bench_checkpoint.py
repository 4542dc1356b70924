"""What checkpointing costs the training loop, per tier, against a synchronous Orbax save.

    python experiments/bench_checkpoint.py [--config=configs/tiny_cpu.py] [--rounds=5]
    -> experiments/results/bench_checkpoint.json

One process, one state (the config's model with its AdamW state), on `--cpu_devices` simulated
devices when running on CPU. Three measurements:

1. Blocking time per save, interleaved round by round in rotating order: the checkpointer's local
   tier (RAM disk) and its persistent tier (async Orbax plus per-array digests, in a writer
   thread), both reading the state itself, which the next step keeps (`train.keep`: it runs
   without donating); each tier copying the state to pinned host memory first
   (`checkpoint.keep_state=never`: `local_host`, `persistent_host`, what a save does where a
   kept state would not fit the device); the local tier copying the state on the device first
   (`device_snapshot`, what a save does until the step can keep it); a plain async Orbax
   `CheckpointManager` save, a plain synchronous Orbax save
   (`Checkpointer(StandardCheckpointHandler)`) of the same state, and the device snapshot and
   the device-to-host copy alone, waited for. "hook" is the wall time `after_step` took (what
   the loop waits for); "commit" is when the data was durable. Each save follows a fresh train
   step that is waited for first, so the numbers are the save alone (part 2 shows what the
   loop pays in all).
2. Step time, blocks of training steps in rotating order: no saves; every step non-donating (the
   cost of the step that keeps its input, without a save); a local save after every step (each
   next step keeping the saved state; a save due while the previous write runs is skipped); the
   same with the device copy, and with the host copy, instead. Each block starts with one untimed
   step (and its save), so every timed step runs beside the previous step's write as in a run;
   the block's last write is waited for after its clock stops. (Until 2026-11-27 a block timed
   its first step with no write beside it and the wait for its last write: with 3-step blocks
   that charged up to a third of a commit to each step.)
3. Restore time per tier onto the same mesh and onto half the devices.

With `--backends` it measures instead the persistent tier on a local directory against gs:// on
a local GCS emulator (fake-gcs-server, `pip install -e '.[dev]'`), the same state, interleaved:
save (blocking and commit) and restore; then an outage: the emulator is killed while a persistent
save is in flight, and the steps that follow are timed (the local tier saving every step), until
it is started again and a persistent save commits.
-> experiments/results/bench_checkpoint_gcs.json
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import report

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_cpu.py", "Experiment config.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Measured save rounds (after one warm-up round).")
_BLOCKS = flags.DEFINE_integer("blocks", 3, "Throughput blocks per side.")
_STEPS = flags.DEFINE_integer("steps", 6, "Steps per throughput block.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "Simulated devices when on CPU.")
_OUT = flags.DEFINE_string("out", "experiments/results/bench_checkpoint.json", "Result file.")
_BACKENDS = flags.DEFINE_bool("backends", False, "Local directory against gs:// (emulator).")
_LEAN = flags.DEFINE_bool(
    "lean",
    False,
    "Leave out the device-copy save (local_copy, snapshot) and the non-donating step block: each "
    "holds one more state, which a large state on a small host cannot spare.",
)
_PARTS = flags.DEFINE_list(
    "parts",
    ["saves", "steps", "restores"],
    "Parts run (1 saves, 2 steps, 3 restores); a state too large for one process to hold every "
    "part's copies is measured part by part (experiments/growth.py does).",
)
_KINDS = flags.DEFINE_list(
    "kinds",
    [],
    "Save kinds of part 1, and the step blocks of part 2 beside no saves (default: every kind, "
    "less the device copies with --lean).",
)
_BACKENDS_OUT = flags.DEFINE_string(
    "backends_out", "experiments/results/bench_checkpoint_gcs.json", "Result file of --backends."
)


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    os.environ.setdefault(
        "XLA_FLAGS", f"--xla_force_host_platform_device_count={_CPU_DEVICES.value}"
    )
    if _BACKENDS.value:
        compare_backends()
        return
    import jax
    import jax.numpy as jnp
    from checkpoint_saves import SaveKinds

    from resilient_jax.checkpoint import checksum
    from resilient_jax.data import BatchLoader, make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.events import EventLog, read_events
    from resilient_jax.goodput.model import young_daly_interval_s
    from resilient_jax.run import compile_step, prepare
    from resilient_jax.train.hooks import StepInfo
    from resilient_jax.train.state import init_state

    base = _CONFIG.value
    base.total_steps = 10**9  # no final-step save inside the benchmark
    base.log.progress_bar = False
    base.log.tensorboard = False
    root = tempfile.mkdtemp(prefix="bench_ckpt_")
    local_root = report.ram_disk_dir("bench_ckpt")

    try:
        compiled_in = os.path.join(root, "compile")
        ctx_compile = prepare(base, compiled_in, EventLog(compiled_in))
        step_fn = compile_step(ctx_compile)
        saves = SaveKinds(base, root, local_root, ctx_compile.keeper)
        loader = BatchLoader(base, ctx_compile.mesh, ctx_compile.plan, make_source(base))
        _, batch = loader.next()
        one = jnp.float32(1.0)
        state = init_state(base, ctx_compile.mesh)
        state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
        saves.on_start(state)
        step = 0

        def train_step(state):
            nonlocal step
            state, _ = step_fn(state, batch, one)
            step += 1
            return state

        def info() -> StepInfo:
            return StepInfo(step, step - 1, DataPosition(next_batch=step), 0.0)

        # 1. Blocking time per save, interleaved.
        state = train_step(train_step(state))
        step_fn.load_keeping()  # in a run: loaded beside training from the first save on
        (compile_keep,) = [
            {"duration_s": e["duration_s"], "cache": e.get("cache", "none")}
            for e in read_events(compiled_in)
            if e["type"] == "compile_background"
        ]
        kinds = [
            "local",
            "persistent",
            "local_copy",
            "local_host",
            "persistent_host",
            "orbax_async",
            "orbax_sync",
            "snapshot",
            "device_to_host",
        ]
        if _LEAN.value:
            kinds = [k for k in kinds if k not in ("local_copy", "snapshot")]
        if _KINDS.value:
            unknown = set(_KINDS.value) - set(kinds)
            if unknown:
                raise app.UsageError(f"--kinds: {sorted(unknown)} not among {kinds}")
            kinds = list(_KINDS.value)
        if "saves" not in _PARTS.value:
            kinds = []
        hook_s: dict[str, list[float]] = {kind: [] for kind in kinds}
        digest_s: list[float] = []
        for r in range(_ROUNDS.value + 1 if kinds else 0):
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                saves.wait()
                state = jax.block_until_ready(train_step(state))  # time the save alone
                # round 0 warms up compiles and caches
                elapsed = saves.save(kind, state, info(), record=r > 0)
                if r > 0:
                    hook_s[kind].append(elapsed)
            if r > 0:
                jax.block_until_ready(state)
                start = time.perf_counter()  # what the writer thread computes, off the loop
                checksum.combine_sums([checksum.process_partial_sums(state)])
                digest_s.append(time.perf_counter() - start)
        saves.wait()
        saves.drop_plain()
        commit_s = {k: v for k, v in saves.commit_s().items() if k in kinds}
        event_s = {k: v for k, v in saves.event_s().items() if k in kinds}
        tiers = saves.tiers

        # 2. Step time: no saves, non-donating steps, a local save every step (kept, copied).
        def one_step(state, mode: str):
            if mode == "non_donating":
                assert ctx_compile.keeper.keep(state)
            state = train_step(state)
            if mode in tiers:
                ck, ctx = tiers[mode]
                ck.after_step(ctx, state, info())
            return state

        def block(state, mode: str) -> tuple:
            # One step before the clock starts, so every timed step runs beside the write of the
            # step before it, as in a run; the last write is waited for after the clock stops
            # (a run never waits for it), so the next block starts with none in flight.
            state = jax.block_until_ready(one_step(state, mode))
            start = time.perf_counter()
            for _ in range(_STEPS.value):
                state = one_step(state, mode)
            jax.block_until_ready(state)
            took = (time.perf_counter() - start) / _STEPS.value
            if mode in tiers:
                tiers[mode][0].wait_until_finished()
            return state, took

        modes = ["no_saves", "non_donating", "local", "local_copy", "local_host"]
        if _LEAN.value:
            modes = ["no_saves", "local", "local_host"]
        if _KINDS.value:  # the blocks of the kinds asked for, each against no saves
            modes = [m for m in modes if m == "no_saves" or m in _KINDS.value]
        if "steps" not in _PARTS.value:
            modes = []
        block_s: dict[str, list[float]] = {mode: [] for mode in modes}
        for b in range(_BLOCKS.value + 1 if modes else 0):
            for mode in modes[b % len(modes) :] + modes[: b % len(modes)]:
                state, t = block(state, mode)
                if b > 0:  # block 0 warms up
                    block_s[mode].append(t)
        saves.close()

        # 3. Restore time per tier, same mesh and half the devices.
        restore_s: dict[str, list[float]] = {}
        devices = jax.devices()
        targets = {"same mesh": None}
        if len(devices) >= 2:
            targets[f"{len(devices) // 2} devices"] = devices[: len(devices) // 2]
        if "restores" not in _PARTS.value:
            targets = {}
        elif not {"local", "persistent"} <= set(kinds):  # each tier needs a step to restore
            saves = SaveKinds(base, root, local_root, ctx_compile.keeper)
            saves.on_start(state)
            for kind in ("local", "persistent"):
                state = jax.block_until_ready(train_step(state))
                saves.save(kind, state, info(), record=False)
                saves.wait()
            saves.close()
        for target, subset in targets.items():
            for tier in ("local", "persistent"):
                for _ in range(3):
                    elapsed = saves.restore(base, tier, subset)
                    restore_s.setdefault(f"{tier} -> {target}", []).append(elapsed)
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)

    med = statistics.median
    result = {
        **report.state_header(base, state_bytes, _ROUNDS.value),
        "parts": _PARTS.value,
        "save_hook_s": hook_s,
        "save_event_duration_s": event_s,
        "save_commit_s": commit_s,
        "digest_s": digest_s,
        "compile_keep": compile_keep,  # the non-donating step, loaded beside the run
        "step_s": block_s,
        "restore_s": restore_s,
        # The process's host memory high-water mark (the state, its kept, copied and written
        # forms, Orbax's buffers, the restores): what limits the state size on a small host.
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "lean": _LEAN.value,
    }
    if "orbax_sync" in hook_s:
        sync = med(hook_s["orbax_sync"])
        result["blocking_vs_sync"] = {k: med(v) / sync for k, v in hook_s.items()}
    if "persistent" in hook_s:
        cost = med(hook_s["persistent"])
        result["young_daly_interval_s_at_mtbf_1h"] = young_daly_interval_s(cost, 3600.0)
    if block_s:
        result["step_s_no_saves"] = block_s["no_saves"]
        if "local" in block_s:
            result["step_s_local_save_every_step"] = block_s["local"]
        result["step_overhead"] = {
            mode: med(times) / med(block_s["no_saves"]) - 1.0
            for mode, times in block_s.items()
            if mode != "no_saves"
        }
    print(f"state {state_bytes / 1e6:.1f} MB on {jax.device_count()} x {result['device']}")
    if kinds:
        title = f"save (median of {_ROUNDS.value})"
        print(f"{title:34}{'blocks loop s':>14}{'commit s':>10}")
        for kind in kinds:
            commit = med(commit_s[kind]) if commit_s.get(kind) else med(hook_s[kind])
            print(f"{kind:34}{med(hook_s[kind]):>14.4f}{commit:>10.4f}")
        print(f"{'per-array digests (writer thread)':34}{med(digest_s):>14.4f}")
    for kind, ratio in result.get("blocking_vs_sync", {}).items():
        print(f"{kind} blocking / synchronous save: {ratio:.3f}")
    if block_s:
        print(f"step s (median of {_BLOCKS.value} blocks of {_STEPS.value})")
        for mode, times in block_s.items():
            overhead = result["step_overhead"].get(mode)
            extra = f" ({100 * overhead:+.1f}%)" if overhead is not None else ""
            print(f"  {mode:32}{med(times):>10.4f}{extra}")
    print(
        f"non-donating step loaded beside the run in {compile_keep['duration_s']:.2f} s "
        f"(executable cache: {compile_keep['cache']})"
    )
    for name, times in restore_s.items():
        print(f"restore {name:28}{med(times):>10.4f} s")
    if "young_daly_interval_s_at_mtbf_1h" in result:
        print(
            f"Young/Daly interval at MTBF 1 h with this persistent cost: "
            f"{result['young_daly_interval_s_at_mtbf_1h']:.1f} s"
        )
    report.write_json(_OUT.value, result)


def compare_backends() -> None:
    import jax
    import jax.numpy as jnp

    from resilient_jax.checkpoint import Checkpointer
    from resilient_jax.data import BatchLoader, make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.events import EventLog, read_events
    from resilient_jax.run import compile_step, prepare
    from resilient_jax.testing.gcs_emulator import GcsEmulator
    from resilient_jax.train.hooks import StepInfo
    from resilient_jax.train.state import init_state

    base = _CONFIG.value
    base.total_steps = 10**9
    base.log.progress_bar = False
    base.log.tensorboard = False
    base.checkpoint.local_dir = ""
    base.checkpoint.every_steps = 1
    root = tempfile.mkdtemp(prefix="bench_gcs_")
    local_root = report.ram_disk_dir("bench_gcs")
    emulator = GcsEmulator()
    emulator.start()
    os.environ.update(emulator.environ())
    med = statistics.median
    step = 0

    def events(workdir: str, kind: str) -> list[dict]:
        return [e for e in read_events(workdir) if e["type"] == kind]

    try:
        dirs = {"dir": os.path.join(root, "store"), "gs": emulator.gs_url("bench")}

        def context(backend: str, **overrides):
            config = base.copy_and_resolve_references()
            config.checkpoint.dir = dirs[backend]
            config.update_from_flattened_dict(overrides)
            workdir = os.path.join(root, f"{backend}-{uuid.uuid4().hex[:6]}")
            return prepare(config, workdir, EventLog(workdir))

        ctxs = {backend: context(backend) for backend in dirs}
        step_fn = compile_step(ctxs["dir"])
        loader = BatchLoader(base, ctxs["dir"].mesh, ctxs["dir"].plan, make_source(base))
        _, batch = loader.next()
        one = jnp.float32(1.0)
        state = init_state(base, ctxs["dir"].mesh)
        state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))

        def train_step(state):
            nonlocal step
            state, _ = step_fn(state, batch, one)
            step += 1
            return jax.block_until_ready(state)

        def info() -> StepInfo:
            return StepInfo(step, step - 1, DataPosition(next_batch=step), 0.0)

        # Save: blocking time and commit, interleaved round by round (round 0 warms up).
        checkpointers = {
            b: Checkpointer(ctx, handle_sigterm=False).open() for b, ctx in ctxs.items()
        }
        for backend, ck in checkpointers.items():
            ck.on_start(ctxs[backend], state)
        save_s: dict[str, list[float]] = {b: [] for b in dirs}
        saved_steps: dict[str, list[int]] = {b: [] for b in dirs}
        for r in range(_ROUNDS.value + 1):
            for backend in list(dirs)[r % 2 :] + list(dirs)[: r % 2]:
                state = train_step(state)
                start = time.perf_counter()
                checkpointers[backend].after_step(ctxs[backend], state, info())
                elapsed = time.perf_counter() - start
                checkpointers[backend].wait_until_finished()
                if r > 0:
                    save_s[backend].append(elapsed)
                    saved_steps[backend].append(step)
        commit_s = {}
        for backend, ck in checkpointers.items():
            ck.close()
            committed = {
                e["step"]: e["commit_s"] for e in events(ctxs[backend].workdir, "save_committed")
            }
            commit_s[backend] = [committed[s] for s in saved_steps[backend]]

        # Restore the newest step, alternating backends.
        restore_s: dict[str, list[float]] = {b: [] for b in dirs}
        for _ in range(3):
            for backend in dirs:
                ctx = context(backend)
                ck = Checkpointer(ctx, handle_sigterm=False).open()
                start = time.perf_counter()
                restored = ck.restore_latest(ctx)
                jax.block_until_ready(restored.state)
                restore_s[backend].append(time.perf_counter() - start)
                ck.close()

        # An outage in the middle of an async persistent save (persistent every 4 steps, local
        # every step); the outage is declared after persistent_timeout_s.
        timeout_s = 2.0
        dirs["gs"] = emulator.gs_url("outage")
        ctx = context(
            "gs",
            **{
                "checkpoint.every_steps": 4,
                "checkpoint.local_dir": local_root,
                "checkpoint.local_every_steps": 1,
                "checkpoint.local_auto_interval": False,
                "checkpoint.persistent_timeout_s": timeout_s,
            },
        )
        ck = Checkpointer(ctx, handle_sigterm=False).open()
        ck.on_start(ctx, state)
        healthy_s = []
        while step % 4 != 3 or len(healthy_s) < 8:
            state = train_step(state)
            start = time.perf_counter()
            ck.after_step(ctx, state, info())
            healthy_s.append(time.perf_counter() - start)
        state = train_step(state)
        ck.after_step(ctx, state, info())  # a persistent save starts: killed in flight
        emulator.kill()
        killed = time.perf_counter()
        outage_steps_s, first_step_after_s = [], None
        while time.perf_counter() - killed < 4 * timeout_s + 4:
            state = train_step(state)
            start = time.perf_counter()
            ck.after_step(ctx, state, info())
            outage_steps_s.append(time.perf_counter() - start)
            if first_step_after_s is None:
                first_step_after_s = time.perf_counter() - killed
        detected = events(ctx.workdir, "persistent_outage")
        emulator.start()
        back = time.perf_counter()
        recovered_s = None
        while recovered_s is None and time.perf_counter() - back < 180:
            state = train_step(state)
            ck.after_step(ctx, state, info())
            if events(ctx.workdir, "persistent_recovered"):
                recovered_s = time.perf_counter() - back
        ck.close()
        local_saves = [e["step"] for e in events(ctx.workdir, "save") if e["tier"] == "local"]
    finally:
        emulator.close()
        shutil.rmtree(local_root, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)

    result = {
        **report.state_header(base, state_bytes, _ROUNDS.value),
        "emulator": "fake-gcs-server on 127.0.0.1",
        "save_hook_s": save_s,
        "save_commit_s": commit_s,
        "restore_s": restore_s,
        "gs_over_dir": {
            "save_hook": med(save_s["gs"]) / med(save_s["dir"]),
            "save_commit": med(commit_s["gs"]) / med(commit_s["dir"]),
            "restore": med(restore_s["gs"]) / med(restore_s["dir"]),
        },
        "outage": {
            "persistent_timeout_s": timeout_s,
            "healthy_step_hook_s": healthy_s,
            "outage_step_hook_s": outage_steps_s,
            "kill_to_next_step_done_s": first_step_after_s,
            "outage_event": detected[0] if detected else None,
            "restart_to_persistent_commit_s": recovered_s,
            "local_saves_during_outage": len(outage_steps_s),
            "local_saves": len(local_saves),
        },
    }
    print(f"state {state_bytes / 1e6:.1f} MB on {jax.device_count()} x {result['device']}")
    print(f"{'median of ' + str(_ROUNDS.value):24}{'dir':>10}{'gs://':>10}{'ratio':>8}")
    for name, table in (("save blocks s", save_s), ("save commit s", commit_s)):
        ratio = med(table["gs"]) / med(table["dir"])
        print(f"{name:24}{med(table['dir']):>10.3f}{med(table['gs']):>10.3f}{ratio:>8.2f}")
    ratio = result["gs_over_dir"]["restore"]
    print(
        f"{'restore s':24}{med(restore_s['dir']):>10.3f}{med(restore_s['gs']):>10.3f}{ratio:>8.2f}"
    )
    o = result["outage"]
    print(
        f"outage: next step done {o['kill_to_next_step_done_s']:.3f} s after the kill; longest "
        f"step hook during it {max(outage_steps_s):.3f} s (healthy {max(healthy_s):.3f} s); "
        f"outage event {'yes' if detected else 'no'}; persistent commit "
        f"{recovered_s if recovered_s is None else round(recovered_s, 1)} s after the restart"
    )
    report.write_json(_BACKENDS_OUT.value, result)


if __name__ == "__main__":
    app.run(main)
