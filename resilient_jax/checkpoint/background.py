"""One long-lived daemon thread per checkpoint writer, running its saves in order.

A save hands its write to this thread instead of starting a thread of its own: `Thread.start`
waits until the new thread has been scheduled and has taken the interpreter lock, which on a
loaded host costs the training thread tens of milliseconds per save (measured: 18 ms on the
2-core machine, more than the device snapshot itself). Handing work to a running thread is a
queue put. The thread is a daemon: a write stuck on a store that stopped answering must not hold
the process at exit (the checkpointer has already given up on it and said so).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable


class Job:
    """A call handed to a `BackgroundThread`; done once it has returned or raised."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether the call finished within `timeout_s` (None: waits for it)."""
        return self._done.wait(timeout_s)


class BackgroundThread:
    """Runs submitted calls one after another on a daemon thread, started at construction.

    Calls must handle their own errors (a writer records them for its `finish`); anything they
    let through is dropped here so the thread keeps serving."""

    def __init__(self, name: str, nice: int = 0) -> None:
        """`nice`: added to the thread's own nice value (Linux schedules threads one by one), so
        that its work takes the CPU the training thread and XLA's leave idle."""
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], Job] | None] = queue.SimpleQueue()
        self._nice = nice
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], None]) -> Job:
        job = Job()
        self._queue.put((call, job))
        return job

    def stop(self, wait_s: float = 0.0) -> None:
        """Ends the thread once the calls already submitted have run, waiting up to `wait_s`.

        Waiting matters at exit: a daemon thread that wakes while the interpreter finalizes is
        torn down mid-call, which has aborted processes that had otherwise finished cleanly."""
        self._queue.put(None)
        self._thread.join(wait_s)

    def _serve(self) -> None:
        if self._nice:
            # Best effort: a platform without per-thread priorities runs the thread as it is.
            with contextlib.suppress(OSError, AttributeError):
                tid = threading.get_native_id()
                niceness = os.getpriority(os.PRIO_PROCESS, tid) + self._nice
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        while (item := self._queue.get()) is not None:
            call, job = item
            try:
                call()
            except BaseException:  # the call's owner records its failures itself
                pass
            finally:
                job._done.set()
