"""Local-tier pieces from peer hosts (checkpoint/peer_fetch.py, control/tier_service.py): a
restoring process whose RAM disk is empty fetches the newest local step from a peer's tier server
over loopback; a corrupt piece is rejected by its CRC (another copy used, else the next
candidate); a peer that never answers costs at most `checkpoint.peer_timeout_s`. One process on 8
simulated devices; the multi-host run with a replaced host is test_peer_fetch_netns.py."""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid

import pytest
from conftest import (
    assert_bitwise,
    checkpoint_config,
    events_of,
    run_context,
    step_through,
)

from resilient_jax.checkpoint import Checkpointer, Tier, local
from resilient_jax.contracts import env_vars
from resilient_jax.contracts.event_types import EventType
from resilient_jax.control.tier_service import (
    PeerError,
    TierServer,
    list_copies,
    read_ranges,
)
from resilient_jax.train.state import init_state

TOKEN = "peer-test-token"
LAST = 4  # local saves at every step; the tier keeps steps 3 and 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run's workdir and the local-tier root ("the peer's RAM disk") holding steps 3 and 4; the
    host copies of the state by step."""
    workdir = str(tmp_path_factory.mktemp("run"))
    root = f"/dev/shm/rj-peer-{uuid.uuid4().hex[:8]}"
    config = checkpoint_config(root, **{"checkpoint.local_every_steps": 1})
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    state0 = init_state(ctx.config, ctx.mesh)
    ck.on_start(ctx, state0)
    _, host = step_through(ck, ctx, state0, 1, LAST)
    ck.wait_until_finished()
    ck.close()
    yield workdir, root, host
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def peer_root(saved, tmp_path):
    """A copy of the saved local tier for one test to damage as it likes."""
    _, root, _ = saved
    copy = f"/dev/shm/rj-peer-{uuid.uuid4().hex[:8]}"
    shutil.copytree(root, copy)
    yield copy
    shutil.rmtree(copy, ignore_errors=True)


@pytest.fixture
def servers():
    started: list[TierServer] = []

    def serve(root: str) -> str:
        server = TierServer("127.0.0.1", 0, TOKEN)
        server.serve(root)
        started.append(server)
        return f"127.0.0.1:{server.port}"

    yield serve
    for server in started:
        server.close()


@pytest.fixture
def empty_root():
    """The replaced host's RAM disk: empty."""
    root = f"/dev/shm/rj-peer-{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def restore_with_peers(workdir, root, peers, monkeypatch, timeout_s: float = 10.0):
    monkeypatch.setenv(env_vars.LOCAL_TIER_PEERS, ",".join(peers))
    monkeypatch.setenv(env_vars.RUN_TOKEN, TOKEN)
    config = checkpoint_config(
        root, **{"checkpoint.local_every_steps": 1, "checkpoint.peer_timeout_s": timeout_s}
    )
    ctx = run_context(config, workdir)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    try:
        return ck.restore_latest(ctx)
    finally:
        ck.close()


def data_file(root: str, workdir: str, step: int) -> str:
    (listed,) = [c for c in local.list_committed(local.run_dir(root, workdir)) if c.step == step]
    return os.path.join(listed.dir, local.DATA_FILE)


def corrupt(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_an_empty_ram_disk_restores_the_newest_local_step_from_a_peer(
    saved, peer_root, servers, empty_root, monkeypatch
):
    workdir, _, host = saved
    peer = servers(peer_root)
    restored = restore_with_peers(workdir, empty_root, [peer], monkeypatch)
    assert (restored.tier, restored.step) == (Tier.LOCAL, LAST)
    assert_bitwise(restored.state, host[LAST])
    (fetch,) = events_of(workdir, EventType.LOCAL_FETCH)[-1:]
    assert fetch["step"] == LAST and fetch["peers"] == [peer]
    assert fetch["bytes"] == os.path.getsize(data_file(peer_root, workdir, LAST))
    # The fetched pieces are now a copy on this host too, which its own agent can serve on.
    assert [c.step for c in local.list_committed(local.run_dir(empty_root, workdir))] == [LAST]


def test_fetched_pieces_that_cannot_be_kept_still_restore(
    saved, peer_root, servers, empty_root, monkeypatch, caplog
):
    # The fetched copy is written after the restore has read it from memory: a RAM disk that
    # refuses it (a file where its directory goes) costs the copy, logged, not the restore.
    workdir, _, host = saved
    run_root = local.run_dir(empty_root, workdir)
    os.makedirs(run_root)
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=0xABCD))  # the copy's token
    blocker = os.path.join(run_root, f"{local.PROC_PREFIX}00000-fetched{uuid.uuid4().hex[:8]}")
    open(blocker, "w").close()
    restored = restore_with_peers(workdir, empty_root, [servers(peer_root)], monkeypatch)
    assert (restored.tier, restored.step) == (Tier.LOCAL, LAST)
    assert_bitwise(restored.state, host[LAST])
    assert "pieces fetched from peers not kept" in caplog.text
    assert not [c for c in local.list_committed(run_root) if "fetched" in c.dir]


