"""What every part of a run shares: config, workdir, topology, mesh, event log; `prepare` makes it
for the devices of the running JAX job."""

from __future__ import annotations

import dataclasses

import jax
import ml_collections
from jax.sharding import Mesh

from resilient_jax import mesh as mesh_lib
from resilient_jax import topology as topology_lib
from resilient_jax.events import EventLog
from resilient_jax.topology import MeshPlan, Topology
from resilient_jax.train.keep import StateKeeper
from resilient_jax.train.state import TrainState, abstract_state


@dataclasses.dataclass
class RunContext:
    config: ml_collections.ConfigDict
    workdir: str
    topology: Topology
    plan: MeshPlan
    mesh: Mesh
    events: EventLog
    abstract_state: TrainState  # ShapeDtypeStructs with shardings: the target of every restore
    generation: int = 0  # how many times the coordinator has restarted this job
    # Which state the loop's next step must not donate (a save reads it in the background).
    keeper: StateKeeper = dataclasses.field(default_factory=StateKeeper)

    @classmethod
    def on_mesh(
        cls,
        config: ml_collections.ConfigDict,
        workdir: str,
        topology: Topology,
        plan: MeshPlan,
        mesh: Mesh,
        events: EventLog,
        generation: int = 0,
    ) -> RunContext:
        """The context of a run on `mesh`, with the abstract state every restore targets."""
        state = abstract_state(config, mesh)
        return cls(config, workdir, topology, plan, mesh, events, state, generation)


def prepare(
    config: ml_collections.ConfigDict, workdir: str, events: EventLog, generation: int = 0
) -> RunContext:
    """Topology, mesh and state shapes: everything before the first step that touches no
    parameters. Raises ConfigError when the config does not fit the devices."""
    topology = mesh_lib.discover()
    plan = topology_lib.plan_mesh(planned_config(config), topology, strict=generation == 0)
    mesh = mesh_lib.make_mesh(plan, topology)
    events.update_common(process=jax.process_index(), slice=topology.slice_index)
    return RunContext.on_mesh(config, workdir, topology, plan, mesh, events, generation)


def planned_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The config the mesh is planned for: in elastic mode a slice computes the global batch a
    part at a time (`elastic.slices` parts), so its mesh and microbatches are those of one part."""
    if not config.elastic.enabled:
        return config
    part = config.copy_and_resolve_references()
    part.global_batch_size = config.global_batch_size // config.elastic.slices
    return part
