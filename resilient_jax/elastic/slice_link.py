"""The processes of one slice acting as one member of the elastic job.

A slice may span several processes: its own JAX runtime, with its own coordination service among
them. Process 0 alone talks to the quorum server and hands each answer to the others through the
slice's key-value store (`Agreement.share`). Every process keeps its own exchange: process p of
each member slice forms a group with process p of the others and exchanges the whole flat vector
(every row is filled by exactly one member, so every process of every slice gets the same bits),
and, for a heal, its own pieces of the state (`step.state_bytes`). After every exchange operation
the processes of a slice agree (`Agreement.agree`) whether all of theirs completed; when one did
not, all of them treat it as failed (`SliceExchange`), so the processes of a slice always take the
same path (redo the step, re-form, heal) and never part ways.

Every wait is bounded: a process of the slice silent for longer than the bound is dead or hung,
and the slice is lost (`SliceLost`: the process exits non-zero, and the supervisor replaces the
slice as a whole).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from resilient_jax.agreement import Agreement
from resilient_jax.elastic.exchange import Exchange, ExchangeError, Quorum, Transfer

_T = TypeVar("_T")
_PREFIX = "rj_elastic"


class SliceLost(RuntimeError):
    """Another process of this slice stayed silent past the bound: the slice cannot go on."""


def _silent(process: int, what: str, seconds: float, detail: str) -> SliceLost:
    return SliceLost(
        f"elastic: process {process} of this slice silent for {seconds:.0f} s ({detail})"
    )


def slice_agreement(
    timeout_s: float, client: Any = None, process: int = 0, count: int = 1
) -> Agreement | None:
    """The agreement among this slice's processes (`resilient_jax.agreement`), None for a slice of
    one process. `client`: a stand-in for the runtime's key-value store (with `process` of
    `count`); without it, this process's JAX runtime."""
    if client is not None:
        return Agreement(client, process, count, _PREFIX, timeout_s, _silent)
    link = Agreement.of_runtime(_PREFIX, timeout_s, _silent)
    return link if link.distributed else None


class SliceExchange:
    """An `Exchange` for one process of a slice of several: each operation on this process's own
    exchange, then agreed on by the slice's processes (see the module docstring)."""

    def __init__(self, exchange: Exchange, link: Agreement) -> None:
        self._exchange, self._link = exchange, link
        self.store_address = exchange.store_address

    def configure(self, quorum: Quorum, slice_id: int) -> None:
        self._agreed(lambda: self._exchange.configure(quorum, slice_id), "forming the group")

    def allreduce_sum(self, buffer: np.ndarray) -> np.ndarray:
        return self._agreed(lambda: self._exchange.allreduce_sum(buffer), "allreduce")

    def broadcast(self, buffer: np.ndarray, root: int) -> np.ndarray:
        return self._agreed(lambda: self._exchange.broadcast(buffer, root), "broadcast")

    def start_broadcast(self, buffer: np.ndarray, root: int) -> Transfer:
        try:
            return _AgreedTransfer(self, self._exchange.start_broadcast(buffer, root), None)
        except ExchangeError as e:  # agreed on at its wait, as every process waits for it
            return _AgreedTransfer(self, None, e)

    def close(self) -> None:
        self._exchange.close()

    def _agreed(self, op: Callable[[], _T], name: str) -> _T:
        error: ExchangeError | None = None
        try:
            result = op()
        except ExchangeError as e:
            error = e
        if not self._link.agree(name, error is None):
            raise error or ExchangeError(f"{name}: failed in another process of this slice")
        return result


class _AgreedTransfer:
    def __init__(
        self, exchange: SliceExchange, transfer: Transfer | None, error: ExchangeError | None
    ) -> None:
        self._exchange, self._transfer, self._error = exchange, transfer, error

    def wait(self) -> np.ndarray:
        def finish() -> np.ndarray:
            if self._error is not None:
                raise self._error
            assert self._transfer is not None
            return self._transfer.wait()

        return self._exchange._agreed(finish, "broadcast")
