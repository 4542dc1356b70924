"""The device mesh and the logical-axis rules, built from the devices JAX reports and the plan
`resilient_jax.topology.plan_mesh` made for them.

Axes: `replica` (pure data parallelism, the only axis that crosses slices), `expert` (the experts of
a mixture-of-experts layer, and data parallel everywhere else, inside a slice), `fsdp` (data
parallel with parameters and optimizer state sharded, inside a slice) and `tensor` (model parallel
inside a slice). A dense model has `expert` = 1. The global batch never changes with the mesh: on
fewer devices, more gradient-accumulation microbatches make up the difference, so a run keeps the
same training semantics after a reshape.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from resilient_jax.contracts import env_vars
from resilient_jax.topology import MeshPlan, Topology

MESH_AXES = ("replica", "expert", "fsdp", "tensor")
DATA_AXES = ("replica", "expert", "fsdp")

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
    # Mixture of experts: expert weights [expert, embed, mlp] over expert x fsdp x tensor; the
    # tokens inside the experts [expert_batch, expert, ...] keep sequences on the data axes but
    # `expert`, which holds the experts instead.
    ("expert", "expert"),
    ("expert_batch", ("replica", "fsdp")),
)


def make_mesh(plan: MeshPlan, topology: Topology) -> Mesh:
    """Devices in slice order, so each `replica` group lies within one slice when it can."""
    devices = np.asarray(topology.devices, dtype=object).reshape(
        plan.replica, plan.expert, plan.fsdp, plan.tensor
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


def slice_of(device: jax.Device, num_slices: int, num_processes: int) -> int:
    index = getattr(device, "slice_index", None)
    if index is not None and num_slices > 1:
        return int(index)
    return device.process_index // max(1, num_processes // num_slices)


def discover(
    devices: Sequence[jax.Device] | None = None, num_slices: int | None = None
) -> Topology:
    """The topology of the running JAX job (or of a subset of its devices, for tests)."""
    devices = list(jax.devices() if devices is None else devices)
    num_processes = jax.process_count()
    if num_slices is None:
        tpu_slices = {getattr(d, "slice_index", None) for d in devices}
        if None not in tpu_slices and len(tpu_slices) > 1:
            num_slices = len(tpu_slices)
        else:
            num_slices = int(os.environ.get(env_vars.NUM_SLICES, "1"))
    if num_slices < 1 or num_processes % num_slices or len(devices) % num_slices:
        raise ValueError(
            f"{env_vars.NUM_SLICES}={num_slices} does not divide {num_processes} processes "
            f"with {len(devices)} devices into equal slices"
        )
    ordered = sorted(
        devices, key=lambda d: (slice_of(d, num_slices, num_processes), d.process_index, d.id)
    )
    return Topology(
        num_slices=num_slices,
        num_processes=num_processes,
        process_index=jax.process_index(),
        devices=tuple(ordered),
    )
