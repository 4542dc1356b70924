"""The executable cache's key is built without tracing, and changes whenever the program would."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types

import jax
import ml_collections
import numpy as np
import pytest
from conftest import REPO, run_context, tiny_config

from resilient_jax import executables
from resilient_jax.contracts.event_types import EventType
from resilient_jax.events import read_events
from resilient_jax.train import compile as compile_lib


@pytest.fixture
def ctx(tmp_path):
    return run_context(tiny_config(), str(tmp_path), devices=2)


def _key(ctx, config=None, mesh=None, program="train", plan=None):
    plan = plan or ctx.plan.describe()
    return executables.program_key(program, config or ctx.config, mesh or ctx.mesh, plan)


def test_same_inputs_give_the_same_key(ctx):
    assert _key(ctx) == _key(ctx, config=ctx.config.copy_and_resolve_references())
    assert _key(ctx).endswith(f"-p{jax.process_index()}")


@pytest.mark.parametrize(
    "key, value",
    [
        ("model.d_model", 32),
        ("optimizer.learning_rate", 1e-4),
        ("total_steps", 21),  # the schedule spans total_steps
        ("global_batch_size", 32),
        ("health.zscore", 7.0),  # the in-band anomaly verdict is compiled into the step
    ],
)
def test_any_config_change_changes_the_key(ctx, key, value):
    config = ctx.config.copy_and_resolve_references()
    config.update_from_flattened_dict({key: value})
    assert _key(ctx, config=config) != _key(ctx)


def _changed(value):
    """Another value of the same kind (None stays None: nothing to vary)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value * 3 + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, tuple | list):
        return (*value, *value)
    return value


def _host_only_changed(config):
    """`config` with every leaf of `executables.HOST_ONLY_KEYS` changed."""
    changed = config.copy_and_resolve_references()
    for dotted in executables.HOST_ONLY_KEYS:
        node = changed
        for name in dotted.split("."):
            node = node[name]
        if isinstance(node, ml_collections.ConfigDict):
            leaves = [f"{dotted}.{k}" for k in node.to_dict() if not isinstance(node[k], dict)]
        else:
            leaves = [dotted]
        with changed.unlocked():
            for leaf in leaves:
                *parents, name = leaf.split(".")
                owner = changed
                for parent in parents:
                    owner = owner[parent]
                owner[name] = _changed(owner[name])
    return changed


def test_keys_only_the_host_reads_leave_the_key_and_the_programs_alone(ctx):
    """Where and when to save, log and evaluate, and the control plane's settings, are left out of
    the key (a restart that changes them keeps its executables), and changing them all changes
    neither the train step, the eval step nor elastic mode's update as lowered: none of them
    reaches a program."""
    from resilient_jax.elastic import slice_step as elastic_step
    from resilient_jax.train.state import abstract_state

    changed = _host_only_changed(ctx.config)
    assert changed.checkpoint.every_steps != ctx.config.checkpoint.every_steps
    assert changed.coordinator.heartbeat_timeout_s != ctx.config.coordinator.heartbeat_timeout_s
    assert _key(ctx, config=changed) == _key(ctx)
    assert _key(ctx, config=changed, program="eval") == _key(ctx, program="eval")

    def programs(config):
        on_config = dataclasses.replace(
            ctx, config=config, abstract_state=abstract_state(config, ctx.mesh)
        )
        lowerings = [
            compile_lib.train_lowering(on_config, donate=False),
            compile_lib.eval_lowering(on_config),
            elastic_step.apply_lowering(on_config),  # elastic mode's half of the step
        ]
        return [lower().as_text() for lower in lowerings]

    assert programs(changed) == programs(ctx.config)


