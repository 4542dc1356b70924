"""What hardware this run has (slices x processes x devices) and the mesh plan that fits a config
onto it: pure arithmetic, no JAX, so the supervisor plans the mesh of a restart the same way the
workers will (`resilient_jax.mesh.discover` fills a Topology from the running JAX job).

A slice is a group of processes joined by a fast interconnect (a TPU slice, an NVLink domain);
slices are joined by the slower data-centre network, so only the `replica` mesh axis crosses them.
On TPU, devices carry `slice_index`. Elsewhere the slice of a process comes from the environment
(`RJ_NUM_SLICES`, set by `launch/local_cluster.py`, the SLURM script or the JobSet): processes are
numbered slice by slice, `processes_per_slice` consecutive process indices to a slice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from resilient_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Topology:
    num_slices: int
    num_processes: int
    process_index: int
    devices: tuple[Any, ...]  # all devices, ordered slice by slice, then by process and id

    @property
    def processes_per_slice(self) -> int:
        return self.num_processes // self.num_slices

    @property
    def devices_per_slice(self) -> int:
        return len(self.devices) // self.num_slices

    @property
    def slice_index(self) -> int:
        return self.process_index // self.processes_per_slice

    def describe(self) -> dict[str, int]:
        return {
            "num_slices": self.num_slices,
            "num_processes": self.num_processes,
            "devices": len(self.devices),
            "devices_per_slice": self.devices_per_slice,
        }


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    replica: int
    fsdp: int
    tensor: int
    microbatches: int  # gradient-accumulation steps per optimizer step
    global_batch_size: int
    expert: int = 1  # expert-parallel ways (also data-parallel outside the MoE layers)

    @property
    def data_parallel(self) -> int:
        return self.replica * self.expert * self.fsdp

    @property
    def num_devices(self) -> int:
        return self.replica * self.expert * self.fsdp * self.tensor

    @property
    def rows_per_device(self) -> int:
        """Rows of one microbatch that one data-parallel device processes."""
        return self.global_batch_size // (self.data_parallel * self.microbatches)

    def describe(self) -> dict[str, int]:
        return {
            "replica": self.replica,
            "expert": self.expert,
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
    that are left and the microbatch size shrinks to the largest divisor that fits. The `expert`
    and `tensor` axes never change: they stay inside a slice, so the experts are re-placed on the
    slices left, and the model's expert count is untouched.
    """
    n = len(topology.devices)
    tensor, expert = config.mesh.tensor, config.mesh.expert
    for key, ways in (("tensor", tensor), ("expert", expert)):
        if n % ways:
            raise ConfigError(f"config.mesh.{key}={ways} is invalid: must divide the {n} devices")
    inner = expert * tensor  # the devices one data-parallel group of the slice spans
    if topology.devices_per_slice % inner:
        raise ConfigError(
            f"config.mesh.expert={expert} is invalid: expert x tensor={inner} must divide the "
            f"{topology.devices_per_slice} devices of a slice (both stay in a slice)"
            if expert > 1
            else f"config.mesh.tensor={tensor} is invalid: must divide the "
            f"{topology.devices_per_slice} devices of a slice (tensor parallelism stays in a slice)"
        )
    replica, fsdp = config.mesh.replica, config.mesh.fsdp
    if not strict and replica * fsdp * inner != n:
        replica, fsdp = -1, -1
    if replica == -1 and fsdp == -1:
        replica = topology.num_slices
    if replica == -1:
        replica = n // (fsdp * inner) if n % (fsdp * inner) == 0 else 0
    if fsdp == -1:
        fsdp = n // (replica * inner) if n % (replica * inner) == 0 else 0
    if replica <= 0 or fsdp <= 0 or replica * fsdp * inner != n:
        raise ConfigError(
            f"config.mesh=(replica={config.mesh.replica}, expert={expert}, "
            f"fsdp={config.mesh.fsdp}, tensor={tensor}) is invalid: the axes must multiply to "
            f"the {n} devices (use -1 for an automatic axis)"
        )
    batch = config.global_batch_size
    dp = replica * expert * fsdp
    if batch % dp:
        raise ConfigError(
            f"config.global_batch_size={batch} is invalid: must be a multiple of the {dp} "
            f"data-parallel devices (replica={replica} x expert={expert} x fsdp={fsdp})"
        )
    per_device = batch // dp
    limit = config.per_device_batch_size or per_device
    if strict and per_device % min(limit, per_device):
        raise ConfigError(
            f"config.per_device_batch_size={limit} is invalid: must divide the {per_device} rows "
            f"each of the {dp} data-parallel devices gets of global_batch_size={batch}"
        )
    rows = max(r for r in range(1, min(limit, per_device) + 1) if per_device % r == 0)
    return MeshPlan(replica, fsdp, tensor, per_device // rows, batch, expert)
