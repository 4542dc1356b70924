"""Elastic mode's sync interval (DiLoCo) in this process: the outer step against a numpy
reference, a lone slice's rounds bitwise reproducible, and H = 1 left exactly as it was."""

from __future__ import annotations

import os
import signal

import jax
import numpy as np
import pytest
from conftest import (
    SMALL,
    events_of,
    run_context,
    slice_digests,
    slice_events,
    supervise_elastic,
    tiny_config,
)

SYNC = {"elastic.enabled": True, "elastic.slices": 2}


def _numpy_nesterov(outer, momentum, delta, lr, beta):
    momentum = beta * momentum + delta
    return outer - lr * (delta + beta * momentum), momentum


def test_the_outer_step_is_nesterov_sgd_on_the_mean_delta(tmp_path):
    from resilient_jax.elastic.slice_step import compile_outer
    from resilient_jax.train.state import init_state

    config = tiny_config(
        **SYNC,
        **{
            "elastic.sync_every_steps": 2,
            "elastic.outer_learning_rate": 0.5,
            "elastic.outer_momentum": 0.8,
        },
    )
    ctx = run_context(config, str(tmp_path), devices=2)
    outer_step, _ = compile_outer(ctx)
    state = init_state(config, ctx.mesh)
    flat = lambda tree: np.concatenate([np.ravel(a) for a in jax.tree.leaves(tree)])
    outer, momentum = flat(state.opt_state.params), np.zeros_like(flat(state.params))
    assert not momentum.any() and np.array_equal(outer, flat(state.params))
    rng = np.random.default_rng(0)
    for _ in range(2):  # the second step uses the momentum of the first
        delta = rng.normal(scale=1e-2, size=outer.size).astype(np.float32)
        state = outer_step(state, delta)
        outer, momentum = _numpy_nesterov(outer, momentum, delta, np.float32(0.5), np.float32(0.8))
        np.testing.assert_allclose(flat(state.opt_state.params), outer, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(flat(state.opt_state.momentum), momentum, rtol=1e-6, atol=1e-8)
        # The inner parameters restart from the new outer ones.
        assert np.array_equal(flat(state.params), flat(state.opt_state.params))


def test_a_sync_interval_of_one_keeps_the_state_and_the_step_of_today(tmp_path):
    from resilient_jax.train.state import abstract_state

    mesh = run_context(tiny_config(), str(tmp_path), devices=2).mesh
    plain = abstract_state(tiny_config(), mesh)
    every_step = abstract_state(tiny_config(**SYNC, **{"elastic.sync_every_steps": 1}), mesh)
    assert jax.tree.structure(every_step) == jax.tree.structure(plain)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), every_step) == jax.tree.map(
        lambda a: (a.shape, a.dtype), plain
    )
    interval = abstract_state(tiny_config(**SYNC, **{"elastic.sync_every_steps": 2}), mesh)
    assert interval.opt_state.inner == plain.opt_state  # the inner optimizer is today's
    assert jax.tree.structure(interval.opt_state.params) == jax.tree.structure(plain.params)


class _FailingSync:
    """The exchange, but its `fail_at`-th all-reduce (a sync) fails as if a peer had died."""

    def __init__(self, exchange, fail_at: int) -> None:
        self._exchange, self._fail_at, self._calls = exchange, fail_at, 0
        self.store_address = exchange.store_address

    def configure(self, quorum, slice_id: int) -> None:
        self._exchange.configure(quorum, slice_id)

    def allreduce_sum(self, buffer):
        from resilient_jax.elastic.exchange import ExchangeError

        self._calls += 1
        if self._calls == self._fail_at:
            raise ExchangeError("allreduce: connection reset by peer (injected)")
        return self._exchange.allreduce_sum(buffer)

    def broadcast(self, buffer, root: int):
        return self._exchange.broadcast(buffer, root)

    def close(self) -> None:
        self._exchange.close()


