"""GaLore: the projection's arithmetic, its config checks, its state's shardings and size, and
its checkpoints restoring bitwise on the same mesh and onto a reshaped one."""

from __future__ import annotations

import jax
import numpy as np
import optax
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
from resilient_jax.train.galore import galore
from resilient_jax.train.hooks import StepInfo
from resilient_jax.train.state import init_state

GALORE = {"optimizer.galore.rank": 16, "optimizer.galore.update_interval": 2}


def _grads(seed: int = 0) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w": jax.random.normal(k1, (12, 20)), "norm": jax.random.normal(k2, (20,))}


def test_update_is_the_gradient_projected_onto_its_top_singular_vectors():
    grads = _grads()
    for rank in (4, 12):  # below and at the smaller side
        tx = galore(optax.identity(), rank=rank, update_interval=1, scale=0.5, min_size=0)
        updates, state = tx.update(grads, tx.init(grads))
        u, s, vt = np.linalg.svd(np.asarray(grads["w"]), full_matrices=False)
        best = (u[:, :rank] * s[:rank]) @ vt[:rank]
        np.testing.assert_allclose(updates["w"], 0.5 * best, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(updates["norm"], grads["norm"])  # 1-D: not projected
        assert state.projections["w"].shape == (12, rank)  # rows (12 < 20) are projected
        assert state.inner == tx.init(grads).inner


def test_projection_is_refreshed_every_interval_and_kept_between():
    tx = galore(optax.identity(), rank=3, update_interval=2, scale=1.0, min_size=0)
    state = tx.init(_grads())
    bases = []
    for seed in range(4):
        _, state = tx.update(_grads(seed), state)
        bases.append(np.asarray(state.projections["w"]))
    assert int(state.count) == 4 and int(state.refreshed_at) == 2
    np.testing.assert_array_equal(bases[0], bases[1])
    np.testing.assert_array_equal(bases[2], bases[3])
    assert not np.allclose(bases[1], bases[2])


def test_small_weights_and_vectors_pass_through_the_inner_optimizer_unchanged():
    grads = _grads()
    tx = galore(optax.scale_by_adam(), rank=4, update_interval=1, scale=1.0, min_size=241)
    plain = optax.scale_by_adam()
    updates, state = tx.update(grads, tx.init(grads))
    expected, _ = plain.update(grads, plain.init(grads))
    assert state.projections == {}  # 12 x 20 = 240 < min_size
    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_stack_of_matrices_is_projected_matrix_by_matrix():
    grads = {"experts": jax.random.normal(jax.random.key(3), (3, 12, 20))}
    tx = galore(
        optax.identity(), rank=4, update_interval=1, scale=1.0, min_size=0, batch_dims=lambda _: 1
    )
    updates, state = tx.update(grads, tx.init(grads))
    assert state.projections["experts"].shape == (3, 12, 4)  # one basis per expert
    for e in range(3):  # each expert's gradient projected onto its own top singular vectors
        u, s, vt = np.linalg.svd(np.asarray(grads["experts"][e]), full_matrices=False)
        best = (u[:, :4] * s[:4]) @ vt[:4]
        np.testing.assert_allclose(updates["experts"][e], best, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rotate", [True, False])
def test_a_refresh_carries_adams_moments_into_the_new_basis(rotate):
    b1, b2 = 0.9, 0.95
    tx = galore(
        optax.scale_by_adam(b1=b1, b2=b2),
        rank=3,
        update_interval=1,
        scale=1.0,
        min_size=0,
        rotate_state=rotate,
    )
    g1, g2 = _grads(1), _grads(2)
    _, s1 = tx.update(g1, tx.init(g1))
    _, s2 = tx.update(g2, s1)
    p1, p2 = np.asarray(s1.projections["w"]), np.asarray(s2.projections["w"])
    mu1, nu1 = np.asarray(s1.inner.mu["w"]), np.asarray(s1.inner.nu["w"])
    r = p2.T @ p1 if rotate else np.eye(3)  # [new, old] coordinates
    low2 = p2.T @ np.asarray(g2["w"])  # rows (12 < 20) are projected
    np.testing.assert_allclose(s2.inner.mu["w"], b1 * r @ mu1 + (1 - b1) * low2, atol=1e-5)
    nu2 = b2 * (r * r) @ nu1 + (1 - b2) * low2**2
    np.testing.assert_allclose(s2.inner.nu["w"], nu2, rtol=1e-5, atol=1e-6)
    unprojected = g2["norm"]  # 1-D leaves: plain Adam, never rotated
    np.testing.assert_allclose(
        s2.inner.nu["norm"], b2 * (1 - b2) * g1["norm"] ** 2 + (1 - b2) * unprojected**2, rtol=1e-5
    )


@pytest.mark.parametrize(
    "overrides,key",
    [
        ({"optimizer.galore.rank": 65}, "optimizer.galore.rank"),  # d_model = 64
        ({"optimizer.galore.rank": -1}, "optimizer.galore.rank"),
        ({"optimizer.galore.min_size": -5}, "optimizer.galore.min_size"),
        ({"optimizer.galore.update_interval": 0}, "optimizer.galore.update_interval"),
        ({"optimizer.galore.scale": -1.0}, "optimizer.galore.scale"),
    ],
)
def test_bad_galore_config_is_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"config.{key}="):
        validate(tiny_config(**overrides))


def test_rank_only_limited_by_matrices_large_enough_to_project():
    # Every matrix of the tiny model has a side of 64; with min_size above all of them, none
    # is projected and no rank is too large for it.
    validate(tiny_config(**{"optimizer.galore.rank": 65, "optimizer.galore.min_size": 10**7}))


def _opt_state_bytes(state) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state.opt_state))


