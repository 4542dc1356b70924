"""Requests to stop the supervisor: SIGINT and SIGTERM ask it to have the workers save and stop; a
second one cuts the save's grace short."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable


class StopRequests:
    """The signals received so far; safe to feed from a signal handler."""

    def __init__(self, poll_s: float) -> None:
        self._signals: list[int] = []
        self._poll_s = poll_s
        self._taken = 0  # how many `unseen` handed out

    def request(self, signum: int) -> None:
        self._signals.append(signum)

    @property
    def requested(self) -> bool:
        return bool(self._signals)

    @property
    def hurry(self) -> bool:
        """A second request: stop without waiting for saves."""
        return len(self._signals) > 1

    def unseen(self) -> list[int]:
        """The signals received since the last call (each handed on once: elastic mode passes
        every one to its slices, the second cutting their save short)."""
        signals = self._signals[self._taken :]
        self._taken += len(signals)
        return signals

    def first_name(self) -> str:
        return signal.Signals(self._signals[0]).name

    def sleep(self, seconds: float) -> bool:
        """Sleeps up to `seconds`; True if a stop was requested meanwhile."""
        end = time.monotonic() + max(0.0, seconds)
        while time.monotonic() < end:
            if self._signals:
                return True
            time.sleep(min(self._poll_s, max(0.0, end - time.monotonic())))
        return self.requested

    def install_handlers(self) -> Callable[[], None]:
        """Routes SIGINT and SIGTERM here (main thread only); returns what restores the previous
        handlers."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for signum in previous:
            signal.signal(signum, lambda s, _frame: self.request(s))

        def restore() -> None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

        return restore
