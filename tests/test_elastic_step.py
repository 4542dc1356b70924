"""The elastic step in this process: a slice alone computes every part of the global batch and
makes the single-runtime step's update (up to the order of float additions)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import events_of, run_context, tiny_config

pytest.importorskip("torch")


def test_a_lone_slice_trains_the_global_batch_like_the_single_runtime_step(tmp_path):
    from resilient_jax.control.quorum import QuorumServer
    from resilient_jax.data import BatchLoader, make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.elastic.data import StepIndex
    from resilient_jax.elastic.exchange import make_exchange
    from resilient_jax.elastic.quorum_client import QuorumClient
    from resilient_jax.elastic.trainer import ElasticStep
    from resilient_jax.train.compile import compile_step, without_fault_scale
    from resilient_jax.train.state import init_state

    config = tiny_config(**{"elastic.enabled": True, "elastic.slices": 2})
    ctx = run_context(config, str(tmp_path), devices=2)
    source = make_source(config)
    server = QuorumServer("t", join_timeout_s=0.5, expected=1, settle_s=0.0)
    exchange = make_exchange("gloo", "127.0.0.1", 5.0)
    client = QuorumClient(server.address, "t", 0)
    try:
        step = ElasticStep(ctx, source, exchange, exchange.store_address, client, slice_id=0)
        state, position = step.join(lambda: (init_state(config, ctx.mesh), DataPosition()))
        loader = StepIndex(position)
        for _ in range(3):
            state, metrics = step(state, loader.next()[1])
        elastic_params, elastic_loss = jax.device_get(state.params), float(metrics["loss"])
    finally:
        client.close()
        exchange.close()
        server.close()
    reference = init_state(config, ctx.mesh)
    batches = BatchLoader(config, ctx.mesh, ctx.plan, source, DataPosition())
    train_step = without_fault_scale(compile_step(ctx))
    for _ in range(3):
        reference, ref_metrics = train_step(reference, batches.next()[1])
    batches.close()
    assert int(state.step) == 3
    assert elastic_loss == pytest.approx(float(ref_metrics["loss"]), rel=1e-5)
    close = jax.tree.map(
        lambda a, b: np.allclose(a, b, rtol=1e-4, atol=1e-6),
        elastic_params,
        jax.device_get(reference.params),
    )
    assert all(jax.tree.leaves(close))
    # One quorum of one slice, which computed both parts of every step.
    steps = events_of(str(tmp_path), "elastic_step")
    assert [(e["step"], e["owned"], e["slices"]) for e in steps] == [
        (s, [0, 1], [0]) for s in (1, 2, 3)
    ]
