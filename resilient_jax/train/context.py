"""What every part of a run shares: config, workdir, topology, mesh, event log."""

from __future__ import annotations

import dataclasses

import ml_collections
from jax.sharding import Mesh

from resilient_jax.events import EventLog
from resilient_jax.topology import MeshPlan, Topology
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
