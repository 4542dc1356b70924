"""A save's snapshot has its shards listed on the training thread (`snapshot.list_shards`), so the
threads that read it at once (the local tier's writer, the persistent writer's digests, Orbax's
save) each see every shard. jax builds an array's list of shards the first time it is asked;
two threads asking first at the same time could be handed a list missing its last shards, and a
step saved from such a list failed its checksum at restore."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from resilient_jax.checkpoint.snapshot import device_snapshot, saved_state
from resilient_jax.train.keep import StateKeeper

DEVICES = 8


def _tree(leaves: int = 6) -> list[jax.Array]:
    mesh = jax.make_mesh((DEVICES,), ("x",))
    sharded = NamedSharding(mesh, PartitionSpec("x"))
    replicated = NamedSharding(mesh, PartitionSpec())
    return [
        jax.device_put(jnp.full((DEVICES, 16), i, jnp.float32), sharded) for i in range(leaves)
    ] + [jax.device_put(jnp.int32(7), replicated)]


def _listed(tree: list[jax.Array]) -> bool:
    # Where jax caches an array's list of shards once built (`ArrayImpl.addressable_shards`).
    return all(len(leaf.__dict__.get("addressable_shards", ())) == DEVICES for leaf in tree)


def _keeper(keeps: bool) -> StateKeeper:
    keeper = StateKeeper()
    keeper.offer(lambda: keeps)
    return keeper


@pytest.mark.parametrize(
    "keep, keeps",
    [(True, True), (True, False), (False, False)],
    ids=["kept-state", "device-copy", "host-copy"],
)
def test_every_snapshot_has_its_shards_listed_before_another_thread_reads_it(keep, keeps):
    state = _tree()
    assert not _listed(state)  # a fresh array has not built its list yet: the check can fail
    snapshot = saved_state(state, _keeper(keeps), keep=keep)
    assert (snapshot is state) == (keep and keeps)
    assert _listed(snapshot)
    assert not _listed(device_snapshot(state))  # listing is the save's doing, not the copy's


def test_threads_reading_a_fresh_snapshot_at_once_see_every_shard():
    """The local tier's writer and the persistent writer, as they read a snapshot: both list
    every leaf's shards, one also starts their copies to host (without the listing on the
    training thread, a few short lists in 10,000 on a loaded 2-core host)."""
    state, keeper = _tree(leaves=40), _keeper(False)
    short = []
    for _ in range(100):
        snapshot = jax.block_until_ready(saved_state(state, keeper))
        start = threading.Barrier(2)

        def read(copy: bool, tree: list[jax.Array] = snapshot, at: threading.Barrier = start):
            at.wait(timeout=30)
            for leaf in tree:
                shards = leaf.addressable_shards
                short.extend([len(shards)] if len(shards) != DEVICES else [])
                for shard in shards if copy else ():
                    shard.data.copy_to_host_async()

        threads = [threading.Thread(target=read, args=(copy,)) for copy in (False, True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
    assert short == []
