"""The jitted training step: gradient accumulation over microbatches, clipping, AdamW, and the
in-band health verdict (a non-finite or spiking step leaves parameters and optimizer untouched).

The batch is `[microbatches, rows, seq_len + 1]`; the step scans over microbatches, summing token
losses and gradients, so the update is the same whatever the split (up to floating-point reduction
order). `fault_scale` multiplies the loss and gradients: the loop's step passes 1.0
(`compile.without_fault_scale`); the chaos wrapper passes NaN or a spike factor to exercise the
health checks with a real fault inside the step.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from resilient_jax import mesh as mesh_lib
from resilient_jax.config import ConfigError
from resilient_jax.data import tokenizer as tokenizer_lib
from resilient_jax.model import moe as moe_lib
from resilient_jax.model import segments
from resilient_jax.train import in_band
from resilient_jax.train.state import (
    TrainState,
    learning_rate_schedule,
    make_model,
    make_optimizer,
    state_shardings,
)

Metrics = dict[str, jax.Array]
# The jitted (or compiled) step: (state, batch, fault_scale) -> (state, metrics).
ScaledStepFn = Callable[[TrainState, jax.Array, jax.Array], tuple[TrainState, Metrics]]
# What the loop calls: (state, batch) -> (state, metrics).
StepFn = Callable[[TrainState, jax.Array], tuple[TrainState, Metrics]]
# A metric a step function returns when it replaced the state instead of stepping it (elastic
# mode: healed from a live slice, possibly several steps ahead) and moved the loader to that
# state's data position: the loop takes the step count from the state.
HEALED = "healed"


def token_loss_sum(logits_BLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL).sum()


def document_eos_id(config: ml_collections.ConfigDict) -> int | None:
    """The end-of-text id that splits a training row into documents with `data.document_mask`;
    None when the mask is off. The tokenizer is loaded to know it (config validation loads no
    files), so a tokenizer without one is refused here, where the train and eval steps are built:
    a one-line ConfigError naming the key."""
    if not config.data.document_mask:
        return None
    eos_id = tokenizer_lib.from_config(config).eos_id
    if eos_id is None:
        raise ConfigError(
            "config.data.document_mask=True is invalid: config.data.tokenizer="
            f"{config.data.tokenizer!r} has no end-of-text token to split documents at"
        )
    return eos_id


def make_documents(
    config: ml_collections.ConfigDict,
) -> Callable[[jax.Array], segments.Documents | None]:
    """model input rows [B, L] -> their documents for the model (`data.document_mask`), or None
    (the mask off: the model computes exactly what it computes without the key). Shared by the
    train and the eval step, so both see the same attention."""
    eos_id = document_eos_id(config)
    if eos_id is None:
        return lambda inputs_BL: None
    return lambda inputs_BL: segments.documents(inputs_BL, eos_id)


def router_zeros(config: ml_collections.ConfigDict) -> tuple[jax.Array, moe_lib.RouterSums] | None:
    """The router's sums of no tokens: (token-loss sum without the router's terms, the sums of
    `moe_lib.RouterSums`); None for a dense model."""
    model = make_model(config)
    num_moe_layers = model.cfg.moe.num_moe_layers(model.cfg.num_layers)
    if not num_moe_layers:
        return None
    zero = jnp.zeros((), jnp.float32)
    return zero, moe_lib.RouterSums.zeros(num_moe_layers, model.cfg.moe.num_experts)


def make_gradient_sums(config: ml_collections.ConfigDict):
    """(params, batch [microbatches, rows, seq_len + 1]) -> (token-loss sum, gradient sums, the
    router's sums or None): the scan over microbatches, not yet divided by the token count (the
    elastic mode adds these sums across slices before dividing)."""
    model, documents = make_model(config), make_documents(config)
    moe = model.cfg.moe
    num_moe_layers = moe.num_moe_layers(model.cfg.num_layers)
    seq_len = config.data.seq_len
    Router = tuple[jax.Array, moe_lib.RouterSums]  # token-loss sum without the router's terms

    def loss_fn(p, tokens_BL: jax.Array) -> tuple[jax.Array, Router | None]:
        """The microbatch's token-loss sum (with the router's loss terms, if it has experts).
        Every position counts, a document's end-of-text too: it predicts the next document's
        first token, as torchtitan trains Llama 3."""
        inputs_BL = tokens_BL[:, :-1]
        docs = documents(inputs_BL)
        if not num_moe_layers:
            logits = model.apply({"params": p}, inputs_BL, documents=docs)
            return token_loss_sum(logits, tokens_BL[:, 1:]), None
        logits, sown = model.apply(
            {"params": p}, inputs_BL, documents=docs, mutable=["intermediates"]
        )
        router = moe_lib.router_sums(sown["intermediates"], moe, num_moe_layers)
        lm_loss = token_loss_sum(logits, tokens_BL[:, 1:])
        terms = moe_lib.loss_terms(router, moe, seq_len)
        return lm_loss + terms, (lm_loss, router)

    def gradient_sums(params, batch_MBL: jax.Array):
        def microbatch(carry, tokens_BL):
            (loss_sum, router), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens_BL)
            total_loss, total_grads, total_router = carry
            total_grads = jax.tree.map(jnp.add, total_grads, grads)
            if router is not None:
                total_router = (total_router[0] + router[0], total_router[1] + router[1])
            return (total_loss + loss_sum, total_grads, total_router), None

        zero = jnp.zeros((), jnp.float32)
        zeros = (zero, jax.tree.map(jnp.zeros_like, params), router_zeros(config))
        (loss_sum, grad_sum, router), _ = jax.lax.scan(microbatch, zeros, batch_MBL)
        return loss_sum, grad_sum, router

    return gradient_sums


def make_router_metrics(config: ml_collections.ConfigDict):
    """(the router's sums of a step or None, the step's token count) -> the step's router
    metrics: the loss without the router's terms (`lm_loss`) and the router's health
    (`moe_lib.router_metrics`); none for a dense model. The single-runtime and the elastic step
    report them alike."""
    model = make_model(config)
    moe = model.cfg.moe
    num_moe_layers = moe.num_moe_layers(model.cfg.num_layers)
    seq_len = config.data.seq_len

    def router_metrics(router, num_tokens: int) -> Metrics:
        if router is None:
            return {}
        lm_loss_sum, sums = router
        return {
            "lm_loss": lm_loss_sum / num_tokens,
            **moe_lib.router_metrics(sums, moe, num_tokens, seq_len, num_moe_layers),
        }

    return router_metrics


def make_update(config: ml_collections.ConfigDict):
    """(state, mean loss, mean gradients, fault_scale) -> (state, metrics): the in-band health
    verdict, the optimizer update, and the state left as it was on a bad step."""
    optimizer = make_optimizer(config)
    schedule = learning_rate_schedule(config)

    def update(state: TrainState, loss: jax.Array, grads, fault_scale: jax.Array):
        loss = loss * fault_scale
        grads = jax.tree.map(lambda g: g * fault_scale, grads)
        grad_norm = optax.tree.norm(grads)
        ok, health, flags = in_band.assess(state.health, loss, grad_norm, config.health)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(
            state.params, in_band.scale_updates(updates, flags["lr_scale"])
        )
        params, opt_state = in_band.where_ok(
            ok, (params, opt_state), (state.params, state.opt_state)
        )
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, health=health
        )
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "learning_rate": schedule(state.step) * flags["lr_scale"],
            **flags,
        }
        return new_state, metrics

    return update


def make_train_step(
    config: ml_collections.ConfigDict, mesh: Mesh, donate: bool = True
) -> ScaledStepFn:
    """The step, jitted with every input and output sharding fixed and the state donated (its
    buffers become the new state's). `donate=False`: the same program writing the new state into
    fresh buffers, leaving the input state valid (`train.keep`)."""
    gradient_sums, update = make_gradient_sums(config), make_update(config)
    router_metrics = make_router_metrics(config)

    def loss_and_grads(params, batch_MBL: jax.Array):
        loss_sum, grad_sum, router = gradient_sums(params, batch_MBL)
        num_tokens = batch_MBL.shape[0] * batch_MBL.shape[1] * (batch_MBL.shape[2] - 1)
        grads = jax.tree.map(lambda g: g / num_tokens, grad_sum)
        return loss_sum / num_tokens, grads, router_metrics(router, num_tokens)

    def step(state: TrainState, batch: jax.Array, fault_scale: jax.Array):
        # The mesh and the rules make the model's activation constraints (`batch` rows over the
        # data axes) real sharding constraints; without them Flax drops them.
        with (
            jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
            nn.logical_axis_rules(mesh_lib.LOGICAL_AXIS_RULES),
        ):
            loss, grads, router_metrics = loss_and_grads(state.params, batch)
        new_state, metrics = update(state, loss, grads, fault_scale)
        return new_state, {**metrics, **router_metrics}

    shardings = state_shardings(config, mesh)
    replicated = mesh_lib.replicated(mesh)
    return jax.jit(
        step,
        in_shardings=(shardings, mesh_lib.batch_sharding(mesh), replicated),
        out_shardings=(shardings, replicated),
        donate_argnums=0 if donate else (),
    )
