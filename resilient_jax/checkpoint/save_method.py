"""How a save holds the state while both tiers read it in the background: kept on the device, or
copied to host (`checkpoint.keep_state`).

Keeping costs no copy (the step after the save runs without donating the saved state, `train.keep`)
but holds one extra params + optimizer state in device memory until the tiers have read it: the
save step's peak, which `--plan` shows (`memory_plan.MeshMemory.save_peak_kept`). Where that peak
does not fit, the save copies the state straight into pinned host memory instead, array by array
(each shard a direct device-to-host transfer into a host buffer: no second device copy), and
blocks for that transfer; the tiers then read the host copy.

`auto` decides once per checkpointer from the plan of the run's own mesh and the device's memory
(`checkpoint.device_memory_gb`, else what the device reports; a CPU reports none, and there
device memory is host memory, so the state is kept).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import ml_collections

from resilient_jax.contracts.names import Name
from resilient_jax.topology import MeshPlan
from resilient_jax.train import memory_plan

GB = memory_plan.GB


class SaveMethod(Name):
    KEEP = "keep"  # the saved state stays on the device while the tiers read it
    COPY_TO_HOST = "copy_to_host"  # the saved state is copied to pinned host memory first


@dataclasses.dataclass(frozen=True)
class Choice:
    method: SaveMethod
    why: str
    device_bytes: int | None = None  # one device's memory, when known
    steady_bytes: int | None = None  # the plan's steady state per device
    save_peak_bytes: int | None = None  # the plan's save-step peak with the state kept


def device_memory_bytes(config: ml_collections.ConfigDict) -> int | None:
    """One device's memory: `checkpoint.device_memory_gb`, else the device's own figure."""
    if config.checkpoint.device_memory_gb > 0:
        return int(config.checkpoint.device_memory_gb * GB)
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def choose(config: ml_collections.ConfigDict, plan: MeshPlan) -> Choice:
    """The save method for `config` on the mesh `plan`."""
    mode = config.checkpoint.keep_state
    if mode == "always":
        return Choice(SaveMethod.KEEP, "checkpoint.keep_state=always")
    if mode == "never":
        return Choice(SaveMethod.COPY_TO_HOST, "checkpoint.keep_state=never")
    capacity = device_memory_bytes(config)
    if capacity is None:
        return Choice(SaveMethod.KEEP, "the device reports no memory limit (host memory)")
    mem = memory_plan.mesh_memory(config, plan, slices=plan.replica, capacity=capacity)
    figures = dict(
        device_bytes=capacity, steady_bytes=mem.total, save_peak_bytes=mem.save_peak_kept
    )
    budget = f"{memory_plan.HEADROOM:.0%} of {capacity / GB:.2f} GB"
    if mem.keeps_state:
        why = f"save-step peak {mem.save_peak_kept / GB:.2f} GB fits {budget}"
        return Choice(SaveMethod.KEEP, why, **figures)
    why = (
        f"save-step peak {mem.save_peak_kept / GB:.2f} GB (steady {mem.total / GB:.2f} GB) "
        f"exceeds {budget}"
    )
    logging.info("saves copy the state to host: %s", why)
    return Choice(SaveMethod.COPY_TO_HOST, why, **figures)
