"""The local tier's byte path (checkpoint/local.py, assembly.py, piece_io.py): a commit overwrites
the data file of the step it dropped, restore reads pieces straight into the arrays it assembles,
under the saving layout and under others, and every piece is still CRC-checked."""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from resilient_jax.checkpoint import assembly, checksum, manifest, piece_io
from resilient_jax.checkpoint.errors import InvalidCheckpoint
from resilient_jax.checkpoint.local import DATA_FILE, LocalTier, list_committed, run_dir
from resilient_jax.contracts.local_tier import TMP_PREFIX

IDS = {"fingerprint": "f", "run_id": "r"}


def _state(mesh: Mesh, seed: int, rows: int = 64) -> dict[str, jax.Array]:
    """Leaves sharded along the first axis, along the last, and replicated; three dtypes."""
    key = jax.random.key(seed)
    layouts = {
        "rows": ((rows, 24), jnp.float32, PartitionSpec("x")),
        "cols": ((6, 32), jnp.bfloat16, PartitionSpec(None, "x")),
        "whole": ((5, 3), jnp.int32, PartitionSpec()),
    }
    out = {}
    for i, (name, (shape, dtype, spec)) in enumerate(layouts.items()):
        value = jax.random.normal(jax.random.fold_in(key, i), shape) * 100
        out[name] = jax.device_put(value.astype(dtype), NamedSharding(mesh, spec))
    return out


def _abstract(state: dict[str, jax.Array], mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, v.sharding.spec))
        for k, v in state.items()
    }


def _save(tier: LocalTier, step: int, state) -> None:
    tier.save(step, state, {**IDS, "leaves": manifest.leaf_specs(state)})
    tier.finish()


def _restore(tier: LocalTier, step: int, abstract):
    found, unusable = tier.scan(IDS["fingerprint"], IDS["run_id"])
    assert step in found, unusable
    return tier.restore(found[step], abstract, manifest.leaf_specs(abstract))


def _assert_bitwise(restored, state) -> None:
    for name in state:
        assert restored[name].sharding.spec == state[name].sharding.spec
        got = np.asarray(jax.device_get(restored[name]))
        want = np.asarray(jax.device_get(state[name]))
        assert got.dtype == want.dtype
        assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), name


@pytest.fixture
def tier_root():
    root = f"/dev/shm/rj-io-{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_commit_overwrites_the_dropped_steps_file_and_restores_bitwise(tier_root, tmp_path):
    mesh = Mesh(np.array(jax.devices()), ("x",))
    root = run_dir(tier_root, str(tmp_path))
    tier = LocalTier(root, 0, keep=2)
    big, small = _state(mesh, 1, rows=128), _state(mesh, 2, rows=64)
    try:
        for step, state in ((1, big), (2, big), (3, small), (4, small)):
            _save(tier, step, state)
        own = os.listdir(tier.own_dir)
        spares = [n for n in own if n.startswith(f"{TMP_PREFIX}spare-")]
        assert len(spares) == 1, own
        assert sorted(c.step for c in list_committed(root)) == [3, 4]
        # Step 3 went into step 1's (larger) file: cut to its own length, every byte its own.
        (newest,) = [c for c in list_committed(root) if c.step == 3]
        data = os.path.join(newest.dir, DATA_FILE)
        assert os.path.getsize(data) == newest.files.manifest["bytes"]
        _assert_bitwise(_restore(tier, 3, _abstract(small, mesh)), small)
        _assert_bitwise(_restore(tier, 4, _abstract(small, mesh)), small)
        # A recycled file is checked like any other: one flipped byte fails its piece's CRC.
        with open(data, "r+b") as f:
            f.seek(7)
            byte = f.read(1)
            f.seek(7)
            f.write(bytes([byte[0] ^ 0x40]))
        with pytest.raises(InvalidCheckpoint, match="CRC mismatch"):
            _restore(tier, 3, _abstract(small, mesh))
        # A restore clears temp dirs (no writer runs then): the spare goes; saves go on.
        tier.drop_after(4)
        assert not [n for n in os.listdir(tier.own_dir) if n.startswith(TMP_PREFIX)]
        _save(tier, 5, big)
        _assert_bitwise(_restore(tier, 5, _abstract(big, mesh)), big)
    finally:
        tier.close()


@pytest.mark.parametrize("devices", [4, 2, 1])
def test_a_smaller_mesh_assembles_the_same_bits(tier_root, tmp_path, devices):
    """Regions of several pieces: read in place where the pieces lie in them back to back
    (sharded along the first axis), through a buffer where not (along the last)."""
    mesh = Mesh(np.array(jax.devices()), ("x",))
    state = _state(mesh, 3)
    tier = LocalTier(run_dir(tier_root, str(tmp_path)), 0, keep=2)
    try:
        _save(tier, 1, state)
        smaller = Mesh(np.array(jax.devices()[:devices]), ("x",))
        restored = _restore(tier, 1, _abstract(state, smaller))
        for name in state:
            assert restored[name].sharding.mesh == smaller
        _assert_bitwise(restored, state)
    finally:
        tier.close()


def test_span_is_where_a_part_lies_back_to_back():
    """`_span` against the flat positions numpy gives, over every sub-box of a 3-d region."""
    region = ((2, 5), (0, 4), (1, 3))
    extents = [hi - lo for lo, hi in region]
    flat = np.arange(int(np.prod(extents))).reshape(extents)
    ranges = [[(a, b) for a in range(lo, hi) for b in range(a + 1, hi + 1)] for lo, hi in region]
    checked = 0
    for part in itertools.product(*ranges):
        span = assembly._span(part, region)
        inside = flat[assembly._relative(part, region)].reshape(-1)
        contiguous = bool(np.all(np.diff(inside) == 1))
        if span is None:
            assert not contiguous, part
        else:
            assert contiguous, part
            assert (span[0], span[1]) == (int(inside[0]), inside.size), part
            checked += 1
    assert checked > 10


def test_crc32_is_zlibs_and_aligned_buffers_are_aligned():
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    for view in (data, memoryview(data)[3:], b"", bytes(data[:17])):
        assert checksum.crc32(view) == zlib.crc32(view)
    for shape, dtype in (((3, 5), np.float32), ((), jnp.bfloat16), ((0, 4), np.int8)):
        array = piece_io.aligned_empty(shape, dtype)
        assert array.shape == shape and array.dtype == np.dtype(dtype)
        assert array.ctypes.data % piece_io.ALIGN == 0 and array.flags.c_contiguous
