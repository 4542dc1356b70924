"""The job's shape as the supervisor sees it: how many slices, processes and devices, and which
slice counts the config can train on.

The supervisor never sees a device: it plans each generation's mesh with `topology.plan_mesh`, the
same arithmetic the workers use, on stand-ins for the devices.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from resilient_jax import topology as topology_lib
from resilient_jax.config import ConfigError
from resilient_jax.topology import MeshPlan, plan_mesh


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    num_slices: int
    processes_per_slice: int = 1
    devices_per_process: int = 1
    spare_slices: int = 0

    def __post_init__(self) -> None:
        for name in ("num_slices", "processes_per_slice", "devices_per_process"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.spare_slices < 0:
            raise ValueError(f"spare_slices={self.spare_slices} must be >= 0")


def plan_for(config: ml_collections.ConfigDict, num_slices: int, cluster: ClusterSpec) -> MeshPlan:
    """The mesh the trainer will build on `num_slices` slices (raises ConfigError if none fits).

    `plan_mesh` only counts devices, so stand-ins replace the devices the supervisor never sees.
    """
    processes = num_slices * cluster.processes_per_slice
    devices = tuple(object() for _ in range(processes * cluster.devices_per_process))
    topo = topology_lib.Topology(
        num_slices=num_slices,
        num_processes=processes,
        process_index=0,
        devices=devices,  # type: ignore[arg-type]
    )
    return plan_mesh(config, topo, strict=False)


def fit_slices(
    config: ml_collections.ConfigDict, cluster: ClusterSpec, slices: list[int]
) -> tuple[list[int], str | None]:
    """The longest prefix of `slices` the config can run on (the global batch must divide), and
    why the whole list cannot run when no prefix can."""
    error = "no slices"
    for n in range(len(slices), 0, -1):
        try:
            plan_for(config, n, cluster)
        except ConfigError as e:
            error = f"cannot run on {n} slices: {e}" if n == len(slices) else error
            continue
        return slices[:n], None
    return [], error
