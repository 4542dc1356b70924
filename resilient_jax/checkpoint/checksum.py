"""Content checksums of arrays, independent of how the arrays are sharded.

A digest is two uint32 sums over an array's raw bits, each element weighted by a function of its
flat position. Integer addition modulo 2**32 is associative and commutative, so the digest of a
global array is the same whatever the mesh, the reduction order or the device count: the digest
written at save time on 8 devices verifies the array restored onto 4. Any single changed element
changes the first sum (its weight is odd, so no non-zero difference vanishes modulo 2**32).

The same function exists twice: on device (`tree_digests`, one jitted pass over the state, the
result replicated on every process) and on host in numpy (`host_digest` for one whole array, for
the `inspect` tool and readers without devices; `process_partial_sums` for the blocks a process
holds, whose shares `combine_sums` adds up across processes). They agree bit for bit. Saves
(in the persistent writer thread, beside training) and restores use the host version: no digest
program is compiled, on the recovery path or anywhere, and its cross-process step is a key-value
exchange, not a device collective. The device version is the reference the tests compare with.

`crc32` is the local tier's per-piece check (zlib's CRC-32, the value `zlib.crc32` gives), computed
with ISA-L's carry-less-multiply kernels: 20-30 GB/s on one core against zlib's 1.5-4 GB/s, which
made the CRC a third of a RAM-disk commit. Both release the GIL.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # a platform without an ISA-L wheel: the same value, several times slower
    _crc32 = zlib.crc32

_W1_MUL = 0x9E3779B1
_W1_ADD = 0x7F4A7C15
_MIX_MUL = 0x2C1B3C6D
_W2_MUL = 0x297A2D39


def format_digest(h1: int, h2: int) -> str:
    return f"{int(h1):08x}{int(h2):08x}"


def crc32(data: Any) -> int:
    """The CRC-32 of a buffer (bytes, memoryview, contiguous numpy array), as `zlib.crc32`."""
    return int(_crc32(data))


def leaf_paths(tree: Any) -> list[str]:
    """Stable names of a pytree's leaves (`.params['embed']`), the keys of every manifest."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


# ----------------------------------------------------------------------------- device version


