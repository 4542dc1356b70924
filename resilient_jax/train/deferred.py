"""A program compiled (or loaded from the executable cache) in a background thread, so that its
compile stays off the path from a (re)start to the first train step; the first call waits for it.

Held-out evaluation's step is one: it is not needed before the first evaluation, and loading it
on the start path cost about half a second of every recovery on a 2-core host.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class DeferredProgram:
    """`compile_fn()` run in a thread once `start()` is called (at the latest by the first call);
    calling the object calls the compiled program. An error of the compile is raised there."""

    def __init__(self, compile_fn: Callable[[], Callable[..., Any]]) -> None:
        self._compile_fn = compile_fn
        self._program: Callable[..., Any] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._compile, name="rj-deferred-compile", daemon=True
                )
                self._thread.start()

    def _compile(self) -> None:
        try:
            self._program = self._compile_fn()
        except BaseException as e:  # raised in the caller's thread at the first call
            self._error = e

    def ready(self) -> bool:
        """Whether the program is compiled (without waiting); False after a failed compile."""
        return self._program is not None

    @property
    def error(self) -> BaseException | None:
        """The compile's error, once it failed (a call raises it)."""
        return self._error

    def join(self) -> None:
        """Returns once a started compile has ended (at once if none was started); its error,
        if any, stays for the first call."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()

    def wait(self) -> None:
        """Returns once the program is compiled (starting the compile if need be)."""
        self.start()
        assert self._thread is not None
        self._thread.join()
        if self._error is not None:
            raise self._error

    def __call__(self, *args: Any) -> Any:
        self.wait()
        assert self._program is not None
        return self._program(*args)
