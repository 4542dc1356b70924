"""Decoder-only transformer: causal attention with rotary positions, RMSNorm, gated (SwiGLU) MLP.

Parameters are float32 and annotated with logical axes (see `mesh.LOGICAL_AXIS_RULES`); the
computation runs in `compute_dtype` (float32 or bfloat16). Shapes use suffixes: B batch, L sequence,
D model width, H heads, K kv heads, E head dim, F MLP width, V vocabulary, T positions of a
`KVCache`.

With `model.moe.num_experts > 0`, the MLP of every `model.moe.every`-th layer is a mixture of
experts (`resilient_jax.model.moe`); the other layers, and every layer of a dense model, compute
exactly what they compute without it.

Training calls the model on whole sequences; with `documents` (`resilient_jax.model.segments`,
`data.document_mask`), a row holding several documents is attended block-causally, each document
only to itself, and each document's rotary positions start at 0. Decoding passes a `KVCache` too:
the tokens continue the cached positions, their keys and values are written into the cache, and
attention reads the cache's fixed-size buffers under a mask, so a decode step's cost and compiled
shape do not depend on how many positions are filled. Both paths use the same parameters.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections

from resilient_jax.model import layers as layers_lib
from resilient_jax.model.moe import DENSE, MoeConfig, MoeMlp
from resilient_jax.model.segments import Documents
from resilient_jax.perf import model_size

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
    remat: str  # a policy of `layers.REMAT_POLICIES`
    compute_dtype: str
    tie_embeddings: bool
    moe: MoeConfig = DENSE  # a dense model unless the config's model.moe says otherwise
    scan_unroll: int = 1  # scanned units per iteration of the scan over layers

    @classmethod
    def from_config(cls, model: ml_collections.ConfigDict) -> ModelConfig:
        plain = {f.name: model[f.name] for f in dataclasses.fields(cls) if f.name != "moe"}
        return cls(**plain, moe=MoeConfig.from_config(model))

    @property
    def dtype(self) -> Dtype:
        return jnp.dtype(self.compute_dtype)

    def num_params(self, active: bool = False) -> int:
        """Parameters of the model; `active`: only those one token's forward pass uses (of a
        mixture of experts, the router and `top_k` experts)."""
        return model_size.num_params(self, active)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul parameters + attention scores (PaLM appendix B)."""
        return model_size.flops_per_token(self, seq_len)


@flax.struct.dataclass
class LayerCache:
    """Keys and values of one layer (or, with leading axes, of a stack of layers), position t at
    index t (after rotary positions)."""

    keys_BTKE: jax.Array
    values_BTKE: jax.Array


