"""What a host agent tells one of its warm standbys (`worker.standby`, the restart path's): the
role it takes, as one typed line (`wire`) on the standby's stdin. The pipe is the agent's own (it
started the standby), so the line carries no token; end of input before it ends the standby."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from resilient_jax.contracts.messages import StandbyMessage
from resilient_jax.contracts.names import Name
from resilient_jax.control import wire


@dataclasses.dataclass(frozen=True)
class StandbyRole(wire.Message):
    """Become this worker: `env` is its whole environment (its place in the job: `RJ_*`)."""

    TYPE: ClassVar[Name] = StandbyMessage.ROLE
    env: dict[str, str]
