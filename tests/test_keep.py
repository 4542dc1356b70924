"""The step after a save keeps the saved state (`train.keep`): its non-donating twin computes the
same bits, leaves its input valid, and a save of that state reads the right bits after later
(donating) steps have run, on both tiers; nothing is kept before the twin is loaded."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import (
    checkpoint_config,
    data_position,
    device_buffers,
    donated,
    host_bytes,
    restore_from_each_tier,
    run_context,
    tiny_config,
)

from resilient_jax import mesh as mesh_lib
from resilient_jax.checkpoint import Checkpointer
from resilient_jax.contracts.event_types import EventType
from resilient_jax.events import read_events
from resilient_jax.train.compile import compile_step
from resilient_jax.train.hooks import StepInfo
from resilient_jax.train.keep import KEEP_PROGRAM
from resilient_jax.train.state import init_state


def _batches(ctx, count: int) -> list[jax.Array]:
    rows = ctx.config.global_batch_size // ctx.plan.microbatches
    shape = (ctx.plan.microbatches, rows, ctx.config.data.seq_len + 1)
    rng = np.random.default_rng(0)
    return [
        jax.device_put(
            rng.integers(0, 256, shape, dtype=np.int32), mesh_lib.batch_sharding(ctx.mesh)
        )
        for _ in range(count)
    ]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        pytest.param(  # a second optimizer's compile: about 15 s on 2 cores
            {"optimizer.galore.rank": 8, "optimizer.galore.update_interval": 2},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["adamw", "galore"],
)
def test_the_non_donating_step_is_bitwise_the_donating_one_and_keeps_its_input(tmp_path, overrides):
    ctx = run_context(tiny_config(**overrides), str(tmp_path))
    step = compile_step(ctx)
    # The AdamW run also takes a skipped (NaN) step.
    scales = [np.float32(s) for s in (1.0, np.nan if not overrides else 1.0, 1.0, 1.0)]
    batches = _batches(ctx, len(scales))

    state = init_state(ctx.config, ctx.mesh)
    by_donating = []
    for batch, scale in zip(batches, scales, strict=True):
        previous = state
        state, metrics = step(state, batch, scale)
        assert donated(previous)
        by_donating.append(host_bytes((state, metrics)))

    step.load_keeping()
    state = init_state(ctx.config, ctx.mesh)
    kept_states = []
    for i, (batch, scale) in enumerate(zip(batches, scales, strict=True)):
        assert ctx.keeper.keep(state)
        new, metrics = step(state, batch, scale)
        assert host_bytes((new, metrics)) == by_donating[i], f"step {i + 1} differs"
        assert not device_buffers(new) & device_buffers(state), "an output shares a buffer"
        kept_states.append(state)
        state = new
    assert not any(leaf.is_deleted() for s in kept_states for leaf in jax.tree.leaves(s))
    # Unkept, the next step donates again.
    step(state, batches[0], scales[0])
    assert donated(state)


def test_nothing_is_kept_before_the_twin_is_loaded_nor_a_state_the_step_is_not_given(tmp_path):
    ctx = run_context(tiny_config(), str(tmp_path))
    step = compile_step(ctx)
    (batch,) = _batches(ctx, 1)
    one = np.float32(1.0)
    state = init_state(ctx.config, ctx.mesh)
    assert not ctx.keeper.keep(state)  # not loaded, and not before the first step has run
    state, _ = step(state, batch, one)
    assert not ctx.keeper.keep(state)
    state, _ = step(state, batch, one)
    ctx.keeper.keep(state)  # the first save after the second step starts loading it
    step.load_keeping()
    background = [
        e for e in read_events(str(tmp_path)) if e["type"] == EventType.COMPILE_BACKGROUND
    ]
    assert [e["program"] for e in background] == [KEEP_PROGRAM]
    # Kept, but the loop hands the step another state (a rollback restored one): donated, and
    # the request is gone.
    assert ctx.keeper.keep(state)
    other = init_state(ctx.config, ctx.mesh)
    step(other, batch, one)
    assert donated(other)
    step(state, batch, one)
    assert donated(state)


def _save_step_2_of_5(ctx, step, batches, held_saves):
    """Five steps from a fresh state with a checkpointer saving step 2, whose writes are held
    until the fifth step has run; returns the state the save was given."""
    checkpointer = Checkpointer(ctx, handle_sigterm=False).open()
    state = init_state(ctx.config, ctx.mesh)
    checkpointer.on_start(ctx, state)
    for i in range(5):
        state, _ = step(state, batches[i], np.float32(1.0))
        if i == 1:
            checkpointer.after_step(ctx, state, StepInfo(2, 1, data_position(2), 0.01))
            saved = state
    jax.block_until_ready(state)
    held_saves.set()
    checkpointer.wait_until_finished()
    checkpointer.close()
    return saved


def test_a_save_reads_the_kept_state_after_later_steps_donated_theirs(
    tmp_path, local_root, held_saves
):
    config = checkpoint_config(
        local_root,
        **{
            "checkpoint.every_steps": 2,
            "checkpoint.local_every_steps": 2,
            "checkpoint.local_auto_interval": False,
        },
    )
    ctx = run_context(config, str(tmp_path / "run"))
    step = compile_step(ctx)
    step.load_keeping()
    batches = _batches(ctx, 5)
    one = np.float32(1.0)

    # The reference: the same steps, all donating, the state after step 2 copied to the host.
    state = init_state(config, ctx.mesh)
    for i in range(2):
        state, _ = step(state, batches[i], one)
    expected = host_bytes(state)
    for i in range(2, 5):
        state, _ = step(state, batches[i], one)

    # Both tiers' writes of step 2 wait until steps 3-5 have run; the save must not copy.
    _save_step_2_of_5(ctx, step, batches, held_saves)
    committed = [e for e in read_events(ctx.workdir) if e["type"] == EventType.SAVE_COMMITTED]
    assert sorted(e["tier"] for e in committed if e["step"] == 2) == ["local", "persistent"]
    # The persistent copy too: its digests were computed from the kept state.
    restored = restore_from_each_tier(config, ctx.workdir, 2)
    assert {tier: host_bytes(state) for tier, state in restored.items()} == {
        "local": expected,
        "persistent": expected,
    }


def test_a_save_whose_kept_state_would_not_fit_copies_it_to_host_and_keeps_nothing(
    tmp_path, local_root, held_saves
):
    """`checkpoint.keep_state=auto` on a device whose memory holds the steady state but not the
    save step's peak (a kept state beside the new one): the save copies the state to pinned host
    memory before the next step donates it, no non-donating step is asked for, and both tiers
    still hold step 2 bit for bit after later steps donated every buffer."""
    from resilient_jax.checkpoint.snapshot import host_snapshot
    from resilient_jax.train import memory_plan

    overrides = {
        "checkpoint.every_steps": 2,
        "checkpoint.local_every_steps": 2,
        "checkpoint.local_auto_interval": False,
    }
    probe = run_context(checkpoint_config(local_root, **overrides), str(tmp_path / "probe"))
    mem = memory_plan.mesh_memory(probe.config, probe.plan, slices=1, capacity=1)
    between = (mem.total + mem.save_peak_kept) / 2 / memory_plan.HEADROOM
    assert mem.total < memory_plan.HEADROOM * between < mem.save_peak_kept
    config = checkpoint_config(
        local_root, **overrides, **{"checkpoint.device_memory_gb": between / memory_plan.GB}
    )
    ctx = run_context(config, str(tmp_path / "run"))
    step = compile_step(ctx)
    asked = []
    ctx.keeper.keep = lambda state: asked.append(state) or True
    batches = _batches(ctx, 5)
    one = np.float32(1.0)
    state = init_state(config, ctx.mesh)
    for i in range(2):
        state, _ = step(state, batches[i], one)
    expected = host_bytes(state)
    copy = host_snapshot(state)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(copy)} == {"pinned_host"}
    assert host_bytes(copy) == expected

    saved = _save_step_2_of_5(ctx, step, batches, held_saves)
    assert donated(saved) and not asked  # the next step donated it: nothing was kept
    (method,) = [e for e in read_events(ctx.workdir) if e["type"] == EventType.SAVE_METHOD]
    assert method["method"] == "copy_to_host" and "exceeds" in method["why"]
    assert method["steady_bytes"] < memory_plan.HEADROOM * method["device_bytes"]
    assert method["save_peak_bytes"] > memory_plan.HEADROOM * method["device_bytes"]
    restored = restore_from_each_tier(config, ctx.workdir, 2)
    assert {tier: host_bytes(state) for tier, state in restored.items()} == {
        "local": expected,
        "persistent": expected,
    }