def _train_alone(tmp_path, config, steps: int, fail_sync: int | None = None):
    """A lone slice (it owns every part) trains `steps` steps; its state after each step. With
    `fail_sync`, that sync's exchange fails once."""
    pytest.importorskip("torch")
    from resilient_jax.control.quorum import QuorumServer
    from resilient_jax.data import make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.elastic.data import StepIndex
    from resilient_jax.elastic.diloco import SyncIntervalStep
    from resilient_jax.elastic.exchange import make_exchange
    from resilient_jax.elastic.quorum_client import QuorumClient
    from resilient_jax.train.state import init_state

    ctx = run_context(config, str(tmp_path), devices=2)
    server = QuorumServer("t", join_timeout_s=0.5, expected=1, settle_s=0.0)
    exchange = make_exchange("gloo", "127.0.0.1", 5.0)
    if fail_sync is not None:
        exchange = _FailingSync(exchange, fail_sync)
    client = QuorumClient(server.address, "t", 0)
    states = []
    try:
        step = SyncIntervalStep(
            ctx, make_source(config), exchange, exchange.store_address, client, 0
        )
        state, position = step.join(lambda: (init_state(config, ctx.mesh), DataPosition()))
        loader = StepIndex(position)
        for _ in range(steps):
            state, _ = step(state, loader.next()[1])
            states.append(jax.device_get(state))
    finally:
        client.close()
        exchange.close()
        server.close()
    return states


@pytest.mark.slow  # three compiles of the tiny model: about a minute on 2 cores
def test_a_lone_slice_with_a_sync_interval_is_bitwise_reproducible_through_a_failed_sync(
    tmp_path,
):
    from resilient_jax.data import BatchLoader, make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.train.compile import compile_step, without_fault_scale
    from resilient_jax.train.state import init_state

    # No warmup: the first step moves the parameters already.
    config = tiny_config(**SYNC, **{"elastic.sync_every_steps": 2, "optimizer.warmup_steps": 0})
    first = _train_alone(tmp_path / "a", config, 4)
    # The second run's second sync fails: its round is redone from its start, to the same bits.
    second = _train_alone(tmp_path / "b", config, 4, fail_sync=2)
    for a, b in zip(first, second, strict=True):
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, a, b)))
    assert not events_of(str(tmp_path / "a"), "elastic_round_redone")
    (redone,) = events_of(str(tmp_path / "b"), "elastic_round_redone")
    assert (redone["from_step"], redone["step"], redone["owned"]) == (2, 4, [0, 1])
    assert [int(s.step) for s in first] == [1, 2, 3, 4]

    # Between syncs the inner parameters move away from the outer ones; a sync brings them back.
    def synced(s) -> bool:
        return all(jax.tree.leaves(jax.tree.map(np.array_equal, s.params, s.opt_state.params)))

    assert [synced(s) for s in first] == [False, True, False, True]
    reported = [e["synced"] for e in events_of(str(tmp_path / "a"), "elastic_step")]
    assert reported == [False, True, False, True]

    # The first round against a reference: two single-runtime steps (the lone slice's inner
    # steps, up to the order of float additions), then Nesterov on their delta in numpy.
    ctx = run_context(config, str(tmp_path / "ref"), devices=2)
    reference = init_state(config, ctx.mesh)
    start = jax.device_get(reference.params)
    batches = BatchLoader(config, ctx.mesh, ctx.plan, make_source(config), DataPosition())
    train_step = without_fault_scale(compile_step(ctx))
    for _ in range(2):
        reference, _ = train_step(reference, batches.next()[1])
    batches.close()
    e = config.elastic
    for outer0, inner, got in zip(
        jax.tree.leaves(start),
        jax.tree.leaves(jax.device_get(reference.params)),
        jax.tree.leaves(first[1].params),
        strict=True,
    ):
        expected, _ = _numpy_nesterov(
            outer0, np.zeros_like(outer0), outer0 - inner, e.outer_learning_rate, e.outer_momentum
        )
        # Float additions in another order, through two Adam steps and the outer update: at most
        # 2.4e-6 apart on values near 1e-2 (scanned layers); a wrong update is off by ~1e-3.
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


# Two single-process slices of the real trainer under the elastic supervisor, a sync every 4 steps.
STEPS, EVERY = 16, 4
TWO_SLICES = {
    **SMALL,
    **SYNC,
    "total_steps": STEPS,
    "elastic.sync_every_steps": EVERY,
    "elastic.check_every_steps": 1,
    "optimizer.warmup_steps": 0,  # the first inner step moves the parameters already
    "checkpoint.every_steps": 0,
    "checkpoint.local_every_steps": 0,
}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    pytest.importorskip("torch")
    runs = []
    for name in ("first", "second"):
        workdir = str(tmp_path_factory.mktemp(name))
        result = supervise_elastic(workdir, TWO_SLICES)
        assert result.exit_code == 0, result.reason
        runs.append(workdir)
    return runs


