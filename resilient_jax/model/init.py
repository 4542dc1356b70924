"""The model's initialisation: one rule for the dense layers and the experts alike.

As in GPT-2 (Radford et al. 2019, section 2.3) and Megatron-LM (`init_method_normal`,
`scaled_init_method_normal`), which OLMo and Hugging Face's Llama (`initializer_range`) follow:
every weight matrix, the embedding included, is N(0, 0.02^2); the projections that write into the
residual stream (attention `wo`, the MLP's and the experts' `w_down`) are
N(0, (0.02 / sqrt(2 * num_layers))^2), so the residual stream's variance at initialisation does
not grow with depth; norm scales start at one (the router keeps Switch's init, `moe`).

With the embedding this small, the tied output layer (`embed.T / sqrt(d_model)`) starts with logits
of about 0.02 and a token's logit for itself of about 0.02 * sqrt(d_model) (0.9 at d_model 2048):
the first loss is within a few hundredths of ln(vocab_size), where an N(0, 1) embedding made the
model predict the token it had just read (loss 9.3 at ln(vocab_size) 6.9).
"""

from __future__ import annotations

import math

import flax.linen as nn

INIT_STD = 0.02


def init_normal(std: float) -> nn.initializers.Initializer:
    return nn.initializers.normal(stddev=std)


def residual_init_std(num_layers: int) -> float:
    """The standard deviation of a projection that writes into the residual stream."""
    return INIT_STD / math.sqrt(2 * num_layers)


def untied_output_init_std(d_model: int) -> float:
    """An untied output layer starts as the tied one does (the embedding's N(0, 0.02^2) times
    d_model^-1/2): the same logits at initialisation whichever layer the model has."""
    return INIT_STD * d_model**-0.5
