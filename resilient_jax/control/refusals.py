"""How a control port reports the connections it refuses, at a bounded rate per peer.

Every refusal is reported, but a hostile or broken peer that opens connections in a loop must
not turn the supervisor's log and event file into a flood. So, per peer host (the port changes
with every connection), the first `burst` refusals of each `window_s` are reported one by one,
and the rest are only counted; the count, with how many of each reason, is reported once that
window ends (or the server closes). The reports of a peer thus always add up to its refusals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from resilient_jax.contracts.event_types import EventType
from resilient_jax.events import EventLog

# A window counts at most this many distinct reasons; any other is counted under OTHER_REASONS,
# so what a peer can make the server remember stays bounded whatever it sends.
MAX_REASONS = 16
OTHER_REASONS = "other reasons"

# (peer "host:port", why)
OnRefused = Callable[[str, str], None]
# (peer host, how many were not reported one by one, {why: count}, the window they fell in)
OnSuppressed = Callable[[str, int, dict[str, int], float], None]


@dataclasses.dataclass
class _Window:
    started: float
    reported: int = 0
    suppressed: dict[str, int] = dataclasses.field(default_factory=dict)


class RefusalLimiter:
    """Reports refusals through `on_refused`, at most `burst` per peer host and window; the ones
    beyond are summed up through `on_suppressed` when the window ends. Used from one thread."""

    def __init__(
        self,
        burst: int,
        window_s: float,
        on_refused: OnRefused | None,
        on_suppressed: OnSuppressed | None,
    ) -> None:
        self._burst = burst
        self._window_s = window_s
        self._on_refused = on_refused
        self._on_suppressed = on_suppressed
        # Only hosts with a refusal in their current window: the map shrinks back as windows end.
        self._windows: dict[str, _Window] = {}
        self.total = 0  # refusals since the start, reported or not

    def refused(self, peer: str, why: str, now: float) -> None:
        self.total += 1
        host = peer.rpartition(":")[0] or peer
        window = self._windows.get(host)
        if window is not None and now - window.started >= self._window_s:
            self._end(host, window)
            window = None
        if window is None:
            window = self._windows[host] = _Window(started=now)
        if window.reported < self._burst:
            window.reported += 1
            if self._on_refused is not None:
                self._on_refused(peer, why)
            return
        if why not in window.suppressed and len(window.suppressed) >= MAX_REASONS:
            why = OTHER_REASONS
        window.suppressed[why] = window.suppressed.get(why, 0) + 1

    def flush(self, now: float | None) -> None:
        """Ends the windows that are over by `now` (every window with `now` None: the server
        is closing), reporting what each suppressed."""
        for host, window in list(self._windows.items()):
            if now is None or now - window.started >= self._window_s:
                self._end(host, window)

    def _end(self, host: str, window: _Window) -> None:
        del self._windows[host]
        count = sum(window.suppressed.values())
        if count and self._on_suppressed is not None:
            self._on_suppressed(host, count, dict(window.suppressed), self._window_s)


class RefusalReports:
    """What a supervisor does with a control port's reports: an event and a line of its log."""

    def __init__(self, events: EventLog, say: Callable[[str], None]) -> None:
        self._events = events
        self._say = say

    def refused(self, peer: str, why: str) -> None:
        self._events.emit(EventType.CONNECTION_REFUSED, peer=peer, why=why)
        self._say(f"refused a connection from {peer}: {why}")

    def suppressed(self, peer: str, count: int, reasons: dict[str, int], window_s: float) -> None:
        self._events.emit(
            EventType.CONNECTION_REFUSALS_SUPPRESSED,
            peer=peer,
            count=count,
            reasons=reasons,
            window_s=window_s,
        )
        self._say(f"refused {count} more connections from {peer} in {window_s:g}s: {reasons}")