def _bits_u32(x: jax.Array) -> jax.Array:
    """The array's raw bits as uint32 (64-bit elements become two uint32 words)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = x.dtype.itemsize
    if width == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if width == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if width == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    if width == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # adds a trailing axis of 2
    raise ValueError(f"no checksum for dtype {x.dtype}")


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        iota = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
        index = index + iota * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= shape[axis]
    return index


def _leaf_digest(x: jax.Array) -> jax.Array:
    bits = _bits_u32(x)
    index = _flat_index(bits.shape)
    w1 = (index * jnp.uint32(_W1_MUL) + jnp.uint32(_W1_ADD)) | jnp.uint32(1)
    h1 = jnp.sum(bits * w1, dtype=jnp.uint32)
    mixed = (bits ^ (bits >> 15)) * jnp.uint32(_MIX_MUL)
    h2 = jnp.sum(mixed ^ (index * jnp.uint32(_W2_MUL)), dtype=jnp.uint32)
    return jnp.stack([h1, h2])


@functools.lru_cache(maxsize=16)
def _digest_fn(mesh: jax.sharding.Mesh):
    replicated = NamedSharding(mesh, PartitionSpec())

    def digests(leaves: list[jax.Array]) -> jax.Array:
        return jnp.stack([_leaf_digest(x) for x in leaves])

    return jax.jit(digests, out_shardings=replicated)


def tree_digests(tree: Any) -> dict[str, str]:
    """Digest of every leaf of a tree of (possibly sharded) jax.Arrays, by leaf path.

    A collective over the arrays' mesh: every process holding part of the tree must call it.
    """
    paths = leaf_paths(tree)
    leaves = jax.tree.leaves(tree)
    values = np.asarray(_digest_fn(_mesh_of(leaves))(leaves))
    return {p: format_digest(h1, h2) for p, (h1, h2) in zip(paths, values, strict=True)}


def _mesh_of(leaves: list[jax.Array]) -> jax.sharding.Mesh:
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    devices = np.asarray(jax.devices()[:1])
    return jax.sharding.Mesh(devices, ("x",))


# ------------------------------------------------------------------------------- host version


def _host_bits_u32(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        return x.astype(np.uint32)
    width = x.dtype.itemsize
    if width == 4:
        return x.view(np.uint32)
    if width == 2:
        return x.view(np.uint16).astype(np.uint32)
    if width == 1:
        return x.view(np.uint8).astype(np.uint32)
    if width == 8:
        return x.view(np.uint32).reshape((*x.shape, 2))
    raise ValueError(f"no checksum for dtype {x.dtype}")


def host_digest(x: np.ndarray) -> str:
    """The digest of one whole array held on the host; equal to the device digest."""
    x = np.asarray(x)
    return format_digest(*host_partial_sums(x, (0,) * x.ndim, x.shape))


# Elements summed at a time: a block's uint32 temporaries (256 KB each) stay in the core's cache
# and are reused from one block to the next. Temporaries the size of a whole shard are fresh
# memory every save: on a 2-core host that made the digest run at 0.1-0.4 GB/s (2.5-2.6 GB/s in
# blocks of this size; 1 MB blocks ran at 0.5 GB/s, allocated and released each time), and 10x
# slower at 2.4 GB of state than at 0.9 GB once the host was short of memory.
_BLOCK_ELEMENTS = 1 << 16


def host_partial_sums(x: np.ndarray, start: tuple[int, ...], shape: tuple[int, ...]) -> list[int]:
    """The two sums of the digest restricted to the elements `x` holds of a global array of
    `shape`, `x` being its block starting at index `start`. Sums of disjoint blocks add up
    (modulo 2**32, `combine_sums`) to the sums of the whole array."""
    total = [0, 0]
    for block, block_start in _blocks(np.asarray(x), tuple(start)):
        sums = _block_sums(block, block_start, shape)
        total = [(a + b) & 0xFFFFFFFF for a, b in zip(total, sums, strict=True)]
    return total


def _blocks(
    x: np.ndarray, start: tuple[int, ...], axis: int = 0
) -> Iterator[tuple[np.ndarray, tuple[int, ...]]]:
    """`x` cut into blocks of at most about `_BLOCK_ELEMENTS` elements along its leading axes,
    with each block's start index in the global array."""
    if x.size <= _BLOCK_ELEMENTS or axis >= x.ndim:
        yield x, start
        return
    per_index = x.size // x.shape[axis]  # the axes before `axis` have extent 1 here
    step = max(1, _BLOCK_ELEMENTS // per_index)
    for i in range(0, x.shape[axis], step):
        block = x[(slice(None),) * axis + (slice(i, i + step),)]
        block_start = (*start[:axis], start[axis] + i, *start[axis + 1 :])
        if block.size > _BLOCK_ELEMENTS:  # one index along `axis` is still too large
            yield from _blocks(block, block_start, axis + 1)
        else:
            yield block, block_start


def _block_sums(x: np.ndarray, start: tuple[int, ...], shape: tuple[int, ...]) -> list[int]:
    bits = _host_bits_u32(x)
    if bits.ndim > len(shape):  # 64-bit elements: a trailing axis of two words
        start, shape = (*start, 0), (*shape, 2)
    index = np.zeros(bits.shape, np.uint32)
    stride = 1
    with np.errstate(over="ignore"):
        for axis in reversed(range(bits.ndim)):
            positions = np.arange(start[axis], start[axis] + bits.shape[axis], dtype=np.uint64)
            along = [1] * bits.ndim
            along[axis] = bits.shape[axis]
            index += (positions.astype(np.uint32) * np.uint32(stride & 0xFFFFFFFF)).reshape(along)
            stride *= shape[axis]
        w1 = (index * np.uint32(_W1_MUL) + np.uint32(_W1_ADD)) | np.uint32(1)
        h1 = np.sum(bits * w1, dtype=np.uint32)
        mixed = (bits ^ (bits >> np.uint32(15))) * np.uint32(_MIX_MUL)
        h2 = np.sum(mixed ^ (index * np.uint32(_W2_MUL)), dtype=np.uint32)
    return [int(h1), int(h2)]


def process_partial_sums(tree: Any) -> dict[str, list[int]]:
    """This process's share of every leaf's digest sums, by leaf path, computed on the host.

    Each distinct block of a leaf counts once across all processes: the one copy with replica id
    0, wherever it lives. Gathering every process's result and adding them (`combine_sums`)
    gives `tree_digests(tree)`, without a device pass or a device collective."""
    out: dict[str, list[int]] = {}
    for path, leaf in zip(leaf_paths(tree), jax.tree.leaves(tree), strict=True):
        total = [0, 0]
        for shard in leaf.addressable_shards:
            if shard.replica_id != 0:
                continue
            start = tuple(s.indices(n)[0] for s, n in zip(shard.index, leaf.shape, strict=True))
            sums = host_partial_sums(np.asarray(shard.data), start, leaf.shape)
            total = [(a + b) & 0xFFFFFFFF for a, b in zip(total, sums, strict=True)]
        out[path] = total
    return out


def combine_sums(shares: list[dict[str, list[int]]]) -> dict[str, str]:
    """The digests of a tree from every process's `process_partial_sums`."""
    out: dict[str, str] = {}
    for path in shares[0]:
        h1 = sum(share[path][0] for share in shares) & 0xFFFFFFFF
        h2 = sum(share[path][1] for share in shares) & 0xFFFFFFFF
        out[path] = format_digest(h1, h2)
    return out
