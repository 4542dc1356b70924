"""Elastic mode's update after a save keeps the saved state (`train.keep`): its non-donating twin
computes the same bits and leaves its input valid, and an elastic slice's save of that state
reads the right bits after later (donating) steps have run, on both tiers, without a copy."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import (
    assert_bitwise,
    checkpoint_config,
    data_position,
    device_buffers,
    donated,
    host_bytes,
    restore_from_each_tier,
    run_context,
)

pytest.importorskip("torch")

ELASTIC = {"elastic.enabled": True, "elastic.slices": 2}


def test_the_non_donating_update_is_bitwise_the_donating_one_and_keeps_its_input(tmp_path):
    from resilient_jax.elastic import slice_step as elastic_step
    from resilient_jax.train.state import init_state

    ctx = run_context(checkpoint_config(**ELASTIC), str(tmp_path), devices=2)
    apply, _ = elastic_step.compile_apply(ctx)
    keeping = elastic_step.keeping_apply(ctx)
    keeping.wait()
    width = elastic_step.vector_width(ctx)
    rng = np.random.default_rng(0)
    tokens = ctx.config.global_batch_size * ctx.config.data.seq_len
    sums = [rng.normal(scale=tokens * 1e-3, size=width).astype(np.float32) for _ in range(3)]
    sums[1][0] = np.nan  # a bad step: the update leaves the state as it was

    state = init_state(ctx.config, ctx.mesh)
    by_donating = []
    for summed in sums:
        previous = state
        state, metrics = apply(state, summed)
        assert donated(previous)
        by_donating.append(host_bytes((state, metrics)))

    state = init_state(ctx.config, ctx.mesh)
    for i, summed in enumerate(sums):
        new, metrics = keeping(state, summed)
        assert host_bytes((new, metrics)) == by_donating[i], f"update {i + 1} differs"
        assert not device_buffers(new) & device_buffers(state), "an output shares a buffer"
        assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
        state = new


def test_an_elastic_save_reads_the_kept_state_after_later_steps_donated_theirs(
    tmp_path, local_root, held_saves
):
    """A lone slice (real quorum server and gloo) saves step 2 on both tiers; the writes wait
    until steps 3-5 have run. The save copies nothing, and both tiers hold step 2's bits."""
    from resilient_jax.checkpoint import Checkpointer
    from resilient_jax.control.quorum import QuorumServer
    from resilient_jax.data import make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.elastic.data import StepIndex
    from resilient_jax.elastic.exchange import make_exchange
    from resilient_jax.elastic.quorum_client import QuorumClient
    from resilient_jax.elastic.trainer import ElasticStep, compile_programs
    from resilient_jax.events import read_events
    from resilient_jax.train.hooks import StepInfo
    from resilient_jax.train.state import init_state

    config = checkpoint_config(
        local_root,
        **ELASTIC,
        **{
            "checkpoint.every_steps": 2,
            "checkpoint.local_every_steps": 2,
            "checkpoint.local_auto_interval": False,
        },
    )
    ctx = run_context(config, str(tmp_path / "run"), devices=2)
    server = QuorumServer("t", join_timeout_s=0.5, expected=1, settle_s=0.0)
    exchange = make_exchange("gloo", "127.0.0.1", 5.0)
    client = QuorumClient(server.address, "t", 0)
    checkpointer = Checkpointer(ctx, handle_sigterm=False).open()
    try:
        programs = compile_programs(ctx)
        programs.apply.load_keeping()  # in a run: loaded beside training from the first save
        step = ElasticStep(
            ctx, make_source(config), exchange, exchange.store_address, client, 0, programs
        )
        state, position = step.join(lambda: (init_state(config, ctx.mesh), DataPosition()))
        checkpointer.on_start(ctx, state)
        loader = StepIndex(position)
        for i in range(5):
            state, _ = step(state, loader.next()[1])
            if i == 1:
                saved, expected = state, jax.device_get(state)
                checkpointer.after_step(ctx, state, StepInfo(2, 1, data_position(2), 0.01))
        jax.block_until_ready(state)
        assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(saved)), "saved was donated"
        held_saves.set()
        checkpointer.wait_until_finished()
    finally:
        held_saves.set()
        checkpointer.close()
        client.close()
        exchange.close()
        server.close()
        programs.close()
    committed = [e for e in read_events(ctx.workdir) if e["type"] == "save_committed"]
    assert sorted(e["tier"] for e in committed if e["step"] == 2) == ["local", "persistent"]
    restored = restore_from_each_tier(config, ctx.workdir, 2, devices=2)
    assert sorted(restored) == ["local", "persistent"]
    for state in restored.values():
        assert_bitwise(state, expected)
