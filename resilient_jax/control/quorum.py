"""The quorum server of elastic mode: which slices exchange gradients at the next step.

Each slice's worker keeps one TCP connection open to it and, before every step, asks for the
quorum of that step (its slice id, its state's step, the address of the rendezvous store it
hosts). A quorum is decided, and sent to everyone who asked, when every connected slice has asked:
the members are in lockstep (their exchange is a barrier), so this is one round trip per step. A
slice whose connection closes (its process died) is out at once, which is what lets the survivors
of a killed slice re-form within milliseconds. A connected slice that does not ask is left out
only when a member asks to re-form (its exchange failed, so the silent one is dead or hung) and
`join_timeout_s` has passed: a slow slice is waited for, never split off. Once left out, a slice
still connected is not waited for at the next steps (only the last quorum's members are): the
others train on without a stall per step, and it is let back in, and healed, when it asks again.

A quorum keeps its id while its members, their steps and their groups stay the same, so a steady
job forms its exchange group once; any change (a slice lost or joining, a member behind the others,
a member whose group broke) gets a new id, unique across restarts of this server.

A freshly started server decides nothing until the job's slices are back: `expected` of them, and
every member of the quorum that a training slice says it is on (its request carries that quorum).
Until then (at most `settle_s`) a slice that is training on a quorum gets "no quorum" at once and
trains on with it, and a starting one waits; so a restarted server neither splits the job in two
nor stalls it. Once they are all back, a quorum that every one of them is on, at one step, is
taken over with its id: the slices' exchange group stays as it is. The messages are typed
(`quorum_protocol`), JSON lines with the run token; no JAX and no torch here.

A warm standby slice (`elastic.standby`) waits here too, on a connection of its own: it registers
with its pid (`standby`) once it is ready to join, is no slice (no quorum waits for it), and is
sent its role (`control.standby.Role`: the slice it replaces, and its workdir) when the supervisor
gives it one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from typing import Any

import ml_collections

from resilient_jax.config import default_config
from resilient_jax.contracts import env_vars
from resilient_jax.control import protocol, wire
from resilient_jax.control.line_server import ConnectionLimits, LineServer, PortGuard
from resilient_jax.control.quorum_protocol import QuorumAnswer, QuorumRequest, StandbyReady
from resilient_jax.control.refusals import RefusalReports
from resilient_jax.control.standby import Role


@dataclasses.dataclass
class _Request:
    conn: socket.socket
    step: int
    store: str
    reform: bool
    # The quorum a slice is training on (id, slices), None when it has none that works.
    last: tuple[str, tuple[int, ...]] | None


class QuorumServer(LineServer):
    """Decides quorums in a background thread; `address` is where workers connect."""

    def __init__(
        self,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        join_timeout_s: float | None = None,  # None: elastic.join_timeout_s's default
        expected: int = 0,
        settle_s: float = 5.0,
        guard: PortGuard | None = None,
    ) -> None:
        super().__init__(host, port, "rj-quorum", 0.01, guard=guard)
        self._token = token
        if join_timeout_s is None:
            join_timeout_s = float(default_config().elastic.join_timeout_s)
        self._join_timeout_s = join_timeout_s
        self._expected = expected
        self._settle_until = time.monotonic() + settle_s
        self._slice_of: dict[socket.socket, int] = {}
        self._pending: dict[int, _Request] = {}
        self._first_pending_at = 0.0
        # Unique across restarts: quorum ids name rendezvous keys in the members' stores.
        self._nonce = f"{os.getpid():x}-{time.time_ns():x}"
        self._count = 0
        self._last: tuple[str, tuple[tuple[int, int], ...]] | None = None
        self._known: set[int] = set()  # before the first quorum: members of the slices' quorums
        self._deferred = -1  # before the first quorum: the last step answered "no quorum yet"
        self._standbys: dict[socket.socket, int] = {}  # ready standbys' connections: their pids
        self._assignments: dict[int, Role] = {}  # by pid, until sent
        self._lock = threading.Lock()
        self.decided: list[dict[str, Any]] = []  # every quorum sent: time, id, slices, steps
        self._start()

    @classmethod
    def for_job(
        cls, config: ml_collections.ConfigDict, token: str, address: str, refusals: RefusalReports
    ) -> QuorumServer:
        """The quorum server of an elastic job of `config` on `address` (host:port, port 0: a
        free one), its port held to `coordinator.*`'s limits."""
        host, port = protocol.split_address(address)
        return cls(
            token,
            host,
            port,
            join_timeout_s=float(config.elastic.join_timeout_s),
            expected=int(config.elastic.slices),
            # the first quorum waits for every slice to have started (or this long)
            settle_s=float(config.coordinator.startup_timeout_s),
            guard=PortGuard.reporting_to(
                refusals, ConnectionLimits.from_config(config.coordinator)
            ),
        )

    def connected_slices(self) -> list[int]:
        with self._lock:
            return sorted(set(self._slice_of.values()))

    def last_slices(self) -> list[int]:
        """The slices of the last quorum sent; before the first, those of the quorum the
        slices that asked are training on (a restarted server learns it from them)."""
        with self._lock:
            if self._last is not None:
                return [slice_id for slice_id, _ in self._last[1]]
            return sorted(self._known)

    def ready_standbys(self) -> list[int]:
        """The pids of the standby slices waiting here for an identity."""
        with self._lock:
            return sorted(self._standbys.values())

    def assign(self, pid: int, slice_id: int, workdir: str) -> None:
        """Makes the standby `pid` slice `slice_id` (working in `workdir`): sent at once if it is
        waiting here, else as soon as it is (it is still starting, or reconnecting)."""
        with self._lock:
            self._assignments[pid] = Role({env_vars.ELASTIC_SLICE: str(slice_id)}, workdir=workdir)

    # The server thread.

    def _on_drop(self, conn: socket.socket) -> None:
        with self._lock:
            self._standbys.pop(conn, None)
            slice_id = self._slice_of.pop(conn, None)
        request = self._pending.get(slice_id) if slice_id is not None else None
        if request is not None and request.conn is conn:
            del self._pending[slice_id]

    def _tick(self) -> None:
        self._send_assignments()
        self._maybe_decide()

    def _send_assignments(self) -> None:
        with self._lock:
            ready = [
                (conn, pid) for conn, pid in self._standbys.items() if pid in self._assignments
            ]
            sends = [(conn, pid, self._assignments.pop(pid)) for conn, pid in ready]
            for conn, _, _ in sends:
                del self._standbys[conn]
        for conn, pid, message in sends:
            if not self._send(conn, wire.encode(message)):
                with self._lock:  # gone meanwhile: sent when it registers again, if it does
                    self._assignments.setdefault(pid, message)

    def _handle_line(self, conn: socket.socket, line: bytes) -> str | None:
        try:
            message = json.loads(line)
            if not protocol.token_matches(message.get("token"), self._token):
                return protocol.WRONG_TOKEN
            asked = wire.decode(message, QuorumRequest, StandbyReady)
            last = None
            if isinstance(asked, QuorumRequest) and asked.last is not None:
                last = (asked.last.quorum_id, tuple(sorted(int(s) for s in asked.last.slices)))
        except wire.UnknownMessage:
            return f"not a quorum message: type {str(message.get('type'))[:40]!r}"
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return f"malformed quorum message: {type(e).__name__}"
        if isinstance(asked, StandbyReady):
            with self._lock:
                self._standbys[conn] = asked.pid
            return None
        slice_id = asked.slice
        request = _Request(conn, asked.step, asked.store, asked.reform, last)
        with self._lock:
            self._slice_of[conn] = slice_id
            if self._last is None and last is not None:
                self._known.update(last[1])
        if not self._pending:
            self._first_pending_at = time.monotonic()
        self._pending[slice_id] = request
        return None

    def _maybe_decide(self) -> None:
        if not self._pending:
            return
        now = time.monotonic()
        with self._lock:
            connected = set(self._slice_of.values())
            missing = len(connected) < self._expected or not self._known <= connected
        reform = any(r.reform for r in self._pending.values())
        if reform and now - self._first_pending_at >= self._join_timeout_s:
            self._decide()
            return
        waiting = self._last is None and now < self._settle_until and missing
        if self._last is None:
            # A fresh server: until the job's slices are back, those training on a quorum go on
            # with it. Whoever asks for a step at which one was told so is told so too: its
            # peers will not ask again before that step's exchange.
            for slice_id, request in list(self._pending.items()):
                if request.last is not None and (waiting or request.step <= self._deferred):
                    self._deferred = max(self._deferred, request.step)
                    self._answer(self._pending.pop(slice_id), None)
        if waiting or not self._pending:
            return
        # In lockstep with the last quorum's members: a connected slice left out of it (silent
        # at a re-forming: hung) is not waited for again at every step; it is let back in when
        # it asks, and healed then.
        awaited = connected
        if self._last is not None:
            awaited = connected & {slice_id for slice_id, _ in self._last[1]}
        if awaited <= set(self._pending):
            self._decide()

    def _answer(self, request: _Request, quorum: dict[str, Any] | None) -> None:
        if not self._send(request.conn, wire.encode(QuorumAnswer(quorum))):
            self._drop(request.conn)

    def _decide(self) -> None:
        members = sorted(self._pending.items())
        shape = tuple((slice_id, r.step) for slice_id, r in members)
        slices = tuple(slice_id for slice_id, _ in shape)
        steps = {r.step for _, r in members}
        steady = len(steps) == 1 and not any(r.reform for _, r in members)
        if self._last is not None:
            last_slices = tuple(s for s, _ in self._last[1])
            same_id = self._last[0] if steady and last_slices == slices else None
        else:  # the first quorum of this server: the one every member is on, if any
            lasts = {r.last for _, r in members}
            carried = lasts.pop() if len(lasts) == 1 else None
            fits = steady and carried is not None and carried[1] == slices
            same_id = carried[0] if fits and carried is not None else None
        if same_id is not None:
            quorum_id = same_id
        else:
            self._count += 1
            quorum_id = f"{self._nonce}-{self._count}"
        with self._lock:
            first = self._last is None
            self._last = (quorum_id, shape)
        quorum = {
            "quorum_id": quorum_id,
            "members": [
                {"slice": slice_id, "step": r.step, "store": r.store} for slice_id, r in members
            ],
        }
        if same_id is None or first:
            self.decided.append(
                {
                    "time": time.time(),
                    "monotonic": time.monotonic(),
                    "quorum_id": quorum_id,
                    "slices": list(slices),
                    "carried_over": same_id is not None,
                }
            )
        self._pending.clear()
        for _, request in members:
            self._answer(request, quorum)
