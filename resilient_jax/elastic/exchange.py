"""The cross-slice exchange of elastic data parallelism: one small interface, re-formed per quorum.

In elastic mode every slice is its own JAX runtime; what crosses slices is a flat host buffer per
step (the gradient sums) and, when a slice joins, the train state it heals from. `Exchange` is
everything the trainer needs from a collective library for that: sum a buffer over the current
members, broadcast one from a member (at once, or in the background while the caller computes),
and be re-formed for a new membership (a `Quorum`). Each
operation is bounded: a dead or hung peer makes it raise `ExchangeError` within the timeout, never
hang, so the caller can ask for a new quorum and redo the step.

The backend here is the gloo process group of `torch.distributed` (`elastic.gloo`, the optional
extra `resilient_jax[elastic]`), formed without `init_process_group` so that a process can drop one
group and form the next, as torchft does per quorum. A NCCL (GPU) or DCN (TPU) backend implements
the same three methods.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

# The step a slice asks for a quorum at when it has no state yet (a replacement, or the job's
# start): any member with a state heals it; a quorum of such members loads its own (restore or
# initialise) and asks again.
NO_STATE = -1


class ExchangeError(RuntimeError):
    """An exchange that did not complete (a peer died, hung or left): redo the step."""


@dataclasses.dataclass(frozen=True)
class Member:
    slice: int  # the slice's id (stable across its restarts)
    step: int  # optimizer steps its state has applied when it asked (NO_STATE: none yet)
    store: str  # host:port of the rendezvous store this member hosts


@dataclasses.dataclass(frozen=True)
class Quorum:
    """A membership every member of it agrees on: `quorum_id` names it (a new one for every
    change of membership, and unique across restarts of whoever decides it); ranks are positions
    in `members`, ordered by slice id."""

    quorum_id: str
    members: tuple[Member, ...]

    def rank_of(self, slice_id: int) -> int:
        for rank, member in enumerate(self.members):
            if member.slice == slice_id:
                return rank
        raise KeyError(f"slice {slice_id} is not a member of quorum {self.quorum_id}")

    @property
    def slices(self) -> tuple[int, ...]:
        return tuple(m.slice for m in self.members)

    @property
    def max_step(self) -> int:
        return max(m.step for m in self.members)

    @property
    def source_rank(self) -> int:
        """The member a lagging member heals from: the first one with the newest state."""
        return next(r for r, m in enumerate(self.members) if m.step == self.max_step)

    def to_json(self) -> dict:
        return {
            "quorum_id": self.quorum_id,
            "members": [dataclasses.asdict(m) for m in self.members],
        }

    @classmethod
    def from_json(cls, d: dict) -> Quorum:
        return cls(d["quorum_id"], tuple(Member(**m) for m in d["members"]))


class Transfer(Protocol):
    """A collective started in the background (`Exchange.start_broadcast`)."""

    def wait(self) -> np.ndarray:
        """Its result, once complete; raises ExchangeError when it failed or timed out."""


class Exchange(Protocol):
    """Collectives among the members of the current quorum (see the module docstring)."""

    store_address: str  # host:port of the rendezvous store this process hosts

    def configure(self, quorum: Quorum, slice_id: int) -> None:
        """Drops the current group and forms one for `quorum` (this process is `slice_id`).
        Raises ExchangeError when the members do not all show up within the timeout."""

    def allreduce_sum(self, buffer: np.ndarray) -> np.ndarray:
        """The elementwise sum of every member's `buffer` (same shape and dtype on all), the same
        bits on every member."""

    def broadcast(self, buffer: np.ndarray, root: int) -> np.ndarray:
        """Rank `root`'s `buffer` on every member (the others pass a buffer of its shape)."""

    def start_broadcast(self, buffer: np.ndarray, root: int) -> Transfer:
        """`broadcast` in the background, in place: `buffer` is sent (or received into) while
        the caller goes on, and must be left alone until `wait()` returns. Collectives are
        matched in the order they are started, the same on every member."""

    def close(self) -> None:
        """Drops the group and stops the store this process hosts."""


def make_exchange(backend: str, host: str, timeout_s: float, process: int = 0) -> Exchange:
    """The exchange of `elastic.backend`; this process hosts its rendezvous store on `host`.
    `process`: this process's index in its slice (process p of each member slice forms a group
    with process p of the others)."""
    if backend == "gloo":
        from resilient_jax.elastic.gloo import GlooExchange  # torch: the optional extra

        return GlooExchange(host, timeout_s, process)
    raise ValueError(f"unknown elastic.backend {backend!r}")
