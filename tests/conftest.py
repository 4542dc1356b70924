"""Test set-up: 8 simulated CPU devices in this process, and helpers for subprocess runs."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Test files that run themselves as worker scripts import this module outside pytest, whose
# `pythonpath` setting is what puts the repository root (`configs`) on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest

from configs import small_cpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config) -> None:
    """One compilation cache for the whole test session, so the programs the tests share (the
    SMALL model's init and train step on the same meshes) compile once per session: JAX's
    persistent cache in this process, and, through the inherited environment, the executable
    cache (`resilient_jax.executables`) of every run the tests start, supervised workers
    included (a cache set in the environment wins over the workdir's). A test that asserts
    compile events or cache hits gives its runs a private cache. Removed at the session's end;
    a directory already set in the environment is kept as it is."""
    import tempfile

    from resilient_jax.contracts import env_vars

    if not os.environ.get(env_vars.JAX_COMPILATION_CACHE_DIR):
        _SESSION_CACHE.append(tempfile.mkdtemp(prefix="rj-test-compile-"))
        os.environ[env_vars.JAX_COMPILATION_CACHE_DIR] = _SESSION_CACHE[0]
    # Cache every compile: the SMALL model's programs compile in well under JAX's default 1 s.
    os.environ.setdefault(env_vars.JAX_MIN_COMPILE_TIME_S, "0")


def pytest_unconfigure(config) -> None:
    import shutil

    for path in _SESSION_CACHE:
        shutil.rmtree(path, ignore_errors=True)


_SESSION_CACHE: list[str] = []  # the cache directory this session made (none when given one)

# Workers `-n auto` starts: one more than the cores, at most this many. Many tests wait on
# processes they started or on simulated steps that sleep, so a worker per core leaves cores idle
# (1.82 of 2 busy on average); one more keeps them full (1.97 of 2, the suite 9% faster on 2
# cores). Each runs XLA with 8 simulated devices and compiles of its own: more costs memory.
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config) -> int:
    return min(MAX_WORKERS, len(os.sched_getaffinity(0)) + 1)


@pytest.fixture
def own_compile_cache(monkeypatch) -> None:
    """The runs this test starts compile as outside the test session (a supervised job in its
    workdir's cache, a lone run in none): for tests that assert what a first compile misses."""
    from resilient_jax.contracts import env_vars

    monkeypatch.delenv(env_vars.JAX_COMPILATION_CACHE_DIR, raising=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(
    args: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Runs `python ARGS` from the repo root; killed (by PID, via its process group) on timeout."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"python {' '.join(args)} timed out after {timeout}s\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# The tiny default made smaller still, for fast tests (as dotted config keys): defined with the
# config it shrinks, in configs/small_cpu.py.
SMALL = small_cpu.SHORT_RUN


# The supervisor's settings for short supervised runs of sim or tiny workers: fast heartbeats
# and restarts, no re-admission, the plain reshape path, the hosts' probe without JAX.
FAST_SUPERVISION = {
    "coordinator.heartbeat_interval_s": 0.2,
    "coordinator.heartbeat_timeout_s": 1.5,
    "coordinator.hang_floor_s": 3.0,
    "coordinator.startup_timeout_s": 30.0,
    "coordinator.kill_grace_s": 0.5,
    "coordinator.save_grace_s": 10.0,
    "coordinator.backoff_s": 0.1,
    "coordinator.readmit_after_s": -1.0,
    # Slices here step no faster than one: re-admission would never pay, and is what is tested.
    "coordinator.scale_up_when_faster": False,
    # The reshape path is what these runs test: the cost-aware planner would wait for a
    # slice back within seconds instead.
    "coordinator.reconfiguration": "reshape",
    # The hosts' health probe without its JAX start (tests of the probe run it).
    "coordinator.probe_jax": False,
    "coordinator.agent_timeout_s": 1.5,
    # No warm standbys: each imports the trainer's libraries (2 CPU-s) and most runs never use
    # one, which doubled these tests' CPU. A test of the standby path turns them on.
    "coordinator.standby_workers": False,
}


def as_flags(overrides: dict) -> list[str]:
    """`--config.KEY=VALUE` flags for the launcher."""
    return [
        f"--config.{key}={str(value).lower() if isinstance(value, bool) else value}"
        for key, value in overrides.items()
    ]


def tiny_config(**overrides):
    """configs/tiny_cpu.py with SMALL and no RAM-disk tier; dotted keys as further overrides."""
    from configs.tiny_cpu import get_config

    config = get_config()
    config.update_from_flattened_dict({**SMALL, "checkpoint.local_dir": "", **overrides})
    return config


def event(time: float, type: str, process: int | str | None = 0, **fields) -> dict:
    """One events.jsonl row for hand-built event logs; `process=None` leaves the field out."""
    row = {"time": time, "type": type, **fields}
    if process is not None:
        row["process"] = process
    return row


# ------------------------------------------------------------------ checkpoint engine helpers
# Shared by test_checkpoint.py and the workers of test_checkpoint_process.py (which run outside
# pytest, so these are plain functions; JAX is imported inside them, not when tests collect).


@pytest.fixture
def local_root():
    """A fresh local-tier root on the RAM disk, removed afterwards."""
    import shutil
    import uuid

    root = f"/dev/shm/rj-test-{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def checkpoint_config(local_root: str = "", **overrides):
    """tiny_config for checkpoint tests: 100 steps, no saves unless `overrides` ask for them."""
    return tiny_config(
        total_steps=100,
        **{
            "checkpoint.every_steps": 0,
            "checkpoint.local_every_steps": 0,
            "checkpoint.local_dir": local_root,
            "checkpoint.sync_timeout_s": 30.0,
            **overrides,
        },
    )


def run_context(config, workdir: str, devices: int = 8, replica: int = -1, fsdp: int = -1):
    """A RunContext on the first `devices` devices with the given mesh axes (-1: planned)."""
    import jax

    from resilient_jax import mesh as mesh_lib
    from resilient_jax import topology as topology_lib
    from resilient_jax.events import EventLog
    from resilient_jax.train.context import RunContext
    from resilient_jax.train.state import abstract_state

    config = config.copy_and_resolve_references()
    config.mesh.replica, config.mesh.fsdp = replica, fsdp
    topology = mesh_lib.discover(jax.devices()[:devices])
    plan = topology_lib.plan_mesh(config, topology)
    mesh = mesh_lib.make_mesh(plan, topology)
    return RunContext(
        config, workdir, topology, plan, mesh, EventLog(workdir), abstract_state(config, mesh)
    )


def data_position(step: int):
    """The data position the hook is given after `step` (with a skip window, to carry one)."""
    from resilient_jax.data.position import DataPosition

    return DataPosition(next_batch=step, skips=((1, 3),))


@functools.cache
def _bump():
    """A jitted function giving a new state in which every leaf changed (floats and integers)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(
        lambda state: jax.tree.map(
            lambda x: x + (0.25 if jnp.issubdtype(x.dtype, jnp.floating) else 1), state
        )
    )


def _wait_for_writes(hook, persistent: bool, timeout_s: float = 60.0) -> None:
    import time

    local = getattr(hook, "_local", None)
    if local is not None:
        local.wait_idle(timeout_s)
    writer = getattr(hook, "_writer", None) if persistent else None
    deadline = time.monotonic() + timeout_s
    while writer is not None and writer.save_in_progress() and time.monotonic() < deadline:
        time.sleep(0.005)


def step_through(
    hook,
    ctx,
    state,
    first: int,
    last: int,
    clock=None,
    tick_s: float = 0.0,
    writes_finish: bool | str = True,
):
    """Steps `first..last` through `hook.after_step`, every leaf changing each step; returns the
    final state and host copies by step. `clock` (a FakeClock) advances `tick_s` per step.

    `writes_finish`: each step lasts until a checkpointer's writes (local tier, persistent save
    and its commit; "local": the local tier's only, for a store that may hang) have ended, as a
    real step longer than a write would (else a save due while its tier's write runs is
    skipped); their outcome is left for the checkpointer to collect."""
    import jax
    import numpy as np

    from resilient_jax.train.hooks import StepInfo
    from resilient_jax.train.shard_list import list_shards

    host = {}
    for step in range(first, last + 1):
        state = _bump()(state)
        if clock is not None:
            clock.now += tick_s
        hook.after_step(ctx, state, StepInfo(step, step - 1, data_position(step), 0.01))
        # A kept state is the one the save's writer threads read: list its shards with them.
        host[step] = jax.tree.map(np.asarray, list_shards(state))
        if writes_finish:
            _wait_for_writes(hook, persistent=writes_finish != "local")
    return state, host


_STEPS: dict = {}  # (config, mesh) -> the jitted train step: compiled once per test session
_BATCHES: dict = {}  # (config, mesh) -> (its loader, the global batches it gave so far)


def _step_key(ctx) -> tuple:
    return ctx.config.to_json_best_effort(sort_keys=True), tuple(ctx.mesh.shape.items())


def train_steps(ctx, state, first: int, last: int):
    """Steps first..last of `ctx`'s run (batch s-1 for step s) with one compiled step per config
    and mesh; returns the state and the last step's metrics (host values). The state is donated:
    copy it out first."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from resilient_jax.data import BatchLoader, make_source
    from resilient_jax.train.step import make_train_step

    key = _step_key(ctx)
    if key not in _STEPS:
        _STEPS[key] = make_train_step(ctx.config, ctx.mesh)
    if key not in _BATCHES:
        _BATCHES[key] = (BatchLoader(ctx.config, ctx.mesh, ctx.plan, make_source(ctx.config)), [])
    loader, batches = _BATCHES[key]
    while len(batches) < last:
        batches.append(loader.next()[1])
    metrics = {}
    for s in range(first, last + 1):
        state, metrics = _STEPS[key](state, batches[s - 1], jnp.float32(1.0))
    return state, jax.tree.map(np.asarray, metrics)


def assert_bitwise(restored, expected) -> None:
    """Every leaf of `restored` (device arrays) equals `expected` (host copies) bit for bit."""
    import jax
    import numpy as np

    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), restored, expected)
    assert all(jax.tree.leaves(same))


def persistent_step_dirs(workdir: str) -> list[str]:
    """What the persistent directory holds besides its run-id file."""
    from resilient_jax.checkpoint.persistent import DEFAULT_DIR, RUN_ID_FILE

    names = os.listdir(os.path.join(workdir, DEFAULT_DIR))
    return sorted((n for n in names if n != RUN_ID_FILE), key=lambda n: (not n.isdigit(), n))


def supervise_tiny_cpu(
    workdir, overrides: dict, actions=(), out=None, time_limit_s: float = 400
) -> tuple[int, list[dict]]:
    """`configs/tiny_cpu.py` with `overrides` under the supervisor on 2 slices x 1 process x 2
    devices (the real trainer): its exit code and events. Nothing it started may outlive it."""
    import io
    import runpy

    from resilient_jax.control import ClusterSpec, Supervisor
    from resilient_jax.events import read_events

    config = runpy.run_path(os.path.join(REPO, "configs", "tiny_cpu.py"))["get_config"]()
    config.update_from_flattened_dict(overrides)
    config.coordinator.probe_jax = False  # as in ELASTIC_SMALL, for every elastic run here
    log = io.StringIO()
    argv = [
        sys.executable,
        "launch/train.py",
        "--config=configs/tiny_cpu.py",
        f"--workdir={workdir}",
        *(f"--config.{k}={v}" for k, v in overrides.items()),
    ]
    supervisor = Supervisor(
        config,
        ClusterSpec(2, 1, 2),
        argv,
        str(workdir),
        actions=actions,
        out=out if out is not None else log,
        cwd=REPO,
    )
    result = supervisor.run(time_limit_s=time_limit_s)
    events = list(read_events(str(workdir)))
    if result.exit_code != 0 and out is None:
        # Shown by pytest with a failing test: the supervisor's own account of the run first,
        # then the end of each worker's output (a hung worker's thread dump: every process's,
        # not only the last one's, which alone would fill a shared tail).
        lines = log.getvalue().splitlines()
        said = "\n".join(line for line in lines if line.startswith("[supe"))
        print(f"supervisor exited {result.exit_code}; its lines:\n{said[-8000:]}")
        print(f"the end of each worker's output:\n{_worker_tails(lines)}")
    for pid in [e["pid"] for e in events if e["type"] == "process_start" and "source" in e]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    return result.exit_code, events


def _worker_tails(lines: list[str], per_worker: int = 45) -> str:
    """The last `per_worker` lines of each worker's output (`[gG sS pP] ...`), Gloo's connection
    lines and the interpreter's list of extension modules left out."""
    by_worker: dict[str, list[str]] = {}
    for line in lines:
        prefix, _, text = line.partition("] ")
        if prefix.startswith("[g") and not text.startswith(("[Gloo]", "Extension modules")):
            by_worker.setdefault(prefix + "]", []).append(line)
    return "\n".join(line for kept in by_worker.values() for line in kept[-per_worker:])


def stand_in_elastic_config(slices: int, standby: bool = False):
    """The default config for an elastic run of `slices` stand-in slices (no JAX): their hosts'
    agents probe no JAX, and the run waits for the agents as long as a loaded machine may need."""
    from resilient_jax.config import default_config

    config = default_config()
    config.elastic.slices = slices
    config.elastic.standby = standby
    config.coordinator.probe_jax = False
    config.coordinator.startup_timeout_s = 30.0
    # Agents left behind by a supervisor a test killed end their stand-ins soon after.
    config.coordinator.orphan_timeout_s = 20.0
    return config


def elastic_stand_in_process(
    workdir: str, argv: dict, token: str, standby: bool = False, restart_delay_s: float = 1.0
) -> subprocess.Popen:
    """An elastic supervisor of stand-in slices in a process of its own (`helpers/
    elastic_stand_in.py`), to be killed: argv maps each slice id (-1: the standby) to its
    command, "{workdir}" standing for the slice's workdir."""
    spec = os.path.join(workdir, "stand_in.json")
    os.makedirs(workdir, exist_ok=True)
    with open(spec, "w") as f:
        json.dump(
            {
                "workdir": workdir,
                "slices": len([s for s in argv if s >= 0]),
                "standby": standby,
                "restart_delay_s": restart_delay_s,
                "argv": {str(s): a for s, a in argv.items()},
            },
            f,
        )
    helper = os.path.join(REPO, "tests", "helpers", "elastic_stand_in.py")
    env = {**os.environ, "RJ_RUN_TOKEN": token, "PYTHONPATH": REPO}
    with open(os.path.join(workdir, "stand_in.log"), "ab") as log:
        return subprocess.Popen(
            [sys.executable, helper, spec], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )


def wait_for_events(workdir: str, kind: str, count: int, timeout_s: float = 60.0) -> list[dict]:
    """The events of one type in a run's events.jsonl once there are `count` of them."""
    deadline = time.monotonic() + timeout_s
    while len(found := events_of(workdir, kind)) < count:
        assert time.monotonic() < deadline, f"no {count} {kind} events in {timeout_s:g} s"
        time.sleep(0.05)
    return found


def supervise_elastic(
    workdir: str,
    overrides: dict,
    during=None,
    restart_delay_s: float = 1.0,
    time_limit_s=400,
    processes_per_slice: int = 1,
    devices_per_process: int = 2,
):
    """`configs/tiny_cpu.py` with `overrides` in elastic mode under the elastic supervisor (in a
    thread; by default one single-process slice of 2 devices per part): its result, once done.
    `during(supervisor)` is called every 50 ms meanwhile and returns True once it has acted."""
    import io
    import runpy
    import threading

    from resilient_jax.control.elastic import ElasticSupervisor

    config = runpy.run_path(os.path.join(REPO, "configs", "tiny_cpu.py"))["get_config"]()
    config.update_from_flattened_dict(overrides)
    config.coordinator.probe_jax = False  # as in ELASTIC_SMALL, for every elastic run here

    def argv(slice_id: int, slice_dir: str) -> list[str]:
        flags = as_flags(overrides)
        return [
            sys.executable,
            "launch/train.py",
            "--config=configs/tiny_cpu.py",
            f"--workdir={slice_dir}",
            *flags,
        ]

    supervisor = ElasticSupervisor(
        config,
        argv,
        workdir,
        devices_per_process=devices_per_process,
        out=io.StringIO(),
        restart_delay_s=restart_delay_s,
        cwd=REPO,
        processes_per_slice=processes_per_slice,
    )
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=supervisor.run(time_limit_s)))
    thread.start()
    while thread.is_alive():
        if during is not None and during(supervisor):
            during = None
        time.sleep(0.05)
    thread.join()
    return result["r"]


# An elastic run of the SMALL model that writes a parameter digest every step, no checkpoints.
ELASTIC_SMALL = {
    **SMALL,
    # The hosts' health probe without its JAX start (3 hosts: seconds of CPU per run; tests of the
    # probe run it).
    "coordinator.probe_jax": False,
    "elastic.enabled": True,
    "elastic.check_every_steps": 1,
    "checkpoint.every_steps": 0,
    "checkpoint.local_every_steps": 0,
}


def slice_digests(workdir: str, slice_id: int, process: int = 0) -> dict[int, str]:
    """The parameter digest of each step of one slice of an elastic run, by step (of the pieces
    of the parameters that process `process` of the slice holds)."""
    steps = slice_events(workdir, slice_id, "elastic_step")
    return {e["step"]: e["digest"] for e in steps if e.get("process", 0) == process}


def slice_events(workdir: str, slice_id: int, kind: str | None = None) -> list[dict]:
    """The events (of one type, if given) of one slice of an elastic run (complete lines only)."""
    path = os.path.join(workdir, "slices", str(slice_id), "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.endswith("\n")]
    return [e for e in rows if kind is None or e["type"] == kind]


def events_of(workdir: str, kind: str) -> list[dict]:
    """The events of one type in a run's events.jsonl."""
    from resilient_jax.events import read_events

    return [e for e in read_events(workdir) if e["type"] == kind]


# ------------------------------------------------------------------ elastic slices in threads


def run_slices(
    address: str,
    slice_ids,
    body,
    exchange_timeout_s: float = 10.0,
    on_error=lambda: None,
    timeout_s: float = 300.0,
) -> None:
    """Runs `body(slice_id, exchange, client)` for each slice in a thread of its own, with a gloo
    exchange and a quorum client (of the server at `address`, token "t") of its own, closed after
    it. Joins them with a bound, then raises the first error a slice raised (`on_error` runs in
    that slice's thread first: it releases slices waiting for the failed one) or fails on a slice
    that did not finish."""
    import threading

    from resilient_jax.elastic.exchange import make_exchange
    from resilient_jax.elastic.quorum_client import QuorumClient

    errors: list[BaseException] = []

    def run(slice_id: int) -> None:
        exchange = make_exchange("gloo", "127.0.0.1", exchange_timeout_s)
        client = QuorumClient(address, "t", slice_id)
        try:
            body(slice_id, exchange, client)
        except BaseException as e:  # raised by the calling thread
            errors.append(e)
            on_error()
        finally:
            client.close()
            exchange.close()

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in slice_ids]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a slice did not finish"


# ------------------------------------------------------------- saves of a state the step keeps


def host_bytes(tree) -> list[bytes]:
    """Every leaf's bytes, on the host."""
    import jax
    import numpy as np

    from resilient_jax.train.shard_list import list_shards

    # A kept state's shards may be read by a save's writer threads right now.
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(list_shards(tree))]


