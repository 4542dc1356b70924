"""The elastic step in this process: a slice alone computes every part of the global batch and
makes the single-runtime step's update (up to the order of float additions)."""

from __future__ import annotations

import functools
import threading
import time

import jax
import numpy as np
import pytest
from conftest import assert_bitwise, events_of, run_context, run_slices, tiny_config

pytest.importorskip("torch")


# A mixture of experts with its experts over the `expert` axis of the slice's 2 devices.
MOE = {"model.moe.num_experts": 4, "mesh.expert": 2, "per_device_batch_size": 2}


def _assert_like_the_single_runtime_step(config, ctx, params, metrics, steps: int) -> None:
    """`params` and the last `metrics` of `steps` elastic steps from a fresh state match the
    single-runtime step's to float tolerance, not bitwise: the elastic step sums each part's
    microbatches and then the parts, the single-runtime step all microbatches in one scan, so
    the float additions run in another order. A mixture of experts' router metrics too."""
    from resilient_jax.data import BatchLoader, make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.train.compile import compile_step, without_fault_scale
    from resilient_jax.train.state import init_state

    reference = init_state(config, ctx.mesh)
    batches = BatchLoader(config, ctx.mesh, ctx.plan, make_source(config), DataPosition())
    train_step = without_fault_scale(compile_step(ctx))
    for _ in range(steps):
        reference, ref_metrics = train_step(reference, batches.next()[1])
    batches.close()
    ref_metrics = jax.device_get(ref_metrics)
    assert sorted(metrics) == sorted(ref_metrics)  # the same metrics.jsonl keys
    moe = config.model.moe.num_experts > 0
    assert ("moe_expert_load" in ref_metrics) == moe
    for key in ("loss", "grad_norm", "lm_loss", "moe_balance_loss", "moe_z_loss"):
        if key in ref_metrics:
            assert float(metrics[key]) == pytest.approx(float(ref_metrics[key]), rel=1e-5)
    for key in ("moe_dropped_fraction", "moe_expert_load"):  # counts: exact in float32
        if key in ref_metrics:
            np.testing.assert_array_equal(metrics[key], ref_metrics[key])
    close = jax.tree.map(
        lambda a, b: np.allclose(a, b, rtol=1e-4, atol=1e-6),
        params,
        jax.device_get(reference.params),
    )
    assert all(jax.tree.leaves(close))


def test_a_lone_slice_trains_the_global_batch_like_the_single_runtime_step(tmp_path):
    """A dense model here; a mixture of experts (its router's metrics) in the slow
    test_moe_parts_split_across_two_slices_give_a_lone_slices_bits."""
    from resilient_jax.control.quorum import QuorumServer
    from resilient_jax.data import make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.elastic.data import StepIndex
    from resilient_jax.elastic.trainer import ElasticStep
    from resilient_jax.train.state import init_state

    config = tiny_config(**{"elastic.enabled": True, "elastic.slices": 2})
    ctx = run_context(config, str(tmp_path), devices=2)
    source = make_source(config)
    server = QuorumServer("t", join_timeout_s=0.5, expected=1, settle_s=0.0)
    trained = {}

    def lone_slice(slice_id: int, exchange, client) -> None:
        step = ElasticStep(ctx, source, exchange, exchange.store_address, client, slice_id)
        state, position = step.join(lambda: (init_state(config, ctx.mesh), DataPosition()))
        loader = StepIndex(position)
        for _ in range(3):
            state, metrics = step(state, loader.next()[1])
        trained["step"] = int(state.step)
        trained["params"], trained["metrics"] = jax.device_get((state.params, metrics))

    try:
        run_slices(server.address, [0], lone_slice, exchange_timeout_s=5.0)
    finally:
        server.close()
    assert trained["step"] == 3
    _assert_like_the_single_runtime_step(config, ctx, trained["params"], trained["metrics"], 3)
    # One quorum of one slice, which computed both parts of every step.
    steps = events_of(str(tmp_path), "elastic_step")
    assert [(e["step"], e["owned"], e["slices"]) for e in steps] == [
        (s, [0, 1], [0]) for s in (1, 2, 3)
    ]


class _ScriptedClient:
    """The quorum server's answers, scripted: slice 0 alone, except that at `pair_at` (the step
    its state has applied) slice 1 is in the quorum too, until slice 0 asks to re-form."""

    def __init__(self, pair_at: int | None) -> None:
        self._pair_at = pair_at
        self._reformed = False

    def request(self, step, store, reform, timeout_s, last=None):
        from resilient_jax.elastic.exchange import Member, Quorum

        self._reformed = self._reformed or reform
        if step == self._pair_at and not self._reformed:
            return Quorum("pair", (Member(0, step, store), Member(1, step, "127.0.0.1:1")))
        return Quorum("alone-2" if self._reformed else "alone", (Member(0, step, store),))

    def close(self) -> None:
        pass


