"""Batches are a pure function of (dataset, seed, batch index, global batch), for any process
count or mesh, for one dataset or a mixture (more mixture tests in test_mixture.py); sources and
the ArrayRecord converter."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from conftest import free_port, tiny_config

from resilient_jax import mesh, topology
from resilient_jax.data import BatchLoader, make_source
from resilient_jax.data.position import DataPosition


def loader_for(config, num_devices, next_batch=0):
    topo = mesh.discover(jax.devices()[:num_devices])
    plan = topology.plan_mesh(config, topo)
    start = DataPosition(next_batch)
    return BatchLoader(config, mesh.make_mesh(plan, topo), plan, make_source(config), start)


def global_rows(loader, steps):
    out = []
    for _ in range(steps):
        index, batch = loader.next()
        out.append((index, np.asarray(batch).reshape(-1, batch.shape[-1])))
    return out


def test_same_rows_for_any_mesh_and_start():
    config = tiny_config(per_device_batch_size=1)
    eight = global_rows(loader_for(config, 8), 4)
    two = global_rows(loader_for(config, 2), 4)
    resumed = global_rows(loader_for(config, 4, next_batch=2), 2)
    for (i, a), (j, b) in zip(eight, two, strict=True):
        assert i == j and np.array_equal(a, b)
    assert [i for i, _ in resumed] == [2, 3]
    assert np.array_equal(resumed[0][1], eight[2][1])
    assert not np.array_equal(eight[0][1], eight[1][1])


class IndexSource:
    """Example i is the sequence [i, i, ...]: batches then show which examples they hold."""

    def __init__(self, n: int, seq_len: int) -> None:
        self.n, self.seq_len = n, seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.seq_len + 1, i % self.n, dtype=np.int32)


def test_epochs_are_seeded_permutations_each_with_its_own_order():
    config = tiny_config(global_batch_size=8)
    topo = mesh.discover(jax.devices()[:8])
    plan = topology.plan_mesh(config, topo)
    loader = BatchLoader(config, mesh.make_mesh(plan, topo), plan, IndexSource(64, 32))
    seen = [np.asarray(loader.next()[1])[..., 0].ravel() for _ in range(16)]
    epoch0, epoch1 = np.concatenate(seen[:8]), np.concatenate(seen[8:])
    assert sorted(epoch0) == sorted(epoch1) == list(range(64))
    assert not np.array_equal(epoch0, epoch1)
    assert not np.array_equal(epoch0, np.arange(64))
    other_seed = BatchLoader(
        tiny_config(global_batch_size=8, seed=1), loader._sharding.mesh, plan, IndexSource(64, 32)
    )
    assert not np.array_equal(np.asarray(other_seed.next()[1])[..., 0].ravel(), seen[0])


def test_skip_windows_are_never_used():
    config = tiny_config()
    loader = loader_for(config, 8)
    loader.seek(DataPosition.from_json({"next_batch": 1, "skips": [[2, 5]]}))
    assert [loader.next()[0] for _ in range(3)] == [1, 5, 6]
    assert loader.position == DataPosition(next_batch=7, skips=((2, 5),))
    assert loader.position.to_json() == {"next_batch": 7, "skips": [[2, 5]]}


def test_data_position_json_is_the_saved_form():
    start = DataPosition.from_json(None)
    assert start == DataPosition.from_json({}) == DataPosition()
    assert start.to_json() == {"next_batch": 0, "skips": []}
    later = DataPosition(next_batch=9).skipping(30, 34).skipping(3, 5).skipping(30, 34)
    assert later.skips == ((3, 5), (30, 34))  # sorted, each window once
    assert later.to_json() == {"next_batch": 9, "skips": [[3, 5], [30, 34]]}
    assert DataPosition.from_json(later.to_json()) == later


def test_arrayrecord_files_read_as_the_windows_they_hold(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    config = tiny_config(**{"data.seq_len": 32})
    from_text = make_source(config)
    out = str(tmp_path / "tokens.array_record")
    writer = ArrayRecordWriter(out, "group_size:1")
    for i in range(len(from_text)):
        writer.write(from_text[i].astype("<i4").tobytes())
    writer.close()
    records = {"data.source": "arrayrecord", "data.path": out}
    from_records = make_source(tiny_config(**records, **{"data.seq_len": 32}))
    assert len(from_text) == len(from_records) > 10
    for i in range(0, len(from_text), 7):
        assert np.array_equal(from_text[i], from_records[i])
    with pytest.raises(ValueError, match="holds sequences of 33 tokens"):
        make_source(tiny_config(**records, **{"data.seq_len": 16}))


def two_text_datasets(tmp_path) -> dict[str, str]:
    """Config overrides: a 0.7/0.3 mixture of the bundled corpus and a small text dataset."""
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.txt").write_text("Sphinx of black quartz, judge my vow! " * 60)
    return {"data.mixture": f":0.7,{small}:0.3"}


@pytest.mark.parametrize("num_processes", [2, 4])
def test_global_batch_identical_across_process_counts(tmp_path, num_processes):
    """Real JAX processes (gloo) each load only their rows; the batches match one process's, for
    one dataset and for a mixture (both loaded by the same processes)."""
    override_sets = [{}, two_text_datasets(tmp_path)]
    port = free_port()
    procs = []
    for pid in range(num_processes):
        devices = 8 // num_processes
        procs.append(_spawn_dump(tmp_path, port, pid, num_processes, devices, override_sets))
    for p in procs:
        try:
            p.wait(timeout=180)
        except Exception:
            for q in procs:
                q.kill()
            raise
    assert [p.returncode for p in procs] == [0] * num_processes
    for i, overrides in enumerate(override_sets):
        config = tiny_config(per_device_batch_size=1, **overrides)
        expected = global_rows(loader_for(config, 8), 3)
        got = np.load(tmp_path / f"batches_{i}.npy")
        local_rows = [np.load(tmp_path / f"rows_{i}_{pid}.npy") for pid in range(num_processes)]
        for step, (_, rows) in enumerate(expected):
            assert np.array_equal(got[step], rows), (overrides, step)
        # Each process read only its own rows: together they are the batch, none read twice.
        assert sum(len(r) for r in local_rows) == config.global_batch_size


def _spawn_dump(tmp_path, port, pid, num_processes, devices, override_sets):
    import subprocess
    import sys

    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
    }
    script = os.path.join(os.path.dirname(__file__), "helpers", "dump_batches.py")
    return subprocess.Popen(
        [
            sys.executable,
            script,
            *map(str, (port, pid, num_processes, tmp_path)),
            json.dumps(override_sets),
        ],
        env=env,
        stdout=open(tmp_path / f"log_{pid}.txt", "w"),
        stderr=subprocess.STDOUT,
    )