def test_a_corrupt_piece_is_rejected_and_taken_from_another_peer(
    saved, peer_root, servers, empty_root, monkeypatch, tmp_path
):
    workdir, _, host = saved
    intact = f"{peer_root}-intact"
    shutil.copytree(peer_root, intact)
    try:
        corrupt(data_file(peer_root, workdir, LAST))
        bad, good = servers(peer_root), servers(intact)
        restored = restore_with_peers(workdir, empty_root, [bad, good], monkeypatch)
    finally:
        shutil.rmtree(intact, ignore_errors=True)
    assert (restored.tier, restored.step) == (Tier.LOCAL, LAST)
    assert_bitwise(restored.state, host[LAST])
    # The one corrupt piece came from the other peer, every other one from the first.
    assert set(events_of(workdir, EventType.LOCAL_FETCH)[-1]["peers"]) == {bad, good}


def test_a_corrupt_piece_on_the_only_peer_falls_back_to_the_next_candidate(
    saved, peer_root, servers, empty_root, monkeypatch
):
    workdir, _, host = saved
    corrupt(data_file(peer_root, workdir, LAST))
    restored = restore_with_peers(workdir, empty_root, [servers(peer_root)], monkeypatch)
    assert (restored.tier, restored.step) == (Tier.LOCAL, LAST - 1)
    assert_bitwise(restored.state, host[LAST - 1])
    invalid = [e for e in events_of(workdir, EventType.CHECKPOINT_INVALID) if e["step"] == LAST]
    assert invalid and "CRC mismatch" in invalid[-1]["cause"], invalid


def test_a_peer_that_never_answers_costs_one_timeout(
    saved, peer_root, servers, empty_root, monkeypatch
):
    workdir, _, host = saved
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        dead = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        restored = restore_with_peers(
            workdir, empty_root, [dead, servers(peer_root)], monkeypatch, timeout_s=1.0
        )
        elapsed = time.monotonic() - started
    assert (restored.tier, restored.step) == (Tier.LOCAL, LAST)
    assert_bitwise(restored.state, host[LAST])
    failed = events_of(workdir, EventType.LOCAL_FETCH_FAILED)
    assert failed and dead in failed[-1]["cause"], failed
    assert elapsed < 10.0, elapsed  # one 1 s timeout, plus JAX's restore


def test_the_server_refuses_a_wrong_token_and_names_outside_the_tier(saved):
    workdir, root, _ = saved
    server = TierServer("127.0.0.1", 0, TOKEN)
    try:
        address, run = f"127.0.0.1:{server.port}", local.run_dir(root, workdir).split("/")[-1]
        with pytest.raises(PeerError, match="serves no local tier"):
            list_copies(address, TOKEN, run, 2.0)
        server.serve(root)
        with pytest.raises(PeerError, match="wrong run token"):
            list_copies(address, "not-the-token", run, 2.0)
        copies = list_copies(address, TOKEN, run, 2.0)
        assert sorted(c["manifest"]["step"] for c in copies) == [LAST - 1, LAST]
        copy = copies[0]["copy"]
        with pytest.raises(PeerError, match="bad copy"):
            read_ranges(address, TOKEN, run, "../../etc", [(0, 1)], 2.0)
        with pytest.raises(PeerError, match="bad run key"):
            list_copies(address, TOKEN, "..", 2.0)
        with pytest.raises(PeerError, match="outside"):
            read_ranges(address, TOKEN, run, copy, [(0, 1 << 40)], 2.0)
        assert len(read_ranges(address, TOKEN, run, copy, [(0, 8), (16, 4)], 2.0)) == 12
    finally:
        server.close()
    with pytest.raises(PeerError, match="cannot connect"):
        list_copies(address, TOKEN, run, 1.0)
