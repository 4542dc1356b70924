"""The control plane: the supervisor that starts, watches and restarts the workers of a job, its
heartbeat server, failure/hang/straggler detection and restart policy.

It never imports JAX (or Flax, Optax, Orbax): it starts in milliseconds and survives anything a
device does. The worker's side of the conversation is `resilient_jax.worker`.

    Supervisor(config, ClusterSpec(...), worker_argv, workdir).run()   # or launch/local_cluster.py
"""

from resilient_jax.control.supervisor import (
    ClusterSpec,
    Supervisor,
    SupervisorAction,
    SupervisorResult,
    plan_for,
)

__all__ = ["ClusterSpec", "Supervisor", "SupervisorAction", "SupervisorResult", "plan_for"]