class _PeerDiesExchange:
    """A lone slice's exchange (the identity) whose every exchange with a peer fails, as when
    the peer was killed while this slice computed its part."""

    store_address = "127.0.0.1:0"

    def configure(self, quorum, slice_id) -> None:
        self._size = len(quorum.members)

    def allreduce_sum(self, buffer):
        from resilient_jax.elastic.exchange import ExchangeError

        if self._size > 1:
            raise ExchangeError("allreduce: Connection reset by peer")
        return buffer

    def broadcast(self, buffer, root):
        raise AssertionError("nobody is behind: no heal")

    def close(self) -> None:
        pass


@pytest.fixture
def shared_programs(monkeypatch):
    """The elastic step's programs compiled once for every ElasticStep of the test; yields a
    one-element list counting the parts whose gradient sums were computed."""
    from resilient_jax.elastic import slice_step as elastic_step

    compile_sums, compile_apply = elastic_step.compile_gradient_sums, elastic_step.compile_apply
    compiled: dict = {}
    computed = [0]

    def counted_sums(ctx):
        sums, hit = compiled.setdefault("sums", compile_sums(ctx))

        def run(params, rows):
            computed[0] += 1
            return sums(params, rows)

        return run, hit

    monkeypatch.setattr(elastic_step, "compile_gradient_sums", counted_sums)
    monkeypatch.setattr(
        elastic_step, "compile_apply", lambda ctx: compiled.setdefault("apply", compile_apply(ctx))
    )
    return computed


def test_a_failed_exchange_keeps_the_rows_computed_and_redoes_only_the_new_part(
    tmp_path, shared_programs
):
    """Slice 0 computes its part of step 2 in a quorum with slice 1, whose exchange then fails:
    under the new quorum (alone) it computes only part 1, keeps part 0's row, and its parameters
    are those of a lone slice that computed both parts of every step, bit for bit."""
    from resilient_jax.data import make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.elastic.trainer import ElasticStep
    from resilient_jax.train.state import init_state

    config = tiny_config(**{"elastic.enabled": True, "elastic.slices": 2})
    source = make_source(config)
    computed = shared_programs

    def train(workdir: str, pair_at: int | None) -> tuple[object, list[int]]:
        """3 steps; the parameters, and the parts computed at each step."""
        ctx = run_context(config, workdir, devices=2)
        client = _ScriptedClient(pair_at)
        step = ElasticStep(ctx, source, _PeerDiesExchange(), "127.0.0.1:0", client, 0)
        state, position = step.join(lambda: (init_state(config, ctx.mesh), DataPosition()))
        per_step = []
        for batch_index in range(position.next_batch, position.next_batch + 3):
            before = computed[0]
            state, _ = step(state, batch_index)
            per_step.append(computed[0] - before)
        return jax.device_get(state.params), per_step

    reference, reference_parts = train(str(tmp_path / "alone"), pair_at=None)
    params, parts = train(str(tmp_path / "failed"), pair_at=1)
    assert reference_parts == [2, 2, 2]
    assert parts == [2, 2, 2]  # part 0 of step 2 once, before the failure; part 1 after it
    assert_bitwise(params, jax.device_get(reference))
    failed = events_of(str(tmp_path / "failed"), "elastic_exchange_failed")
    assert [(e["step"], e["quorum_id"]) for e in failed] == [(1, "pair")]
    steps = events_of(str(tmp_path / "failed"), "elastic_step")
    assert [(e["step"], e["quorum_id"], e["owned"], e.get("reused")) for e in steps] == [
        (1, "alone", [0, 1], None),
        (2, "alone-2", [0, 1], [0]),
        (3, "alone-2", [0, 1], None),
    ]


