"""The elastic step with a sync interval (`elastic.sync_every_steps` = H > 1, DiLoCo).

A round is H steps. At its start the slice asks for the quorum (membership changes take effect
at round boundaries; a joining slice heals then, from a live slice's round-start state) and keeps
a host copy of its state. Each step of the round is an inner step: the gradient sums of the parts
of the global batch this slice owns (its own and its share of lost slices', exactly as without a
sync interval), averaged over those parts' tokens, through the inner optimizer. After the H-th,
the slices sum their deltas (outer minus inner parameters, one row per member, the same bits
whoever computed them), weigh each by the parts its slice owned, and every member makes the same
outer step (`train.outer`, Nesterov SGD): at every round boundary the parameters of all members
are bitwise equal, and the run is a pure function of its membership.

A failed sync (a peer died or hung during the round or the exchange) is not half-applied: the
slice goes back to its round-start copy, asks for a new quorum, and trains the round again with
the new ownership (the survivors take over the lost slice's parts of all H batches) before it
syncs again; a member whose exchange failed while the others' completed heals to their state
instead. The inner optimizer's state is each slice's own: a slice that takes over parts trains
them with it, and a joining slice starts from the copy of a live slice's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from resilient_jax.contracts.event_types import EventType
from resilient_jax.elastic import slice_step as elastic_step
from resilient_jax.elastic.data import owned_parts
from resilient_jax.elastic.exchange import ExchangeError, Quorum
from resilient_jax.elastic.trainer import ElasticStep
from resilient_jax.train.state import TrainState
from resilient_jax.train.step import HEALED, Metrics


@dataclasses.dataclass
class _Round:
    start: int  # the step the round began at
    quorum: Quorum
    snapshot: np.ndarray  # host copy of the state at `start` (`step.host_copy`)
    owned: list[int]  # the parts this slice trains in this round
    batches: list[int]  # batch indices of the round's steps so far


class SyncIntervalStep(ElasticStep):
    """The loop's step function with `elastic.sync_every_steps` > 1 (see the module docstring)."""

    # A joining slice heals at a round's start, from the state every member has there: there is
    # no step's sum for it to apply itself.
    _overlapped_heal = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._delta, self._outer = self._programs.delta, self._programs.outer
        self._every = int(self._e.sync_every_steps)
        self._round: _Round | None = None

    def __call__(self, state: TrainState, batch_index: int) -> tuple[TrainState, Metrics]:
        self._step = int(jax.device_get(state.step))
        r = self._round
        if r is None or self._step % self._every == 0 or self._step != r.start + len(r.batches):
            step_before = self._step
            state, next_batch = self._begin_round(state, batch_index)
            if self._step != step_before:  # healed to a live slice's state: see ElasticStep
                self._round = None
                self.seek(next_batch)
                return state, {**self._last_metrics, HEALED: jax.numpy.float32(1.0)}
            r = self._round
            assert r is not None
        r.batches.append(batch_index)
        state, metrics = self._inner(state, batch_index, r.owned)
        self._step += 1
        exchange_s = 0.0
        if self._step % self._every == 0:
            state, exchange_s = self._sync(state)
            self._decided = None
            if self._round is None:  # the sync failed here and the others' state was newer
                metrics = {**metrics, HEALED: jax.numpy.float32(1.0)}
        self._last_metrics = metrics
        self._report(state, r.quorum, r.owned, exchange_s, synced=self._step % self._every == 0)
        return state, metrics

    def _begin_round(self, state: TrainState, batch_index: int) -> tuple[TrainState, int]:
        """The round's quorum adopted (healing this slice if it is behind) and its start kept.
        Returns the state and the next batch index (another one after a heal)."""
        quorum, state, next_batch = self._adopt_quorum(state, batch_index)
        owned = owned_parts(quorum.slices, self._slice, self._parts)
        self._round = _Round(self._step, quorum, elastic_step.host_copy(state), owned, [])
        return state, next_batch

    def _inner(self, state: TrainState, batch_index: int, owned: list[int]):
        """One inner step on the owned parts' rows of batch `batch_index`."""
        vectors = [self._gradient_sums(state.params, self._rows(batch_index, p)) for p in owned]
        total = np.array(vectors[0], copy=True)
        for vector in vectors[1:]:  # in part order: the same bits whoever owns what
            total += np.asarray(vector)
        if len(owned) != self._parts:  # `apply` divides by the global batch's tokens
            total *= np.float32(self._parts / len(owned))
        return self._apply(state, elastic_step.replicated_input(self._ctx, total))

    def _sync(self, state: TrainState) -> tuple[TrainState, float]:
        """The exchange of the round's deltas and the outer step; a failed one redoes the round."""
        r = self._round
        assert r is not None
        while True:
            try:
                start = time.perf_counter()
                delta = np.asarray(self._delta(state))
                buffer = np.zeros((len(r.quorum.members), delta.size), np.float32)
                buffer[r.quorum.rank_of(self._slice)] = delta
                summed = self._exchange.allreduce_sum(buffer)
                exchange_s = time.perf_counter() - start
                break
            except ExchangeError as e:
                self._failed(e)
                state = self._redo(state)
                if self._round is None:  # healed to the others' state after this round
                    return state, 0.0
        mean = np.zeros(delta.size, np.float32)
        for rank, member in enumerate(r.quorum.members):  # in rank order, weighed by parts
            owned = len(owned_parts(r.quorum.slices, member.slice, self._parts))
            mean += summed[rank] * np.float32(owned)
        mean /= np.float32(self._parts)
        return self._outer(state, elastic_step.replicated_input(self._ctx, mean)), exchange_s

    def _redo(self, state: TrainState) -> TrainState:
        """Back to the round's start, a new quorum, and the round trained again under it (or
        the others' newer state, if their sync of this round completed)."""
        r = self._round
        assert r is not None
        state = elastic_step.to_device(self._ctx, r.snapshot)
        self._step = r.start
        quorum, state, next_batch = self._adopt_quorum(state, r.batches[0])
        done = r.start + len(r.batches)
        if self._step != r.start:  # healed: their sync of this round (or later ones) completed
            self._round = None
            self.seek(next_batch)
            return state
        r.quorum, r.owned = quorum, owned_parts(quorum.slices, self._slice, self._parts)
        for batch_index in r.batches:
            state, _ = self._inner(state, batch_index, r.owned)
        self._step = done
        self._ctx.events.emit(
            EventType.ELASTIC_ROUND_REDONE,
            step=done,
            from_step=r.start,
            quorum_id=quorum.quorum_id,
            owned=r.owned,
        )
        return state