def test_mesh_program_and_place_change_the_key(ctx, tmp_path, monkeypatch):
    wider = run_context(tiny_config(), str(tmp_path), devices=4)
    assert _key(ctx, mesh=wider.mesh) != _key(ctx)
    other_devices = jax.sharding.Mesh(
        np.array(jax.devices()[2:4]).reshape(ctx.mesh.devices.shape), ctx.mesh.axis_names
    )
    assert _key(ctx, mesh=other_devices) != _key(ctx)  # same shape, other devices
    assert _key(ctx, program="eval") != _key(ctx)
    more_microbatches = {**ctx.plan.describe(), "microbatches": ctx.plan.microbatches + 1}
    assert _key(ctx, plan=more_microbatches) != _key(ctx)
    base = _key(ctx)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert _key(ctx) != base


def _other_device_kind(real):
    fake = types.SimpleNamespace(client=real[0].client, device_kind="other", id=0)
    return lambda *args: [fake, *real[1:]]


RUNTIME_CHANGES = {
    "jax version": lambda m: m.setattr(jax, "__version__", "0.0.1"),
    "jaxlib version": lambda m: m.setattr(executables.jaxlib, "__version__", "0.0.1"),
    "code": lambda m: m.setattr(executables, "code_version", lambda: "edited"),
    "XLA flags": lambda m: m.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true"),
    "device kind": lambda m: m.setattr(jax, "devices", _other_device_kind(jax.devices())),
}


@pytest.mark.parametrize("change", sorted(RUNTIME_CHANGES))
def test_versions_backend_and_flags_change_the_key(ctx, monkeypatch, change):
    base = _key(ctx)
    RUNTIME_CHANGES[change](monkeypatch)
    assert _key(ctx) != base


@pytest.fixture
def jax_flag():
    """Sets a JAX configuration flag for one test, restoring it afterwards."""
    saved = {}

    def set_flag(name, value):
        saved.setdefault(name, jax.config.values[name])
        jax.config.update(name, value)

    yield set_flag
    for name, value in saved.items():
        jax.config.update(name, value)


def test_a_jax_flag_changes_the_key(ctx, jax_flag):
    base = _key(ctx)
    jax_flag("jax_default_matmul_precision", "highest")
    assert _key(ctx) != base


def test_where_the_cache_lives_is_not_in_the_key(ctx, jax_flag):
    base = _key(ctx)
    jax_flag("jax_compilation_cache_dir", "/elsewhere")
    assert jax.config.values["jax_compilation_cache_dir"] == "/elsewhere"
    assert _key(ctx) == base


def test_code_version_follows_every_source_file(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not code\n")
    monkeypatch.setattr(executables, "_PACKAGE_DIR", str(tmp_path))
    version = executables.code_version.__wrapped__
    before = version()
    (tmp_path / "notes.txt").write_text("edited, still not code\n")
    assert version() == before
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert version() != before


def test_a_hit_loads_without_tracing_and_steps_bitwise_alike(ctx, tmp_path, monkeypatch):
    from resilient_jax.train import compile as compile_lib
    from resilient_jax.train.state import init_state

    directory = str(tmp_path / "executables")
    fresh = compile_lib.compile_step(ctx, cache_dir=directory)

    def no_tracing(*args, **kwargs):
        raise AssertionError("a cache hit must not build or trace the step")

    monkeypatch.setattr(compile_lib, "make_train_step", no_tracing)
    loaded = compile_lib.compile_step(ctx, cache_dir=directory)
    caches = [e["cache"] for e in read_events(ctx.workdir) if e["type"] == EventType.COMPILE]
    assert caches == ["miss", "hit"]
    state = init_state(ctx.config, ctx.mesh)
    rows = ctx.config.global_batch_size // ctx.plan.microbatches
    shape = (ctx.plan.microbatches, rows, ctx.config.data.seq_len + 1)
    batch = jax.device_put(
        np.arange(np.prod(shape), dtype=np.int32).reshape(shape) % 256,
        compile_lib.mesh_lib.batch_sharding(ctx.mesh),
    )
    scale = np.float32(1.0)
    copy = jax.tree.map(lambda x: x.copy(), state)  # the step donates its state
    a, _ = fresh(state, batch, scale)
    b, _ = loaded(copy, batch, scale)
    same = jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)
    assert all(jax.tree.leaves(same))