def test_a_joining_slice_is_handed_the_state_over_a_step_the_survivor_computes_alone(
    tmp_path, shared_programs
):
    """Two slices in this process over a real quorum server and gloo: slice 0 trains alone,
    slice 1 joins from a fresh state. Slice 0 sends the state of a step's start while it
    computes both parts of that step; slice 1 applies the step's sum itself and computes its own
    part from the next step on. Both end bitwise equal to a lone slice's run."""
    from resilient_jax.control.quorum import QuorumServer
    from resilient_jax.data import make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.elastic.data import StepIndex
    from resilient_jax.elastic.trainer import ElasticStep
    from resilient_jax.train.state import init_state

    total = 14
    config = tiny_config(
        **{"elastic.enabled": True, "elastic.slices": 2, "elastic.quorum_timeout_s": 60.0}
    )
    server = QuorumServer("t", join_timeout_s=1.0, expected=1, settle_s=0.0)
    results = {}
    started = threading.Event()

    def until_slice_1_asks() -> None:
        deadline = time.monotonic() + 120
        while 1 not in server.connected_slices():
            assert time.monotonic() < deadline, "slice 1 never asked for a quorum"
            time.sleep(0.01)

    def slice_run(slice_id: int, exchange, client, paired: bool) -> None:
        """Slice 0 alone (in `lone/`), or slice 0 waiting after step 3 for slice 1 to ask, or
        slice 1 joining once slice 0 is at step 3 (in `s<id>/`)."""
        if slice_id == 1:
            assert started.wait(120)
        ctx = run_context(config, str(tmp_path / (f"s{slice_id}" if paired else "lone")), devices=2)
        step = ElasticStep(
            ctx, make_source(config), exchange, exchange.store_address, client, slice_id
        )

        def load():
            assert slice_id == 0, "slice 1 is healed by slice 0: it loads no state"
            return init_state(config, ctx.mesh), DataPosition()

        state, position = step.join(load)
        results[(slice_id, "joined")] = int(jax.device_get(state.step))
        loader = StepIndex(position)
        while int(jax.device_get(state.step)) < total:
            state, _ = step(state, loader.next()[1])
            if slice_id == 0 and paired and int(jax.device_get(state.step)) == 3:
                started.set()
                until_slice_1_asks()
        results[slice_id] = jax.device_get(state.params)

    try:
        run_slices(server.address, [0], functools.partial(slice_run, paired=False))
        lone = results.pop(0)
        pair = functools.partial(slice_run, paired=True)
        run_slices(server.address, [0, 1], pair, on_error=started.set)
    finally:
        server.close()
    assert_bitwise(results[0], lone)
    assert_bitwise(results[1], lone)

    heals = events_of(str(tmp_path / "s1"), "elastic_heal")
    assert [(e["role"], e["source_slice"]) for e in heals] == [("received", 0)]
    joined = heals[0]["step"]
    assert results[(1, "joined")] == joined == 4  # handed the state of step 3 over step 4
    sent = events_of(str(tmp_path / "s0"), "elastic_heal")
    assert [(e["role"], e["step"]) for e in sent] == [("sent", joined)]
    survivor = {e["step"]: e for e in events_of(str(tmp_path / "s0"), "elastic_step")}
    # The step handed over: both in the quorum, slice 0 computed both parts.
    assert (survivor[joined]["slices"], survivor[joined]["owned"]) == ([0, 1], [0, 1])
    for step in range(joined + 1, total + 1):
        assert (survivor[step]["slices"], survivor[step]["owned"]) == ([0, 1], [0])
    joiner = events_of(str(tmp_path / "s1"), "elastic_step")
    assert [(e["step"], e["owned"]) for e in joiner] == [
        (s, [1]) for s in range(joined + 1, total + 1)
    ]
    assert not events_of(str(tmp_path / "s0"), "elastic_exchange_failed")


@pytest.mark.slow  # a mixture of experts: one slice, two slices, the single-runtime step
def test_moe_parts_split_across_two_slices_give_a_lone_slices_bits(tmp_path, shared_programs):
    """A mixture of experts trained by two slices over a real quorum server and gloo, each
    computing its own part: parameters and every metric (the router's sums included) are
    bitwise those of one slice computing both parts. Each part is a row of the exchanged buffer
    that one member fills, and every member adds the rows up in part order."""
    from resilient_jax.control.quorum import QuorumServer
    from resilient_jax.data import make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.elastic.trainer import ElasticStep
    from resilient_jax.train.state import init_state

    config = tiny_config(**{"elastic.enabled": True, "elastic.slices": 2, **MOE})

    def train(slices: int, workdir: str) -> dict:
        """2 steps of `slices` slices from a fresh state: each one's (params, last metrics)."""
        server = QuorumServer("t", join_timeout_s=1.0, expected=slices, settle_s=60.0)
        results = {}

        def slice_run(slice_id: int, exchange, client) -> None:
            ctx = run_context(config, f"{workdir}/{slice_id}", devices=2)
            store = exchange.store_address
            step = ElasticStep(ctx, make_source(config), exchange, store, client, slice_id)
            state, position = step.join(lambda: (init_state(config, ctx.mesh), DataPosition()))
            for batch_index in range(position.next_batch, position.next_batch + 2):
                state, metrics = step(state, batch_index)
            results[slice_id] = jax.device_get((state.params, metrics))

        try:
            run_slices(server.address, range(slices), slice_run)
        finally:
            server.close()
        return results

    lone = train(1, str(tmp_path / "lone"))[0]
    # The lone slice, computing both parts, makes the single-runtime step's update.
    lone_ctx = run_context(config, str(tmp_path / "reference"), devices=2)
    assert lone_ctx.plan.expert == 2
    _assert_like_the_single_runtime_step(config, lone_ctx, *lone, steps=2)
    pair = train(2, str(tmp_path / "pair"))
    owned = [e["owned"] for e in events_of(str(tmp_path / "pair" / "1"), "elastic_step")]
    assert owned == [[1], [1]]
    assert "moe_expert_load" in lone[1] and lone[1]["moe_dropped_fraction"] > 0
    for params, metrics in pair.values():
        assert_bitwise(params, lone[0])
        assert sorted(metrics) == sorted(lone[1])
        for key, value in metrics.items():
            np.testing.assert_array_equal(value, lone[1][key], err_msg=key)
