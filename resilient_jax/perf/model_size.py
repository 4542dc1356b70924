"""Parameters and training FLOPs of the decoder, from its shape: arithmetic only.

One count for everything that needs it: the model (`ModelConfig.num_params`, the MFU estimate in
the metrics), the step-time model (`step_time.Workload`) and through it the supervisor, which
never imports JAX. `model` is either the config's `model` section or a `ModelConfig`: both have
the fields read here, and `moe.d_ff` 0 means the dense `d_ff` in the first.
"""

from __future__ import annotations

from typing import Any


def num_params(model: Any, active: bool = False) -> int:
    """Parameters of the model; `active`: only those one token's forward pass uses (of a mixture
    of experts, the router and `top_k` experts)."""
    d, f, e = model.d_model, model.d_ff, model.head_dim
    attn = d * e * (model.num_heads * 2 + model.num_kv_heads * 2)
    layer = attn + 3 * d * f + 2 * d  # attention, gated MLP, two norms
    head = 0 if model.tie_embeddings else d * model.vocab_size
    total = model.vocab_size * d + model.num_layers * layer + d + head  # + the final norm
    moe = model.moe
    if moe.num_experts:
        experts = moe.top_k if active else moe.num_experts
        moe_mlp = d * moe.num_experts + experts * 3 * d * (moe.d_ff or f)  # router + experts
        moe_layers = model.num_layers // moe.every  # layers every-1, 2*every-1, ...
        total += moe_layers * (moe_mlp - 3 * d * f)
    return total


def flops_per_token(model: Any, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters + attention scores (PaLM appendix B)."""
    # The embedding lookup costs nothing; the output projection (tied or not) is a matmul.
    untied_head = 0 if model.tie_embeddings else model.vocab_size * model.d_model
    matmul_params = num_params(model, active=True) - untied_head
    attention = 12 * model.num_layers * model.num_heads * model.head_dim * seq_len
    return 6.0 * matmul_params + attention
