"""What elastic slices, their warm standby and the quorum server say to each other (`quorum`,
`elastic.quorum_client`, `control.standby`): typed messages (`wire`), each line with the run token.

A slice asks before every step (`QuorumRequest`) and is answered with the step's quorum, or with
none (`QuorumAnswer`); a standby registers once it is ready (`StandbyReady`) and is sent its role
(`control.standby.Role`, the one message every standby is given) when it is needed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from resilient_jax.contracts.messages import QuorumMessage
from resilient_jax.contracts.names import Name
from resilient_jax.control import wire


@dataclasses.dataclass(frozen=True)
class LastQuorum:
    """The quorum a training slice is on: a restarted server rebuilds the membership from it."""

    quorum_id: str
    slices: list[int]


@dataclasses.dataclass(frozen=True)
class QuorumRequest(wire.Message):
    """A slice's question before a step: its state has applied `step` steps; `store` is the
    rendezvous store it hosts; `reform` after its exchange failed."""

    TYPE: ClassVar[Name] = QuorumMessage.QUORUM
    slice: int
    step: int
    store: str
    reform: bool = False
    last: LastQuorum | None = None


@dataclasses.dataclass(frozen=True)
class QuorumAnswer(wire.Message):
    """The quorum of the step asked about (`elastic.exchange.Quorum.to_json`), or None: none yet,
    train on with the last one."""

    TYPE: ClassVar[Name] = QuorumMessage.QUORUM
    quorum: dict[str, Any] | None


@dataclasses.dataclass(frozen=True)
class StandbyReady(wire.Message):
    """A warm standby slice, started and loaded, waiting for an identity."""

    TYPE: ClassVar[Name] = QuorumMessage.STANDBY
    pid: int
