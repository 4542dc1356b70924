"""The device mesh, the logical-axis rules, and the plan that fits a config onto our devices.

Axes: `replica` (pure data parallelism, the only axis that crosses slices), `fsdp` (data parallel
with parameters and optimizer state sharded, inside a slice) and `tensor` (model parallel inside a
slice). The global batch never changes with the mesh: on fewer devices, more gradient-accumulation
microbatches make up the difference, so a run keeps the same training semantics after a reshape.
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from resilient_jax.config import ConfigError
from resilient_jax.topology import Topology

MESH_AXES = ("replica", "fsdp", "tensor")
DATA_AXES = ("replica", "fsdp")

# Model (logical) axis -> mesh axes. The whole sharding strategy of the model is this table.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", DATA_AXES),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("seq", None),
    ("layers", None),
)


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    replica: int
    fsdp: int
    tensor: int
    microbatches: int  # gradient-accumulation steps per optimizer step
    global_batch_size: int

    @property
    def data_parallel(self) -> int:
        return self.replica * self.fsdp

    @property
    def num_devices(self) -> int:
        return self.replica * self.fsdp * self.tensor

    @property
    def rows_per_device(self) -> int:
        """Rows of one microbatch that one data-parallel device processes."""
        return self.global_batch_size // (self.data_parallel * self.microbatches)

    def describe(self) -> dict[str, int]:
        return {
            "replica": self.replica,
            "fsdp": self.fsdp,
            "tensor": self.tensor,
            "microbatches": self.microbatches,
            "rows_per_device": self.rows_per_device,
        }


def plan_mesh(
    config: ml_collections.ConfigDict, topology: Topology, strict: bool = True
) -> MeshPlan:
    """Mesh shape and microbatch count for `config` on `topology`'s devices.

    `strict` (a fresh start) takes the config literally: explicit axis sizes must multiply to the
    device count and `per_device_batch_size` must divide each device's share of the batch. After a
    reshape (`strict=False`, used by the coordinator) explicit data axes give way to the devices
    that are left and the microbatch size shrinks to the largest divisor that fits.
    """
    n = len(topology.devices)
    tensor = config.mesh.tensor
    if n % tensor:
        raise ConfigError(f"config.mesh.tensor={tensor} is invalid: must divide the {n} devices")
    if topology.devices_per_slice % tensor:
        raise ConfigError(
            f"config.mesh.tensor={tensor} is invalid: must divide the "
            f"{topology.devices_per_slice} devices of a slice (tensor parallelism stays in a slice)"
        )
    replica, fsdp = config.mesh.replica, config.mesh.fsdp
    if not strict and replica * fsdp * tensor != n:
        replica, fsdp = -1, -1
    if replica == -1 and fsdp == -1:
        replica = topology.num_slices
    if replica == -1:
        replica = n // (fsdp * tensor) if n % (fsdp * tensor) == 0 else 0
    if fsdp == -1:
        fsdp = n // (replica * tensor) if n % (replica * tensor) == 0 else 0
    if replica <= 0 or fsdp <= 0 or replica * fsdp * tensor != n:
        raise ConfigError(
            f"config.mesh=(replica={config.mesh.replica}, fsdp={config.mesh.fsdp}, "
            f"tensor={tensor}) is invalid: the axes must multiply to the {n} devices "
            "(use -1 for an automatic axis)"
        )
    batch = config.global_batch_size
    dp = replica * fsdp
    if batch % dp:
        raise ConfigError(
            f"config.global_batch_size={batch} is invalid: must be a multiple of the {dp} "
            f"data-parallel devices (replica={replica} x fsdp={fsdp})"
        )
    per_device = batch // dp
    limit = config.per_device_batch_size or per_device
    if strict and per_device % min(limit, per_device):
        raise ConfigError(
            f"config.per_device_batch_size={limit} is invalid: must divide the {per_device} rows "
            f"each of the {dp} data-parallel devices gets of global_batch_size={batch}"
        )
    rows = max(r for r in range(1, min(limit, per_device) + 1) if per_device % r == 0)
    return MeshPlan(replica, fsdp, tensor, per_device // rows, batch)


def make_mesh(plan: MeshPlan, topology: Topology) -> Mesh:
    """Devices in slice order, so each `replica` group lies within one slice when it can."""
    devices = np.asarray(topology.devices, dtype=object).reshape(
        plan.replica, plan.fsdp, plan.tensor
    )
    return Mesh(devices, MESH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches are [microbatches, rows, tokens]; rows split over the data-parallel axes."""
    return NamedSharding(mesh, PartitionSpec(None, DATA_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def logical_sharding(tree, mesh: Mesh):
    """NamedShardings for a tree of flax logical PartitionSpecs."""
    import flax.linen as nn

    return nn.logical_to_mesh_sharding(tree, mesh, LOGICAL_AXIS_RULES)


def local_devices_in_mesh(mesh: Mesh) -> list[jax.Device]:
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