def test_state_is_sharded_like_its_weights_and_at_most_half_of_adamw(tmp_path):
    # Vocabulary 256 and the tied output layer: the weight matrices dominate, as the bar (rank
    # d_model / 4) asks (the embedding and an untied output layer keep full Adam).
    small_vocab = {"model.vocab_size": 256, "model.tie_embeddings": True}
    ctx = run_context(tiny_config(**GALORE, **small_vocab), str(tmp_path))
    galore_state = ctx.abstract_state.opt_state[1][0]
    assert "embed" not in galore_state.projections  # embeddings keep full Adam
    specs = {k: tuple(v.sharding.spec) for k, v in galore_state.projections.items()}
    # A basis per layer: [layers, d_model, r], the stacked axis unsharded.
    layers = ctx.config.model.num_layers
    assert galore_state.projections["layers__mlp__w_gate"].shape == (layers, 64, 16)
    assert specs["layers__mlp__w_gate"] == (None, "fsdp", None)  # rows of [64, 128]
    assert specs["layers__mlp__w_down"] == (None, "fsdp", None)  # cols of [128, 64]
    assert specs["layers__attn__wo"] == (None, None, None)  # rows are heads x head_dim
    mu = galore_state.inner.mu["layers"]["mlp"]
    assert (mu["w_gate"].shape, tuple(mu["w_gate"].sharding.spec)) == (
        (layers, 16, 128),
        (None, None, "tensor"),
    )
    assert (mu["w_down"].shape, tuple(mu["w_down"].sharding.spec)) == (
        (layers, 128, 16),
        (None, "tensor", None),
    )
    adamw = run_context(tiny_config(**small_vocab), str(tmp_path)).abstract_state
    assert _opt_state_bytes(ctx.abstract_state) <= _opt_state_bytes(adamw) / 2


# Every layer's MLP is 4 experts [4, 64, 128] on an expert axis of 2.
MOE_GALORE = {**GALORE, "model.moe.num_experts": 4, "mesh.expert": 2}


