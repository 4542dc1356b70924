"""The persistent tier held to one contract on both backends: a local directory and gs:// (a
fake-gcs-server on 127.0.0.1, started by the `gcs` fixture). Each test takes `persistent_base`,
parametrized over the two. Outages of the object store: test_checkpoint_outage.py."""

from __future__ import annotations

import json
import socket
import time

import jax
import pytest
from conftest import (
    assert_bitwise,
    checkpoint_config,
    data_position,
    events_of,
    run_context,
    step_through,
)
from etils import epath

from resilient_jax import executables
from resilient_jax.checkpoint import Checkpointer, Tier
from resilient_jax.checkpoint.__main__ import main as inspect_main
from resilient_jax.checkpoint.persistent import QUARANTINE_DIR
from resilient_jax.checkpoint.store_outage import StoreProbe, store_endpoint
from resilient_jax.contracts.event_types import EventType
from resilient_jax.train.state import init_state


@pytest.fixture(scope="module")
def state0(tmp_path_factory):
    ctx = run_context(checkpoint_config(), str(tmp_path_factory.mktemp("init")))
    return init_state(ctx.config, ctx.mesh)


def test_save_resume_reshard_verify_fallback_quarantine_and_report(
    tmp_path, persistent_base, state0, capsys
):
    """Async saves commit; the newest step resumes onto other meshes bitwise; a step whose
    contents no longer match their digests is reported by the CLI, skipped on restore (the
    previous step restores) and moved into quarantine, never deleted."""
    workdir = str(tmp_path / "run")
    ckpt_dir = f"{persistent_base}/checkpoints"
    config = checkpoint_config(**{"checkpoint.every_steps": 2, "checkpoint.dir": ckpt_dir})
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    assert ck.restore_latest(ctx) is None
    ck.on_start(ctx, state0)
    _, host = step_through(ck, ctx, state0, 1, 4)
    ck.wait_until_finished()
    ck.close()
    saves = [e for e in events_of(workdir, EventType.SAVE) if e["tier"] == Tier.PERSISTENT]
    commits = [e["step"] for e in events_of(workdir, EventType.SAVE_COMMITTED)]
    assert [e["step"] for e in saves] == [2, 4] and sorted(commits) == [2, 4]

    for devices, replica, fsdp in [(4, -1, -1), (8, 2, 4)]:
        ctx = run_context(config, workdir, devices, replica, fsdp)
        ck = Checkpointer(ctx, handle_sigterm=False).open()
        restored = ck.restore_latest(ctx)
        ck.close()
        assert (restored.tier, restored.step) == (Tier.PERSISTENT, 4)
        assert restored.data_position == data_position(4)
        assert_bitwise(restored.state, host[4])
        for leaf, target in zip(
            jax.tree.leaves(restored.state), jax.tree.leaves(ctx.abstract_state), strict=True
        ):
            assert leaf.sharding == target.sharding

    # Contents that still decode but differ from what was saved: only the digests notice.
    meta_file = epath.Path(ckpt_dir) / "4" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["checksums"][".params['embed']"] = "0" * 16
    meta_file.write_text(json.dumps(meta))
    assert inspect_main(["inspect", ckpt_dir, "--json"]) == 1
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows[2]["status"] == "ok" and "mismatch" in rows[4]["status"]

    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert (restored.tier, restored.step) == (Tier.PERSISTENT, 2)
    assert_bitwise(restored.state, host[2])
    (invalid,) = events_of(workdir, EventType.CHECKPOINT_INVALID)
    assert invalid["step"] == 4 and "checksum mismatch" in invalid["cause"]
    (moved,) = list((epath.Path(ckpt_dir) / QUARANTINE_DIR).iterdir())
    assert moved.name.startswith("4-") and (moved / "meta" / "metadata").exists()
    assert not (epath.Path(ckpt_dir) / "4").exists()
    assert inspect_main(["inspect", ckpt_dir]) == 0  # what is left verifies
    assert "step" in capsys.readouterr().out


def test_executable_cache_round_trip(persistent_base):
    """The serialized-executable cache stores and loads through epath: gs:// works as a path."""
    directory = f"{persistent_base}/executables"
    devices = jax.devices()
    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(devices, ("x",)), jax.sharding.PartitionSpec("x")
    )
    lowered = jax.jit(lambda x: x * 3 + 1).lower(
        jax.ShapeDtypeStruct((len(devices) * 2,), "float32", sharding=sharding)
    )
    compiled, hit = executables.load_or_compile("x3", lambda: lowered, devices, directory)
    assert not hit and len(list(epath.Path(directory).iterdir())) == 1
    loaded, hit = executables.load_or_compile("x3", lambda: lowered, devices, directory)
    assert hit
    x = jax.device_put(jax.numpy.arange(len(devices) * 2, dtype="float32"), sharding)
    assert (loaded(x) == compiled(x)).all()


def test_a_store_that_refuses_connections_is_reported_refused_at_once(monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    assert store_endpoint("gs://bucket/run") == ("127.0.0.1", port)
    assert store_endpoint("/local/dir") is None
    started = time.monotonic()
    cause = StoreProbe("gs://test-bucket/run/checkpoints").unreachable(30.0)
    assert time.monotonic() - started < 5.0  # not the 30 s of "did not answer"
    assert cause == (
        "gs://test-bucket/run/checkpoints unreachable: ConnectionRefusedError: "
        f"connection to 127.0.0.1:{port} refused"
    )
