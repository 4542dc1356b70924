"""Multi-controller coordination: the supervisor that runs, watches and restarts workers, and the
worker side that joins the JAX job and reports heartbeats and progress.

Worker program (`launch/train.py`), in this order:

    client = SupervisorClient.from_env(config.coordinator)   # None when not supervised
    env = initialize_from_env(config.coordinator, events)    # before any other JAX call
    ...                                                      # topology, mesh, restore, compile
    hooks.append(client)                                     # heartbeats + step progress
    # SIGTERM = save and stop: save at multihost_utils.reached_preemption_sync_point(step),
    # then exit with EXIT_PREEMPTED.

Supervisor: `Supervisor(config, ClusterSpec(...), worker_argv, workdir).run()`, or
`launch/local_cluster.py`.
"""

from resilient_jax.coordinator.client import SupervisorClient
from resilient_jax.coordinator.protocol import (
    EXIT_PREEMPTED,
    PHASE_COMPILE,
    PHASE_DONE,
    PHASE_INIT,
    PHASE_RESTORE,
    PHASE_SAVE,
    PHASE_TRAIN,
)
from resilient_jax.coordinator.supervisor import (
    ClusterSpec,
    Supervisor,
    SupervisorAction,
    SupervisorResult,
    plan_for,
)
from resilient_jax.coordinator.worker import WorkerEnv, initialize_from_env, read_env

__all__ = [
    "EXIT_PREEMPTED",
    "PHASE_COMPILE",
    "PHASE_DONE",
    "PHASE_INIT",
    "PHASE_RESTORE",
    "PHASE_SAVE",
    "PHASE_TRAIN",
    "ClusterSpec",
    "Supervisor",
    "SupervisorAction",
    "SupervisorClient",
    "SupervisorResult",
    "WorkerEnv",
    "initialize_from_env",
    "plan_for",
    "read_env",
]
