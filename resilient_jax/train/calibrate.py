"""A short profiling run that measures the component costs `perf.step_time` predicts from.

    python -m resilient_jax.train.calibrate --config=configs/tiny_cpu.py --out=calibration.json

On the devices at hand (in seconds, medians of a few timed calls after a warm-up):

- the real train step on one device with one microbatch of 1, 4 and 16 rows, and with 4
  microbatches of 4 rows: the compute per FLOP at each microbatch size, and what a step costs
  besides its microbatches (the optimizer, timed alone, is part of it);
- the optimizer's update and apply over the model's parameters on one device;
- an all-reduce (`psum`) of two buffer sizes over each mesh axis of a 3-axis mesh of all the
  devices: the slope is the cost per byte sent, the intercept the cost per call;
- the real step data-parallel on 2, 4, ... devices with as many rows on each as on one device:
  how many devices' compute the host runs in parallel;
- the all-reduce's jitted call without the all-reduce: its dispatch, which a collective inside
  a step does not pay, comes off the per-call cost.

`step_probe` is one call of the real train step on a given mesh plan, and `time_round_robin`
times probes in turns; `experiments/step_time_model.py` times the calibration's probes and the
meshes it checks side by side.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from resilient_jax import mesh as mesh_lib
from resilient_jax.perf.step_time import AXES, Calibration, Workload
from resilient_jax.topology import MeshPlan, Topology
from resilient_jax.train.state import init_state, make_optimizer
from resilient_jax.train.step import make_train_step

_WARMUP = 2
# The one-device steps timed, one microbatch of each of these row counts (the cost of a token
# depends on how many share a microbatch: caches, vectorization), and the middle one repeated
# `_SPLIT` times in one step (what a step costs besides its microbatches).
_ROWS = (1, 4, 16)
_SPLIT = 4
_DP_ROWS = 4  # rows per device of the data-parallel steps that measure concurrency
_PSUM_FLOATS = (1 << 12, 1 << 20)  # all-reduced per device: 16 KiB and 4 MiB

Probe = Callable[[], Any]  # one timed call; blocks until its result is ready


def time_round_robin(probes: dict[str, Probe], repeats: int) -> dict[str, float]:
    """Median seconds of each probe, timed in turns (a, b, c, a, b, c, ...) after a warm-up, so
    that a change in the machine's load meets every probe alike."""
    for _ in range(_WARMUP):
        for probe in probes.values():
            probe()
    times: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(repeats):
        for name, probe in probes.items():
            start = time.perf_counter()
            probe()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _topology(devices: Sequence[jax.Device]) -> Topology:
    return Topology(num_slices=1, num_processes=1, process_index=0, devices=tuple(devices))


def step_probe(
    config: ml_collections.ConfigDict,
    plan: MeshPlan,
    devices: Sequence[jax.Device] | None = None,
) -> Probe:
    """One call of the real jitted train step of `config` on `plan`'s mesh over `devices`
    (default: the first `plan.num_devices` devices), on a random batch; compiled here."""
    devices = list(devices or jax.devices()[: plan.num_devices])
    mesh = mesh_lib.make_mesh(plan, _topology(devices))
    config = ml_collections.ConfigDict(config.to_dict())
    config.global_batch_size = plan.global_batch_size
    step = make_train_step(config, mesh)
    rows = plan.global_batch_size // plan.microbatches
    shape = (plan.microbatches, rows, config.data.seq_len + 1)
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, shape, dtype=np.int32)
    batch = jax.device_put(tokens, mesh_lib.batch_sharding(mesh))
    one = jax.device_put(jnp.float32(1.0), mesh_lib.replicated(mesh))
    box = [init_state(config, mesh)]

    def run() -> None:
        box[0], metrics = step(box[0], batch, one)
        jax.block_until_ready(metrics)

    run()  # compile outside the timing
    return run


def _one_device_plan(rows: int, microbatches: int) -> MeshPlan:
    return MeshPlan(1, 1, 1, microbatches, rows * microbatches)


def _optimizer_probe(config: ml_collections.ConfigDict, device: jax.Device) -> Probe:
    mesh = mesh_lib.make_mesh(_one_device_plan(1, 1), _topology([device]))
    state = init_state(config, mesh)
    optimizer = make_optimizer(config)

    @jax.jit
    def update(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), state.params)
    box = [state.params, state.opt_state]

    def run() -> None:
        box[0], box[1] = update(box[0], box[1], grads)
        jax.block_until_ready(box[0])

    return run


def _psum_probe(mesh: jax.sharding.Mesh, axis: str | None, floats: int) -> Probe:
    """One all-reduce over `axis` of `floats` float32s per device (None: the same jitted call
    without the all-reduce: what dispatching it costs, which a collective inside a step does not
    pay)."""
    spec = PartitionSpec(mesh_lib.MESH_AXES)

    def body(x):
        return x + 1.0 if axis is None else jax.lax.psum(x, axis)

    reduce = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    n = mesh.devices.size
    x = jax.device_put(jnp.ones((n * floats,), jnp.float32), NamedSharding(mesh, spec))
    return lambda: jax.block_until_ready(reduce(x))