def test_init_is_stored_once_for_configs_that_build_the_same_program(ctx, tmp_path, monkeypatch):
    """A fresh state's program is keyed by what it compiles: a config that changes only what
    init does not read (the run's length) loads it; one that changes the model stores another;
    the loaded program gives the compiled one's bits."""
    from resilient_jax.train import state as state_lib

    monkeypatch.setattr(executables, "default_dir", lambda: str(tmp_path))
    entries = lambda: sorted(os.listdir(tmp_path))
    fresh = state_lib._load_or_compile_init(ctx.config, ctx.mesh)
    (entry,) = entries()
    longer = ctx.config.copy_and_resolve_references()
    longer.total_steps += 1
    loaded = state_lib._load_or_compile_init(longer, ctx.mesh)
    assert entries() == [entry]
    wider = ctx.config.copy_and_resolve_references()
    wider.model.d_ff *= 2
    state_lib._load_or_compile_init(wider, ctx.mesh)
    assert len(entries()) == 2
    with jax.set_mesh(ctx.mesh):
        a, b = fresh(), loaded()
    same = jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)
    assert all(jax.tree.leaves(same))


_SVD_PROGRAM = """
import sys
import jax, jax.numpy as jnp, numpy as np
from resilient_jax import executables
directory, key = sys.argv[1], "svd"
f = jax.jit(lambda x: jnp.linalg.svd(x, full_matrices=False)[1])
x = jnp.arange(12.0).reshape(4, 3)
compiled, hit = executables.load_or_compile(
    key, lambda: f.lower(x), jax.devices()[:1], directory
)
print("hit" if hit else "miss", np.asarray(compiled(x)).tolist())
"""


def test_a_loaded_executable_runs_linear_algebra_in_a_process_that_lowered_nothing(tmp_path):
    """On CPU the LAPACK behind an SVD is set up by lowering; a process that only loads its step
    from the cache must still run it (it once died of SIGSEGV at GaLore's first basis refresh)."""
    runs = [
        subprocess.run(
            [sys.executable, "-c", _SVD_PROGRAM, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    first, second = (run.stdout.split(" ", 1) for run in runs)
    assert (first[0], second[0]) == ("miss", "hit")
    assert first[1] == second[1]  # the same singular values


_CACHED_PROGRAM = """
import sys
import jax, jax.numpy as jnp, numpy as np
from resilient_jax import executables
role, directory = sys.argv[1], sys.argv[2]
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
f = jax.jit(lambda x: (x ** 3 * 2.0).sum(axis=0))
x = jnp.arange(12.0).reshape(4, 3)
if role == "jax":  # any process of a job that fills JAX's own cache, as JAX process 0 does
    print("jax", np.asarray(f(x)).tolist())
else:  # a worker: its first compile misses this cache, its restart loads what it stored
    if role == "worker":
        executables.supersede_jax_cache()
    # "shared": a process keeping JAX's cache on for everything else (a test session)
    compiled, hit = executables.load_or_compile("sum", lambda: f.lower(x), jax.devices()[:1],
                                                executables.default_dir())
    assert jax.config.jax_enable_compilation_cache == (role == "shared")
    print("hit" if hit else "miss", np.asarray(compiled(x)).tolist())
"""


@pytest.mark.parametrize("storer", ["worker", "shared"])
def test_an_entry_stored_after_jax_cached_the_program_runs_when_loaded(tmp_path, storer):
    """On CPU an executable JAX took from its own cache serializes without its kernels: a restart
    that loaded such an entry failed ("Function ... not found"), again at every restart. The
    entry is stored by a worker (JAX's cache off) or by a process that keeps JAX's cache on for
    its other programs, which must compile what it stores afresh and then use JAX's cache again."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    outputs = []
    for role in ("jax", storer, "worker"):
        run = subprocess.run(
            [sys.executable, "-c", _CACHED_PROGRAM, role, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
            env=env,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        outputs.append(run.stdout.split(" ", 1))
    assert [tag for tag, _ in outputs] == ["jax", "miss", "hit"]
    assert len({values for _, values in outputs}) == 1  # the same sums everywhere
