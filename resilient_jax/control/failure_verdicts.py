"""What the supervisor concludes from a failure it has seen: the hang of a process that outlives
the end of training, the slice a failure is blamed on and whether that slice is lost, and why a
run a process stopped on purpose ends. Pure functions of what the watch saw."""

from __future__ import annotations

from collections.abc import Sequence

from resilient_jax.contracts import exit_codes
from resilient_jax.control import detector
from resilient_jax.control.generation import Outcome, Watched


def hang_after_finish(process: int, completed_at: float, now: float) -> Watched:
    """The hang of `process`, still running too long after another finished training."""
    return Watched(
        Outcome.FAILURE,
        detector.Failure(
            detector.FailureCause.HANG,
            process,
            f"process {process} still running {now - completed_at:.1f}s after "
            "another finished training",
            since=completed_at,
        ),
    )


def blamed_slice(
    failure: detector.Failure, slice_id: int | None, lost_slices: Sequence[int]
) -> tuple[int | None, bool]:
    """The slice a failure of a process on `slice_id` is blamed on, and whether that slice is
    lost (to be evicted) rather than retried in place; `lost_slices`: those whose hosts were
    found lost."""
    # A process that exited with an error code ran and reported a software error: its
    # hardware is presumed fine and the slice is retried in place (a repeat is a crash loop).
    # Killed by a signal, silent or stuck: the slice is lost and evicted whole. A host found
    # lost meanwhile outranks a peer's error (the peer's collective failed with it).
    software_error = failure.cause == detector.FailureCause.ERROR or (
        failure.exit_code is not None and failure.exit_code > 0
    )
    if lost_slices and slice_id not in lost_slices:
        slice_id, software_error = lost_slices[0], False
    return slice_id, slice_id is not None and not software_error


def fatal_reason(failure: detector.Failure) -> str:
    """Why the run ends when a process stopped it on purpose (an `exit_codes.FATAL` exit)."""
    assert failure.exit_code is not None
    code = failure.exit_code
    return (
        f"process {failure.process} stopped the run: "
        f"{exit_codes.FATAL[code]} (exit {code}); see its output"
    )
