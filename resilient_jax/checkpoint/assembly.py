"""Assembling a restored state from local-tier pieces: which pieces tile each region a device
needs (whoever wrote them, under whatever mesh), reading them back with their CRC-32 checked, and
placing the result on the devices.

A piece is one shard's raw C-order bytes in some process's data file (`local`'s layout); a region
is an index box of one leaf that this process's devices hold under the restoring sharding. Reads
land straight in the region's array where the piece lies in it back to back (`piece_io`), on a few
threads, in 64-byte aligned buffers that a CPU device takes without a copy.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from resilient_jax.checkpoint import piece_io
from resilient_jax.checkpoint.checksum import crc32, leaf_paths
from resilient_jax.checkpoint.errors import InvalidCheckpoint
from resilient_jax.contracts.local_tier import DATA_FILE

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension

_PLACE_BYTES = 1 << 30  # a restore reads at most this much host memory ahead of placing it


def box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape, strict=True))


def size_of(box: Box) -> int:
    return int(np.prod([b - a for a, b in box], dtype=np.int64)) if box else 1


def _relative(part: Box, within: Box) -> tuple[slice, ...]:
    """Slices selecting `part` out of an array that holds the box `within`."""
    return tuple(slice(p0 - w0, p1 - w0) for (p0, p1), (w0, _) in zip(part, within, strict=True))


def _span(part: Box, region: Box) -> tuple[int, int] | None:
    """(first element, element count) of `part` in the C-order array holding `region`, if its
    elements lie there back to back (in their own C order), else None."""
    sizes = [hi - lo for lo, hi in part]
    extents = [hi - lo for lo, hi in region]
    axis = len(part) - 1
    while axis >= 0 and sizes[axis] == extents[axis]:
        axis -= 1  # trailing axes the part spans whole
    if any(n != 1 for n in sizes[: max(axis, 0)]):
        return None
    start = 0
    for (p0, _), (r0, _), extent in zip(part, region, extents, strict=True):
        start = start * extent + (p0 - r0)
    return start, size_of(part)


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


@dataclasses.dataclass(frozen=True)
class Piece:
    path: str  # the data file
    offset: int
    nbytes: int
    crc32: int
    box: Box


@dataclasses.dataclass
class StepFiles:
    """One process's committed copy of one step, as its manifest describes it. `data`: its data
    file's bytes held in memory, every piece's CRC-32 checked already (a copy fetched from peers,
    read from there while it is written to `dir` in the background); None: read from `dir`."""

    dir: str
    manifest: dict[str, Any]
    data: memoryview | None = None

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def timeline(self) -> str:
        """The timeline that wrote it: copies of one step assemble only within one timeline."""
        return str(self.manifest.get("timeline", ""))

    def pieces(self, leaf: str) -> list[Piece]:
        path = os.path.join(self.dir, DATA_FILE)
        return [
            Piece(path, p["offset"], p["nbytes"], p["crc32"], tuple(map(tuple, p["box"])))
            for p in self.manifest["pieces"]
            if p["leaf"] == leaf
        ]


class Assembly:
    """The pieces of one step available to this process, grouped by leaf and index box."""

    def __init__(self, copies: list[StepFiles], wanted: dict[str, dict[str, Any]]) -> None:
        self.copies = copies
        self.groups: dict[str, dict[Box, list[Piece]]] = {}
        for leaf in wanted:
            by_box: dict[Box, list[Piece]] = {}
            for copy in copies:
                spec = copy.manifest["leaves"].get(leaf)
                if spec != wanted[leaf]:
                    continue
                for piece in copy.pieces(leaf):
                    by_box.setdefault(piece.box, []).append(piece)
            self.groups[leaf] = by_box
        self._verified: dict[Piece, bool] = {}
        self._in_memory = {
            os.path.join(copy.dir, DATA_FILE): copy.data for copy in copies if copy.data is not None
        }

    def plan(self, leaf: str, region: Box) -> list[tuple[Box, list[Piece]]] | None:
        """Disjoint boxes (with their copies) tiling `region`; None if something is missing."""
        chosen: list[tuple[Box, list[Piece]]] = []
        covered = 0
        for box, copies in sorted(self.groups.get(leaf, {}).items()):
            part = _intersect(box, region) if region else ()
            if part is None:
                continue
            if any(_intersect(part, other) is not None for other, _ in chosen if part):
                continue  # a copy written under another layout; the tiling uses disjoint boxes
            chosen.append((part, copies))
            covered += size_of(part)
            if not region:
                break
        return chosen if covered == size_of(region) else None

    def read(self, leaf: str, region: Box, dtype: np.dtype) -> np.ndarray:
        """The leaf's `region`, in a 64-byte aligned array (placed on a CPU device as it is)."""
        plan = self.plan(leaf, region)
        if plan is None:
            raise InvalidCheckpoint(f"{leaf}: no complete set of pieces for {region}")
        out = piece_io.aligned_empty([b - a for a, b in region], dtype)
        for part, copies in plan:
            self._fill(leaf, out, region, part, copies)
        return out

    def _fill(
        self, leaf: str, out: np.ndarray, region: Box, part: Box, copies: list[Piece]
    ) -> None:
        """Writes `part` into `out` (which holds `region`) from the first copy that reads back
        intact: straight into `out` where the piece is the part and lies in it back to back
        (the same layout, or a mesh that splits fewer ways), else through a buffer."""
        span = _span(part, region)
        problems = []
        for piece in copies:
            memory = self._in_memory.get(piece.path)
            try:
                if span is not None and piece.box == part:
                    first, count = span
                    size = out.dtype.itemsize
                    into = piece_io.as_bytes(out)[first * size : (first + count) * size]
                    _read_piece(piece, into, self._verified, memory)
                else:
                    whole = piece_io.aligned_empty([b - a for a, b in piece.box], out.dtype)
                    _read_piece(piece, piece_io.as_bytes(whole), self._verified, memory)
                    out[_relative(part, region)] = whole[_relative(part, piece.box)]
                return
            except InvalidCheckpoint as e:
                problems.append(str(e))
        raise InvalidCheckpoint(f"{leaf}: every copy is bad ({'; '.join(problems)})")


