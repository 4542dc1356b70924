"""Step time of a config on a mesh, predicted from measured component costs: arithmetic only.

A `Calibration` holds what a short profiling run measured on the devices at hand
(`resilient_jax.train.calibrate`): the compute cost of a token's forward and backward pass per
FLOP, the fixed cost of one microbatch, the cost per byte and per call of a collective on each mesh
axis, the optimizer update per parameter, the fixed cost of a step, and how many devices' compute
the host runs at once. `predict` adds them up for a `Workload` (the config's model and batch) on
a `MeshPlan`:

    step = fixed + serial x (microbatches x (microbatch_fixed + tokens x FLOPs/token / tensor x
           s_per_flop) + params_on_device x s_per_param) + collectives

where `serial` = devices / the devices' worth of compute the host runs at once (simulated devices
share the host's cores; on accelerators every device computes at once, so it is 1). The
collectives are, once per step, FSDP's all-gather of the parameters and reduction of the
gradients and the replica axis's all-reduce of each device's gradient shard (the compiled step
gathers the parameters before the microbatch loop and reduces the summed gradients after it),
and, every microbatch, tensor parallelism's two all-reduces of the activations per layer,
forward and backward; ring algorithms move (k-1)/k of the buffer per device (twice for an
all-reduce).

The supervisor (which never imports JAX) ranks a restart's candidate meshes with it, and
`experiments/step_time_model.py` checks it against measured step times.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from typing import Any, Protocol

import ml_collections

from resilient_jax.perf import model_size

AXES = ("replica", "fsdp", "tensor")  # the axes whose collectives the model prices
_PARAM_BYTES = 4  # parameters, gradients and their accumulator are float32
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class MeshPlan(Protocol):
    """The mesh shape the model prices (`topology.MeshPlan` is one; this layer cannot import it)."""

    replica: int
    fsdp: int
    tensor: int
    microbatches: int
    expert: int

    @property
    def num_devices(self) -> int: ...

    @property
    def rows_per_device(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured costs on one kind of device (seconds)."""

    # Training compute per FLOP of one device, by the tokens of a microbatch on it (a few sizes
    # measured, keys as strings in JSON, a number = one for all; log-linear in between, flat
    # beyond): caches and vector units make a token's cost depend on how many share the pass.
    s_per_flop: dict[int, float]
    microbatch_s: float  # fixed cost of one microbatch (loop, launch), whatever its size
    s_per_param: float  # optimizer update (clip, AdamW, apply) per parameter on a device
    step_s: float  # fixed cost of one step (dispatch, metrics)
    byte_s: dict[str, float]  # per axis: seconds per byte a device sends in a collective
    call_s: dict[str, float]  # per axis: seconds per collective call (latency)
    # Devices' worth of compute the host runs at once when n devices compute (measured at a few
    # n, keys as strings in JSON; linear in between, flat beyond); None: all n at once.
    parallel_devices: dict[int, float] | None = None
    device: str = ""  # what was measured, for the record

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown calibration fields {sorted(unknown)}")
        parallel = data.get("parallel_devices")
        if parallel is not None:
            data = {**data, "parallel_devices": {int(k): float(v) for k, v in parallel.items()}}
        flops = data.get("s_per_flop")
        if isinstance(flops, int | float):
            data = {**data, "s_per_flop": {1: float(flops)}}
        elif isinstance(flops, dict):
            data = {**data, "s_per_flop": {int(k): float(v) for k, v in flops.items()}}
        return cls(**data)

    @classmethod
    def load(cls, path: str) -> Calibration:
        with open(path) as f:
            return cls.from_json(json.load(f))


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one optimizer step computes: the model's size and the batch, from a config."""

    params: int  # all parameters
    flops_per_token: float  # forward + backward
    num_layers: int
    d_model: int
    activation_bytes: int  # per element of the activations
    global_batch_size: int
    seq_len: int

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> Workload:
        m = config.model
        seq_len = config.data.seq_len
        return cls(
            params=model_size.num_params(m),
            flops_per_token=model_size.flops_per_token(m, seq_len),
            num_layers=m.num_layers,
            d_model=m.d_model,
            activation_bytes=_DTYPE_BYTES.get(m.compute_dtype, 4),
            global_batch_size=config.global_batch_size,
            seq_len=seq_len,
        )


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """A predicted step time and its parts (seconds)."""

    compute_s: float
    optimizer_s: float
    collective_s: dict[str, float]
    fixed_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.optimizer_s + sum(self.collective_s.values()) + self.fixed_s


