"""The model's initialisation (`model.init`): every weight N(0, 0.02^2), the residual output
projections N(0, (0.02 / sqrt(2 * num_layers))^2), norms one; so a fresh model predicts every token
with about 1/V and its first loss is ln(V). (The llama_1b shapes: experiments/first_loss.py.)"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from resilient_jax.data import make_source
from resilient_jax.data.mixture import example_stream
from resilient_jax.train.state import make_model
from resilient_jax.train.step import token_loss_sum

# The default model's shapes (configs/tiny_cpu.py), not conftest's smaller SMALL model.
TINY_CPU = {"model.d_model": 256, "model.num_layers": 4, "model.num_heads": 4, "model.d_ff": 768}


def _params_and_first_loss(config):
    model = make_model(config)
    examples = example_stream(make_source(config), config.seed)
    tokens = jnp.asarray([examples[i] for i in range(4)])
    params = nn.unbox(model.init(jax.random.key(config.seed), tokens[:1, :-1])["params"])
    logits = jax.jit(model.apply)({"params": params}, tokens[:, :-1])
    loss = float(token_loss_sum(logits, tokens[:, 1:])) / tokens[:, 1:].size
    return params, loss


@pytest.mark.parametrize(
    "overrides",
    [{}, {"model.tie_embeddings": False}, {"model.moe.num_experts": 4, "model.moe.d_ff": 384}],
    ids=["tied", "untied", "experts"],
)
def test_a_fresh_model_predicts_uniformly(overrides):
    config = tiny_config(**TINY_CPU, **overrides)
    _, loss = _params_and_first_loss(config)
    ln_v = math.log(config.model.vocab_size)
    assert abs(loss - ln_v) < 0.1, (loss, ln_v)


def test_weights_start_with_the_documented_deviations():
    config = tiny_config(**TINY_CPU, **{"model.tie_embeddings": False})
    params, _ = _params_and_first_loss(config)
    residual = 0.02 / math.sqrt(2 * config.model.num_layers)
    expected = {
        "embed": 0.02,
        "wq": 0.02,
        "wk": 0.02,
        "wv": 0.02,
        "w_gate": 0.02,
        "w_up": 0.02,
        "wo": residual,
        "w_down": residual,
        "unembed": 0.02 / math.sqrt(config.model.d_model),
    }
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = path[-1].key
        if name == "scale":
            np.testing.assert_array_equal(leaf, 1.0)
        else:
            std = float(np.std(np.asarray(leaf)))
            assert std == pytest.approx(expected[name], rel=0.05), (path, std)
