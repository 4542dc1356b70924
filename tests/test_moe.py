"""Mixture of experts: routing with capacity and dropped tokens, the router's losses, its config
checks, the experts on the `expert` mesh axis, and checkpoints restoring bitwise on the same mesh
and onto a reshaped one (the experts re-placed, their count kept)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_bitwise,
    checkpoint_config,
    data_position,
    run_context,
    tiny_config,
    train_steps,
)

from resilient_jax.checkpoint import Checkpointer, Tier
from resilient_jax.config import ConfigError, validate
from resilient_jax.model.moe import MoeConfig, MoeMlp, expert_load_extremes, router_sums
from resilient_jax.topology import Topology, plan_mesh
from resilient_jax.train.hooks import StepInfo
from resilient_jax.train.state import init_state

# On fewer devices, more microbatches: a reshape changes how sequences are grouped.
MOE = {"model.moe.num_experts": 4, "mesh.expert": 2, "per_device_batch_size": 2}


def _moe_layer(top_k: int, capacity_factor: float, experts: int = 4) -> MoeMlp:
    moe = MoeConfig(experts, 1, top_k, capacity_factor, 16, 0.01, 0.001)
    return MoeMlp(moe, 8, jnp.dtype(jnp.float32))


def _apply(layer: MoeMlp, x_BLD: jax.Array):
    params = nn.unbox(jax.jit(layer.init)(jax.random.key(0), x_BLD)["params"])
    apply = jax.jit(lambda p, x: layer.apply({"params": p}, x, mutable=["intermediates"]))
    out, sown = apply(params, x_BLD)
    return jax.tree.map(np.asarray, params), out, router_sums(sown["intermediates"], layer.moe, 1)


def _expert(params, e: int, x_D: np.ndarray) -> np.ndarray:
    gate = x_D @ params["w_gate"][e]
    return ((gate / (1 + np.exp(-gate))) * (x_D @ params["w_up"][e])) @ params["w_down"][e]


def _routes(params, x_LD: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    logits = x_LD @ params["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    return order, np.take_along_axis(probs, order, -1)


@pytest.mark.parametrize("top_k", [1, 2])
def test_each_token_gets_its_top_k_experts_mixed_by_router_weight(top_k):
    x = jax.random.normal(jax.random.key(1), (2, 6, 8))
    params, out, sums = _apply(_moe_layer(top_k, capacity_factor=4.0), x)  # nothing dropped
    assert float(sums.dropped) == 0.0
    for b in range(2):
        experts, weights = _routes(params, np.asarray(x[b]), top_k)
        if top_k == 2:  # Switch (top-1) scales by the router probability; top-2 renormalises
            weights /= weights.sum(-1, keepdims=True)
        for t in range(6):
            expected = sum(
                w * _expert(params, e, np.asarray(x[b, t]))
                for e, w in zip(experts[t], weights[t], strict=True)
            )
            np.testing.assert_allclose(out[b, t], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(sums.load_NE.sum(), 2 * 6 * top_k)


def test_assignments_beyond_capacity_are_dropped_first_choices_first():
    layer = _moe_layer(top_k=2, capacity_factor=0.5)  # 2 slots per expert for 8 tokens
    x = jax.random.normal(jax.random.key(2), (1, 8, 8))
    params, out, sums = _apply(layer, x)
    experts, weights = _routes(params, np.asarray(x[0]), 2)
    weights /= weights.sum(-1, keepdims=True)
    # The queue: every first choice in position order, then every second choice.
    taken = {e: 0 for e in range(4)}
    expected = np.zeros((8, 8), np.float32)
    dropped = 0
    for choice in range(2):
        for t in range(8):
            e = experts[t, choice]
            if taken[e] < layer.moe.capacity(8):
                taken[e] += 1
                expected[t] += weights[t, choice] * _expert(params, e, np.asarray(x[0, t]))
            else:
                dropped += 1
    assert dropped > 0 and float(sums.dropped) == dropped
    np.testing.assert_allclose(out[0], expected, rtol=1e-4, atol=1e-5)


def test_balance_loss_is_one_for_uniform_routing_and_z_loss_is_logsumexp_squared():
    layer = _moe_layer(top_k=1, capacity_factor=4.0)
    x = jnp.zeros((3, 4, 8))  # zero input: equal logits, every probability 1/4
    _, _, sums = _apply(layer, x)
    # top-k of equal probabilities picks expert 0: f = (1, 0, 0, 0), P = 1/4 each -> 4 * 1/4 = 1.
    np.testing.assert_allclose(float(sums.balance), 3 * 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(sums.z), 3 * 4 * np.log(4.0) ** 2, rtol=1e-6)
    np.testing.assert_array_equal(sums.load_NE, [[12, 0, 0, 0]])


@pytest.mark.parametrize(
    "overrides,key",
    [
        ({"model.moe.num_experts": 6, "mesh.expert": 4}, "mesh.expert"),  # 4 does not divide 6
        ({"model.moe.num_experts": 1, "model.moe.top_k": 2}, "model.moe.top_k"),
        ({"model.moe.num_experts": 4, "model.moe.top_k": 3}, "model.moe.top_k"),
        ({"model.moe.num_experts": 4, "model.moe.capacity_factor": 0}, "model.moe.capacity_factor"),
        ({"model.moe.num_experts": 4, "model.moe.every": 3}, "model.moe.every"),  # 2 layers
        ({"model.moe.num_experts": -2}, "model.moe.num_experts"),
        ({"model.moe.num_experts": 4, "model.moe.z_weight": -1.0}, "model.moe.z_weight"),
        ({"mesh.expert": 2}, "mesh.expert"),  # a dense model has no experts to place
    ],
)
def test_bad_moe_config_is_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"config.{key}="):
        validate(tiny_config(**overrides))


def test_a_lost_slice_keeps_the_expert_axis_and_the_experts_move_to_the_slices_left():
    config = tiny_config(**MOE)
    full = plan_mesh(config, Topology(2, 2, 0, tuple(range(8))))
    half = plan_mesh(config, Topology(1, 1, 0, tuple(range(4))), strict=False)
    assert (full.replica, full.expert, full.fsdp, full.microbatches) == (2, 2, 2, 1)
    assert (half.replica, half.expert, half.fsdp, half.microbatches) == (1, 2, 2, 2)
    with pytest.raises(ConfigError, match=r"config.mesh.expert=2 is invalid: .* of a slice"):
        plan_mesh(tiny_config(**MOE), Topology(2, 2, 0, tuple(range(2))))


def test_experts_are_sharded_over_the_expert_axis_with_fsdp_and_tensor_inside(tmp_path):
    config = tiny_config(**MOE, **{"mesh.tensor": 2, "model.moe.every": 2})
    ctx = run_context(config, str(tmp_path))
    assert dict(ctx.mesh.shape) == {"replica": 1, "expert": 2, "fsdp": 2, "tensor": 2}
    params = ctx.abstract_state.params
    group = params["layers"]  # every 2nd layer: groups of two layers, the second with experts
    assert "mlp" in group["block_0"] and "moe" in group["block_1"]
    moe = group["block_1"]["moe"]  # [groups, experts, ...]: the stacked axis is never sharded
    assert tuple(moe["w_gate"].sharding.spec) == (None, "expert", "fsdp", "tensor")
    assert tuple(moe["w_down"].sharding.spec) == (None, "expert", "tensor", "fsdp")
    assert moe["w_up"].shape == (1, 4, 64, 128)  # two layers: one group
    adam_mu = ctx.abstract_state.opt_state[1][0].mu["layers"]["block_1"]["moe"]["w_gate"]
    assert tuple(adam_mu.sharding.spec) == (None, "expert", "fsdp", "tensor")


def test_the_default_router_keeps_every_expert_within_2x_of_uniform(tmp_path):
    """The default balance and z-loss weights on the default data: each expert's load averaged
    over 10-step windows (as metrics.jsonl reports it) after a 10-step settling."""
    config = tiny_config(**{"model.moe.num_experts": 8, "model.moe.d_ff": 64, "total_steps": 40})
    ctx = run_context(config, str(tmp_path), devices=1)
    state, loads = init_state(ctx.config, ctx.mesh), []
    for s in range(1, 41):
        state, metrics = train_steps(ctx, state, s, s)
        loads.append(metrics["moe_expert_load"])
    for first in range(10, 40, 10):
        low, high = expert_load_extremes(loads[first : first + 10])
        assert 0.5 <= low <= high <= 2.0, (first, low, high)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """Three MoE steps on 8 devices (expert axis 2) saved to the persistent tier, and step 4."""
    workdir = str(tmp_path_factory.mktemp("moe_run"))
    config = checkpoint_config(**MOE, **{"checkpoint.every_steps": 3})
    ctx = run_context(config, workdir)
    state, metrics = train_steps(ctx, init_state(ctx.config, ctx.mesh), 1, 3)
    saved = jax.tree.map(np.asarray, state)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.on_start(ctx, state)
    ck.after_step(ctx, state, StepInfo(3, 2, data_position(3), 0.01))
    ck.wait_until_finished()
    ck.close()
    state, after = train_steps(ctx, state, 4, 4)
    return config, workdir, saved, jax.tree.map(np.asarray, state), metrics, after


@pytest.mark.slow  # compiles the MoE step on 8 and on 4 devices
def test_router_losses_are_in_the_loss_and_the_metrics(saved_run):
    *_, metrics, _ = saved_run
    moe = tiny_config(**MOE).model.moe
    per_layer = (
        moe.balance_weight * metrics["moe_balance_loss"] + moe.z_weight * metrics["moe_z_loss"]
    )
    layers = tiny_config().model.num_layers  # every layer has experts
    assert metrics["loss"] == pytest.approx(metrics["lm_loss"] + layers * per_layer, rel=1e-6)
    assert metrics["moe_balance_loss"] >= 1.0 - 1e-6  # 1.0 only when perfectly uniform
    assert 0.0 <= metrics["moe_dropped_fraction"] < 0.25
    load = metrics["moe_expert_load"]  # [layer, expert], relative to uniform: mean 1 per layer
    assert load.shape == (layers, moe.num_experts)
    np.testing.assert_allclose(load.mean(axis=1), 1.0, rtol=1e-6)


@pytest.mark.slow  # compiles the MoE step on 8 and on 4 devices
def test_checkpoint_restores_and_resumes_bitwise_on_the_same_mesh(saved_run):
    config, workdir, saved, after, *_ = saved_run
    ctx = run_context(config, workdir, 8)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert (restored.tier, restored.step) == (Tier.PERSISTENT, 3)
    assert_bitwise(restored.state, saved)
    state, _ = train_steps(ctx, restored.state, 4, 4)
    assert_bitwise(jax.tree.map(np.asarray, state), after)


@pytest.mark.slow  # compiles the MoE step on 8 and on 4 devices
def test_checkpoint_restores_onto_half_the_devices_with_every_expert(saved_run):
    config, workdir, saved, after, *_ = saved_run
    ctx = run_context(config, workdir, 4)  # a lost slice: 4 devices, expert axis still 2
    assert (ctx.plan.replica, ctx.plan.expert, ctx.plan.fsdp, ctx.plan.microbatches) == (1, 2, 2, 2)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert_bitwise(restored.state, saved)  # every expert, verified and placed on 4 devices
    w_gate = restored.state.params["layers"]["moe"]["w_gate"]  # [layers, experts, ...]
    assert w_gate.shape[1] == 4 and len(w_gate.sharding.device_set) == 4
    state, _ = train_steps(
        ctx, restored.state, 4, 4
    )  # two microbatches now: same routing per sequence
    for a, b in zip(
        jax.tree.leaves(jax.tree.map(np.asarray, state)), jax.tree.leaves(after), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
