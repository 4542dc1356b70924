"""The elastic step: one optimizer step of a slice that trains with whichever slices are alive.

Per step: ask the quorum server for the step's quorum (one round trip; a steady quorum keeps its
id and its exchange group); re-form the group if the quorum changed, and heal a member that is
behind by broadcasting the newest state from a member that has it; compute the gradient sums of
the global batch's parts this slice owns (its own, and its share of the lost slices': more
microbatches, same executable); sum every part's vector across the quorum (each part is a row of
the exchanged buffer that exactly one member fills, so the sum is exact and the same bits whoever
computed which part); add the parts up in part order on the host, and apply the update. Every
member thus applies the same bits, whatever the membership: replicas stay bitwise equal, and a run
that lost a slice computes the same function as one that did not.

A failed exchange (a peer died or hung) leaves the state untouched: the step asks for a new quorum
and is redone, computing only the parts this slice newly owns (the rows it already computed for
this state are kept: the same bits as computing them again). Without a quorum server (the
supervisor is down or restarting) a slice keeps the last quorum and trains on; only a failed
exchange with no server to re-form through ends the run (after `elastic.quorum_timeout_s`).

In a slice of several processes every process runs this step alike (`slice_link`): process 0
asks for the quorum and shares it, each process exchanges the whole buffer with its counterparts
in the other slices, and the exchange's outcome is agreed on, so the processes never part ways.
The `digest` of a step's event is of this process's pieces of the parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from resilient_jax import executables
from resilient_jax import mesh as mesh_lib
from resilient_jax.agreement import Agreement
from resilient_jax.contracts.event_types import EventType
from resilient_jax.data.position import DataPosition
from resilient_jax.elastic import slice_step as elastic_step
from resilient_jax.elastic.data import PartRows, StepIndex, owned_parts
from resilient_jax.elastic.exchange import NO_STATE, Exchange, ExchangeError, Quorum, Transfer
from resilient_jax.elastic.quorum_client import QuorumClient
from resilient_jax.train.context import RunContext
from resilient_jax.train.keep import KeepingProgram
from resilient_jax.train.state import TrainState
from resilient_jax.train.step import HEALED, Metrics


@dataclasses.dataclass
class _Handover:
    """A handover this slice takes part in as a member up to date, in flight during a step."""

    quorum: Quorum
    transfer: Transfer  # the broadcast of the state of the step's start
    active: tuple[int, ...]  # the members that compute the step's parts: those up to date
    started: float  # perf_counter at its start
    size: int  # bytes sent
    sent: bool  # this slice is the source


@dataclasses.dataclass
class Programs:
    """The elastic step's compiled programs (a warm standby loads them before it knows which
    slice it will be). `delta` and `outer` only with a sync interval."""

    gradient_sums: Any
    apply: KeepingProgram  # runs without donation on a state a save keeps (`train.keep`)
    delta: Any = None
    outer: Any = None

    def close(self) -> None:
        """Waits for the non-donating update's compile, if one is running (a process that
        exits while XLA compiles in a thread aborts)."""
        self.apply.close()


def compile_programs(ctx: RunContext) -> Programs:
    """The programs of this run's elastic step, compiled or loaded from the executable cache,
    each pair with its `compile` event."""
    start = time.perf_counter()
    gradient_sums, sums_hit = elastic_step.compile_gradient_sums(ctx)
    apply, apply_hit = elastic_step.compile_apply(ctx)
    _report_compile(ctx, "elastic", start, sums_hit and apply_hit)
    keeping = elastic_step.keeping_apply(ctx)
    programs = Programs(
        gradient_sums,
        KeepingProgram(apply, keeping, ctx.keeper, name=elastic_step.APPLY_KEEP_PROGRAM),
    )
    _first_run(ctx, gradient_sums)
    if int(ctx.config.elastic.sync_every_steps) > 1:
        start = time.perf_counter()
        programs.delta, delta_hit = elastic_step.compile_delta(ctx)
        programs.outer, outer_hit = elastic_step.compile_outer(ctx)
        _report_compile(ctx, "elastic_outer", start, delta_hit and outer_hit)
    return programs


def _first_run(ctx: RunContext, gradient_sums: Any) -> None:
    """Runs the gradient sums once (zero parameters, a zero batch): the first run of a loaded
    program takes several steps' time (0.1 s for a step of 0.02 s on the tests' small model),
    which the members training would otherwise wait for at a joining slice's first exchange. A
    warm standby pays it ahead, while it waits."""
    params = jax.tree.map(
        lambda a: elastic_step.global_array(np.zeros(a.shape, a.dtype), a.sharding),
        ctx.abstract_state.params,
    )
    shape = elastic_step.part_shape(ctx)
    batch = elastic_step.global_array(np.zeros(shape, np.int32), mesh_lib.batch_sharding(ctx.mesh))
    np.asarray(gradient_sums(params, batch))


def _report_compile(ctx: RunContext, program: str, start: float, hit: bool) -> None:
    """The `compile` event of programs compiled (or loaded, `hit`) since `start`."""
    fields: dict[str, Any] = {}
    if executables.default_dir():
        fields["cache"] = "hit" if hit else "miss"
    ctx.events.emit(
        EventType.COMPILE, duration_s=time.perf_counter() - start, program=program, **fields
    )


class NoQuorum(RuntimeError):
    """The exchange failed and no quorum server answered within `elastic.quorum_timeout_s`."""


class ElasticStep:
    """The loop's step function in elastic mode: `(state, batch index) -> (state, metrics)`."""

    def __init__(
        self,
        ctx: RunContext,
        source: Any,
        exchange: Exchange,
        store_address: str,
        client: QuorumClient | None,
        slice_id: int,
        programs: Programs | None = None,
        link: Agreement | None = None,
    ) -> None:
        # In a slice of several processes (`link`), only process 0 has a quorum client.
        self._ctx, self._exchange, self._client, self._link = ctx, exchange, client, link
        self._store = store_address
        self._slice = slice_id
        self._e = ctx.config.elastic
        self._parts = int(self._e.slices)
        programs = programs or compile_programs(ctx)
        self._gradient_sums, self._apply = programs.gradient_sums, programs.apply
        self._programs = programs
        self._width = elastic_step.vector_width(ctx)
        self._rows = PartRows(ctx, source, elastic_step.part_shape(ctx))
        self._step = 0  # steps the state has applied
        self._quorum: Quorum | None = None  # the group formed, if any
        self._broken = True  # no usable group: the next quorum must form one
        self._decided: tuple[int, Quorum] | None = None  # the quorum already got for a step
        self._handover: _Handover | None = None  # a heal this slice takes part in, in flight
        self._last_metrics: Metrics = {}
        # The loop's loader (made by `join`): a heal moves it to the healed state's data.
        self.index: StepIndex | None = None

    # Before the loop: the first quorum (a joining slice heals here).

    def join(
        self, load: Callable[[], tuple[TrainState, DataPosition]]
    ) -> tuple[TrainState, DataPosition]:
        """Joins the quorum, asking first without a state (`NO_STATE`): when a member has one (the
        job is training), its newest state and data position are received, and nothing is restored
        or initialised here. Only when no member has one (the job starts, or restarts as a whole)
        does `load` restore or initialise the state, and the slice asks again at its step, healing
        from whoever is ahead as before."""
        self._step = NO_STATE
        _, state, next_batch = self._adopt_quorum(None, 0)
        if state is not None:
            position = DataPosition(next_batch=next_batch)
        else:
            state, position = load()
            self._step = int(jax.device_get(state.step))
            _, state, next_batch = self._adopt_quorum(state, position.next_batch)
            if next_batch != position.next_batch:
                position = DataPosition(next_batch=next_batch, skips=position.skips)
        self.index = StepIndex(position)
        return state, position

    def seek(self, next_batch: int) -> None:
        """Moves the loop's loader (`index`) to `next_batch`, keeping its skip windows."""
        if self.index is not None:
            skips = self.index.position.skips
            self.index.seek(DataPosition(next_batch=next_batch, skips=skips))

    # The loop's step.

    def __call__(self, state: TrainState, batch_index: int) -> tuple[TrainState, Metrics]:
        # From the state, not a counter: a rollback (every member rolls back alike) resets it.
        self._step = int(jax.device_get(state.step))
        # The rows of this step's parts computed so far, by part: a failed exchange leaves the
        # state as it was, so they are the same bits under any quorum, and a redo computes only
        # the parts this slice newly owns.
        rows: dict[int, np.ndarray] = {}
        reused: list[int] = []
        compute_s = 0.0
        while True:
            quorum = self._quorum_of(self._step)
            try:
                step_before = self._step
                state, next_batch = self._adopt(quorum, state, batch_index)
                if self._step != step_before:
                    # Behind (by the step in flight, whose exchange completed for the others and
                    # failed here; or by many, after a hang or a cut-off link): healed to the
                    # newest state, which is this call's result. The loop takes the step count
                    # from it, and its data position jumps with it.
                    self.seek(next_batch)
                    return state, {**self._last_metrics, HEALED: jax.numpy.float32(1.0)}
                # While a member behind receives the state, the others compute every part.
                handover = self._handover
                computing = handover.active if handover is not None else quorum.slices
                owned = owned_parts(computing, self._slice, self._parts)
                reused = [p for p in owned if p in rows]
                start = time.perf_counter()
                buffer = self._contributions(state, batch_index, owned, rows)
                compute_s = time.perf_counter() - start
                summed = self._exchange.allreduce_sum(buffer)
                exchange_s = time.perf_counter() - start - compute_s
                if handover is not None:
                    self._finish_handover(handover)
            except ExchangeError as e:
                self._failed(e)
                continue
            break
        state, metrics = self._apply(state, self._in_part_order(summed))
        self._step += 1
        self._decided = None
        self._last_metrics = metrics
        extra = {"reused": reused} if reused else {}
        self._report(state, quorum, owned, exchange_s, compute_s=round(compute_s, 5), **extra)
        return state, metrics

    # Quorums.

    def _adopt_quorum(self, state: Any, batch_index: int) -> tuple[Quorum, Any, int]:
        """The quorum of this slice's step, adopted (`_adopt`), asking again until an adoption
        goes through. Returns (quorum, state, next batch index); the state is None only when
        this slice had none and neither had any member (`NO_STATE`)."""
        while True:
            quorum = self._quorum_of(self._step)
            try:
                state, next_batch = self._adopt(quorum, state, batch_index)
                return quorum, state, next_batch
            except ExchangeError as e:
                self._failed(e)

    def _quorum_of(self, step: int) -> Quorum:
        if self._decided is not None and self._decided[0] == step:
            return self._decided[1]
        if self._link is None:
            quorum, decided = self._ask(step)
        elif self._link.process_index == 0:  # asks, and hands the answer to the slice's others
            try:
                quorum, decided = self._ask(step)
            except NoQuorum as e:
                self._link.share("quorum", json.dumps({"error": str(e)}))
                raise
            self._link.share("quorum", json.dumps({"quorum": quorum.to_json(), "decided": decided}))
        else:
            answer = json.loads(self._link.share("quorum", None))
            if "error" in answer:
                raise NoQuorum(answer["error"])
            quorum, decided = Quorum.from_json(answer["quorum"]), answer["decided"]
        if decided:
            self._decided = (step, quorum)
        return quorum

    def _ask(self, step: int) -> tuple[Quorum, bool]:
        """The quorum server's quorum of `step` (True), or, when it does not answer, the last
        quorum to train on with (False)."""
        assert self._client is not None
        deadline = time.monotonic() + float(self._e.quorum_timeout_s)
        # A group that broke asks the server to re-form without whoever stays silent; a slice
        # that never had one (starting, joining) only waits to be let in.
        reform = self._broken and self._quorum is not None
        while True:
            # The server answers once every connected slice has asked: about a step at most.
            # A slice training on a quorum says which: a restarted server rebuilds from that.
            last = None if self._broken else self._quorum
            timeout_s = float(self._e.timeout_s)
            quorum = self._client.request(step, self._store, reform, timeout_s, last)
            if quorum is not None:
                return quorum, True
            if not self._broken and self._quorum is not None:
                return self._quorum, False  # no answer: train on with the last quorum
            if time.monotonic() > deadline:
                raise NoQuorum(
                    f"elastic: no quorum for step {step} within elastic.quorum_timeout_s="
                    f"{self._e.quorum_timeout_s} (quorum server unreachable or peers silent)"
                )
            time.sleep(0.05)

    def _adopt(self, quorum: Quorum, state: Any, next_batch: int) -> tuple[Any, int]:
        """Forms the quorum's group if it is new, and heals whoever is behind. Returns the state
        (replaced when this slice was behind) and the next batch index. A quorum in which no
        member has a state forms no group: its members load theirs and ask again."""
        if quorum.max_step == NO_STATE:
            return state, next_batch
        same = self._quorum is not None and quorum.quorum_id == self._quorum.quorum_id
        if same and not self._broken:
            return state, next_batch
        start = time.perf_counter()
        self._exchange.configure(quorum, self._slice)
        self._quorum, self._broken = quorum, False
        rank = quorum.rank_of(self._slice)
        self._ctx.events.emit(
            EventType.ELASTIC_QUORUM,
            quorum_id=quorum.quorum_id,
            slices=list(quorum.slices),
            rank=rank,
            from_step=self._step,
            duration_s=time.perf_counter() - start,
        )
        behind = [m for m in quorum.members if m.step < quorum.max_step]
        if not behind:
            return state, next_batch
        if self._overlapped_heal and all(quorum.max_step - m.step > 1 for m in behind):
            return self._hand_over(quorum, rank, state, next_batch)
        return self._heal(quorum, rank, state, next_batch)

    # Heals. A member behind by one step (its exchange failed where the others' completed) is
    # sent the newest state at once (`_heal`). A joining member, further behind, is handed it
    # over a step (`_hand_over`): the members up to date compute every part of the next step
    # while the state of its start goes out in the background; the ones behind take part in
    # that step's exchange with no parts and apply its sum themselves (the same executable on
    # the same bits: the same state), and compute their own part from the step after.
    # Without it the members up to date would wait for the transfer, and then for the joining
    # one's first part, inside the step.

    _overlapped_heal = True  # the step after a heal is exchanged with the joining members

    def _hand_over(self, quorum: Quorum, rank: int, state: Any, next_batch: int) -> tuple[Any, int]:
        start = time.perf_counter()
        source = quorum.source_rank
        size = elastic_step.state_nbytes(self._ctx) + 8
        if quorum.members[rank].step == quorum.max_step:
            if rank == source:
                buffer = self._state_message(state, next_batch)
            else:
                buffer = np.zeros(size, np.uint8)
            active = tuple(m.slice for m in quorum.members if m.step == quorum.max_step)
            transfer = self._exchange.start_broadcast(buffer, source)
            self._handover = _Handover(quorum, transfer, active, start, size, rank == source)
            return state, next_batch
        # Behind: the state of the step's start, then the step's sum (no parts of its own).
        from_step = self._step
        received = self._exchange.start_broadcast(np.zeros(size, np.uint8), source).wait()
        healed = elastic_step.state_from_bytes(self._ctx, received[:-8])
        batch_index = int(received[-8:].view(np.int64)[0])
        nothing = np.zeros((self._parts, self._width), np.float32)
        state, self._last_metrics = self._apply(
            healed, self._in_part_order(self._exchange.allreduce_sum(nothing))
        )
        self._step = quorum.max_step + 1
        self._decided = None  # the next quorum is asked for by every member alike
        self._emit_heal(quorum, source, size, start, "received", from_step)
        return state, batch_index + 1

    def _finish_handover(self, handover: _Handover) -> None:
        """Waits for the handover's transfer (done by the time the step's exchange is: the
        members behind receive before they exchange)."""
        self._handover = None
        handover.transfer.wait()
        if handover.sent:
            q = handover.quorum
            self._emit_heal(q, q.source_rank, handover.size, handover.started, "sent")

    def _state_message(self, state: TrainState, next_batch: int) -> np.ndarray:
        """The state and the data position a member behind heals to, as one buffer."""
        position = np.asarray([next_batch], np.int64).view(np.uint8)
        return np.concatenate([elastic_step.state_bytes(state), position])

    def _emit_heal(
        self,
        quorum: Quorum,
        source: int,
        size: int,
        start: float,
        role: str,
        from_step: int | None = None,
    ):
        """The `elastic_heal` event; a member that received says from which step it jumped
        (`from_step`: `NO_STATE` for a slice that joined with none)."""
        extra = {"from_step": from_step} if from_step is not None else {}
        self._ctx.events.emit(
            EventType.ELASTIC_HEAL,
            step=self._step if role == "received" else quorum.max_step + 1,
            source_slice=quorum.members[source].slice,
            bytes=size,
            duration_s=time.perf_counter() - start,
            role=role,
            **extra,
        )

    def _heal(self, quorum: Quorum, rank: int, state: Any, next_batch: int) -> tuple[Any, int]:
        start = time.perf_counter()
        source = quorum.source_rank
        size = elastic_step.state_nbytes(self._ctx) + 8
        if rank == source:
            buffer = self._state_message(state, next_batch)
        else:
            buffer = np.zeros(size, np.uint8)
        received = self._exchange.broadcast(buffer, source)
        behind = quorum.members[rank].step < quorum.max_step
        extra = {"from_step": self._step} if behind else {}
        if behind:
            state = elastic_step.state_from_bytes(self._ctx, received[:-8])
            next_batch = int(received[-8:].view(np.int64)[0])
            self._step = quorum.max_step
            self._decided = (self._step, quorum)  # this quorum goes on for the step healed to
        if behind or rank == source:
            self._ctx.events.emit(
                EventType.ELASTIC_HEAL,
                step=quorum.max_step,
                source_slice=quorum.members[source].slice,
                bytes=size,
                duration_s=time.perf_counter() - start,
                role="received" if behind else "sent",
                **extra,
            )
        return state, next_batch

    def _failed(self, error: ExchangeError) -> None:
        self._broken = True
        self._decided = None
        handover, self._handover = self._handover, None
        if handover is not None:  # the step is redone under a new quorum, without it
            with contextlib.suppress(ExchangeError):
                handover.transfer.wait()
        self._ctx.events.emit(
            EventType.ELASTIC_EXCHANGE_FAILED,
            step=self._step,
            quorum_id=self._quorum.quorum_id if self._quorum else None,
            error=str(error),
        )

    # The step's work.

    def _in_part_order(self, summed: np.ndarray) -> jax.Array:
        """The exchanged rows added up in part order (the same bits on every member), as
        `apply`'s input."""
        total = summed[0].copy()
        for part in range(1, self._parts):
            total += summed[part]
        return elastic_step.replicated_input(self._ctx, total)

    def _contributions(
        self, state: TrainState, batch_index: int, owned: list[int], rows: dict[int, np.ndarray]
    ) -> np.ndarray:
        """[parts, width] float32: this slice's parts filled in, zeros elsewhere. Parts already in
        `rows` (computed for this state and batch before a failed exchange) are not computed
        again; the ones computed here are added to it."""
        new = [p for p in owned if p not in rows]
        # Dispatched together, then fetched: the executions queue back to back on the devices.
        vectors = [self._gradient_sums(state.params, self._rows(batch_index, p)) for p in new]
        for part, vector in zip(new, vectors, strict=True):
            rows[part] = np.asarray(vector)
        buffer = np.zeros((self._parts, self._width), np.float32)
        for part in owned:
            buffer[part] = rows[part]
        return buffer

    def _report(
        self, state: TrainState, quorum: Quorum, owned: list[int], exchange_s: float, **extra: Any
    ):
        every = int(self._e.check_every_steps)
        fields: dict[str, Any] = dict(extra)
        if every and self._step % every == 0:
            fields["digest"] = hashlib.sha256(
                elastic_step.state_bytes(state.params).tobytes()
            ).hexdigest()[:16]
        self._ctx.events.emit(
            EventType.ELASTIC_STEP,
            step=self._step,
            quorum_id=quorum.quorum_id,
            slices=list(quorum.slices),
            owned=owned,
            exchange_s=round(exchange_s, 5),
            **fields,
        )
