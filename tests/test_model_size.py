"""The parameter count of `perf.model_size` (used by the step-time model, the supervisor and the
MFU estimate) against the parameters the model actually creates, dense and mixture of experts,
tied and untied, and the model's and the step-time model's counts against each other."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import tiny_config

from resilient_jax.model import ModelConfig, Transformer
from resilient_jax.perf.step_time import Workload


def _created_params(config) -> int:
    model = Transformer(ModelConfig.from_config(config.model))
    tokens = jnp.zeros((1, 8), jnp.int32)
    shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), tokens)["params"]))
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"model.tie_embeddings": False},
        {"model.num_kv_heads": 1},
        {"model.moe.num_experts": 4, "model.moe.every": 2, "model.moe.d_ff": 96},
        {"model.moe.num_experts": 4, "model.moe.top_k": 1, "model.tie_embeddings": False},
    ],
    ids=["tied", "untied", "grouped_query", "moe_every_2", "moe_top_1_untied"],
)
def test_parameter_count_is_what_the_model_creates(overrides):
    config = tiny_config(**overrides)
    created = _created_params(config)
    assert ModelConfig.from_config(config.model).num_params() == created
    assert Workload.from_config(config).params == created


def test_active_parameters_and_flops_count_top_k_experts_and_one_output_matmul():
    dense = tiny_config()
    moe = tiny_config(**{"model.moe.num_experts": 4, "model.moe.top_k": 2})
    m, d = ModelConfig.from_config(moe.model), moe.model.d_model
    experts = m.num_layers * 3 * d * m.moe.d_ff
    assert m.num_params() - m.num_params(active=True) == (4 - 2) * experts
    # Untying adds a parameter matrix but no FLOPs: the tied embedding was already a matmul.
    untied = tiny_config(**{"model.tie_embeddings": False})
    flops = Workload.from_config(untied).flops_per_token
    assert flops == Workload.from_config(dense).flops_per_token
    assert ModelConfig.from_config(untied.model).flops_per_token(dense.data.seq_len) == flops