def donated(state) -> bool:
    """Whether a step donated `state` (its parameters: a leaf the step does not read, such as
    the health state's `lr_scale`, is never donated)."""
    import jax

    return all(leaf.is_deleted() for leaf in jax.tree.leaves(state.params))


def device_buffers(state) -> set[int]:
    """The addresses of every shard's device buffer."""
    import jax

    return {
        shard.data.unsafe_buffer_pointer()
        for leaf in jax.tree.leaves(state)
        for shard in leaf.addressable_shards
    }


@pytest.fixture
def held_saves(monkeypatch):
    """Holds both tiers' writes until the returned event is set (bounded), and fails the save of
    a state it copies: a save must read the state the next step keeps."""
    import threading

    from resilient_jax.checkpoint import snapshot
    from resilient_jax.checkpoint.local import LocalTier
    from resilient_jax.checkpoint.persistent import PersistentTier

    gate = threading.Event()

    def gated(original):
        def call(*args, **kwargs):
            assert gate.wait(120)
            return original(*args, **kwargs)

        return call

    def no_copy(tree):
        raise AssertionError("the save copied a state the next step keeps")

    monkeypatch.setattr(LocalTier, "_write", gated(LocalTier._write))
    monkeypatch.setattr(PersistentTier, "save", gated(PersistentTier.save))
    monkeypatch.setattr(snapshot, "device_snapshot", no_copy)
    yield gate
    gate.set()