def _axis_sizes(n: int) -> tuple[int, int, int]:
    """(replica, fsdp, tensor) for a calibration mesh of n devices: each axis 2 while it can."""
    sizes = [1, 1, 1]
    for i in range(3):
        if n % (2 * int(np.prod(sizes))) == 0:
            sizes[i] = 2
    sizes[1] *= n // int(np.prod(sizes))  # what is left goes to fsdp
    return sizes[0], sizes[1], sizes[2]


def calibration_probes(
    config: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None
) -> dict[str, Probe]:
    """What `calibration_from` needs timed, by name (compiled here)."""
    devices = list(devices or jax.devices())
    probes = {f"step_{r}": step_probe(config, _one_device_plan(r, 1), devices[:1]) for r in _ROWS}
    probes["step_split"] = step_probe(config, _one_device_plan(_ROWS[1], _SPLIT), devices[:1])
    probes["optimizer"] = _optimizer_probe(config, devices[0])
    # The real step, data-parallel on 2, 4, ... devices, as much work on each as on one.
    for n in _concurrency_counts(len(devices))[1:]:
        plan = MeshPlan(n, 1, 1, 1, n * _DP_ROWS)
        probes[f"dp_{n}"] = step_probe(config, plan, devices[:n])
    shape = _axis_sizes(len(devices))
    mesh = jax.sharding.Mesh(
        np.asarray(devices).reshape(shape[0], 1, shape[1], shape[2]), mesh_lib.MESH_AXES
    )
    for axis, k in zip(AXES, shape, strict=True):
        if k > 1:
            for floats in _PSUM_FLOATS:
                probes[f"psum_{axis}_{floats}"] = _psum_probe(mesh, axis, floats)
    probes["dispatch"] = _psum_probe(mesh, None, _PSUM_FLOATS[0])
    return probes


def _concurrency_counts(n: int) -> list[int]:
    """1, 2, 4, ... up to n devices (and n)."""
    counts = [1]
    while counts[-1] * 2 <= n:
        counts.append(counts[-1] * 2)
    return counts if counts[-1] == n else [*counts, n]


def calibration_from(
    config: ml_collections.ConfigDict, seconds: dict[str, float], num_devices: int, kind: str
) -> Calibration:
    """The components from the probes' times."""
    work = Workload.from_config(config)
    seq = config.data.seq_len
    # One step with k microbatches of r rows costs fixed + k x microbatch(r): the split step
    # against the single one gives the fixed part, each row count its microbatch's cost.
    single, split = seconds[f"step_{_ROWS[1]}"], seconds["step_split"]
    fixed = max(0.0, (_SPLIT * single - split) / (_SPLIT - 1))
    optimizer_s = seconds["optimizer"]
    fixed = max(fixed, optimizer_s)
    s_per_flop = {
        r * seq: max(seconds[f"step_{r}"] - fixed, 0.0) / (r * seq * work.flops_per_token)
        for r in _ROWS
    }
    byte_s: dict[str, float] = {}
    call_s: dict[str, float] = {}
    shape = _axis_sizes(num_devices)
    for axis, k in zip(AXES, shape, strict=True):
        if k == 1:
            continue
        sent = [2 * 4 * floats * (k - 1) / k for floats in _PSUM_FLOATS]  # a ring all-reduce
        times = [seconds[f"psum_{axis}_{floats}"] for floats in _PSUM_FLOATS]
        slope = (times[1] - times[0]) / (sent[1] - sent[0])
        byte_s[axis] = max(slope, 0.0)
        call_s[axis] = max(times[0] - slope * sent[0] - seconds["dispatch"], 0.0)
    # Devices' worth of compute the host runs at once: n devices' microbatches take what is left
    # of `dp_n` after the fixed part; one device's, what is left of `step_4`.
    one = seconds[f"step_{_DP_ROWS}"] - fixed
    parallel = {1: 1.0}
    for n in _concurrency_counts(num_devices)[1:]:
        taken = max(seconds[f"dp_{n}"] - fixed, 1e-9)
        parallel[n] = max(1.0, min(float(n), n * one / taken))
    all_at_once = all(p >= 0.9 * n for n, p in parallel.items())
    return Calibration(
        s_per_flop=s_per_flop,
        microbatch_s=0.0,  # in s_per_flop: measured per microbatch size
        s_per_param=optimizer_s / work.params,
        step_s=fixed - optimizer_s,
        byte_s=byte_s,
        call_s=call_s,
        parallel_devices=None if all_at_once else parallel,
        device=f"{num_devices} x {kind}",
    )


def calibrate(config: ml_collections.ConfigDict, repeats: int = 5) -> Calibration:
    """Measures the components on the devices at hand (all of `jax.devices()`)."""
    devices = jax.devices()
    seconds = time_round_robin(calibration_probes(config, devices), repeats)
    return calibration_from(config, seconds, len(devices), devices[0].device_kind)


def main() -> None:
    import argparse
    import importlib.util

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny_cpu.py")
    parser.add_argument("--out", required=True, help="where the calibration JSON goes")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("experiment_config", args.config)
    assert spec is not None and spec.loader is not None, args.config
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cal = calibrate(module.get_config(), args.repeats)
    with open(args.out, "w") as f:
        json.dump(dataclasses.asdict(cal), f, indent=2)
    print(json.dumps(cal.to_json(), indent=2))


if __name__ == "__main__":
    main()
