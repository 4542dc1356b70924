"""The fault vocabulary of `--chaos` specs: each kind, the keys it needs and the defaults of the
others. The parser (`resilient_jax.chaos.spec`), the worker-side injector and the supervisor's
fault actions all read the kinds from here."""

from __future__ import annotations

from typing import Any

from resilient_jax.contracts.names import Name


class FaultKind(Name):
    NAN = "nan"  # the loss of step K is NaN
    SPIKE = "spike"  # the loss (and so the gradient) of step K is F times larger
    SLOW = "slow"  # from step K process P takes F times as long
    HANG = "hang"  # process P stops making progress at step K (mode sleep or stop)
    KILL = "kill"  # process P SIGKILLs itself at step K
    LOSE_SLICE = "lose_slice"  # every process of slice S dies at step K; the slice stays out T
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"  # flip bytes in the newest committed checkpoint
    # Whole hosts: the supervisor has the agent of each host of slice S act them out at step K
    # (workers ignore them), so they work across machines.
    LOSE_HOST = "lose_host"  # agent and workers SIGKILLed; the host boots again after T
    FREEZE_HOST = "freeze_host"  # agent and workers SIGSTOPped, for good
    # Without network namespaces: the agent closes its link to the supervisor and ignores it for
    # T (its workers run on); the namespace test bed cuts the host's link instead.
    PARTITION_HOST = "partition_host"
    RANDOM = "random"  # a seeded schedule of the kinds above


SPIKE_FACTOR = 100.0
HANG_MODES = ("sleep", "stop")

# kind -> (required keys, optional keys with their defaults)
KEYS: dict[FaultKind, tuple[tuple[str, ...], dict[str, Any]]] = {
    FaultKind.NAN: (("step",), {}),
    FaultKind.SPIKE: (("step",), {"factor": SPIKE_FACTOR}),
    FaultKind.SLOW: (("process", "factor"), {"step": 1}),
    FaultKind.HANG: (("process", "step"), {"mode": "sleep"}),
    FaultKind.KILL: (("process", "step"), {}),
    FaultKind.LOSE_SLICE: (("slice", "step", "for"), {}),
    FaultKind.CORRUPT_CHECKPOINT: (("step",), {}),
    FaultKind.LOSE_HOST: (("slice", "step", "for"), {}),
    FaultKind.FREEZE_HOST: (("slice", "step"), {}),
    FaultKind.PARTITION_HOST: (("slice", "step", "for"), {}),
}

# Kinds the supervisor carries out through the hosts' agents; a worker's chaos hook skips them.
HOST_FAULT_KINDS = (FaultKind.LOSE_HOST, FaultKind.FREEZE_HOST, FaultKind.PARTITION_HOST)

# Kinds that change the loss: every process must apply them at the same step, or replicated
# values would diverge.
LOSS_KINDS = (FaultKind.NAN, FaultKind.SPIKE)


class SupervisorFaultKind(Name):
    """Faults only the supervisor injects: a worker does not send itself a preemption notice, so
    these have no `--chaos` spelling. The supervisor's other faults (kill, hang, lose_slice) are
    `FaultKind`s."""

    PREEMPT = "preempt"  # SIGTERM to a worker, as a cloud preemption notice: it saves and stops
