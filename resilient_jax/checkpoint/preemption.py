"""Preemption notices: SIGTERM becomes "save at an agreed step, then stop".

With `jax.distributed` initialised, JAX's preemption sync manager catches SIGTERM on any process
and all processes agree on the step to save at (`reached_preemption_sync_point`, to be called every
step). A single process without the distributed runtime has no such manager, so a Python SIGTERM
handler sets a flag that the next step reads.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from jax._src import distributed  # whether the distributed runtime (and its manager) is up
from jax.experimental import multihost_utils


class PreemptionNotice:
    """Constructed idle; `install` takes SIGTERM over where no sync manager does, `close` gives it
    back."""

    def __init__(self, handle_sigterm: bool = True) -> None:
        self._handle_sigterm = handle_sigterm
        self._requested = threading.Event()
        self._previous: Any = None
        self._installed = False
        self._use_sync_manager = False

    def install(self) -> None:
        self._use_sync_manager = (
            distributed.global_state.client is not None
            and distributed.global_state.preemption_sync_manager is not None
        )
        if (
            self._handle_sigterm
            and not self._installed
            and not self._use_sync_manager
            and threading.current_thread() is threading.main_thread()
        ):
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._requested.set()
        # Chain to a handler someone installed before us (not the default, which would exit).
        if callable(self._previous):
            self._previous(signum, frame)

    def reached(self, step: int) -> bool:
        """True at the step where every process saves and stops. Call once per step, everywhere."""
        if self._use_sync_manager:
            return bool(multihost_utils.reached_preemption_sync_point(step))
        return self._requested.is_set()

    def close(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(signal.SIGTERM, previous)
            self._installed = False
