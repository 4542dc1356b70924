"""The processes of one slice acting as one member of the elastic job.

A slice may span several processes: its own JAX runtime, with its own coordination service among
them. Process 0 alone talks to the quorum server and hands each answer to the others through the
slice's key-value store (`SliceLink.share`). Every process keeps its own exchange: process p of
each member slice forms a group with process p of the others and exchanges the whole flat vector
(every row is filled by exactly one member, so every process of every slice gets the same bits),
and, for a heal, its own pieces of the state (`step.state_bytes`). After every exchange operation
the processes of a slice agree (`SliceLink.agree`) whether all of theirs completed; when one did
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

from resilient_jax.elastic.exchange import Exchange, ExchangeError, Quorum, Transfer

_T = TypeVar("_T")
_PREFIX = "rj_elastic"


class SliceLost(RuntimeError):
    """Another process of this slice stayed silent past the bound: the slice cannot go on."""


class SliceLink:
    """Process `process` of `num_processes` of one slice, on the slice's key-value store
    (`client`: jax.distributed's, or anything with its four methods). Calls are matched by
    order: every process of the slice makes the same sequence of `share` and `agree` calls."""

    def __init__(self, client: Any, process: int, num_processes: int, timeout_s: float) -> None:
        self._client = client
        self.process = process
        self._num = num_processes
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._seq = 0
        self._written: list[tuple[int, str]] = []  # this process's keys, by sequence number

    @classmethod
    def of_runtime(cls, timeout_s: float) -> SliceLink | None:
        """The link of this process's slice, None for a slice of one process."""
        import jax
        from jax._src import distributed

        if jax.process_count() == 1:
            return None
        client = distributed.global_state.client
        return cls(client, jax.process_index(), jax.process_count(), timeout_s)

    def share(self, value: str | None) -> str:
        """Process 0's `value` on every process (the others pass None)."""
        seq = self._next()
        key = f"{_PREFIX}/{seq}/0"
        if self.process == 0:
            assert value is not None
            self._set(seq, key, value)
            return value
        return self._get(key, 0)

    def agree(self, ok: bool) -> bool:
        """True when every process of the slice passed ok=True to this call."""
        seq = self._next()
        self._set(seq, f"{_PREFIX}/{seq}/{self.process}", "1" if ok else "0")
        agreed = ok
        for process in range(self._num):
            if process != self.process:
                agreed &= self._get(f"{_PREFIX}/{seq}/{process}", process) == "1"
        # Every process has written this call's key, so every one has read whatever this
        # process wrote before it: those keys are deleted.
        old = [key for written_seq, key in self._written if written_seq < seq]
        self._written = [(s, k) for s, k in self._written if s >= seq]
        for key in old:
            self._client.key_value_delete(key)
        return agreed

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _set(self, seq: int, key: str, value: str) -> None:
        self._client.key_value_set(key, value)
        self._written.append((seq, key))

    def _get(self, key: str, process: int) -> str:
        try:
            return self._client.blocking_key_value_get(key, self._timeout_ms)
        except Exception as e:  # jax's runtime error: a timeout, or the service gone
            raise SliceLost(
                f"elastic: process {process} of this slice silent for "
                f"{self._timeout_ms / 1000:.0f} s ({str(e).splitlines()[0][:200]})"
            ) from e


class SliceExchange:
    """An `Exchange` for one process of a slice of several: each operation on this process's own
    exchange, then agreed on by the slice's processes (see the module docstring)."""

    def __init__(self, exchange: Exchange, link: SliceLink) -> None:
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
        if not self._link.agree(error is None):
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
