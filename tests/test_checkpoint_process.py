"""Checkpoint engine across processes: a save torn by SIGKILL, and the local tier of two slices
(two JAX processes) restoring together and then from the surviving slice alone.

The workers are this file run as a script (`python tests/test_checkpoint_process.py MODE ...`).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import (
    REPO,
    checkpoint_config,
    events_of,
    free_port,
    persistent_step_dirs,
    run_context,
    step_through,
)

from resilient_jax.contracts import env_vars
from resilient_jax.contracts.event_types import EventType

TIMEOUT_S = 180


def _popen(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _run_group(commands: list[list[str]], env: dict[str, str]) -> list[str]:
    """Runs the workers together; returns their stdout. Kills all (by PID) on timeout/failure."""
    procs = [_popen(args, {**env, "WORKER_INDEX": str(i)}) for i, args in enumerate(commands)]
    deadline = time.monotonic() + TIMEOUT_S
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{err[-3000:]}"
            outputs.append(out)
    except subprocess.TimeoutExpired:
        pytest.fail(f"workers {commands} timed out after {TIMEOUT_S}s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return outputs


def _results(output: str) -> list[dict]:
    """Every RESULT line a worker printed, in order."""
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert lines, output[-2000:]
    return [json.loads(line[len("RESULT ") :]) for line in lines]


def _result(output: str) -> dict:
    return _results(output)[-1]


def test_save_torn_by_sigkill_falls_back_and_cleans_temp_dirs(tmp_path, local_root):
    from resilient_jax.checkpoint import Checkpointer, Tier, local

    workdir = str(tmp_path)
    proc = _popen(["torn", workdir, local_root], {})
    try:
        deadline = time.monotonic() + TIMEOUT_S
        line = ""
        while not line.startswith("TORN") and time.monotonic() < deadline:
            # Bounded: a worker stuck before printing must fail the test, not hang it.
            ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
            if not ready:
                break
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()[-3000:]
        assert line.startswith("TORN"), "worker never reached the torn save"
        ckpt_dir = os.path.join(workdir, "checkpoints")
        run_dir = local.run_dir(local_root, workdir)

        def temp_dirs() -> tuple[list[str], list[str]]:
            orbax = [n for n in os.listdir(ckpt_dir) if "tmp" in n]
            mine = [
                n
                for p in os.listdir(run_dir)
                for n in os.listdir(os.path.join(run_dir, p))
                if n.startswith(local.TMP_PREFIX)
            ]
            return orbax, mine

        while time.monotonic() < deadline and not all(temp_dirs()):
            time.sleep(0.1)
        assert all(temp_dirs()), f"no torn save in progress: {temp_dirs()}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    config = checkpoint_config(
        local_root, **{"checkpoint.every_steps": 2, "checkpoint.local_every_steps": 2}
    )
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert (restored.tier, restored.step) == (Tier.LOCAL, 2)
    assert restored.data_position.next_batch == 2
    deadline = time.monotonic() + 30  # Orbax removes its temp dirs in the background
    while time.monotonic() < deadline and temp_dirs() != ([], []):
        time.sleep(0.1)
    assert temp_dirs() == ([], [])
    assert persistent_step_dirs(workdir) == ["2"]
    assert [e["step"] for e in events_of(workdir, EventType.RESTORE)] == [2]


def test_two_slices_save_agree_and_restore_then_survivor_alone(tmp_path, local_root):
    from resilient_jax.checkpoint import local

    workdir = str(tmp_path)
    two = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", env_vars.NUM_SLICES: "2"}
    one = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", env_vars.NUM_SLICES: "1"}
    saved = _result(_run_group([["save", workdir, local_root, str(free_port()), "2"]] * 2, two)[0])

    # Wall-clock saves (every 6 ms here) happened at the same steps on both processes.
    saves = [e for e in events_of(workdir, EventType.SAVE) if e["tier"] == "persistent"]
    by_process = {p: [e["step"] for e in saves if e["process"] == p] for p in (0, 1)}
    assert by_process[0] == by_process[1] == [2, 3, 4, 5]
    assert [e["step"] for e in saves if e.get("temporary") and e["process"] == 0] == [3, 5]

    run_dir = local.run_dir(local_root, workdir)
    procs = sorted(os.listdir(run_dir))
    assert len(procs) == 2  # one full copy per slice
    for proc in procs:
        assert local.step_name(5) in os.listdir(os.path.join(run_dir, proc))

    # Both processes restore the local tier, then, in the same processes, without any local copy
    # the persistent tier (verifying its checksums).
    port = str(free_port())
    for output in _run_group([["restore", workdir, local_root, port, "2"]] * 2, two):
        results = _results(output)
        assert [(r["tier"], r["step"]) for r in results] == [("local", 5), ("persistent", 5)]
        assert all(r["digests"] == saved["digests"] for r in results)

    # Slice 1 is gone with its RAM disk; slice 0 restores alone onto its 4 devices.
    shutil.rmtree(os.path.join(run_dir, procs[1]))
    (output,) = _run_group([["restore", workdir, local_root, "0", "1"]], one)
    result = _result(output)
    assert (result["tier"], result["step"]) == ("local", 5)
    assert result["digests"] == saved["digests"]
    assert result["mesh"]["replica"] == 1 and result["mesh"]["fsdp"] == 4


# --------------------------------------------------------------------------------- the workers


def _worker(mode: str, workdir: str, local_root: str, port: str = "0", procs: str = "1") -> None:
    sys.path.insert(0, REPO)
    import jax

    num_processes = int(procs)
    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            f"127.0.0.1:{port}",
            num_processes=num_processes,
            process_id=int(os.environ["WORKER_INDEX"]),
            initialization_timeout=60,
        )
    from resilient_jax.checkpoint import Checkpointer, checksum
    from resilient_jax.events import EventLog
    from resilient_jax.train.state import init_state

    overrides = {"checkpoint.every_steps": 2, "checkpoint.local_every_steps": 2}
    if mode == "save":
        overrides["checkpoint.local_every_steps"] = 1
        overrides["checkpoint.every_minutes"] = 0.0001

    def checkpointer(root: str):
        ctx = run_context(checkpoint_config(root, **overrides), workdir, len(jax.devices()))
        ctx.events = EventLog(workdir, process=jax.process_index())
        return ctx, Checkpointer(ctx, handle_sigterm=False).open()

    if mode == "restore":
        # With two processes, the persistent tier next: the same run without a local tier.
        for root in [local_root, ""] if num_processes > 1 else [local_root]:
            ctx, ck = checkpointer(root)
            restored = ck.restore_latest(ctx)
            digests = checksum.tree_digests(restored.state)
            ck.close()
            result = {"tier": restored.tier, "step": restored.step, "digests": digests}
            print("RESULT " + json.dumps({**result, "mesh": ctx.plan.describe()}), flush=True)
        return
    ctx, ck = checkpointer(local_root)
    state = init_state(ctx.config, ctx.mesh)
    ck.on_start(ctx, state)
    state, _ = step_through(ck, ctx, state, 1, 5 if mode == "save" else 2)
    ck.wait_until_finished()
    if mode == "save":
        digests = checksum.tree_digests(state)
        ck.close()
        print("RESULT " + json.dumps({"digests": digests}), flush=True)
        return
    # mode == "torn": the next save writes everything but never commits, then we are killed.
    import orbax.checkpoint as ocp

    def never_commit(*args, **kwargs):
        time.sleep(3600)

    ocp.path.atomicity.AtomicRenameTemporaryPath.finalize = never_commit
    os.rename = never_commit
    # Not waiting for step 4's writes: they never end (the test sees them begun by their temp dirs).
    step_through(ck, ctx, state, 3, 4, writes_finish=False)
    print("TORN", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    _worker(*sys.argv[1:])
