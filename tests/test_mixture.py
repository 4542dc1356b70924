"""Weighted mixtures of datasets: the stream keeps the weights' proportions and each dataset's
epochs; its batches are a pure function of (datasets, weights, seed, step, global batch), the same
for any mesh, start or process count (the multi-process check is in test_data.py), and across a
kill and resume; bad mixtures are refused with one line."""

from __future__ import annotations

import json
import signal

import jax
import numpy as np
import pytest
from conftest import as_flags, run_python, tiny_config

from resilient_jax import config as config_lib
from resilient_jax import mesh, topology
from resilient_jax.config import ConfigError
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.data import BatchLoader, make_source
from resilient_jax.data.mixture import Mixture
from resilient_jax.data.position import DataPosition


class TaggedSource:
    """Example i is [offset + i, ...]: a batch shows which dataset and example each row is."""

    def __init__(self, n: int, offset: int, seq_len: int = 32) -> None:
        self.n, self.offset, self.seq_len = n, offset, seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.seq_len + 1, self.offset + i % self.n, dtype=np.int32)


def stream_ids(mixture: Mixture, seed: int, count: int) -> np.ndarray:
    stream = mixture.stream(seed)
    return np.asarray([int(stream[k][0]) for k in range(count)])


def test_stream_keeps_the_proportions_and_every_datasets_epochs():
    mixture = Mixture([(TaggedSource(60, 0), 0.75), (TaggedSource(20, 1000), 0.25)])
    ids = stream_ids(mixture, seed=0, count=800)
    small = ids[ids >= 1000] - 1000
    large = ids[ids < 1000]
    assert abs(len(small) / len(ids) - 0.25) < 0.005
    # Each dataset goes through its own epochs: every block of len(dataset) is a permutation,
    # a new one each epoch (the small one repeats three times as often as the large one).
    for data, n in ((small, 20), (large, 60)):
        epochs = [data[i : i + n] for i in range(0, len(data) - n + 1, n)]
        assert len(epochs) >= 9
        assert all(sorted(e) == list(range(n)) for e in epochs)
        assert len({tuple(e) for e in epochs}) == len(epochs)
    assert np.array_equal(ids, stream_ids(mixture, seed=0, count=800))  # a pure function
    assert not np.array_equal(ids, stream_ids(mixture, seed=1, count=800))
    same_sizes = Mixture([(TaggedSource(20, 0), 1.0), (TaggedSource(20, 1000), 1.0)])
    both = stream_ids(same_sizes, seed=0, count=40)
    assert not np.array_equal(both[both < 1000], both[both >= 1000] - 1000)  # orders independent


def test_stream_reaches_far_indices():
    """A run's later batches index the stream far past any dataset's length."""
    mixture = Mixture([(TaggedSource(7, 0), 2.0), (TaggedSource(3, 100), 1.0)])
    stream = mixture.stream(seed=0)
    far = [int(stream[k][0]) for k in range(10**12, 10**12 + 120)]
    assert sum(i >= 100 for i in far) == 40
    assert set(far) == {*range(7), *range(100, 103)}


@pytest.fixture
def mixture_dirs(tmp_path):
    """Two text datasets of very different sizes."""
    large, small = tmp_path / "large", tmp_path / "small"
    large.mkdir()
    small.mkdir()
    (large / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 400)
    (small / "b.txt").write_text("Sphinx of black quartz, judge my vow! " * 60)
    return f"{large}:0.7,{small}:0.3"


def loader_for(config, num_devices: int, position: DataPosition | None = None) -> BatchLoader:
    topo = mesh.discover(jax.devices()[:num_devices])
    plan = topology.plan_mesh(config, topo)
    return BatchLoader(config, mesh.make_mesh(plan, topo), plan, make_source(config), position)


def read_rows(loader: BatchLoader, steps: int) -> list[tuple[int, np.ndarray]]:
    """(batch index, global rows) of the next `steps` batches; the loader stays open."""
    out = []
    for _ in range(steps):
        index, batch = loader.next()
        out.append((index, np.asarray(batch).reshape(-1, batch.shape[-1])))
    return out


def global_rows(loader: BatchLoader, steps: int) -> list[tuple[int, np.ndarray]]:
    rows = read_rows(loader, steps)
    loader.close()
    return rows


