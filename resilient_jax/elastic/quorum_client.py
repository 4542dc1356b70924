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
import socket
import time

from resilient_jax.contracts.messages import QuorumMessage
from resilient_jax.control import protocol
from resilient_jax.elastic.exchange import Quorum


class QuorumClient:
    def __init__(self, address: str, token: str, slice_id: int, retry_s: float = 0.5) -> None:
        self._address = protocol.split_address(address)
        self._token = token
        self._slice = slice_id
        self._retry_s = retry_s
        self._sock: socket.socket | None = None
        self._buffer = b""
        self._next_attempt = 0.0

    def request(
        self, step: int, store: str, reform: bool, timeout_s: float, last: Quorum | None = None
    ) -> Quorum | None:
        """The quorum of `step` (this slice's state has applied `step` steps), or None when the
        server cannot be reached, does not answer within `timeout_s`, or (to a slice training on
        `last`) has no quorum yet."""
        if self._sock is None and not self._connect():
            return None
        assert self._sock is not None
        message = {
            "type": QuorumMessage.QUORUM,
            "token": self._token,
            "slice": self._slice,
            "step": step,
            "store": store,
            "reform": reform,
        }
        if last is not None:
            message["last"] = {"quorum_id": last.quorum_id, "slices": list(last.slices)}
        deadline = time.monotonic() + timeout_s
        try:
            self._sock.settimeout(timeout_s)
            self._sock.sendall(protocol.encode(message))
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no quorum in time")
                self._sock.settimeout(left)
                data = self._sock.recv(65536)
                if not data:
                    raise ConnectionError("quorum server closed the connection")
                self._buffer += data
        except OSError:  # TimeoutError and ConnectionError are OSErrors
            self.close()
            return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        reply = json.loads(line)
        return None if reply["quorum"] is None else Quorum.from_json(reply["quorum"])

    def _connect(self) -> bool:
        now = time.monotonic()
        if now < self._next_attempt:
            return False
        self._next_attempt = now + self._retry_s
        try:
            self._sock = socket.create_connection(self._address, timeout=0.2)
        except OSError:
            self._sock = None
            return False
        self._buffer = b""
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._buffer = b""