def test_expert_weights_get_a_basis_per_expert_sharded_like_them(tmp_path):
    ctx = run_context(tiny_config(**MOE_GALORE), str(tmp_path), devices=4)
    galore_state = ctx.abstract_state.opt_state[1][0]
    assert "layers__moe__router" not in galore_state.projections  # [64, 4]: full Adam
    n = ctx.config.model.num_layers
    for name in ("w_gate", "w_up", "w_down"):  # [64, 128] or [128, 64]: the 64 side projected
        proj = galore_state.projections[f"layers__moe__{name}"]
        spec = (None, "expert", "fsdp", None)
        assert (proj.shape, tuple(proj.sharding.spec)) == ((n, 4, 64, 16), spec)
    mu = galore_state.inner.mu["layers"]["moe"]
    assert (mu["w_up"].shape, tuple(mu["w_up"].sharding.spec)) == (
        (n, 4, 16, 128),
        (None, "expert", None, "tensor"),
    )
    assert (mu["w_down"].shape, tuple(mu["w_down"].sharding.spec)) == (
        (n, 4, 128, 16),
        (None, "expert", "tensor", None),
    )


@pytest.mark.slow  # compiles the MoE + GaLore step on 4 devices: 25-40 s on 2 cores
def test_moe_galore_checkpoint_restores_and_resumes_bitwise_on_the_same_mesh(tmp_path):
    config = checkpoint_config(**MOE_GALORE, **{"checkpoint.every_steps": 2})
    ctx = run_context(config, str(tmp_path), devices=4)
    state, _ = train_steps(ctx, init_state(ctx.config, ctx.mesh), 1, 2)
    saved = jax.tree.map(np.asarray, state)
    bases = saved.opt_state[1][0].projections["layers__moe__w_gate"]  # [layers, experts, ...]
    assert not np.allclose(bases[0, 0], bases[0, 1])  # each expert's own basis
    assert not np.allclose(bases[0, 0], bases[1, 0])  # and each layer's
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.on_start(ctx, state)
    ck.after_step(ctx, state, StepInfo(2, 1, data_position(2), 0.01))
    ck.wait_until_finished()
    ck.close()
    state, _ = train_steps(ctx, state, 3, 3)  # a refresh: new bases, moments rotated
    after = jax.tree.map(np.asarray, state)

    ctx = run_context(config, str(tmp_path), devices=4)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert (restored.tier, restored.step) == (Tier.PERSISTENT, 2)
    assert_bitwise(restored.state, saved)
    assert_bitwise(train_steps(ctx, restored.state, 3, 3)[0], after)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """Three GaLore steps on 8 devices saved to the persistent tier, and the two steps after."""
    workdir = str(tmp_path_factory.mktemp("galore_run"))
    config = checkpoint_config(**GALORE, **{"checkpoint.every_steps": 3})
    ctx = run_context(config, workdir)
    state = train_steps(ctx, init_state(ctx.config, ctx.mesh), 1, 3)[0]
    saved = jax.tree.map(np.asarray, state)
    assert int(saved.opt_state[1][0].refreshed_at) == 2  # a refreshed projection is saved
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.on_start(ctx, state)
    ck.after_step(ctx, state, StepInfo(3, 2, data_position(3), 0.01))
    ck.wait_until_finished()
    ck.close()
    # Step 4 uses the saved projections; step 5 recomputes them (count 4 = 2 x update_interval).
    state = train_steps(ctx, state, 4, 4)[0]
    after = {4: jax.tree.map(np.asarray, state)}
    after[5] = jax.tree.map(np.asarray, train_steps(ctx, state, 5, 5)[0])
    return config, workdir, saved, after


def _restore(config, workdir: str, devices: int):
    ctx = run_context(config, workdir, devices)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert (restored.tier, restored.step) == (Tier.PERSISTENT, 3)
    return ctx, restored.state


def test_checkpoint_restores_bitwise_and_resumes_bitwise_on_the_same_mesh(saved_run):
    config, workdir, saved, after = saved_run
    ctx, state = _restore(config, workdir, 8)
    assert_bitwise(state, saved)
    assert_bitwise(jax.tree.map(np.asarray, train_steps(ctx, state, 4, 5)[0]), after[5])
    _, state = _restore(config, workdir, 4)  # onto half the devices: the same values
    assert_bitwise(state, saved)


def test_checkpoint_resumes_on_half_the_devices_up_to_reduction_order(saved_run):
    config, workdir, _, after = saved_run
    ctx, state = _restore(config, workdir, 4)
    resumed = jax.tree.map(np.asarray, train_steps(ctx, state, 4, 4)[0])
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(after[4]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
