"""Every thread that reads a saved state's shards sees all of them.

A jax array builds its list of shards (its per-device arrays, behind `addressable_shards`) the
first time it is asked, and caches it. Two threads asking first at the same time can be handed a
list that lacks its last shards (jax 0.10: a few lists in ten thousand, fresh 8-device arrays
read by two threads at once on a loaded 2-core host). A save's snapshot is read at once by the
local tier's writer and by the persistent writer (its digests, then Orbax's save): from a short
list the persistent digest covered part of an array, and that committed step failed its checksum
at restore. Each writer lists the snapshot's shards with `list_shards` before reading it; the
lock makes the first of them build every list and the other find them built. It runs in the
writers' threads, not the training thread: building the lists costs about 80 us per leaf (10 ms
for tiny_cpu's 129 leaves on 8 devices), 10-30 times a kept save's whole blocking time. Elastic
mode's host copies of the state (a heal's message, the replicas' check) list it the same way: a
kept state is the one the writers read.
"""

from __future__ import annotations

import threading
from typing import Any

import jax

_LISTING = threading.Lock()


def list_shards(tree: Any) -> Any:
    """`tree`, each array's list of shards built (by this call or an earlier one)."""
    with _LISTING:
        for leaf in jax.tree.leaves(tree):
            if isinstance(leaf, jax.Array):
                leaf.addressable_shards  # noqa: B018 (built and cached by the property)
    return tree
