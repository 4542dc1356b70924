"""Object-store outages: the GCS emulator killed under a training run's checkpointer (mid-save, at
the start, for longer than the limit). Training never waits on the store for longer than a
normal save plus one bounded probe, the local tier keeps every step, and once the store returns
the next persistent save commits and restores bitwise. Also a gs:// run through the launcher and
a local cluster, resumed after SIGKILL, against undisturbed runs. All slow: each outage waits for
timeouts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from conftest import (
    REPO,
    SMALL,
    as_flags,
    assert_bitwise,
    checkpoint_config,
    data_position,
    events_of,
    run_context,
    step_through,
)
from etils import epath

from resilient_jax.checkpoint import Checkpointer, CheckpointError, Tier
from resilient_jax.checkpoint.store_outage import PROBE_WAIT_S
from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.testing.refusing_store import RefusingStore
from resilient_jax.train.hooks import StepInfo, StopTraining
from resilient_jax.train.state import init_state

pytestmark = pytest.mark.slow

# checkpoint.persistent_timeout_s in these tests: above a commit's time on a loaded 2-core machine
# (up to ~1.7 s here), so a healthy save is never taken for an outage.
TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def state0(tmp_path_factory):
    ctx = run_context(checkpoint_config(), str(tmp_path_factory.mktemp("init")))
    return init_state(ctx.config, ctx.mesh)


def _config(local_root: str, gcs, **overrides):
    return checkpoint_config(
        local_root,
        **{
            "checkpoint.dir": gcs.gs_url(uuid.uuid4().hex[:12], "checkpoints"),
            "checkpoint.every_steps": 4,
            "checkpoint.local_every_steps": 1,
            "checkpoint.local_auto_interval": False,
            "checkpoint.persistent_timeout_s": TIMEOUT_S,
            **overrides,
        },
    )


def _timed_steps(ck, ctx, state, first: int, last: int, writes_finish="local") -> tuple:
    """`step_through` one step at a time; returns (state, host copies, seconds per step)."""
    host, blocked = {}, {}
    for step in range(first, last + 1):
        started = time.perf_counter()
        state, copies = step_through(ck, ctx, state, step, step, writes_finish=writes_finish)
        blocked[step] = time.perf_counter() - started
        host.update(copies)
    return state, host, blocked


def test_emulator_killed_mid_save_training_goes_on_and_the_next_save_commits(
    tmp_path, local_root, gcs, state0
):
    workdir = str(tmp_path / "run")
    config = _config(local_root, gcs)
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    assert ck.restore_latest(ctx) is None
    ck.on_start(ctx, state0)
    # Persistent saves at 4 (committed before step 5) and 8.
    state, host, normal = _timed_steps(ck, ctx, state0, 1, 7, writes_finish=True)
    state, more, last = _timed_steps(ck, ctx, state, 8, 8)
    host.update(more)
    normal.update(last)
    gcs.kill()  # the save of step 8 is in flight: Orbax writes it in the background
    killed, killed_at = time.monotonic(), time.time()
    state, more, blocked = _timed_steps(ck, ctx, state, 9, 16)
    host.update(more)

    # Training kept stepping; a step waited at most a normal save plus what is left of the
    # in-flight save's timeout, or one bounded probe (and scheduling noise on 2 loaded cores).
    bound = max(normal.values()) + max(PROBE_WAIT_S, TIMEOUT_S) + 1.0
    assert max(blocked.values()) < bound, (blocked, normal)
    (outage,) = [
        e for e in events_of(workdir, EventType.PERSISTENT_OUTAGE) if e["time"] > killed_at
    ]
    assert outage["step"] in (8, 12) and outage["cause"]
    local_saves = {e["step"] for e in events_of(workdir, EventType.SAVE) if e["tier"] == "local"}
    assert set(range(9, 17)) <= local_saves
    skipped = [e for e in events_of(workdir, EventType.SAVE_FAILED) if e["tier"] == "persistent"]
    assert any(e["step"] in (12, 16) for e in skipped)

    gcs.start()  # the store returns; the stuck save finishes or fails within TensorStore's backoff
    step, recovered = 16, []
    deadline = time.monotonic() + 120
    while not recovered and time.monotonic() < deadline:
        state, more = step_through(ck, ctx, state, step + 1, step + 4, writes_finish="local")
        host.update(more)
        step += 4
        recovered = [
            e for e in events_of(workdir, EventType.PERSISTENT_RECOVERED) if e["time"] > killed_at
        ]
        time.sleep(0.5)
    assert recovered, f"no persistent save committed {time.monotonic() - killed:.0f}s after"
    ck.wait_until_finished()
    ck.close()
    committed = recovered[0]["step"]
    assert committed >= 8  # 8 itself if its retries outlived the outage

    restore_config = config.copy_and_resolve_references()
    restore_config.checkpoint.local_dir = ""  # the persistent tier alone
    ctx = run_context(restore_config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx, max_step=committed)
    ck.close()
    assert (restored.tier, restored.step) == (Tier.PERSISTENT, committed)
    assert_bitwise(restored.state, host[committed])


def test_bucket_unreachable_at_start_resumes_from_the_local_tier(tmp_path, local_root, gcs, state0):
    workdir = str(tmp_path / "run")
    config = _config(local_root, gcs)
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.restore_latest(ctx)
    ck.on_start(ctx, state0)
    _, host = step_through(ck, ctx, state0, 1, 6)  # persistent 4, local 5 and 6
    ck.wait_until_finished()
    ck.close()

    gcs.kill()
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    assert (restored.tier, restored.step) == (Tier.LOCAL, 6)
    assert_bitwise(restored.state, host[6])
    outage = events_of(workdir, EventType.PERSISTENT_OUTAGE)
    assert outage and outage[-1].get("step") is None
    assert config.checkpoint.dir in outage[-1]["cause"]  # it did not answer

    # The store returns: the first scheduled save reaches it again and commits.
    gcs.start()
    ck.on_start(ctx, restored.state)
    step_through(ck, ctx, restored.state, 7, 8)
    ck.wait_until_finished()
    ck.close()
    assert events_of(workdir, EventType.PERSISTENT_RECOVERED)[-1]["step"] == 8
    steps = sorted(
        int(p.name) for p in epath.Path(config.checkpoint.dir).iterdir() if p.name.isdigit()
    )
    assert steps == [4, 8]

    # No local copy of the run (another machine's RAM disk) and no store: a clear refusal.
    gcs.kill()
    elsewhere = config.copy_and_resolve_references()
    elsewhere.checkpoint.local_dir = str(tmp_path / "empty-shm")
    ctx = run_context(elsewhere, str(tmp_path / "run"))
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    with pytest.raises(CheckpointError, match="unreachable and no valid local-tier step"):
        ck.restore_latest(ctx)
    ck.close()
    with pytest.raises(CheckpointError, match="unreachable at start"):
        Checkpointer(run_context(elsewhere, str(tmp_path / "new")), handle_sigterm=False).open()


def test_outage_past_its_limit_stops_after_a_local_save(tmp_path, local_root, gcs, state0):
    workdir = str(tmp_path / "run")
    config = _config(
        local_root,
        gcs,
        **{"checkpoint.every_steps": 2, "checkpoint.persistent_outage_limit_s": 2.0},
    )
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.restore_latest(ctx)
    ck.on_start(ctx, state0)
    state, _ = step_through(ck, ctx, state0, 1, 2, writes_finish="local")
    ck.wait_until_finished()
    gcs.kill()
    step = 2
    deadline = time.monotonic() + 60
    with pytest.raises(StopTraining) as stop:
        while time.monotonic() < deadline:
            state, _ = step_through(ck, ctx, state, step + 1, step + 1, writes_finish="local")
            step += 1
            time.sleep(0.2)
    ck.close()
    assert stop.value.exit_code == ExitCode.STORAGE_UNREACHABLE
    assert "persistent_outage_limit_s" in stop.value.reason
    assert ck.latest_step() == step + 1  # the step that stopped the run is on the local tier


# What these tests refuse is one step's uploads, not time: a timeout well above a loaded machine's
# commit (4.5 s seen at load 13) keeps a slow save from being taken for an outage.
REFUSAL_TIMEOUT_S = 30.0


@pytest.fixture
def refusing(gcs, monkeypatch):
    """A proxy in front of the emulator that refuses the uploads of chosen steps (HTTP 403);
    TensorStore and gcsfs are sent through it for the test."""
    store = RefusingStore(gcs.url)
    for key, value in store.environ().items():
        monkeypatch.setenv(key, value)
    yield store
    store.close()


def _persistent_events(workdir: str, kind: str) -> list[dict]:
    return [e for e in events_of(workdir, kind) if e.get("tier", "persistent") == "persistent"]


def _refusal_run(tmp_path, local_root, gcs, refusing, state0) -> tuple:
    """A run on gs:// through the refusing proxy that committed step 4, the proxy set to refuse
    the uploads of step 8: (config, workdir, ctx, checkpointer, state, host copies by step)."""
    workdir = str(tmp_path / "run")
    config = _config(local_root, gcs, **{"checkpoint.persistent_timeout_s": REFUSAL_TIMEOUT_S})
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.restore_latest(ctx)
    ck.on_start(ctx, state0)
    state, host = step_through(ck, ctx, state0, 1, 4)
    ck.wait_until_finished()
    refusing.refuse_steps = {8}
    return config, workdir, ctx, ck, state, host


def test_a_refused_save_costs_only_itself(tmp_path, local_root, gcs, refusing, state0):
    config, workdir, ctx, ck, state, host = _refusal_run(
        tmp_path, local_root, gcs, refusing, state0
    )
    state, more = step_through(ck, ctx, state, 5, 12)  # 8 refused; 12 started after it
    host.update(more)
    ck.wait_until_finished()  # raises if the save of 12 failed too
    ck.close()

    assert refusing.refused, "the proxy refused nothing: the test tested nothing"
    assert {e["step"] for e in _persistent_events(workdir, EventType.SAVE_FAILED)} == {8}
    # Seen by the poll after step 8 (the step lasted until the refused save had ended).
    assert [e["step"] for e in events_of(workdir, EventType.PERSISTENT_OUTAGE)] == [8]
    assert [e["step"] for e in events_of(workdir, EventType.PERSISTENT_RECOVERED)] == [12]
    committed = [e["step"] for e in _persistent_events(workdir, EventType.SAVE_COMMITTED)]
    assert committed == [4, 12]
    restore_config = config.copy_and_resolve_references()
    restore_config.checkpoint.local_dir = ""  # the persistent tier alone
    ctx = run_context(restore_config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    invalid = events_of(workdir, EventType.CHECKPOINT_INVALID)
    assert (restored.tier, restored.step) == (Tier.PERSISTENT, 12), invalid
    assert_bitwise(restored.state, host[12])


def test_the_final_step_waits_for_a_recovery_save_still_committing(
    tmp_path, local_root, gcs, refusing, state0
):
    """The store refused the save of 8 (an outage); the recovery save of 12 is slow to commit
    and still in flight when the run ends at 14: the final save waits for it, then commits."""
    _, workdir, ctx, ck, state, _ = _refusal_run(tmp_path, local_root, gcs, refusing, state0)
    refusing.delay_s = {12: 0.3}  # each upload of 12: its commit takes seconds
    state, _ = step_through(ck, ctx, state, 5, 11)
    state, _ = step_through(ck, ctx, state, 12, 14, writes_finish="local")
    in_flight = ck._writer is not None and ck._writer.save_in_progress()
    ck.on_end(ctx, state, StepInfo(14, 13, data_position(14), 0.01))  # raises if 14 is not in
    ck.close()

    assert in_flight, "the save of 12 had committed before the end: the test tested nothing"
    assert [e["step"] for e in events_of(workdir, EventType.PERSISTENT_RECOVERED)] == [12]
    committed = [e["step"] for e in _persistent_events(workdir, EventType.SAVE_COMMITTED)]
    assert committed == [4, 12, 14]
    assert {e["step"] for e in _persistent_events(workdir, EventType.SAVE_FAILED)} == {8}


# ------------------------------------------------------------------- whole runs on gs://


def _train(
    workdir, ckpt_dir: str, devices: int = 4, chaos: str = "", **overrides
) -> subprocess.Popen:
    flags = as_flags(
        {
            **SMALL,
            "total_steps": 30,
            "checkpoint.every_steps": 10,
            "checkpoint.local_every_steps": 3,
            "checkpoint.dir": ckpt_dir,
            **overrides,
        }
    )
    return subprocess.Popen(
        [
            sys.executable,
            "launch/train.py",
            "--config=configs/tiny_cpu.py",
            f"--workdir={workdir}",
            f"--config.checkpoint.local_dir={workdir}-shm",
            *flags,
            *([f"--chaos={chaos}"] if chaos else []),
        ],
        cwd=REPO,
        env={**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _plain_state(ckpt_dir: str, step: int) -> dict:
    import jax
    import orbax.checkpoint as ocp

    path = f"{ckpt_dir}/{step}/state"
    checkpointer = ocp.PyTreeCheckpointer()
    meta = checkpointer.metadata(path).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    flat = jax.tree_util.tree_flatten_with_path(checkpointer.restore(path, restore_args=args))[0]
    return {jax.tree_util.keystr(p): v for p, v in flat}


def test_gs_run_killed_and_resumed_is_bitwise_equal_to_an_undisturbed_one(tmp_path, gcs, launcher):
    undisturbed = gcs.gs_url(uuid.uuid4().hex[:12])
    proc = _train(tmp_path / "a", undisturbed)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    resumed = gcs.gs_url(uuid.uuid4().hex[:12])
    # Slowed steps (a sleep: the numbers are the same) and a kill only once a save of the run
    # has committed: under load the first save's write can outlast a dozen small steps, and a
    # run killed with nothing committed would start afresh, resuming nothing.
    proc = _train(tmp_path / "b", resumed, chaos="slow:process=0,factor=4")
    launcher.wait_for_step(tmp_path / "b", 14, proc)
    committed = lambda e: e["type"] == EventType.SAVE_COMMITTED
    launcher.wait_for_event(tmp_path / "b", proc, committed, "a committed save", timeout=120)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc = _train(tmp_path / "b", resumed)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert events_of(str(tmp_path / "b"), EventType.RESTORE)
    expected, got = _plain_state(undisturbed, 30), _plain_state(resumed, 30)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert np.array_equal(value, got[key]), key


def test_a_run_whose_last_save_and_first_final_save_are_refused_exits_0(tmp_path, gcs, refusing):
    """launch/train.py on gs:// through the refusing proxy: the last scheduled save before the
    end (15 of 30) is refused, and so is the first try of the final one (30). The run still
    ends with exit 0 and step 30 committed and readable by plain Orbax."""
    ckpt_dir = gcs.gs_url(uuid.uuid4().hex[:12])
    refusing.refuse_steps = {15}
    refusing.refuse_once = {30}
    workdir = tmp_path / "run"
    # The proxy's endpoint variables are in its environment.
    proc = _train(workdir, ckpt_dir, **{"checkpoint.every_steps": 15})
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert not refusing.refuse_once  # the final save's first try was refused
    persistent = {
        kind: [e["step"] for e in events_of(str(workdir), kind) if e.get("tier") == "persistent"]
        for kind in (EventType.SAVE_FAILED, EventType.SAVE_COMMITTED)
    }
    assert persistent[EventType.SAVE_FAILED] == [15, 30]
    assert persistent[EventType.SAVE_COMMITTED] == [30]
    recovered = events_of(str(workdir), EventType.PERSISTENT_RECOVERED)
    assert [e["step"] for e in recovered] == [30]
    assert _plain_state(ckpt_dir, 30)  # committed: plain Orbax reads it


def test_local_cluster_with_a_gs_persistent_tier(tmp_path, gcs):
    """Two JAX processes (two slices) under the supervisor; every persistent save goes to gs://,
    and a slice lost mid-run comes back through a restore from it."""
    ckpt_dir = gcs.gs_url(uuid.uuid4().hex[:12])
    workdir = tmp_path / "cluster"
    argv = [
        sys.executable,
        "launch/local_cluster.py",
        "--config=configs/tiny_cpu.py",
        f"--workdir={workdir}",
        "--num_slices=2",
        "--devices_per_process=2",
        # Steps slowed 20x (to about the emulator's commit time): a save due while the previous
        # one still commits is skipped, and the restore must find step 5 or 10 committed.
        "--chaos=kill:process=1,step=12;slow:process=0,factor=20",
        *as_flags(
            {
                **SMALL,
                "total_steps": 24,
                "checkpoint.every_steps": 5,
                "checkpoint.local_every_steps": 0,
                "checkpoint.dir": ckpt_dir,
                "coordinator.standby_workers": False,
            }
        ),
    ]
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"local cluster did not finish:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    restores = events_of(str(workdir), EventType.RESTORE)
    # Step 10's save may still be committing when process 1 dies at step 12: then step 5.
    assert any(e["tier"] == "persistent" and e["step"] in (5, 10) for e in restores), restores
    steps = sorted(int(p.name) for p in epath.Path(ckpt_dir).iterdir() if p.name.isdigit())
    assert steps[-1] == 24