def collective_bytes(work: Workload, plan: MeshPlan) -> dict[str, tuple[float, int]]:
    """Per axis: (bytes one device sends, collective calls) in one step."""
    m, t = plan.microbatches, plan.tensor
    shard = work.params * _PARAM_BYTES / t  # a tensor-parallel group's share of the parameters
    out: dict[str, tuple[float, int]] = {}
    f = plan.fsdp
    # Once per step: the parameters are gathered before the microbatch loop (loop-invariant,
    # XLA hoists the all-gather) and the summed gradients reduced after it.
    out["fsdp"] = (2 * shard * (f - 1) / f, 2) if f > 1 else (0.0, 0)
    r = plan.replica * plan.expert
    # The gradient shard each device keeps, reduced across replicas once per step.
    out["replica"] = (2 * (shard / f) * (r - 1) / r, 1) if r > 1 else (0.0, 0)
    tokens = plan.rows_per_device * work.seq_len
    calls = 4 * work.num_layers  # two all-reduces per layer, forward and backward
    act = tokens * work.d_model * work.activation_bytes
    out["tensor"] = (m * calls * 2 * act * (t - 1) / t, m * calls) if t > 1 else (0.0, 0)
    return out


def _interpolate(table: dict[int, float], x: float, log: bool) -> float:
    """`table` at `x`: linear (in log x with `log`) between its points, flat beyond them."""
    points = sorted(table.items())
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0) if log else (x - x0) / (x1 - x0)
            return y0 + (y1 - y0) * f
    return points[-1][1]


def concurrency(cal: Calibration, n: int) -> float:
    """Devices' worth of compute that runs at once when `n` devices compute."""
    if cal.parallel_devices is None:
        return float(n)
    return max(1.0, min(float(n), _interpolate(cal.parallel_devices, n, log=False)))


def s_per_flop(cal: Calibration, tokens: int) -> float:
    """Compute per FLOP of a microbatch of `tokens` tokens on one device."""
    return _interpolate(cal.s_per_flop, tokens, log=True)


def breakdown(cal: Calibration, work: Workload, plan: MeshPlan) -> Breakdown:
    """The predicted step time of `work` on `plan`, part by part."""
    n = plan.num_devices
    serial = n / concurrency(cal, n)
    tokens = plan.rows_per_device * work.seq_len  # one microbatch on one device
    flops = tokens * work.flops_per_token / plan.tensor
    microbatch = cal.microbatch_s + flops * s_per_flop(cal, tokens // plan.tensor)
    compute = serial * plan.microbatches * microbatch
    optimizer = serial * work.params / (plan.fsdp * plan.tensor) * cal.s_per_param
    collectives = {
        axis: sent * cal.byte_s.get(axis, 0.0) + calls * cal.call_s.get(axis, 0.0)
        for axis, (sent, calls) in collective_bytes(work, plan).items()
    }
    return Breakdown(compute, optimizer, collectives, cal.step_s)


def predict(cal: Calibration, work: Workload, plan: MeshPlan) -> float:
    """Predicted seconds per optimizer step of `work` on `plan`."""
    return breakdown(cal, work, plan).total_s


# What a device of an accelerator cluster costs when nothing was measured: only ratios between
# meshes matter to the supervisor (it anchors them on the step time it measures), so the figures
# are H100-like orders of magnitude: ~400 TFLOP/s achieved, 400 GB/s in a slice, 25 GB/s across.
ACCELERATOR_DEFAULT = Calibration(
    s_per_flop={1: 1 / 4e14},
    microbatch_s=2e-4,
    s_per_param=2e-12,
    step_s=5e-3,
    byte_s={"replica": 1 / 25e9, "fsdp": 1 / 400e9, "tensor": 1 / 400e9},
    call_s={"replica": 5e-5, "fsdp": 1e-5, "tensor": 1e-5},
    parallel_devices=None,
    device="assumed accelerator (no calibration file)",
)
