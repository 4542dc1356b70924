"""What a restarted elastic supervisor needs to take over a running job: `<workdir>/elastic.json`.

The elastic supervisor writes there the quorum server's address, its own pid, a digest of the run
token, the launch (the agents' generation number) of each running slice and of its warm standby,
the slices that finished, and the next launch number. The slices run under the hosts' agents and
outlive the supervisor; while it is away they train on with their last quorum. A supervisor
started again on the same workdir (with the same run token) finds them here, listens on the same
address, so their quorum clients reconnect, and adopts the workers the agents register under each
launch: no slice is restarted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

STATE_FILE = "elastic.json"


def token_digest(token: str) -> str:
    """Names the token without saying it (the file is readable by others)."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class ElasticState:
    address: str  # the quorum server's
    supervisor_pid: int
    token_sha256: str
    slices: dict[int, int]  # slice -> the launch running it
    done: list[int]  # slices that finished the run (exit 0)
    standby: int | None = None  # the warm standby's launch, if one runs
    next_launch: int = 0  # the number the next launch gets

    def launches(self) -> int:
        """How many launch numbers are spoken for."""
        recorded = [*self.slices.values(), *([self.standby] if self.standby is not None else [])]
        return max([self.next_launch, *(launch + 1 for launch in recorded)])


def write_state(workdir: str, state: ElasticState) -> None:
    path = os.path.join(workdir, STATE_FILE)
    data = {
        "address": state.address,
        "supervisor_pid": state.supervisor_pid,
        "token_sha256": state.token_sha256,
        "slices": {str(s): launch for s, launch in sorted(state.slices.items())},
        "done": sorted(state.done),
        "standby": state.standby,
        "next_launch": state.next_launch,
    }
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def read_state(workdir: str) -> ElasticState | None:
    """The state a supervisor left in `workdir`, None when there is none or it is unreadable (or
    written before slices ran under agents: nothing of it can be adopted)."""
    try:
        with open(os.path.join(workdir, STATE_FILE)) as f:
            data = json.load(f)
        standby = data["standby"]
        return ElasticState(
            address=str(data["address"]),
            supervisor_pid=int(data["supervisor_pid"]),
            token_sha256=str(data["token_sha256"]),
            slices={int(s): int(launch) for s, launch in data["slices"].items()},
            done=[int(s) for s in data["done"]],
            standby=None if standby is None else int(standby),
            next_launch=int(data["next_launch"]),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
