"""A slice's side of the quorum server (`control.quorum`): ask for the quorum of a step.

One connection, kept open (the server takes a closed one for a dead slice). Every wait is bounded;
an unreachable server is not an error here but `None`, so that the caller can keep training on its
last quorum while the supervisor is away, and reconnection is tried again at most every
`retry_s`, so that an absent server costs a step nothing. A slice training on a quorum says which
(`last`): a restarted server rebuilds the membership from what the slices tell it, and answers
"no quorum yet" (None here) at once until they are all back.
"""

from __future__ import annotations

import json
import time

from resilient_jax.control import protocol, wire
from resilient_jax.control.line_client import LineConnection
from resilient_jax.control.quorum_protocol import LastQuorum, QuorumAnswer, QuorumRequest
from resilient_jax.elastic.exchange import Quorum

_CONNECT_TIMEOUT_S = 0.2  # a server that does not take the connection this fast counts as away


class QuorumClient:
    def __init__(self, address: str, token: str, slice_id: int, retry_s: float = 0.5) -> None:
        protocol.split_address(address)  # a malformed address is refused here, not retried
        self._address = address
        self._token = token
        self._slice = slice_id
        self._retry_s = retry_s
        self._conn: LineConnection | None = None
        self._next_attempt = 0.0

    def request(
        self, step: int, store: str, reform: bool, timeout_s: float, last: Quorum | None = None
    ) -> Quorum | None:
        """The quorum of `step` (this slice's state has applied `step` steps), or None when the
        server cannot be reached, does not answer within `timeout_s`, or (to a slice training on
        `last`) has no quorum yet."""
        conn = self._conn or self._connect()
        if conn is None:
            return None
        message = QuorumRequest(
            self._slice,
            step,
            store,
            reform,
            None if last is None else LastQuorum(last.quorum_id, list(last.slices)),
        )
        try:
            deadline = time.monotonic() + timeout_s  # for the whole request, as it says
            conn.send(message, timeout_s, token=self._token)
            line = conn.read_line(deadline - time.monotonic())
        except OSError:  # TimeoutError and ConnectionError are OSErrors
            self.close()
            return None
        answer = wire.decode(json.loads(line), QuorumAnswer)
        return None if answer.quorum is None else Quorum.from_json(answer.quorum)

    def _connect(self) -> LineConnection | None:
        now = time.monotonic()
        if now < self._next_attempt:
            return None
        self._next_attempt = now + self._retry_s
        try:
            self._conn = LineConnection.open(self._address, _CONNECT_TIMEOUT_S)
        except OSError:
            self._conn = None
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None
