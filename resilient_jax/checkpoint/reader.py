"""A run's checkpoints read from outside the run: by the sampler and the Hugging Face exporter.

`load_run_config` gives the config the run saved; `restore_newest` gives its newest verified step
(either tier, checked like a resuming run checks it) on the devices present, whatever mesh the run
trained on. Nothing is written into the run: the run may still be training, so no Orbax temp dir
is cleaned, no run id is created, and no newer step is retired to quarantine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import jax
import ml_collections
from absl import logging as absl_logging
from jax.sharding import Mesh

from resilient_jax import config as config_lib
from resilient_jax import mesh as mesh_lib
from resilient_jax import topology as topology_lib
from resilient_jax.checkpoint.local import LocalTier, run_dir
from resilient_jax.checkpoint.persistent import PersistentTier, persistent_dir
from resilient_jax.checkpoint.restore import Restored, Restorer
from resilient_jax.checkpoint.sync import process_sync
from resilient_jax.checkpoint.tier import Tier
from resilient_jax.config import BadInput
from resilient_jax.contracts.event_types import EventType
from resilient_jax.events import EventLog
from resilient_jax.train.context import RunContext
from resilient_jax.train.state import abstract_state


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a run saved in `<workdir>/config.json`, over today's defaults (keys added
    since keep their defaults). Raises `BadInput` if there is none or it does not load."""
    path = os.path.join(workdir, "config.json")
    if not os.path.isdir(workdir):
        raise BadInput(f"--workdir={workdir} is invalid: no such directory")
    if not os.path.isfile(path):
        raise BadInput(f"--workdir={workdir} is invalid: no config.json (not a run directory)")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise BadInput(f"{path} is invalid: {e}") from None
    return merged_config(saved, path)


def merged_config(saved: Any, where: str, drop_unknown: bool = False) -> ml_collections.ConfigDict:
    """Today's defaults updated by a saved config (`where` names it in a BadInput). A key this
    code base does not know is refused, or skipped with `drop_unknown` (a key removed since).
    `model.remat` was a bool before it named a policy: False is "none", True "full"."""
    config = config_lib.default_config()
    _merge(config, saved, where, "config", drop_unknown)
    return config


def _merge(
    config: ml_collections.ConfigDict, saved: Any, path: str, prefix: str, drop_unknown: bool
) -> None:
    if not isinstance(saved, dict):
        raise BadInput(f"{path} is invalid: {prefix} is not a mapping")
    for key, value in saved.items():
        if key not in config:
            if drop_unknown:
                continue
            raise BadInput(f"{path} is invalid: {prefix}.{key} is not a known config key")
        if isinstance(config[key], ml_collections.ConfigDict):
            _merge(config[key], value, path, f"{prefix}.{key}", drop_unknown)
            continue
        if f"{prefix}.{key}" == "config.model.remat" and isinstance(value, bool):
            value = "full" if value else "none"
        try:
            config[key] = value
        except (TypeError, ValueError) as e:
            raise BadInput(f"{path} is invalid: {prefix}.{key}={value!r} ({e})") from None


def inference_mesh(
    config: ml_collections.ConfigDict,
) -> tuple[topology_lib.Topology, topology_lib.MeshPlan, Mesh]:
    """Topology, plan and mesh on the most devices present that the model's shapes divide,
    whatever mesh the run trained on.

    Inference splits no training batch, so the plan is made for a batch of one row per
    data-parallel device, and tensor parallelism the devices cannot divide is dropped.
    """
    devices = jax.devices()
    for count in range(len(devices), 0, -1):
        topology = mesh_lib.discover(devices[:count])
        planned = config.copy_and_resolve_references()
        if count % planned.mesh.tensor or topology.devices_per_slice % planned.mesh.tensor:
            planned.mesh.tensor = 1
        planned.global_batch_size = count // planned.mesh.tensor
        planned.per_device_batch_size = 0
        plan = topology_lib.plan_mesh(planned, topology, strict=False)
        mesh = mesh_lib.make_mesh(plan, topology)
        if count == 1 or _divides(abstract_state(config, mesh)):
            return topology, plan, mesh
    raise AssertionError("jax.devices() is never empty")


def _divides(abstract: Any) -> bool:
    """Whether every array of `abstract` splits evenly over its sharding's mesh axes."""
    for leaf in jax.tree.leaves(abstract):
        mesh_shape = leaf.sharding.mesh.shape
        for size, names in zip(leaf.shape, leaf.sharding.spec, strict=False):
            names = (names,) if isinstance(names, str) else names or ()
            ways = 1
            for name in names:
                ways *= mesh_shape[name]
            if size % ways:
                return False
    return True


class StderrEvents(EventLog):
    """Restore's events, which belong to no training run: nothing goes to the run's events.jsonl;
    why a step was passed by is said on stderr."""

    def __init__(self) -> None:
        super().__init__(None)

    def emit(self, type: str, **fields: Any) -> dict[str, Any]:
        event = super().emit(type, **fields)
        if type == EventType.CHECKPOINT_INVALID:
            print(f"{type}: step {fields.get('step')}: {fields.get('cause')}", file=sys.stderr)
        return event


def restore_newest(config: ml_collections.ConfigDict, workdir: str) -> Restored:
    """The newest verified step of the run in `workdir` on the devices present (`inference_mesh`).

    Raises `BadInput` when the run has no step of its own, `CheckpointError` when none verifies.
    """
    # Orbax warns that a read-only manager saves nothing: true, and no news to a reader.
    absl_logging.set_verbosity(min(absl_logging.get_verbosity(), absl_logging.ERROR))
    topology, plan, mesh = inference_mesh(config)
    ctx = RunContext.on_mesh(config, workdir, topology, plan, mesh, StderrEvents())
    c = config.checkpoint
    directory = persistent_dir(config, workdir)
    persistent = PersistentTier(directory, c.keep, c.keep_period, read_only=True)
    local = None
    if c.local_dir and c.local_every_steps > 0:
        local = LocalTier(
            run_dir(c.local_dir, workdir), jax.process_index(), c.local_keep, read_only=True
        )
    restorer = Restorer(
        persistent=persistent,
        persistent_dir=directory,
        local=local,
        sync=process_sync("resilient_jax/checkpoint/reader", c.sync_timeout_s),
        events=ctx.events,
        fingerprint=config_lib.fingerprint(config),
        run_id=persistent.run_id(create=False) or "",
        # The config is the run's own, read back: only the shapes must match (a fingerprint can
        # differ when a newer version hashes more of the config).
        accept_other_config=True,
        on_new_timeline=lambda step, timeline: None,
        read_only=True,
    )
    try:
        restored = restorer.restore(ctx, time.perf_counter(), max_step=None, exact=False)
    finally:
        persistent.close()
    # A run with no step of its own restores only `checkpoint.init_from`'s parameters: not its.
    if restored is None or restored.tier == Tier.INIT_FROM:
        raise BadInput(f"--workdir={workdir} is invalid: it holds no checkpoint")
    return restored
