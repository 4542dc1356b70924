"""Decoder-only transformer: causal attention with rotary positions, RMSNorm, gated (SwiGLU) MLP.

Parameters are float32 and annotated with logical axes (see `mesh.LOGICAL_AXIS_RULES`); the
computation runs in `compute_dtype` (float32 or bfloat16). Shapes use suffixes: B batch, L sequence,
D model width, H heads, K kv heads, E head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

Dtype = jnp.dtype


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_ff: int
    max_seq_len: int
    rope_theta: float
    norm_eps: float
    remat: bool
    compute_dtype: str
    tie_embeddings: bool

    @classmethod
    def from_config(cls, model: ml_collections.ConfigDict) -> ModelConfig:
        return cls(**{f.name: model[f.name] for f in dataclasses.fields(cls)})

    @property
    def dtype(self) -> Dtype:
        return jnp.dtype(self.compute_dtype)

    def num_params(self) -> int:
        d, f, e = self.d_model, self.d_ff, self.head_dim
        attn = d * e * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * layer + d + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul parameters + attention scores (PaLM appendix B)."""
        # The embedding lookup costs nothing; the output projection (tied or not) is a matmul.
        matmul_params = self.num_params() - (
            0 if self.tie_embeddings else self.vocab_size * self.d_model
        )
        attention = 12 * self.num_layers * self.num_heads * self.head_dim * seq_len
        return 6.0 * matmul_params + attention


def _dense_init(fan_in: int) -> nn.initializers.Initializer:
    return nn.initializers.normal(stddev=fan_in**-0.5)


def rotary(x_BLHE: jax.Array, positions_L: jax.Array, theta: float) -> jax.Array:
    half = x_BLHE.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_LE = positions_L[:, None].astype(jnp.float32) * freq[None, :]
    sin, cos = jnp.sin(angle_LE)[None, :, None, :], jnp.cos(angle_LE)[None, :, None, :]
    x1, x2 = jnp.split(x_BLHE.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHE.dtype)


class RMSNorm(nn.Module):
    eps: float
    dtype: Dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (x.shape[-1],)
        )
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * scale).astype(self.dtype)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        c = self.cfg
        dense = lambda name, shape, axes, fan_in: self.param(
            name, nn.with_logical_partitioning(_dense_init(fan_in), axes), shape
        )
        wq = dense(
            "wq", (c.d_model, c.num_heads, c.head_dim), ("embed", "heads", "head_dim"), c.d_model
        )
        wk = dense(
            "wk",
            (c.d_model, c.num_kv_heads, c.head_dim),
            ("embed", "kv_heads", "head_dim"),
            c.d_model,
        )
        wv = dense(
            "wv",
            (c.d_model, c.num_kv_heads, c.head_dim),
            ("embed", "kv_heads", "head_dim"),
            c.d_model,
        )
        wo = dense(
            "wo",
            (c.num_heads, c.head_dim, c.d_model),
            ("heads", "head_dim", "embed"),
            c.num_heads * c.head_dim,
        )
        dt = c.dtype
        positions = jnp.arange(x_BLD.shape[1])
        q_BLHE = rotary(jnp.einsum("bld,dhe->blhe", x_BLD, wq.astype(dt)), positions, c.rope_theta)
        k_BLKE = rotary(jnp.einsum("bld,dke->blke", x_BLD, wk.astype(dt)), positions, c.rope_theta)
        v_BLKE = jnp.einsum("bld,dke->blke", x_BLD, wv.astype(dt))
        out_BLHE = jax.nn.dot_product_attention(q_BLHE, k_BLKE, v_BLKE, is_causal=True)
        return jnp.einsum("blhe,hed->bld", out_BLHE, wo.astype(dt))


class Mlp(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        c = self.cfg
        init = nn.with_logical_partitioning(_dense_init(c.d_model), ("embed", "mlp"))
        w_gate = self.param("w_gate", init, (c.d_model, c.d_ff))
        w_up = self.param("w_up", init, (c.d_model, c.d_ff))
        w_down = self.param(
            "w_down",
            nn.with_logical_partitioning(_dense_init(c.d_ff), ("mlp", "embed")),
            (c.d_ff, c.d_model),
        )
        dt = c.dtype
        gate_BLF = jax.nn.silu(x_BLD @ w_gate.astype(dt))
        return (gate_BLF * (x_BLD @ w_up.astype(dt))) @ w_down.astype(dt)


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        c = self.cfg
        x_BLD = x_BLD + Attention(c, name="attn")(
            RMSNorm(c.norm_eps, c.dtype, name="attn_norm")(x_BLD)
        )
        x_BLD = x_BLD + Mlp(c, name="mlp")(RMSNorm(c.norm_eps, c.dtype, name="mlp_norm")(x_BLD))
        return nn.with_logical_constraint(x_BLD, ("batch", "seq", "embed"))


class Transformer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BL: jax.Array) -> jax.Array:
        """Next-token logits [B, L, V] in float32."""
        c = self.cfg
        embed_VD = self.param(
            "embed",
            nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")),
            (c.vocab_size, c.d_model),
        )
        x_BLD = embed_VD.astype(c.dtype)[tokens_BL]
        x_BLD = nn.with_logical_constraint(x_BLD, ("batch", "seq", "embed"))
        block = nn.remat(Block) if c.remat else Block
        for i in range(c.num_layers):
            x_BLD = block(c, name=f"layer_{i}")(x_BLD)
        x_BLD = RMSNorm(c.norm_eps, c.dtype, name="final_norm")(x_BLD)
        if c.tie_embeddings:
            out_DV = embed_VD.T * c.d_model**-0.5
        else:
            out_DV = self.param(
                "unembed",
                nn.with_logical_partitioning(_dense_init(c.d_model), ("embed", "vocab")),
                (c.d_model, c.vocab_size),
            )
        return jnp.einsum("bld,dv->blv", x_BLD, out_DV.astype(c.dtype)).astype(jnp.float32)