def _read_piece(
    piece: Piece, into: memoryview, verified: dict[Piece, bool], memory: memoryview | None = None
) -> None:
    """Reads a piece into `into` and checks its CRC-32 (once per piece: `verified`); from
    `memory`, its data file's bytes already checked, where given."""
    if piece.nbytes != len(into):
        raise InvalidCheckpoint(
            f"{piece.path}: {piece.nbytes} bytes at offset {piece.offset} for a box of {len(into)}"
        )
    if verified.get(piece) is False:
        raise InvalidCheckpoint(f"{piece.path} CRC mismatch at offset {piece.offset}")
    if memory is not None:
        if piece.offset + piece.nbytes > len(memory):
            raise InvalidCheckpoint(f"{piece.path} truncated at offset {piece.offset}")
        source = np.frombuffer(memory, np.uint8, piece.nbytes, piece.offset)
        np.copyto(np.frombuffer(into, np.uint8), source)  # numpy copies without the GIL
        return
    try:
        fd = os.open(piece.path, os.O_RDONLY)
        try:
            got = piece_io.read_into(fd, into, piece.offset)
        finally:
            os.close(fd)
    except OSError as e:
        raise InvalidCheckpoint(f"{piece.path}: {e.strerror or e}") from e
    if got != piece.nbytes:
        raise InvalidCheckpoint(f"{piece.path} truncated at offset {piece.offset}")
    if piece not in verified:
        verified[piece] = crc32(into) == piece.crc32
    if not verified[piece]:
        raise InvalidCheckpoint(f"{piece.path} CRC mismatch at offset {piece.offset}")


def _read_and_place(assembly: Assembly, leaves: list[tuple[str, Any]]) -> list[jax.Array]:
    """The arrays of `leaves` (path, abstract array) on their shardings, read from `assembly`."""
    jobs = [(leaf, region, target) for leaf, target in leaves for region in needed_regions(target)]
    read = piece_io.parallel_map(
        lambda job: assembly.read(job[0], job[1], jnp.dtype(job[2].dtype)), jobs
    )
    host = {(leaf, region): array for (leaf, region, _), array in zip(jobs, read, strict=True)}
    return [
        jax.make_array_from_callback(
            target.shape,
            target.sharding,
            lambda index, leaf=leaf, shape=target.shape: host[(leaf, box_of(index, shape))],
        )
        for leaf, target in leaves
    ]


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
    return list(zip(leaf_paths(tree), jax.tree.leaves(tree), strict=True))


def needed_regions(target: Any) -> list[Box]:
    """The index boxes of `target` that this process's devices hold (each once)."""
    shape = tuple(target.shape)
    indices = target.sharding.addressable_devices_indices_map(shape).values()
    return sorted({box_of(index, shape) for index in indices})


def restore_leaves(assembly: Assembly, leaves: list[tuple[str, Any]]) -> list[jax.Array]:
    """The arrays of `leaves` (path, abstract array) on their shardings. Leaves go in groups of
    about `_PLACE_BYTES`: a group's regions are read on several threads, then placed on the
    devices (on a GPU that frees the host copies group by group)."""
    arrays: list[jax.Array] = []
    group: list[tuple[str, Any]] = []
    group_bytes = 0
    for i, (leaf, target) in enumerate(leaves):
        group.append((leaf, target))
        group_bytes += int(np.prod(target.shape, dtype=np.int64)) * target.dtype.itemsize
        if group_bytes >= _PLACE_BYTES or i == len(leaves) - 1:
            arrays += _read_and_place(assembly, group)
            group, group_bytes = [], 0
    return arrays
