"""Checkpoint engine in one process on 8 simulated devices: tiers, resharding, verification,
fallback, refusal, policies, failures. Multi-process and kill tests: test_checkpoint_process.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_bitwise,
    checkpoint_config,
    data_position,
    events_of,
    persistent_step_dirs,
    run_context,
    run_python,
    step_through,
)

from resilient_jax.checkpoint import (
    Checkpointer,
    CheckpointError,
    SavePolicy,
    SaveReason,
    Tier,
    checksum,
    local,
)
from resilient_jax.checkpoint.__main__ import main as inspect_main
from resilient_jax.checkpoint.persistent import _KeepPolicy
from resilient_jax.checkpoint.save_policy import local_interval_steps
from resilient_jax.config import fingerprint
from resilient_jax.contracts import env_vars
from resilient_jax.contracts.event_types import EventType
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.data.position import DataPosition
from resilient_jax.goodput.model import young_daly_interval_s
from resilient_jax.train.hooks import StepInfo, StopTraining
from resilient_jax.train.state import init_state

# ---------------------------------------------------------------------------------------- helpers


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def state0(tmp_path_factory):
    ctx = run_context(checkpoint_config(), str(tmp_path_factory.mktemp("init")))
    return init_state(ctx.config, ctx.mesh)


def _saved_run(workdir: str, local_root: str, state0, last: int = 4, **overrides):
    """A run that saved steps up to `last` (persistent every 2 steps unless overridden)."""
    overrides = {"checkpoint.every_steps": 2, **overrides}
    config = checkpoint_config(local_root, **overrides)
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    assert ck.restore_latest(ctx) is None
    ck.on_start(ctx, state0)
    state, host = step_through(ck, ctx, state0, 1, last)
    ck.wait_until_finished()
    ck.close()
    return config, state, host


# ------------------------------------------------------------------------------- round trips


def test_checksum_is_sharding_independent_and_matches_host(state0):
    device = checksum.tree_digests(state0)
    host = {
        path: checksum.host_digest(np.asarray(leaf))
        for path, leaf in zip(checksum.leaf_paths(state0), jax.tree.leaves(state0), strict=True)
    }
    assert device == host
    replicated = jax.device_put(
        state0, jax.sharding.NamedSharding(state0.step.sharding.mesh, jax.sharding.PartitionSpec())
    )
    assert checksum.tree_digests(replicated) == device
    changed = np.asarray(state0.params["embed"]).copy()
    changed[3, 5] = np.nextafter(changed[3, 5], np.float32(1))
    assert checksum.host_digest(changed) != device[".params['embed']"]


@pytest.mark.parametrize("devices,replica,fsdp", [(8, -1, -1), (4, -1, -1), (8, 2, 4), (8, 8, 1)])
def test_local_tier_round_trip_onto_other_meshes(
    tmp_path, local_root, state0, devices, replica, fsdp
):
    workdir = str(tmp_path)
    config, _, host = _saved_run(
        workdir,
        local_root,
        state0,
        **{"checkpoint.local_every_steps": 1, "checkpoint.every_steps": 0},
    )
    ctx = run_context(config, workdir, devices, replica, fsdp)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert (restored.tier, restored.step) == (Tier.LOCAL, 4)
    assert restored.data_position == data_position(4)
    assert_bitwise(restored.state, host[4])
    for leaf, target in zip(
        jax.tree.leaves(restored.state), jax.tree.leaves(ctx.abstract_state), strict=True
    ):
        assert leaf.sharding == target.sharding
    (event,) = events_of(workdir, EventType.RESTORE)
    assert event["tier"] == "local" and event["step"] == 4 and event["duration_s"] > 0


def test_persistent_round_trip_onto_fewer_devices_and_replicas(tmp_path, state0):
    workdir = str(tmp_path)
    config, _, host = _saved_run(workdir, "", state0)
    saves = [e for e in events_of(workdir, EventType.SAVE) if e["tier"] == "persistent"]
    assert [e["step"] for e in saves] == [2, 4] and all(e["duration_s"] > 0 for e in saves)
    assert {e["step"] for e in events_of(workdir, EventType.SAVE_COMMITTED)} == {2, 4}
    for devices, replica, fsdp in [(4, -1, -1), (8, 2, 4)]:
        ctx = run_context(config, workdir, devices, replica, fsdp)
        ck = Checkpointer(ctx, handle_sigterm=False).open()
        restored = ck.restore_latest(ctx)
        ck.close()
        assert (restored.tier, restored.step) == (Tier.PERSISTENT, 4)
        assert restored.data_position == data_position(4)
        assert_bitwise(restored.state, host[4])
    with open(os.path.join(workdir, "checkpoints", "4", "meta", "metadata")) as f:
        meta = json.load(f)
    assert meta["checksums"][".params['embed']"] == checksum.host_digest(host[4].params["embed"])
    assert meta["mesh"]["fsdp"] == 8 and meta["temporary"] is False
    # The data position is saved as the same JSON as before it became a DataPosition, so
    # checkpoints written by earlier versions restore.
    assert meta["data_position"] == {"next_batch": 4, "skips": [[1, 3]]}
    with open(os.path.join(workdir, "checkpoints", "4", "data", "metadata")) as f:
        assert json.load(f) == {"next_batch": 4, "skips": [[1, 3]]}


def test_plain_orbax_reads_state_without_this_package(tmp_path, state0):
    workdir = str(tmp_path)
    _, _, host = _saved_run(workdir, "", state0)
    out = str(tmp_path / "plain.npz")
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        import jax
        import orbax.checkpoint as ocp
        path = {os.path.join(workdir, "checkpoints", "4", "state")!r}
        ckptr = ocp.PyTreeCheckpointer()
        meta = ckptr.metadata(path).item_metadata.tree
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
        tree = ckptr.restore(path, restore_args=args)
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        flat = {{jax.tree_util.keystr(p): v for p, v in leaves}}
        np.savez({out!r}, **flat)
        assert not any(m.startswith("resilient_jax") for m in sys.modules)
        """
    )
    result = run_python(["-c", script], timeout=120, env={"XLA_FLAGS": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    plain = np.load(out)
    assert np.array_equal(plain["['params']['embed']"], host[4].params["embed"])
    assert int(plain["['step']"]) == int(host[4].step)


# ---------------------------------------------------------------------- verification, fallback


def _corrupt(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        chunk = f.read(16)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))


@pytest.mark.parametrize("damage", ["array_files", "silent_change"])
def test_corrupt_persistent_step_falls_back_and_quarantines(tmp_path, state0, capsys, damage):
    workdir = str(tmp_path)
    config, _, host = _saved_run(workdir, "", state0)
    step_dir = os.path.join(workdir, "checkpoints", "4")
    if damage == "array_files":
        data_files = [
            os.path.join(root, name)
            for root, _, names in os.walk(os.path.join(step_dir, "state"))
            for name in names
            if os.sep + "d" in root
        ]
        assert data_files
        for path in data_files:
            _corrupt(path)
    else:
        # Contents that still decode but differ from what was saved: only the digest notices.
        # (Rewriting the recorded digest is equivalent, and independent of Orbax's file format.)
        meta_file = os.path.join(step_dir, "meta", "metadata")
        with open(meta_file) as f:
            meta = json.load(f)
        meta["checksums"][".params['embed']"] = "0" * 16
        with open(meta_file, "w") as f:
            json.dump(meta, f)
    assert inspect_main(["inspect", workdir, "--json"]) == 1
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows[2]["status"] == "ok" and rows[2]["fingerprint"] == fingerprint(config)
    assert rows[4]["status"] != "ok"
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert (restored.tier, restored.step) == (Tier.PERSISTENT, 2)
    assert_bitwise(restored.state, host[2])
    (invalid,) = events_of(workdir, EventType.CHECKPOINT_INVALID)
    assert invalid["tier"] == "persistent" and invalid["step"] == 4 and invalid["cause"]
    if damage == "silent_change":
        assert "checksum mismatch" in invalid["cause"] and "embed" in invalid["cause"]
    # Moved aside, never deleted; and gone from the step list so step 4 can be saved again.
    quarantined = os.listdir(os.path.join(workdir, "checkpoints", "quarantine"))
    assert len(quarantined) == 1 and quarantined[0].startswith("4-")
    assert not os.path.exists(os.path.join(workdir, "checkpoints", "4"))


def test_a_read_of_a_persistent_step_that_fails_once_is_read_again_not_passed_by(
    tmp_path, state0, monkeypatch
):
    """A store's passing error (a dropped connection) must not cost a committed step: taken for
    invalid, it would be passed by and quarantined, and the run resume from an older one."""
    from resilient_jax.checkpoint import restore as restore_module
    from resilient_jax.checkpoint.errors import InvalidCheckpoint
    from resilient_jax.checkpoint.persistent import PersistentTier

    workdir = str(tmp_path)
    config, _, host = _saved_run(workdir, "", state0)
    monkeypatch.setattr(restore_module, "READ_RETRY_DELAYS_S", (0.01, 0.01))
    failures = {"restore_state": 1, "read_meta": 1}
    for name in failures:
        real = getattr(PersistentTier, name)

        def failing_once(self, *args, _real=real, _name=name, **kwargs):
            if failures[_name]:
                failures[_name] -= 1
                raise InvalidCheckpoint("state unreadable: connection reset by peer")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(PersistentTier, name, failing_once)
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert failures == {"restore_state": 0, "read_meta": 0}  # each failed once
    assert (restored.tier, restored.step) == (Tier.PERSISTENT, 4)
    assert_bitwise(restored.state, host[4])
    assert events_of(workdir, EventType.CHECKPOINT_INVALID) == []
    assert not os.path.exists(os.path.join(workdir, "checkpoints", "quarantine"))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_local_piece_falls_back_to_older_step(tmp_path, local_root, state0, damage, capsys):
    workdir = str(tmp_path)
    config, _, host = _saved_run(
        workdir,
        local_root,
        state0,
        last=3,
        **{"checkpoint.local_every_steps": 1, "checkpoint.every_steps": 0},
    )
    (proc,) = [p for p in os.listdir(local.run_dir(local_root, workdir))]
    data = os.path.join(
        local.run_dir(local_root, workdir), proc, local.step_name(3), local.DATA_FILE
    )
    if damage == "flip":
        _corrupt(data)
    else:
        os.truncate(data, os.path.getsize(data) // 2)
    assert inspect_main(["inspect", workdir, "--local-dir", local_root]) == 1
    out = capsys.readouterr().out
    assert "bad piece" in out and "local step 2" in out
    ctx = run_context(config, workdir, 4)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert (restored.tier, restored.step) == (Tier.LOCAL, 2)
    assert_bitwise(restored.state, host[2])
    (invalid,) = events_of(workdir, EventType.CHECKPOINT_INVALID)
    assert invalid["step"] == 3
    assert ("CRC" if damage == "flip" else "truncated") in invalid["cause"]


def test_local_copies_of_a_deleted_workdir_are_not_restored(tmp_path, local_root, state0):
    workdir = str(tmp_path / "run")
    config, _, _ = _saved_run(
        workdir,
        local_root,
        state0,
        **{"checkpoint.local_every_steps": 1, "checkpoint.every_steps": 0},
    )
    shutil.rmtree(workdir)  # the user starts over in the same place; the RAM disk remembers
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    assert ck.restore_latest(ctx) is None
    ck.close()
    causes = [e["cause"] for e in events_of(workdir, EventType.CHECKPOINT_INVALID)]
    assert causes and all("earlier run" in c for c in causes)
    run_dir = local.run_dir(local_root, workdir)
    left = [n for proc in os.listdir(run_dir) for n in os.listdir(os.path.join(run_dir, proc))]
    assert left == []  # and they were dropped


def test_refuses_other_model_and_config_unless_init_from(tmp_path, state0):
    workdir = str(tmp_path / "a")
    _, _, host = _saved_run(workdir, "", state0)
    wider = checkpoint_config(**{"model.d_model": 96})
    with pytest.raises(CheckpointError, match="different model"):
        Checkpointer(run_context(wider, workdir), handle_sigterm=False).open()
    reseeded = checkpoint_config(**{"seed": 7})
    with pytest.raises(CheckpointError, match="fingerprint"):
        Checkpointer(run_context(reseeded, workdir), handle_sigterm=False).open()
    assert persistent_step_dirs(workdir) == ["2", "4"]  # untouched

    # init_from naming this very directory accepts the other config and resumes from it.
    same_dir = checkpoint_config(
        **{"seed": 7, "checkpoint.init_from": os.path.join(workdir, "checkpoints")}
    )
    ctx = run_context(same_dir, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    assert ck.restore_latest(ctx).step == 4
    ck.close()

    # init_from another run: a fresh run takes its parameters only.
    other = str(tmp_path / "b")
    fresh = checkpoint_config(
        **{"seed": 7, "checkpoint.init_from": os.path.join(workdir, "checkpoints")}
    )
    ctx = run_context(fresh, other)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert (restored.tier, restored.step) == (Tier.INIT_FROM, 0)
    assert restored.data_position == DataPosition()  # the data starts from the beginning
    assert_bitwise(restored.state.params, host[4].params)
    assert int(restored.state.step) == 0

    wider_from = checkpoint_config(
        **{"model.d_model": 96, "checkpoint.init_from": os.path.join(workdir, "checkpoints")}
    )
    ctx = run_context(wider_from, str(tmp_path / "c"))
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    with pytest.raises(CheckpointError, match="different model"):
        ck.restore_latest(ctx)
    ck.close()


def test_a_checkpointer_touches_nothing_until_opened_and_a_failed_open_leaves_nothing(
    tmp_path, local_root, state0
):
    """Constructing does no I/O (no store probe, no directory, no event, no signal handler);
    `open` does it all, and an open that refuses the directory closes what it had opened."""
    workdir = str(tmp_path / "a")
    config = checkpoint_config(local_root, **{"checkpoint.local_every_steps": 1})
    idle = Checkpointer(run_context(config, workdir), handle_sigterm=True)
    assert os.listdir(workdir) == [] and not os.path.exists(local_root)  # no store, no event
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    idle.close()  # never opened: nothing to release
    assert os.listdir(workdir) == [] and not os.path.exists(local_root)

    _saved_run(workdir, local_root, state0)
    opened_before = len(events_of(workdir, EventType.SAVE_METHOD))
    wider = checkpoint_config(local_root, **{"model.d_model": 96})
    refused = Checkpointer(run_context(wider, workdir), handle_sigterm=True)
    with pytest.raises(CheckpointError, match="different model"):
        refused.open()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert len(events_of(workdir, EventType.SAVE_METHOD)) == opened_before
    with Checkpointer(run_context(checkpoint_config(local_root), workdir)) as ck:
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert ck.latest_step() == 4
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_run_resumes_with_another_remat_policy_and_scan_unroll(tmp_path, state0):
    """How the layers are computed is not what they compute: a run that changes `model.remat`
    (to fit memory) or `model.scan_unroll` resumes from its own checkpoints, bit for bit."""
    workdir = str(tmp_path / "a")
    _, _, host = _saved_run(workdir, "", state0)
    changed = checkpoint_config(**{"model.remat": "save_dots", "model.scan_unroll": 2})
    assert fingerprint(changed) == fingerprint(checkpoint_config())
    assert fingerprint(checkpoint_config(**{"model.num_layers": 3})) != fingerprint(changed)
    ctx = run_context(changed, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert (restored.tier, restored.step) == (Tier.PERSISTENT, 4)
    assert_bitwise(restored.state.params, host[4].params)
    assert_bitwise(restored.state.opt_state, host[4].opt_state)


def test_rollback_restores_exact_step_and_quarantines_newer(tmp_path, local_root, state0):
    workdir = str(tmp_path)
    config, _, host = _saved_run(
        workdir,
        local_root,
        state0,
        last=6,
        **{"checkpoint.local_every_steps": 1, "checkpoint.local_keep": 2},
    )
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    assert ck.latest_step() == 6 and ck.latest_step(max_step=5) == 5
    restored = ck.restore_latest(ctx, max_step=5)
    assert (restored.tier, restored.step) == (Tier.LOCAL, 5)
    restored = ck.restore_step(ctx, 2)
    assert (restored.tier, restored.step) == (Tier.PERSISTENT, 2)
    assert_bitwise(restored.state, host[2])
    assert ck.latest_step() == 2
    ck.close()
    assert persistent_step_dirs(workdir) == ["2", "quarantine"]


# -------------------------------------------------------------------------------- policies


def test_policy_every_n_steps_and_final():
    config = checkpoint_config(
        "/dev/shm/x", **{"checkpoint.every_steps": 4, "checkpoint.local_every_steps": 2}
    )
    policy = SavePolicy(config.checkpoint, total_steps=10, clock=FakeClock())
    decisions = {s: policy.decide(s, None) for s in range(1, 11)}
    assert [s for s, d in decisions.items() if d.persistent] == [4, 8, 10]
    assert [s for s, d in decisions.items() if d.local] == [2, 4, 6, 8, 10]
    assert (
        decisions[4].reason == SaveReason.EVERY_STEPS and decisions[10].reason == SaveReason.FINAL
    )
    assert not decisions[3]


def test_policy_every_minutes_is_temporary_with_injected_clock():
    clock = FakeClock()
    config = checkpoint_config(**{"checkpoint.every_steps": 100, "checkpoint.every_minutes": 2.0})
    policy = SavePolicy(config.checkpoint, total_steps=1000, clock=clock)
    clock.now += 119
    assert policy.clock_reason() is None
    clock.now += 2
    assert policy.clock_reason() == SaveReason.EVERY_MINUTES
    decision = policy.decide(7, SaveReason.EVERY_MINUTES)
    assert decision.persistent and decision.temporary
    assert not policy.decide(100, SaveReason.EVERY_MINUTES).temporary  # a periodic step is kept
    policy.record_persistent_save(0.5)
    assert policy.clock_reason() is None


def test_policy_young_daly_interval():
    assert young_daly_interval_s(2.0, 3600.0) == pytest.approx(120.0)
    clock = FakeClock()
    config = checkpoint_config(
        **{
            "checkpoint.auto_interval": True,
            "checkpoint.mtbf_s": 3600.0,
            "checkpoint.every_steps": 5,
        }
    )
    policy = SavePolicy(config.checkpoint, total_steps=1000, clock=clock)
    assert policy.clock_reason() == SaveReason.AUTO  # no cost measured yet: save once to measure it
    assert not policy.decide(5, None).persistent  # the interval replaces every_steps
    policy.record_persistent_save(2.0)
    assert policy.auto_interval_s() == pytest.approx(120.0)
    clock.now += 119
    assert policy.clock_reason() is None
    clock.now += 2
    assert policy.clock_reason() == SaveReason.AUTO
    policy.record_persistent_save(8.0)  # the estimate follows the measured cost
    assert 120.0 < policy.auto_interval_s() < young_daly_interval_s(8.0, 3600.0)


def test_local_interval_follows_young_daly_within_the_configured_bound():
    # sqrt(2 x 0.1 s x 60 s) = 3.46 s at 1 s per step: every 3 steps.
    assert local_interval_steps(0.1, 60.0, 1.0, at_most=10) == 3
    assert local_interval_steps(0.1, 3600.0, 1.0, at_most=10) == 10  # bounded by the config
    assert local_interval_steps(1e-4, 1.0, 1.0, at_most=10) == 1  # at least every step
    config = checkpoint_config("/dev/shm/x", **{"checkpoint.local_every_steps": 10})
    policy = SavePolicy(config.checkpoint, total_steps=100, clock=FakeClock())
    policy.set_local_interval(3, from_step=20)
    assert [s for s in range(15, 31) if policy.decide(s, None).local] == [20, 23, 26, 29]


def test_checkpointer_agrees_on_the_local_interval_after_three_saves(
    tmp_path, local_root, state0, monkeypatch
):
    config = checkpoint_config(
        local_root, **{"checkpoint.local_every_steps": 4, "checkpoint.mtbf_s": 1e-6}
    )
    ctx = run_context(config, str(tmp_path / "run"))
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.on_start(ctx, state0)
    step_through(ck, ctx, state0, 1, 16)
    ck.wait_until_finished()
    ck.close()
    local_saves = [
        e["step"] for e in events_of(ctx.workdir, EventType.SAVE) if e["tier"] == "local"
    ]
    assert local_saves == [4, 8, 12, 13, 14, 15, 16]  # a failure every microsecond: every step
    (interval,) = events_of(ctx.workdir, EventType.CHECKPOINT_INTERVAL)
    assert (interval["every_steps"], interval["mtbf_source"]) == (1, "checkpoint.mtbf_s")

    # A supervisor's observed failure rate wins over the configured one.
    monkeypatch.setenv(env_vars.OBSERVED_MTBF_S, "1e9")
    ctx = run_context(config, str(tmp_path / "observed"))
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.on_start(ctx, state0)
    step_through(ck, ctx, state0, 1, 12)
    ck.close()
    (interval,) = events_of(ctx.workdir, EventType.CHECKPOINT_INTERVAL)
    assert (interval["every_steps"], interval["mtbf_s"]) == (4, 1e9)


def test_keep_policy_drops_superseded_temporary_steps():
    class Info:
        def __init__(self, step):
            self.step = step

    temporary = {3, 13}
    policy = _KeepPolicy(2, 0, temporary.__contains__, lambda: 13)
    steps = [3, 10, 13, 20, 30]
    kept = policy.should_preserve([Info(s) for s in steps], context=None)
    assert [s for s, k in zip(steps, kept, strict=True) if k] == [13, 20, 30]
    policy = _KeepPolicy(1, 10, temporary.__contains__, lambda: None)
    kept = policy.should_preserve([Info(s) for s in steps], context=None)
    assert [s for s, k in zip(steps, kept, strict=True) if k] == [10, 20, 30]


def test_wall_clock_save_is_temporary_and_deleted_once_superseded(tmp_path, state0):
    workdir = str(tmp_path)
    clock = FakeClock()
    config = checkpoint_config(**{"checkpoint.every_steps": 10, "checkpoint.every_minutes": 1.0})
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, clock=clock, handle_sigterm=False).open()
    ck.on_start(ctx, state0)
    state, _ = step_through(ck, ctx, state0, 1, 3)
    clock.now += 61  # a minute passes during step 4
    state, _ = step_through(ck, ctx, state, 4, 20)
    ck.wait_until_finished()
    saves = {e["step"]: e for e in events_of(workdir, EventType.SAVE)}
    assert sorted(saves) == [4, 10, 20] and saves[4]["temporary"] is True
    assert persistent_step_dirs(workdir) == ["10", "20"]
    ck.close()


# -------------------------------------------------------------------------- failures, stops


def test_failed_background_save_raises_at_next_save(tmp_path, local_root, state0):
    workdir = str(tmp_path)
    config = checkpoint_config(local_root, **{"checkpoint.local_every_steps": 1})
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.on_start(ctx, state0)
    state, _ = step_through(ck, ctx, state0, 1, 1)
    ck.wait_until_finished()
    own = ck._local.own_dir
    shutil.rmtree(own)
    open(own, "w").close()  # the next background write cannot create its directory
    state, _ = step_through(ck, ctx, state, 2, 2)  # returns at once; the write fails behind it
    with pytest.raises(CheckpointError, match="local save of step 2"):
        step_through(ck, ctx, state, 3, 3)
    (failed,) = events_of(workdir, EventType.SAVE_FAILED)
    assert failed["tier"] == "local"
    os.remove(own)
    ck.close()


def test_failed_final_save_raises(tmp_path, state0):
    workdir = str(tmp_path)
    ctx = run_context(checkpoint_config(), workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.on_start(ctx, state0)
    state, _ = step_through(ck, ctx, state0, 1, 1)
    directory = os.path.join(workdir, "checkpoints")
    shutil.rmtree(directory)
    open(directory, "w").close()  # nothing can be written below it any more
    with pytest.raises(CheckpointError, match="step 1"):
        ck.on_end(ctx, state, StepInfo(1, 0, data_position(1), 0.01))
    assert events_of(workdir, EventType.SAVE_FAILED)
    ck.close()


def test_sigterm_saves_and_stops_with_preempted_exit_code(tmp_path, state0):
    workdir = str(tmp_path)
    ctx = run_context(checkpoint_config(), workdir)
    before = signal.getsignal(signal.SIGTERM)
    ck = Checkpointer(ctx, handle_sigterm=True).open()
    try:
        ck.on_start(ctx, state0)
        state, _ = step_through(ck, ctx, state0, 1, 2)
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(StopTraining) as stop:
            step_through(ck, ctx, state, 3, 3)
    finally:
        ck.close()
    assert stop.value.exit_code == ExitCode.PREEMPTED
    assert persistent_step_dirs(workdir) == ["3"]
    assert events_of(workdir, EventType.PREEMPTION)[0]["step"] == 3
    assert signal.getsignal(signal.SIGTERM) == before


def test_saves_leave_jax_preemption_sync_point_to_the_train_loop(tmp_path, state0, monkeypatch):
    # JAX's sync manager keeps one call counter per process, set by every call: Orbax's save and
    # finalize threads calling it with the step being saved moved it back, the processes agreed on
    # a step already past, and a preemption notice went unheeded for the rest of the run.
    from jax.experimental import multihost_utils

    calls = []
    monkeypatch.setattr(
        multihost_utils, "reached_preemption_sync_point", lambda step: calls.append(step) or False
    )
    workdir = str(tmp_path)
    ctx = run_context(checkpoint_config(**{"checkpoint.every_steps": 2}), workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    try:
        ck.on_start(ctx, state0)
        step_through(ck, ctx, state0, 1, 4)
        ck.wait_until_finished()
    finally:
        ck.close()
    assert persistent_step_dirs(workdir) == ["2", "4"]
    assert calls == []


def test_a_finished_run_gives_its_ram_disk_copies_back(tmp_path, local_root, state0):
    workdir = str(tmp_path / "run")
    config = checkpoint_config(
        local_root, **{"checkpoint.every_steps": 2, "checkpoint.local_every_steps": 1}
    )
    config.total_steps = 4
    ctx = run_context(config, workdir)
    run = local.run_dir(local_root, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.on_start(ctx, state0)
    state, _ = step_through(ck, ctx, state0, 1, 3)
    # Left by an earlier, killed instance of process 0 and by a bigger generation's process 3.
    for stale in ("proc-00000-deadbeef", "proc-00003-cafecafe"):
        os.makedirs(os.path.join(run, stale))
        with open(os.path.join(run, stale, local.DATA_FILE), "wb") as f:
            f.write(b"\0" * 64)
    ck.on_end(ctx, state, StepInfo(3, 2, data_position(3), 0.01))  # stopped early: copies stay
    assert len(os.listdir(run)) == 3
    state, host = step_through(ck, ctx, state, 4, 4)
    ck.on_end(ctx, state, StepInfo(4, 3, data_position(4), 0.01))
    ck.close()
    assert not os.path.exists(run)
    assert persistent_step_dirs(workdir)[-1] == "4"  # the persistent tier keeps the final step
    ck = Checkpointer(run_context(config, workdir), handle_sigterm=False).open()
    restored = ck.restore_latest(run_context(config, workdir))
    assert (restored.step, restored.tier) == (4, Tier.PERSISTENT)
    assert_bitwise(restored.state, host[4])
    ck.close()


def test_host_digest_shares_add_up_to_the_device_digests(state0):
    """What saves and restores compute (each process's share on the host, added up) equals the
    device pass, on any sharding, with replicas counted once and 64-bit leaves included."""
    expected = checksum.tree_digests(state0)
    assert checksum.combine_sums([checksum.process_partial_sums(state0)]) == expected
    mesh = state0.step.sharding.mesh
    spec = jax.sharding.PartitionSpec
    replicated = jax.device_put(state0, jax.sharding.NamedSharding(mesh, spec()))
    assert checksum.combine_sums([checksum.process_partial_sums(replicated)]) == expected
    # Two processes' shares (here: halves of one array) add up modulo 2**32.
    wide = np.arange(24, dtype=np.int64).reshape(4, 6) * 7919
    halves = [
        checksum.host_partial_sums(wide[:2], (0, 0), wide.shape),
        checksum.host_partial_sums(wide[2:], (2, 0), wide.shape),
    ]
    combined = checksum.combine_sums([{"x": halves[0]}, {"x": halves[1]}])
    assert combined == {"x": checksum.host_digest(wide)}


def test_host_digest_in_blocks_equals_the_device_digest(monkeypatch):
    """The host digest sums a shard in blocks (its temporaries stay small whatever the shard's
    size); any block size, along the leading axis or within one index of it, gives the device
    digest, and a share that starts mid-array still adds up to the whole."""
    rng = np.random.default_rng(0)
    tree = {
        "vector": jnp.asarray(rng.standard_normal(300_001), jnp.float32),
        "rows": jnp.asarray(rng.standard_normal((3, 100_003)), jnp.bfloat16),
        "deep": jnp.asarray(rng.integers(-100, 100, (2, 3, 5_001)), jnp.int8),
        "flags": jnp.asarray(rng.random((7, 11)) > 0.5),
    }
    device = checksum.tree_digests(tree)
    wide = np.arange(2 * 3 * 5_001, dtype=np.int64).reshape(2, 3, 5_001) * 7919
    whole = checksum.host_digest(wide)  # one block: the array is below the default block size
    for block in (7, 1_000, 1 << 18):
        monkeypatch.setattr(checksum, "_BLOCK_ELEMENTS", block)
        host = {
            path: checksum.host_digest(np.asarray(leaf))
            for path, leaf in zip(checksum.leaf_paths(tree), jax.tree.leaves(tree), strict=True)
        }
        assert host == device, block
        shares = [
            {"x": checksum.host_partial_sums(wide[:, :2], (0, 0, 0), wide.shape)},
            {"x": checksum.host_partial_sums(wide[:, 2:], (0, 2, 0), wide.shape)},
        ]
        assert checksum.combine_sums(shares) == {"x": whole}, block


def test_one_snapshot_feeds_both_tiers_while_the_next_steps_donate_the_state(
    tmp_path, local_root, state0
):
    """Both tiers save step 2 from one device snapshot; the steps right after donate the state's
    buffers (as the train step does), and both saved copies still hold step 2 bit for bit. The
    newest verified copy is restored: local step 3 (newer than persistent 2); with its data
    damaged, step 2 from either tier."""
    workdir = str(tmp_path)
    overrides = {"checkpoint.every_steps": 2, "checkpoint.local_every_steps": 1}
    config = checkpoint_config(local_root, **overrides)
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.on_start(ctx, state0)
    donate = jax.jit(
        lambda s: jax.tree.map(lambda x: x * 3 if x.dtype.kind == "f" else x + 7, s),
        donate_argnums=0,
    )
    state, host = jax.tree.map(jax.numpy.copy, state0), {}
    for step in (1, 2, 3):
        state = donate(state)
        host[step] = jax.tree.map(np.asarray, state)
        ck.after_step(ctx, state, StepInfo(step, step - 1, DataPosition(next_batch=step), 0.01))
        for _ in range(3):  # reuse the saved buffers while the writers read the snapshot
            state = donate(state)
        ck._local.wait_idle(60.0)  # a step longer than the write: no local save is skipped
    ck.wait_until_finished()
    ck.close()
    saves = events_of(workdir, EventType.SAVE)
    assert sorted((e["tier"], e["step"]) for e in saves) == [
        ("local", 1),
        ("local", 2),
        ("local", 3),
        ("persistent", 2),
    ]
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert (restored.tier, restored.step) == (Tier.LOCAL, 3)
    assert_bitwise(restored.state, host[3])
    (newest,) = [c for c in local.list_committed(local.run_dir(local_root, workdir)) if c.step == 3]
    _corrupt(os.path.join(newest.dir, local.DATA_FILE))
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert restored.step == 2
    assert_bitwise(restored.state, host[2])
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    assert_bitwise(ck.restore_step(ctx, 2).state, host[2])
    ck.close()


def test_a_local_save_due_while_the_previous_write_runs_is_skipped_not_waited_for(
    tmp_path, local_root, state0, monkeypatch
):
    """A write slower than a step: the saves due meanwhile are skipped at once (nothing copied,
    nothing kept), counted in the next save event and the goodput report; the next save after
    the write ends is made, and the skipped steps are simply not on the tier."""
    import threading

    release = threading.Event()
    write = local.LocalTier._write

    def slow_write(self, step, *args):
        if step == 1:
            release.wait(60.0)
        return write(self, step, *args)

    monkeypatch.setattr(local.LocalTier, "_write", slow_write)
    config = checkpoint_config(local_root, **{"checkpoint.local_every_steps": 1})
    ctx = run_context(config, str(tmp_path))
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.on_start(ctx, state0)
    kept = []
    monkeypatch.setattr(ctx.keeper, "keep", lambda state: kept.append(state) or False)
    state, _ = step_through(ck, ctx, state0, 1, 3, writes_finish=False)
    assert len(kept) == 1  # only step 1 took a snapshot
    release.set()
    ck._local.wait_idle(60.0)
    state, _ = step_through(ck, ctx, state, 4, 4)
    ck.wait_until_finished()
    ck.close()
    saves = [(e["step"], e.get("skipped")) for e in events_of(ctx.workdir, EventType.SAVE)]
    assert saves == [(1, None), (4, 2)]
    committed = local.list_committed(local.run_dir(local_root, ctx.workdir))
    assert sorted(c.step for c in committed) == [1, 4]
    from resilient_jax.events import read_events
    from resilient_jax.goodput import accounting

    result = accounting.compute(read_events(ctx.workdir))
    assert result.saves == {"local": {"made": 2, "skipped": 2}}
    assert "local 2 made, 2 skipped (writer busy)" in accounting.format_table(result)


def test_a_persistent_save_due_while_the_previous_one_commits_is_skipped_not_waited_for(
    tmp_path, state0, monkeypatch
):
    """A persistent commit slower than the save interval: the saves due meanwhile are skipped at
    once (no outage), counted in the next save event; the final save waits for the one in
    flight and commits."""
    import threading

    from resilient_jax.checkpoint.persistent import PersistentTier

    held = {2: threading.Event(), 6: threading.Event()}
    save = PersistentTier.save

    def slow_save(self, step, *args, **kwargs):
        if step in held:
            assert held[step].wait(60.0)
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(PersistentTier, "save", slow_save)
    config = checkpoint_config(**{"checkpoint.every_steps": 1})
    config.total_steps = 7
    ctx = run_context(config, str(tmp_path))
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.on_start(ctx, state0)
    state, _ = step_through(ck, ctx, state0, 1, 1)
    ck.wait_until_finished()
    state, _ = step_through(ck, ctx, state, 2, 4, writes_finish=False)  # 3, 4: 2 commits
    held[2].set()
    assert ck._commits.finish() is None
    state, _ = step_through(ck, ctx, state, 5, 5)
    assert ck._commits.finish() is None
    state, _ = step_through(ck, ctx, state, 6, 6, writes_finish=False)  # held at the end
    threading.Timer(0.5, held[6].set).start()
    ck.on_end(ctx, state, StepInfo(7, 6, data_position(7), 0.01))
    ck.close()
    saves = [(e["step"], e.get("skipped")) for e in events_of(ctx.workdir, EventType.SAVE)]
    assert saves == [(1, None), (2, None), (5, 2), (6, None), (7, None)]
    assert not events_of(ctx.workdir, EventType.PERSISTENT_OUTAGE)
    assert not events_of(ctx.workdir, EventType.SAVE_FAILED)
    committed = [e["step"] for e in events_of(ctx.workdir, EventType.SAVE_COMMITTED)]
    assert sorted(committed) == [1, 2, 5, 6, 7]
