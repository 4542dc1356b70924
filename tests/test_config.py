"""Invalid configs are refused before any work, with one line naming key, value and rule."""

from __future__ import annotations

import inspect
import re

import jax
import pytest
from conftest import run_python, tiny_config

from resilient_jax import config as config_lib
from resilient_jax import mesh, topology
from resilient_jax.config import ConfigError, validate


def plan(config, num_devices=8):
    return topology.plan_mesh(config, mesh.discover(jax.devices()[:num_devices]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"data.seq_len": 600}, "config.data.seq_len=600 is invalid: must be <= model.max_seq_len"),
        ({"data.source": "web"}, "config.data.source='web' is invalid: allowed: text"),
        ({"data.path": "/no/such/corpus.txt"}, "config.data.path='/no/such/corpus.txt'"),
        ({"model.num_kv_heads": 3}, "config.model.num_kv_heads=3 is invalid"),
        ({"model.compute_dtype": "float16"}, "allowed: float32, bfloat16"),
        ({"total_steps": 0}, "config.total_steps=0 is invalid: must be a positive integer"),
        ({"checkpoint.peer_timeout_s": 0.0}, "config.checkpoint.peer_timeout_s=0.0 is invalid"),
        (
            {"checkpoint.peer_timeout_s": 400.0},
            "checkpoint.peer_timeout_s=400.0 is invalid: must be below checkpoint.sync_timeout_s",
        ),
        (
            {"checkpoint.keep_state": "sometimes"},
            "config.checkpoint.keep_state='sometimes' is invalid: one of auto, always, never",
        ),
        ({"checkpoint.device_memory_gb": -1.0}, "checkpoint.device_memory_gb=-1.0 is invalid"),
    ],
)
def test_invalid_values_rejected(overrides, message):
    with pytest.raises(ConfigError, match=None) as e:
        validate(tiny_config(**overrides))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_key_rejected_by_the_locked_config():
    config = tiny_config()
    with pytest.raises(AttributeError, match=r'Key "widht" does not exist'):
        config.model.widht = 3
    with pytest.raises(KeyError, match=r'Key "widht" does not exist'):
        config.update_from_flattened_dict({"model.widht": 3})


def test_every_key_is_commented_where_it_is_defined():
    lines = inspect.getsource(config_lib.default_config).splitlines()
    uncommented = []
    for i, line in enumerate(lines):
        if not re.match(r"\s+c\.[\w.]+ = (?!ml_collections)", line) or "#" in line:
            continue
        above = lines[i - 1].strip()
        if not above.startswith("#"):
            uncommented.append(line.strip())
    assert not uncommented


def test_mesh_axes_must_multiply_to_device_count():
    with pytest.raises(ConfigError, match=r"axes must multiply to the 8 devices"):
        plan(tiny_config(**{"mesh.fsdp": 3}))


def test_global_batch_must_divide_over_data_parallel_devices():
    with pytest.raises(ConfigError, match=r"global_batch_size=12 is invalid: must be a multiple"):
        plan(tiny_config(global_batch_size=12))


def test_per_device_batch_must_divide_each_devices_rows():
    # 16 rows over 4 devices = 4 rows each, which 3-row microbatches cannot split.
    with pytest.raises(ConfigError, match=r"per_device_batch_size=3 is invalid"):
        plan(tiny_config(per_device_batch_size=3), num_devices=4)


def test_mesh_plan_keeps_global_batch_with_fewer_devices():
    config = tiny_config(per_device_batch_size=2)
    assert [plan(config, n).microbatches for n in (8, 4, 2)] == [1, 2, 4]
    assert all(plan(config, n).rows_per_device == 2 for n in (8, 4, 2))


def test_reshape_plan_adapts_explicit_axes():
    config = tiny_config(**{"mesh.replica": 2, "mesh.fsdp": 4, "per_device_batch_size": 3})
    relaxed = topology.plan_mesh(config, mesh.discover(jax.devices()[:4]), strict=False)
    assert (relaxed.replica * relaxed.fsdp, relaxed.microbatches) == (4, 2)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--config.global_batch_size=12", "config.global_batch_size=12 is invalid"),
        ("--config.modle.d_model=3", "config.modle.d_model is not a known config key"),
        # The unknown key is named, not the valid override given before it.
        ("--config.model.d_model=64 --config.nonsense=1", "config.nonsense is not a known config"),
        ("--config.total_steps=many", "--config.total_steps=many"),
        ("--config.elastic.standby=maybe", "--config.elastic.standby=maybe"),
        ("--config.data.path=/missing.txt", "config.data.path='/missing.txt' is invalid"),
        ("--chaos=bogus:step=1", "invalid --chaos spec 'bogus:step=1': unknown kind 'bogus'"),
    ],
)
def test_launcher_exits_2_with_one_line(tmp_path, flag, message):
    result = run_python(
        ["launch/train.py", "--config=configs/tiny_cpu.py", f"--workdir={tmp_path}", *flag.split()],
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and message in line, result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--config.modle.d_model=3", "config.modle.d_model is not a known config key"),
        ("--config.total_steps=many", "--config.total_steps=many"),
        ("--num_slice=2", "Unknown command line flag 'num_slice'"),
        ("--config=configs/missing.py", "--config=configs/missing.py: cannot load the config"),
    ],
)
def test_local_cluster_exits_2_with_one_line(tmp_path, flag, message):
    # The supervisor's program refuses bad flags like the worker's (absl alone exits 1 with its
    # usage text), before it starts anything.
    config = [] if flag.startswith("--config=") else ["--config=configs/tiny_cpu.py"]
    result = run_python(
        ["launch/local_cluster.py", *config, f"--workdir={tmp_path}", *flag.split()], timeout=120
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and message in line, result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"elastic.slices": 3}, r"elastic.slices=3 is invalid: must divide global_batch_size=16"),
        ({"elastic.timeout_s": 0.0}, r"elastic.timeout_s=0.0 is invalid: must be > 0"),
        ({"elastic.backend": "nccl"}, r"elastic.backend='nccl' is invalid: allowed: gloo"),
        ({"elastic.sync_every_steps": 0}, r"elastic.sync_every_steps=0 is invalid: must be an"),
        ({"elastic.outer_learning_rate": 0.0}, r"elastic.outer_learning_rate=0.0 is invalid"),
        ({"elastic.outer_momentum": 1.0}, r"elastic.outer_momentum=1.0 is invalid: must be in"),
    ],
)
def test_elastic_mode_refuses_what_it_cannot_run(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_lib.validate(tiny_config(**{"elastic.enabled": True, **overrides}))


def test_elastic_mode_takes_a_mixture_of_experts_with_an_expert_axis():
    config_lib.validate(
        tiny_config(
            **{
                "elastic.enabled": True,
                "model.moe.num_experts": 4,
                "mesh.expert": 2,
                "per_device_batch_size": 2,
            }
        )
    )


def test_a_sync_interval_needs_elastic_mode():
    with pytest.raises(ConfigError, match=r"elastic.sync_every_steps=4 is invalid: needs elastic"):
        config_lib.validate(tiny_config(**{"elastic.sync_every_steps": 4}))
