"""Starting a slice in elastic mode: the exchange, the quorum client, the elastic step, the join.

`start` is what `run.py` calls instead of restoring or initialising the state, compiling the
single-runtime step and opening the batch loader; it returns the loop's step function and loader
with the state the slice trains from: the newest one a live slice sent it, or, when no slice of the
job has one, its own (restored or initialised then). A slice may be several processes (one JAX
runtime among them): process 0 talks to the quorum server, and the processes act as one member
(`slice_link`). `ElasticSession` closes the exchange and the
connection to the quorum server at the end of the run.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import jax

from resilient_jax.config import BadInput
from resilient_jax.contracts import env_vars
from resilient_jax.data.position import DataPosition
from resilient_jax.elastic.data import StepIndex
from resilient_jax.elastic.diloco import SyncIntervalStep
from resilient_jax.elastic.exchange import Exchange, make_exchange
from resilient_jax.elastic.quorum_client import QuorumClient
from resilient_jax.elastic.slice_link import SliceExchange, slice_agreement
from resilient_jax.elastic.trainer import ElasticStep, Programs, compile_programs
from resilient_jax.train.context import RunContext
from resilient_jax.train.hooks import Hook
from resilient_jax.train.state import TrainState


class ElasticSession(Hook):
    def __init__(self, exchange: Any, client: QuorumClient | None, programs: Programs) -> None:
        self._exchange, self._client, self._programs = exchange, client, programs

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._exchange.close()
        self._programs.close()


def slice_id(environ: Mapping[str, str] = os.environ) -> int:
    """This slice's index in the job (`RJ_ELASTIC_SLICE`); BadInput when the environment of an
    elastic slice is not set."""
    address = environ.get(env_vars.QUORUM_ADDRESS)
    slice_text = environ.get(env_vars.ELASTIC_SLICE)
    if not address or slice_text is None or not slice_text.isdigit():
        raise BadInput(
            f"elastic.enabled: {env_vars.QUORUM_ADDRESS} and {env_vars.ELASTIC_SLICE} must be set "
            "(start the job with launch/local_cluster.py)"
        )
    return int(slice_text)


@dataclasses.dataclass
class Warm(Hook):
    """What a slice builds before it knows which slice it is: its exchange (torch imported, its
    rendezvous store listening) and its step's programs. Closing it closes the exchange (the
    session does, once the slice has started)."""

    exchange: Exchange
    programs: Programs

    def close(self) -> None:
        self.exchange.close()
        self.programs.close()


def warm_up(ctx: RunContext, standby: bool = False) -> Warm:
    """The exchange and the step's programs. `standby`: a warm standby, which also starts
    loading the update that runs after a save (`train.keep`) while it waits; a slice started
    directly loads it beside training, from its first save on."""
    e = ctx.config.elastic
    host = e.host or socket.gethostname()
    exchange = make_exchange(e.backend, host, float(e.timeout_s), jax.process_index())
    try:
        programs = compile_programs(ctx)
    except BaseException:
        exchange.close()
        raise
    if standby:
        programs.apply.start_loading()
    return Warm(exchange, programs)


def start(
    ctx: RunContext,
    source: Any,
    load: Callable[[], tuple[TrainState, DataPosition]],
    warm: Warm | None = None,
    environ: Mapping[str, str] = os.environ,
) -> tuple[ElasticStep, StepIndex, TrainState, ElasticSession]:
    """The step function, the loader and the state to train from: joins the quorum first, and
    calls `load` (restore or initialise) only when no live slice has a state to heal this one.
    `warm`: what a standby built ahead (`warm_up`), else built here."""
    this_slice = slice_id(environ)
    e = ctx.config.elastic
    warm = warm or warm_up(ctx)
    exchange: Exchange = warm.exchange
    # A slice of several processes: process 0 alone asks for quorums; every exchange is agreed on.
    link = slice_agreement(float(e.quorum_timeout_s) + 2 * float(e.timeout_s) + 30.0)
    client = None
    if link is None or link.process_index == 0:
        token = environ.get(env_vars.RUN_TOKEN, "")
        client = QuorumClient(environ[env_vars.QUORUM_ADDRESS], token, this_slice)
    if link is not None:
        exchange = SliceExchange(exchange, link)
    session = ElasticSession(exchange, client, warm.programs)
    try:
        kind = SyncIntervalStep if int(e.sync_every_steps) > 1 else ElasticStep
        step = kind(
            ctx, source, exchange, exchange.store_address, client, this_slice, warm.programs, link
        )
        state, _ = step.join(load)
    except BaseException:
        session.close()
        raise
    assert step.index is not None  # made by `join`, at the position joined at
    return step, step.index, state, session
