"""The control plane: the supervisor that starts, watches and restarts the workers of a job.

    supervisor       the supervision loop over generations: watch, decide, restart
    cluster          the job's shape (`ClusterSpec`) and the mesh plan for a number of slices
    launcher         the start of a generation's workers (through the agents), and warm standbys
    agent            the host agent (`python -m resilient_jax.control.agent`), its `probe`, and
                     `agent_protocol`: what agent and supervisor say, the run token
    host_plane       the supervisor's side of its hosts: listener, `hosts` registry, lost hosts,
                     `local_hosts` (one agent per slice on this machine), `attach` (after a restart)
    worker_env       the environment each worker starts with
    processes        worker processes: spawn, signal, stop within a bound
    server, protocol the heartbeat server and what workers send it
    detector         failure and hang detection from the workers' reports; `failure_verdicts`:
                     what a failure means (the slice to blame, lost or retried in place)
    stragglers       which process the others keep waiting for
    restart_policy   slices in and out, restart budget and back-off, whether a reshape pays
    announced_outages  slice outages the chaos hook announces in the event log
    fault_injection  faults the supervisor injects (kill, hang, lose_slice, preempt, host faults)
    stop_requests    SIGINT/SIGTERM to the supervisor itself
    compile_cache    JAX's persistent compilation cache for the workers

It never imports JAX (or Flax, Optax, Orbax): it starts in milliseconds and survives anything a
device does. The worker's side of the conversation is `resilient_jax.worker`.

    Supervisor(config, ClusterSpec(...), worker_argv, workdir).run()   # or launch/local_cluster.py
"""

from resilient_jax.control.cluster import ClusterSpec, plan_for
from resilient_jax.control.fault_injection import SupervisorAction
from resilient_jax.control.run_result import SupervisorResult
from resilient_jax.control.supervisor import Supervisor

__all__ = ["ClusterSpec", "Supervisor", "SupervisorAction", "SupervisorResult", "plan_for"]