def restore_from_each_tier(config, workdir: str, step: int, devices: int = 8) -> dict:
    """`step` restored by a fresh checkpointer from the local tier, then from the persistent tier
    alone (`checkpoint.local_dir` emptied in a copy of `config`): {tier: state}."""
    from resilient_jax.checkpoint import Checkpointer

    restored = {}
    for local_dir in (config.checkpoint.local_dir, ""):
        reader_config = config.copy_and_resolve_references()
        reader_config.checkpoint.local_dir = local_dir
        ctx = run_context(reader_config, workdir, devices=devices)
        reader = Checkpointer(ctx, handle_sigterm=False).open()
        try:
            result = reader.restore_step(ctx, step)
        finally:
            reader.close()
        restored[result.tier] = result.state
    return restored


# --------------------------------------------------------------- launcher runs (resume, healing)
# Whole training runs through launch/train.py on the tiny config made SMALL, shared by the
# resume, self-healing and golden-loss tests through the `launcher` fixture.


def plain_orbax_state(workdir, step: int) -> dict:
    """The saved `state` of `step`, read with plain Orbax: {key path: numpy array}."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    path = os.path.join(workdir, "checkpoints", str(step), "state")
    checkpointer = ocp.PyTreeCheckpointer()
    meta = checkpointer.metadata(path).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    tree = checkpointer.restore(path, restore_args=args)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): v for p, v in flat}


class LauncherRuns:
    total_steps = 40
    flags = as_flags(
        {
            **SMALL,
            "total_steps": total_steps,
            "checkpoint.every_steps": 10,
            "checkpoint.local_every_steps": 3,
        }
    )

    def start(self, workdir, devices: int, extra=(), small: bool = True) -> subprocess.Popen:
        """`launch/train.py` on `devices` CPU devices; `small=False`: the default tiny_cpu run.
        The local tier lives next to the workdir (`<workdir>-shm`)."""
        argv = [
            sys.executable,
            "launch/train.py",
            "--config=configs/tiny_cpu.py",
            f"--workdir={workdir}",
            f"--config.checkpoint.local_dir={workdir}-shm",
            *(self.flags if small else []),
            *extra,
        ]
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        return subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )

    def finish(self, proc: subprocess.Popen, timeout: float = 300) -> int:
        """Waits for the run; it must end finished or preempted (the exit code is returned)."""
        from resilient_jax.contracts.exit_codes import ExitCode

        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail(f"training did not finish within {timeout}s")
        assert proc.returncode in (ExitCode.FINISHED, ExitCode.PREEMPTED), err[-3000:]
        return proc.returncode

    def wait_for_step(self, workdir, step: int, proc: subprocess.Popen, timeout: float = 300):
        """Blocks until the run has logged `step` (polls its event log)."""
        self.wait_for_event(
            workdir,
            proc,
            lambda e: e["type"] == "step" and e["step"] >= step,
            f"step {step}",
            timeout,
        )

    def wait_for_event(
        self, workdir, proc: subprocess.Popen, accept, what: str, timeout: float = 300
    ) -> None:
        """Blocks until the run has logged an event `accept(event)` holds for; the run must still
        be running then (killed, and the test failed, after `timeout`)."""
        import json
        import time

        path = os.path.join(workdir, "events.jsonl")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the run exited ({proc.returncode}) before {what}"
            if os.path.exists(path):
                with open(path) as f:
                    if any(accept(json.loads(line)) for line in f):
                        return
            time.sleep(0.05)
        proc.kill()
        pytest.fail(f"no {what} within {timeout}s")

    def plain_orbax_state(self, workdir, step: int) -> dict:
        return plain_orbax_state(workdir, step)

    def step_losses(self, workdir) -> dict[int, float]:
        """The loss of each step, the last one logged for a step that was run twice."""
        return {e["step"]: e["loss"] for e in events_of(str(workdir), "step")}


@pytest.fixture(scope="session")
def launcher() -> LauncherRuns:
    return LauncherRuns()


# ------------------------------------------------------------ multi-host test bed (netns, Slurm)
# launch/testbed/netns.sh and slurm.sh on this machine: real addresses, real link cuts, a real
# slurmctld. Each test gets its own test bed (its own name, subnet and slurmctld port, so runs in
# parallel do not meet), deleted in the fixture's finalizer whatever the test did.

TESTBED_DIR = os.path.join(REPO, "launch", "testbed")
_TESTBED_CLAIMS = "/run/rj-testbed-claims"


def _testbed_skip_reason() -> str | None:
    import shutil

    if os.geteuid() != 0:
        return "the network-namespace test bed needs root"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"the network-namespace test bed needs `{tool}` (iproute2, util-linux)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


class Testbed:
    """One test bed: `hosts` (names), the head address (the bridge, in our own namespace)."""

    def __init__(self, slot: int, num_hosts: int) -> None:
        self.name = f"rjt{slot}"
        self.subnet = f"10.77.{slot}"
        self.head_address = f"{self.subnet}.1"
        self.hosts = [f"{self.name}n{i}" for i in range(1, num_hosts + 1)]
        self.env = {
            **os.environ,
            "RJ_TESTBED": self.name,
            "RJ_TESTBED_SUBNET": self.subnet,
            "RJ_SLURMCTLD_PORT": str(6817 + 10 * slot),
        }

    def address(self, host: str) -> str:
        return f"{self.subnet}.{10 + self.hosts.index(host) + 1}"

    def script(self, name: str, *args: str, timeout: float = 120) -> str:
        """Runs launch/testbed/NAME.sh ARGS; its stdout. Fails the test with its stderr."""
        proc = subprocess.run(
            [os.path.join(TESTBED_DIR, f"{name}.sh"), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode:
            pytest.fail(f"{name}.sh {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
        return proc.stdout

    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        """`argv` run on `host` (its own address, hostname and /etc/hosts), same PID."""
        return [os.path.join(TESTBED_DIR, "netns.sh"), "exec", host, "--", *argv]

    def popen(self, host: str, argv: list[str], log_path: str, env: dict | None = None):
        """Starts `argv` on `host` from the repo root, output to `log_path`, its own session."""
        with open(log_path, "w") as log:
            return subprocess.Popen(
                self.exec_argv(host, argv),
                cwd=REPO,
                env={**self.env, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )


def _claim_testbed_slot() -> int:
    """A slot (name, subnet, port) no other live test bed uses: mkdir is atomic."""
    os.makedirs(_TESTBED_CLAIMS, exist_ok=True)
    for slot in range(100, 200):
        path = os.path.join(_TESTBED_CLAIMS, str(slot))
        try:
            os.mkdir(path)
        except FileExistsError:
            try:  # claimed by a test run that has ended without releasing it
                with open(os.path.join(path, "pid")) as f:
                    owner = int(f.read())
                os.kill(owner, 0)
                continue
            except (OSError, ValueError):
                pass
        with open(os.path.join(path, "pid"), "w") as f:
            f.write(str(os.getpid()))
        return slot
    pytest.skip("no free test-bed slot (100 test beds alive?)")


@pytest.fixture
def netns_testbed(request):
    """A 3-host namespace test bed (`@pytest.mark.parametrize("netns_testbed", [N],
    indirect=True)` for N hosts); every process on it is killed and it is deleted afterwards."""
    import shutil

    reason = _testbed_skip_reason()
    if reason:
        pytest.skip(reason)
    slot = _claim_testbed_slot()
    testbed = Testbed(slot, getattr(request, "param", 3))
    try:
        testbed.script("netns", "down")  # whatever a killed earlier run left in this slot
        testbed.script("netns", "up", str(len(testbed.hosts)))
        yield testbed
    finally:
        subprocess.run([os.path.join(TESTBED_DIR, "netns.sh"), "down"], env=testbed.env)
        shutil.rmtree(os.path.join(_TESTBED_CLAIMS, str(slot)), ignore_errors=True)


@pytest.fixture
def slurm_cluster(request):
    """A Slurm cluster on a fresh namespace test bed (3 nodes unless parametrized like
    `netns_testbed`): slurmctld on the head, one slurmd per host. Installs slurm-wlm if needed;
    skips only when that is impossible. `SLURM_CONF` is in `testbed.env`."""
    import shutil

    reason = _testbed_skip_reason()
    if reason:
        pytest.skip(reason)
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("Slurm is not installed and there is no apt-get to install it")
    slot = _claim_testbed_slot()
    testbed = Testbed(slot, getattr(request, "param", 3))
    try:
        testbed.script("slurm", "down")  # whatever a killed earlier run left in this slot
        proc = subprocess.run(
            [os.path.join(TESTBED_DIR, "slurm.sh"), "up", str(len(testbed.hosts))],
            env=testbed.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode and "apt-get install" in proc.stderr:
            pytest.skip(f"cannot install Slurm here: {proc.stderr.strip()}")
        assert proc.returncode == 0, f"slurm.sh up failed: {proc.stderr}"
        testbed.env["SLURM_CONF"] = testbed.script("slurm", "env").split("=", 1)[1].strip()
        yield testbed
    finally:
        subprocess.run([os.path.join(TESTBED_DIR, "slurm.sh"), "down"], env=testbed.env)
        shutil.rmtree(os.path.join(_TESTBED_CLAIMS, str(slot)), ignore_errors=True)


# ---------------------------------------------------------------- gs:// on a local GCS emulator


@pytest.fixture(scope="session")
def _gcs_session():
    """One fake-gcs-server on 127.0.0.1 (a free port) for the session, killed by PID at the end;
    TensorStore and gcsfs point at it through the environment (inherited by subprocesses)."""
    from resilient_jax.testing.gcs_emulator import GcsEmulator

    emulator = GcsEmulator()
    emulator.start()  # bounded: raises if it does not serve within its start timeout
    before = {key: os.environ.get(key) for key in emulator.environ()}
    os.environ.update(emulator.environ())
    try:
        yield emulator
    finally:
        emulator.close()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def gcs(_gcs_session):
    """The session's emulator, running (a test that killed it to stage an outage gets it back)."""
    if not _gcs_session.running:
        _gcs_session.start()
    yield _gcs_session
    if not _gcs_session.running:
        _gcs_session.start()


@pytest.fixture(params=["dir", "gs"])
def persistent_base(request, tmp_path) -> str:
    """Where a test puts persistent checkpoint directories: a local directory, or a fresh prefix
    in the emulator's bucket. Tests taking it hold both backends to one contract."""
    import uuid

    if request.param == "dir":
        return str(tmp_path / "store")
    emulator = request.getfixturevalue("gcs")
    return emulator.gs_url(uuid.uuid4().hex[:12])


class MemoryKeyValueStore:
    """The four methods of jax.distributed's key-value client, in memory."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self._changed = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self._changed:
            self.values[key] = value
            self._changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self.values, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]

    def key_value_delete(self, key: str) -> None:
        with self._changed:
            self.values.pop(key, None)


def in_threads(*fns):
    """Each function in a thread of its own, together; their results (or exceptions) in order."""
    results: list = [None] * len(fns)

    def run(i, fn):
        try:
            results[i] = fn()
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results