@flax.struct.dataclass
class KVCache:
    """The keys and values of the positions decoded so far, in buffers of a fixed length, every
    layer's stacked on a leading axis N (layer order).

    Positions `0..length-1` are filled; the next tokens go at `length`. Writing past the buffer's
    end is not detected inside the jitted step (XLA clamps the write): callers check that prompt
    and new tokens fit `max_len` before decoding.
    """

    keys_NBTKE: jax.Array
    values_NBTKE: jax.Array
    length: jax.Array  # int32 scalar

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        zeros = jnp.zeros(shape, cfg.dtype)
        return cls(zeros, zeros, jnp.zeros((), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.keys_NBTKE.shape[2]

    def layers(self, start: int, stop: int, group: int) -> LayerCache:
        """Layers `start..stop-1` as a stack of `(stop - start) // group` groups (group 1: a
        plain stack of layers), the slices a scan over groups takes one by one."""

        def cut(x: jax.Array) -> jax.Array:
            x = x[start:stop]
            return x if group == 1 else x.reshape(-1, group, *x.shape[1:])

        return LayerCache(cut(self.keys_NBTKE), cut(self.values_NBTKE))


def _joined(stacks: list[tuple[LayerCache, int]]) -> tuple[jax.Array, jax.Array]:
    """Keys and values of every layer in layer order again, from the (stack, group size) pairs
    `KVCache.layers` cut."""

    def join(parts: list[jax.Array]) -> jax.Array:
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    flat = lambda x, group: x if group == 1 else x.reshape(-1, *x.shape[2:])
    keys = join([flat(c.keys_BTKE, group) for c, group in stacks])
    values = join([flat(c.values_BTKE, group) for c, group in stacks])
    return keys, values


# Initialisation: PaLM's (Chowdhery et al. 2022, section 5) for the body, kernels N(0, 1/fan_in)
# and the embedding N(0, 1) (no norm is applied to it), and the untied output layer zero, as
# muP's readout (Yang et al. 2022, "Tensor Programs V"). Every logit of a fresh model
# is 0, so its first loss is exactly ln(vocab_size) at any width, and the output layer's first
# updates move the logits at Adam's full rate. With a tied output layer (the embedding scaled by
# d_model^-1/2) a fresh model predicts the token it just read, since the final hidden state is
# close to that token's embedding: the first loss is above ln V (tiny_cpu: 9.2 at ln V 6.9) and
# grows with d_model. Measured alternatives (GPT-2's N(0, 0.02^2), smaller embeddings, a small
# final-norm gain) start at ln V with the tied layer but learn far slower: experiments/README.md,
# "Initialisation and the first loss".
def _dense_init(fan_in: int) -> nn.initializers.Initializer:
    return nn.initializers.normal(stddev=fan_in**-0.5)


def rotary(x_BLHE: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """`x_BLHE` rotated by `positions`: [L] (every row alike) or [B, L] (a position per row, as
    documents inside a row have)."""
    half = x_BLHE.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * freq  # [L, E/2] or [B, L, E/2]
    if positions.ndim == 1:
        sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    else:
        sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    x1, x2 = jnp.split(x_BLHE.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHE.dtype)


def _attend_causal(
    q_BLHE: jax.Array, k_BLKE: jax.Array, v_BLKE: jax.Array, documents: Documents | None
) -> jax.Array:
    """Attention of whole training rows, causal (and inside each document with `documents`)."""
    # Causal AND same document (the function combines its mask with is_causal); without
    # documents, no mask at all: the program is the one a plain causal model compiles.
    mask = None if documents is None else documents.same_document()
    return jax.nn.dot_product_attention(q_BLHE, k_BLKE, v_BLKE, mask=mask, is_causal=True)


def _attend_cached(
    q_BLHE: jax.Array,
    k_BLKE: jax.Array,
    v_BLKE: jax.Array,
    cache: LayerCache,
    start: jax.Array,
    positions: jax.Array,
    dt: Dtype,
) -> tuple[jax.Array, LayerCache]:
    """Attention of decoded tokens at `positions` (from `start`) over the cache, and the cache
    with their keys and values written in."""
    at = (0, start, 0, 0)
    cache = LayerCache(
        jax.lax.dynamic_update_slice(cache.keys_BTKE, k_BLKE.astype(dt), at),
        jax.lax.dynamic_update_slice(cache.values_BTKE, v_BLKE.astype(dt), at),
    )
    # Each token sees the filled positions up to its own; the rest of the buffer is masked.
    visible_LT = jnp.arange(cache.keys_BTKE.shape[1])[None, :] <= positions[:, None]
    out_BLHE = jax.nn.dot_product_attention(
        q_BLHE, cache.keys_BTKE, cache.values_BTKE, mask=visible_LT[None, None]
    )
    return out_BLHE, cache


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
    def __call__(
        self,
        x_BLD: jax.Array,
        cache: LayerCache | None = None,
        start: jax.Array | None = None,
        documents: Documents | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        """The attention output; with `cache` (decoding, `x_BLD` at positions `start..`), also
        the cache with this layer's keys and values written in. With `documents` (training only),
        each token attends to its own document and is rotated by its position in it."""
        if documents is not None and cache is not None:
            raise ValueError("documents apply to training rows, not to a decode step's cache")
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
        if cache is not None:
            positions = start + positions
        elif documents is not None:
            positions = documents.positions_BL
        q_BLHE = rotary(jnp.einsum("bld,dhe->blhe", x_BLD, wq.astype(dt)), positions, c.rope_theta)
        k_BLKE = rotary(jnp.einsum("bld,dke->blke", x_BLD, wk.astype(dt)), positions, c.rope_theta)
        v_BLKE = jnp.einsum("bld,dke->blke", x_BLD, wv.astype(dt))
        if cache is None:
            out_BLHE = _attend_causal(q_BLHE, k_BLKE, v_BLKE, documents)
        else:
            out_BLHE, cache = _attend_cached(q_BLHE, k_BLKE, v_BLKE, cache, start, positions, dt)
        return jnp.einsum("blhe,hed->bld", out_BLHE, wo.astype(dt)), cache


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
    """One decoder layer: attention and an MLP (a mixture of experts if `moe`), each after its
    RMSNorm, each added to the residual stream."""

    cfg: ModelConfig
    moe: bool = False

    @nn.compact
    def __call__(
        self,
        x_BLD: jax.Array,
        cache: LayerCache | None = None,
        start: jax.Array | None = None,
        documents: Documents | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        c = self.cfg
        attn_BLD, cache = Attention(c, name="attn")(
            RMSNorm(c.norm_eps, c.dtype, name="attn_norm")(x_BLD), cache, start, documents
        )
        x_BLD = x_BLD + attn_BLD
        mlp_in_BLD = RMSNorm(c.norm_eps, c.dtype, name="mlp_norm")(x_BLD)
        if self.moe:
            x_BLD = x_BLD + MoeMlp(c.moe, c.d_model, c.dtype, name="moe")(mlp_in_BLD)
        else:
            x_BLD = x_BLD + Mlp(c, name="mlp")(mlp_in_BLD)
        return nn.with_logical_constraint(x_BLD, ("batch", "seq", "embed")), cache


class BlockGroup(nn.Module):
    """`layers.group_size` consecutive layers, the last one a mixture of experts: the unit a
    model with experts in every k-th layer scans (`block_0` .. `block_{k-1}`)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(
        self,
        x_BLD: jax.Array,
        caches: LayerCache | None = None,  # [k, ...]: one per layer of the group
        start: jax.Array | None = None,
        documents: Documents | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        k = layers_lib.group_size(self.cfg)
        written = []
        for j in range(k):
            cache = None if caches is None else jax.tree.map(lambda a, j=j: a[j], caches)
            block = Block(self.cfg, moe=j == k - 1, name=f"block_{j}")
            x_BLD, cache = block(x_BLD, cache, start, documents)
            written.append(cache)
        if caches is None:
            return x_BLD, None
        return x_BLD, jax.tree.map(lambda *a: jnp.stack(a), *written)


class Transformer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(
        self,
        tokens_BL: jax.Array,
        cache: KVCache | None = None,
        documents: Documents | None = None,
    ) -> jax.Array | tuple[jax.Array, KVCache]:
        """Next-token logits [B, L, V] in float32.

        With `cache` (decoding): the tokens continue the cached positions, and the result is the
        logits and the cache holding these tokens too. With `documents` (training rows,
        `segments.documents` of `tokens_BL`): attention stays inside each document and rotary
        positions restart at each; None computes exactly what a model without them does.
        """
        c = self.cfg
        embed_VD = self.param(
            "embed",
            nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")),
            (c.vocab_size, c.d_model),
        )
        x_BLD = embed_VD.astype(c.dtype)[tokens_BL]
        x_BLD = nn.with_logical_constraint(x_BLD, ("batch", "seq", "embed"))
        x_BLD, cache = self._layers(x_BLD, cache, documents)
        x_BLD = RMSNorm(c.norm_eps, c.dtype, name="final_norm")(x_BLD)
        if c.tie_embeddings:
            out_DV = embed_VD.T * c.d_model**-0.5
        else:
            out_DV = self.param(
                "unembed",
                nn.with_logical_partitioning(nn.initializers.zeros, ("embed", "vocab")),
                (c.d_model, c.vocab_size),
            )
        logits_BLV = jnp.einsum("bld,dv->blv", x_BLD, out_DV.astype(c.dtype)).astype(jnp.float32)
        if cache is None:
            return logits_BLV
        return logits_BLV, cache

    def _layers(
        self, x_BLD: jax.Array, cache: KVCache | None, documents: Documents | None
    ) -> tuple[jax.Array, KVCache | None]:
        """Every layer, as one scan over the stacked groups and one over the dense layers left
        over (`layers` module docstring); decoding keeps no activations for a backward pass, so
        it rematerialises nothing."""
        c = self.cfg
        k = layers_lib.group_size(c)
        groups, left = divmod(c.num_layers, k)
        remat = "none" if cache is not None else c.remat
        start = None if cache is None else cache.length
        # (unit, its fields, stack name, units, layers per unit, first layer)
        unit: type[nn.Module] = BlockGroup if k > 1 else Block
        fields = {} if k > 1 else {"moe": c.moe.num_experts > 0}
        stacks = [(unit, fields, layers_lib.STACK, groups, k, 0)]
        if left:  # dense layers after the last group
            stacks.append((Block, {}, layers_lib.TAIL, left, 1, groups * k))
        written = []
        for unit, fields, name, length, group, first in stacks:
            scan = layers_lib.scan_over_layers(unit, length, remat, c.scan_unroll)
            caches = None if cache is None else cache.layers(first, first + length * group, group)
            x_BLD, caches = scan(c, **fields, name=name)(x_BLD, caches, start, documents)
            written.append((caches, group))
        if cache is None:
            return x_BLD, None
        keys, values = _joined(written)
        return x_BLD, KVCache(keys, values, cache.length + x_BLD.shape[1])
