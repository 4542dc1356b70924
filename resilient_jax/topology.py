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
