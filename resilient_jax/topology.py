"""What hardware this run has: slices x processes x devices.

A slice is a group of processes joined by a fast interconnect (a TPU slice, an NVLink domain);
slices are joined by the slower data-centre network, so only the `replica` mesh axis crosses them.
On TPU, devices carry `slice_index`. Elsewhere the slice of a process comes from the environment
(`RJ_NUM_SLICES`, set by `launch/local_cluster.py`, the SLURM script or the JobSet): processes are
numbered slice by slice, `processes_per_slice` consecutive process indices to a slice.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax

ENV_NUM_SLICES = "RJ_NUM_SLICES"


@dataclasses.dataclass(frozen=True)
class Topology:
    num_slices: int
    num_processes: int
    process_index: int
    devices: tuple[jax.Device, ...]  # all devices, ordered slice by slice, then by process and id

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
            num_slices = int(os.environ.get(ENV_NUM_SLICES, "1"))
    if num_slices < 1 or num_processes % num_slices or len(devices) % num_slices:
        raise ValueError(
            f"{ENV_NUM_SLICES}={num_slices} does not divide {num_processes} processes "
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
