"""A save without a copy: the step after a save leaves the saved state's buffers valid.

The train step donates its input state (the state's buffers become the new state's), so a hook
that reads a state after the loop's next step has been dispatched (the checkpointer's writer
threads read a saved state in the background) must copy it first
(`checkpoint.snapshot.device_snapshot`: on CPU devices a memcpy of the whole state run inline on
the dispatching thread, 0.03 s of the loop's time for tiny_cpu's 44 MB). Instead, the step that
follows a save runs the same program compiled without donation: it writes the new state into
fresh buffers (one allocation instead of a copy), so the saved state stays valid until the tiers
drop it, and later steps donate again. Memory is what the copy took: one extra state while the
save is read. The two programs differ only in which buffers the outputs go to; their results are
bitwise equal (`tests/test_keep.py`).

`StateKeeper` connects the two sides. The step (`KeepingProgram`) offers to keep a state once
its non-donating program is loaded; a hook asks it to keep the state it was handed (`keep`, True
if the step will); the step's next call runs the non-donating program if it is given that state
(`claim`). Any other state (one a rollback restored, one a heal replaced) is donated as usual,
and the request is dropped at that call either way, so a kept state is never held past one step.

The non-donating program is a second executable ("train_keep" in the executable cache, compiled
ahead for a candidate mesh like the step itself): loaded or compiled in a background thread from
the first save after the first step, so it never delays a (re)start, and a run that never saves
never loads it; until it is ready, a save copies. Elastic mode does the same with the program
that consumes the loop's state there, its update ("elastic_apply_keep", `elastic.slice_step`); a
warm standby slice loads it while it waits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from resilient_jax.train.deferred import DeferredProgram

KEEP_PROGRAM = "train_keep"  # the non-donating step's name in the executable cache


class StateKeeper:
    """Between the hooks and the loop's step: which state the next step must leave valid."""

    def __init__(self) -> None:
        self._can_keep: Callable[[], bool] = lambda: False
        self._kept: Any = None

    def offer(self, can_keep: Callable[[], bool]) -> None:
        """Called by the loop's step: `can_keep()` says whether its next call can keep a state."""
        self._can_keep = can_keep
        self._kept = None

    def keep(self, state: Any) -> bool:
        """Asks the loop's next step not to donate `state`. True: `state` stays valid after that
        step, for as long as the caller holds it; False: it will be donated (copy it)."""
        if not self._can_keep():
            return False
        self._kept = state
        return True

    def claim(self, state: Any) -> bool:
        """Called by the step at every call: whether to leave `state` valid (it was kept). The
        request ends here either way."""
        kept, self._kept = self._kept, None
        return kept is not None and kept is state


class KeepingProgram:
    """A compiled program that takes the train state first and donates it, running its
    non-donating twin on a state a hook keeps. Called like the donating program:
    `(state, *args)`. The loop's train step is one (`train.compile.compile_step`); so is elastic
    mode's update (`elastic.slice_step`)."""

    def __init__(
        self,
        donating: Callable[..., Any],
        keeping: DeferredProgram,
        keeper: StateKeeper,
        name: str = KEEP_PROGRAM,
    ) -> None:
        self._donating, self._keeping, self._keeper = donating, keeping, keeper
        self._name = name
        self._calls = 0
        self._warned = False
        keeper.offer(self._ready)

    def __call__(self, state: Any, *args: Any) -> Any:
        self._calls += 1
        if self._keeper.claim(state):
            return self._keeping(state, *args)
        return self._donating(state, *args)

    def close(self) -> None:
        """Waits for the non-donating program's compile, if one is running: a process that
        exits while XLA compiles in a thread aborts (SIGABRT, after a finished run)."""
        self._keeping.join()

    def load_keeping(self) -> None:
        """Loads (or compiles) the non-donating program now and waits for it."""
        self._keeping.wait()

    def start_loading(self) -> None:
        """Starts loading (or compiling) the non-donating program in the background now, not at
        the first save (a warm standby does, while it waits)."""
        self._keeping.start()

    def _ready(self) -> bool:
        # Asked at each save. The program is loaded from the first save after the second call's
        # dispatch on (the loop has waited for the first step), beside training; a run that never
        # saves never loads it.
        if self._calls >= 2:
            self._keeping.start()
        if self._keeping.error is not None and not self._warned:
            # Saves go on copying the state: slower, never wrong.
            self._warned = True
            logging.warning(
                "non-donating program %s unavailable: %s", self._name, self._keeping.error
            )
        return self._keeping.ready()