def test_same_rows_for_any_mesh_and_start(mixture_dirs):
    config = tiny_config(per_device_batch_size=1, **{"data.mixture": mixture_dirs})
    assert isinstance(make_source(config), Mixture)
    eight = global_rows(loader_for(config, 8), 4)
    two = global_rows(loader_for(config, 2), 4)
    resumed = global_rows(loader_for(config, 4, DataPosition(next_batch=2)), 2)
    for (i, a), (j, b) in zip(eight, two, strict=True):
        assert i == j and np.array_equal(a, b)
    assert [i for i, _ in resumed] == [2, 3]
    for (_, a), (_, b) in zip(resumed, eight[2:], strict=True):
        assert np.array_equal(a, b)
    assert not np.array_equal(eight[0][1], eight[1][1])
    single = global_rows(loader_for(tiny_config(per_device_batch_size=1), 8), 1)
    assert not np.array_equal(single[0][1], eight[0][1])


def test_position_saved_mid_stream_resumes_on_another_mesh(mixture_dirs):
    """What a checkpoint keeps of the data (the position's JSON, skip windows included) is all a
    resumed mixture needs, on any mesh."""
    config = tiny_config(per_device_batch_size=1, **{"data.mixture": mixture_dirs})
    uninterrupted = global_rows(loader_for(config, 8), 9)
    first = loader_for(config, 8)
    first.seek(DataPosition(next_batch=0).skipping(4, 6))
    before = read_rows(first, 3)
    saved = json.loads(json.dumps(first.position.to_json()))
    first.close()
    after = global_rows(loader_for(config, 2, DataPosition.from_json(saved)), 2)
    assert [i for i, _ in before + after] == [0, 1, 2, 3, 6]
    expected = {i: rows for i, rows in uninterrupted}
    for i, rows in before + after:
        assert np.array_equal(rows, expected[i])


@pytest.mark.parametrize(
    ("mixture", "phrase"),
    [
        ("{a}:0.5,{b}:0", "the weight of"),
        ("{a}:0.5,{b}:-1", "the weight of"),
        ("{a}:0.5,{b}:abc", "the weight of"),
        ("{a}:0.5,{b}", "is not PATH:WEIGHT"),
        ("{a}:0.5,{missing}:0.5", "no such file"),
    ],
)
def test_bad_mixtures_are_refused_by_validate(tmp_path, mixture, phrase):
    (tmp_path / "a.txt").write_text("text a")
    (tmp_path / "b.txt").write_text("text b")
    spec = mixture.format(a=tmp_path / "a.txt", b=tmp_path / "b.txt", missing=tmp_path / "nope")
    with pytest.raises(ConfigError, match=rf"^config\.data\.mixture=.* is invalid: .*{phrase}"):
        config_lib.validate(tiny_config(**{"data.mixture": spec}))


def test_mixture_and_path_or_synthetic_are_refused(tmp_path):
    (tmp_path / "a.txt").write_text("text a")
    spec = f"{tmp_path / 'a.txt'}:1"
    with pytest.raises(ConfigError, match=r"data\.mixture=.*not both"):
        config_lib.validate(tiny_config(**{"data.mixture": spec, "data.path": str(tmp_path)}))
    with pytest.raises(ConfigError, match=r"data\.mixture=.*synthetic"):
        config_lib.validate(tiny_config(**{"data.mixture": spec, "data.source": "synthetic"}))
    config_lib.validate(tiny_config(**{"data.mixture": f":0.5,{spec}"}))  # "" = bundled corpus
    parsed = config_lib.parse_mixture("gs://bucket/a*.rec:2, :1")
    assert parsed == (("gs://bucket/a*.rec", 2.0), ("", 1.0))


def test_training_with_a_zero_weight_exits_2_with_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("text a")
    result = run_python(
        [
            "launch/train.py",
            "--config=configs/tiny_cpu.py",
            f"--workdir={tmp_path / 'run'}",
            f"--config.data.mixture={tmp_path / 'a.txt'}:1,:0",
        ],
        timeout=300,
    )
    assert result.returncode == ExitCode.BAD_INPUT, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: config.data.mixture=") and "the weight of ''" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # three short training runs: two to five minutes on two cores
def test_sigkill_then_resume_is_bitwise_exact_with_a_mixture(tmp_path, launcher, mixture_dirs):
    extra = as_flags({"data.mixture": mixture_dirs})
    total = launcher.total_steps
    straight = tmp_path / "straight"
    assert launcher.finish(launcher.start(straight, devices=4, extra=extra)) == ExitCode.FINISHED
    workdir = tmp_path / "killed"
    proc = launcher.start(workdir, devices=4, extra=extra)
    launcher.wait_for_step(workdir, total // 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert launcher.finish(launcher.start(workdir, devices=4, extra=extra)) == ExitCode.FINISHED
    expected = launcher.plain_orbax_state(straight, total)
    resumed = launcher.plain_orbax_state(workdir, total)
    assert expected.keys() == resumed.keys()
    for key, value in expected.items():
        assert np.array_equal(value, resumed[key]), key
    assert launcher.step_losses(workdir) == launcher.step_losses(straight)
