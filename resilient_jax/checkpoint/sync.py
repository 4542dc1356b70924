"""The checkpoint tiers' agreement among processes (`resilient_jax.agreement`): restore's choice
of step and tier, a time-based save's step, the writer's commits. A silent peer is a one-line
`CheckpointError`."""

from __future__ import annotations

from resilient_jax.agreement import Agreement
from resilient_jax.checkpoint.errors import CheckpointError


def _silent(process: int, what: str, seconds: float, detail: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint: processes did not agree on {what} within {seconds:.0f}s "
        f"(a peer is dead or hung): {detail}"
    )


def process_sync(namespace: str, timeout_s: float) -> Agreement:
    """The agreement of this process's runtime under `namespace`."""
    return Agreement.of_runtime(namespace, timeout_s, _silent)