@pytest.mark.slow
def test_two_slices_sync_every_h_steps_to_the_same_bits_in_every_run(undisturbed):
    first, second = undisturbed
    digests = [slice_digests(first, s) for s in (0, 1)]
    assert sorted(digests[0]) == list(range(1, STEPS + 1))
    # A fixed membership trains the same bits every time, on each slice.
    assert digests == [slice_digests(second, s) for s in (0, 1)]
    for step in range(1, STEPS + 1):
        # Each slice's own inner steps between syncs; the same outer parameters after each.
        assert (digests[0][step] == digests[1][step]) == (step % EVERY == 0), step
    synced = [e["step"] for e in slice_events(first, 0, "elastic_step") if e["synced"]]
    assert synced == list(range(EVERY, STEPS + 1, EVERY))
    assert not slice_events(first, 0, "elastic_exchange_failed")


# Long enough for a replacement to start (about 15 s on a busy 2-core host) while the survivor
# trains on alone (tens of ms a step).
LONG_STEPS = 1200


@pytest.mark.slow
def test_a_killed_slice_is_taken_over_round_by_round_and_its_replacement_joins(tmp_path):
    pytest.importorskip("torch")
    workdir = str(tmp_path)
    killed = {}

    def kill_slice_1_mid_round(supervisor) -> bool:
        # Early in a round (the kill lands inside it unless the round ends first).
        step = max(slice_digests(workdir, 1), default=0)
        if step < EVERY or step % EVERY not in (1, 2):
            return False
        killed["pid"] = supervisor.workers[1].pid
        os.kill(killed["pid"], signal.SIGKILL)
        return True

    overrides = {**TWO_SLICES, "total_steps": LONG_STEPS}
    result = supervise_elastic(
        workdir, overrides, during=kill_slice_1_mid_round, restart_delay_s=0.0
    )
    assert result.exit_code == 0, result.reason
    assert killed and result.replacements == 1
    survivor = slice_events(workdir, 0, "elastic_step")
    # Every step once, in order.
    assert [e["step"] for e in survivor] == list(range(1, LONG_STEPS + 1))
    redone = slice_events(workdir, 0, "elastic_round_redone")
    alone = next(q for q in slice_events(workdir, 0, "elastic_quorum") if q["slices"] == [0])
    if slice_events(workdir, 0, "elastic_exchange_failed"):
        # Killed inside a round: the survivor's sync failed, and it trained the round again from
        # its start with slice 1's parts of all its batches.
        assert redone and redone[0]["owned"] == [0, 1]
        assert redone[0]["from_step"] % EVERY == 0 and alone["from_step"] == redone[0]["from_step"]
    else:
        # Killed while the survivor asked for the next round's quorum: that round is its own.
        assert not redone and alone["from_step"] % EVERY == 0
    synced = [e["step"] for e in survivor if e["synced"]]
    assert synced == list(range(EVERY, LONG_STEPS + 1, EVERY))  # no sync skipped or half-made
    # The replacement healed from the survivor at a round boundary (no restore) and joined.
    pids = {e["pid"] for e in slice_events(workdir, 1, "elastic_step")}
    (replacement_pid,) = pids - {killed["pid"]}
    heals = [e for e in slice_events(workdir, 1, "elastic_heal") if e["pid"] == replacement_pid]
    assert [h["role"] for h in heals] == ["received"] and heals[0]["step"] % EVERY == 0
    assert not slice_events(workdir, 1, "restore")
    joined = [e for e in slice_events(workdir, 1, "elastic_step") if e["pid"] == replacement_pid]
    assert joined[0]["step"] == heals[0]["step"] + 1 and joined[-1]["step"] == LONG_STEPS
    # From then on both slices make the same outer step: bitwise equal after every sync.
    digests = [slice_digests(workdir, s) for s in (0, 1)]
    after = [e["step"] for e in joined if e["synced"]]
    assert after and all(digests[0][step] == digests[1][step] for step in after)
