"""The threads that read a save's snapshot at once (the local tier's writer, the persistent
writer's digests and Orbax's save) each see every shard (`train.shard_list`). jax builds
an array's list of shards the first time it is asked; two threads asking first at the same time
could be handed a list missing its last shards, and a step saved from such a list failed its
checksum at restore."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from resilient_jax.checkpoint.snapshot import device_snapshot
from resilient_jax.train.shard_list import list_shards

DEVICES = 8


def _tree(leaves: int = 6) -> list[jax.Array]:
    mesh = jax.make_mesh((DEVICES,), ("x",))
    sharded = NamedSharding(mesh, PartitionSpec("x"))
    replicated = NamedSharding(mesh, PartitionSpec())
    tree = [jax.device_put(jnp.full((DEVICES, 16), i, jnp.float32), sharded) for i in range(leaves)]
    return [*tree, jax.device_put(jnp.int32(7), replicated)]


def _listed(tree: list[jax.Array]) -> bool:
    # Where jax caches an array's list of shards once built (`ArrayImpl.addressable_shards`).
    return all(len(leaf.__dict__.get("addressable_shards", ())) == DEVICES for leaf in tree)


def test_listing_builds_every_leafs_shard_list():
    snapshot = jax.block_until_ready(device_snapshot(_tree()))
    assert not _listed(snapshot)  # a fresh array has not built its list: the check can fail
    assert list_shards(snapshot) is snapshot
    assert _listed(snapshot)


def test_two_writers_reading_a_fresh_snapshot_at_once_see_every_shard():
    """As the two tiers' writers read a snapshot: each lists it, then reads every leaf's shards;
    one also starts their copies to host. Without the listing's lock: short lists in 4 runs of
    4 beside three CPU hogs."""
    state = _tree(leaves=40)
    short = []
    for _ in range(100):
        snapshot = jax.block_until_ready(device_snapshot(state))
        start = threading.Barrier(2)

        def write(copy: bool, tree: list[jax.Array] = snapshot, at: threading.Barrier = start):
            at.wait(timeout=30)
            for leaf in list_shards(tree):
                shards = leaf.addressable_shards
                short.extend([len(shards)] if len(shards) != DEVICES else [])
                for shard in shards if copy else ():
                    shard.data.copy_to_host_async()

        threads = [threading.Thread(target=write, args=(copy,)) for copy in (False, True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
    assert short == []
