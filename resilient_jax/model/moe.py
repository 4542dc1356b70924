"""Mixture of experts: the MLP of every `model.moe.every`-th decoder layer becomes `num_experts`
gated MLPs and a router that sends each token to its `top_k` experts.

Routing is decided per sequence (GShard's groups are the sequences): an expert takes at most
`capacity = ceil(capacity_factor * top_k * L / num_experts)` tokens of one sequence, every token's
first choice before any second choice, each in position order; an assignment beyond an expert's
capacity is dropped (that token's share of the layer is zero and its residual stream carries it,
as in Switch). Nothing in the routing depends on how many sequences a device or a microbatch
holds, so a reshape that changes the microbatch count computes the same function.

The router's auxiliary losses:
- load balance (Switch Transformer): `num_experts * sum_e f_e * P_e` per sequence, `f_e` the
  share of the sequence's assignments routed to expert e (before dropping), `P_e` its mean router
  probability; 1.0 when routing is uniform.
- z-loss (ST-MoE): `logsumexp(router logits)^2` per token, which keeps the logits small.
Each MoE layer sows its sums (`RouterSums`) into the `intermediates` collection; the training
step gathers them with `router_sums` and turns them into loss terms (`loss_terms`) and metrics
(`router_metrics`). Without a mutable `intermediates` (evaluation, decoding) nothing is sown.

Expert weights are `[E, D, F]` on the logical axis `expert` (the `expert` mesh axis, with `embed`
and `mlp` on fsdp and tensor inside it: `resilient_jax.mesh.LOGICAL_AXIS_RULES`). The tokens an
expert computes are constrained to experts over `expert` and sequences over the other data axes,
so dispatching them is an all-to-all over the `expert` axis.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

# Logical axes of the tokens inside the experts: [sequences, experts, slots, width].
EXPERT_TOKENS = ("expert_batch", "expert", None, None)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    num_experts: int  # 0: every layer keeps its dense MLP
    every: int  # layers every-1, 2*every-1, ... are MoE layers
    top_k: int
    capacity_factor: float
    d_ff: int  # hidden width of one expert
    balance_weight: float
    z_weight: float

    @classmethod
    def from_config(cls, model: ml_collections.ConfigDict) -> MoeConfig:
        m = model.moe
        return cls(
            num_experts=m.num_experts,
            every=m.every,
            top_k=m.top_k,
            capacity_factor=m.capacity_factor,
            d_ff=m.d_ff or model.d_ff,
            balance_weight=m.balance_weight,
            z_weight=m.z_weight,
        )

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and (layer + 1) % self.every == 0

    def num_moe_layers(self, num_layers: int) -> int:
        return sum(self.is_moe_layer(i) for i in range(num_layers))

    def capacity(self, seq_len: int) -> int:
        """Slots of one expert for one sequence (no expert can take more than every token)."""
        slots = math.ceil(self.capacity_factor * self.top_k * seq_len / self.num_experts)
        return max(1, min(seq_len, slots))


DENSE = MoeConfig(
    num_experts=0, every=1, top_k=1, capacity_factor=1.0, d_ff=0, balance_weight=0.0, z_weight=0.0
)


@flax.struct.dataclass
class RouterSums:
    """Sums over the sequences one call routed; `load_NE` per MoE layer and expert."""

    balance: jax.Array  # sum of the sequences' load-balance losses
    z: jax.Array  # sum of the tokens' squared router logsumexp
    dropped: jax.Array  # assignments beyond an expert's capacity
    load_NE: jax.Array  # assignments routed to each expert (before dropping)

    @classmethod
    def zeros(cls, num_moe_layers: int, num_experts: int) -> RouterSums:
        zero = jnp.zeros((), jnp.float32)
        return cls(zero, zero, zero, jnp.zeros((num_moe_layers, num_experts), jnp.float32))

    def __add__(self, other: RouterSums) -> RouterSums:
        return jax.tree.map(jnp.add, self, other)


class MoeMlp(nn.Module):
    moe: MoeConfig
    d_model: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        m, d, f, num_e = self.moe, self.d_model, self.moe.d_ff, self.moe.num_experts
        # Switch's router init (variance 0.1 / fan-in): small logits, near-uniform first routing.
        router_DE = self.param(
            "router",
            nn.with_logical_partitioning(nn.initializers.normal((0.1 / d) ** 0.5), ("embed", None)),
            (d, num_e),
        )
        w_in = nn.with_logical_partitioning(
            nn.initializers.normal(d**-0.5), ("expert", "embed", "mlp")
        )
        w_gate_EDF = self.param("w_gate", w_in, (num_e, d, f))
        w_up_EDF = self.param("w_up", w_in, (num_e, d, f))
        w_down_EFD = self.param(
            "w_down",
            nn.with_logical_partitioning(
                nn.initializers.normal(f**-0.5), ("expert", "mlp", "embed")
            ),
            (num_e, f, d),
        )
        batch, seq_len, k = x_BLD.shape[0], x_BLD.shape[1], m.top_k
        capacity, dt = m.capacity(seq_len), self.dtype

        # The router runs in float32 whatever the compute dtype: its softmax decides the routing.
        logits_BLE = jnp.einsum("bld,de->ble", x_BLD.astype(jnp.float32), router_DE)
        probs_BLE = jax.nn.softmax(logits_BLE, axis=-1)
        weights_BLK, experts_BLK = jax.lax.top_k(probs_BLE, k)
        if k > 1:  # the chosen experts' outputs are mixed with weights summing to one
            weights_BLK = weights_BLK / weights_BLK.sum(axis=-1, keepdims=True)

        # Queue order: choice 0 of every token, then choice 1, each in position order.
        chosen_BXE = jax.nn.one_hot(jnp.swapaxes(experts_BLK, 1, 2), num_e, dtype=jnp.int32)
        chosen_BXE = chosen_BXE.reshape(batch, k * seq_len, num_e)
        slot_BXE = (jnp.cumsum(chosen_BXE, axis=1) - 1) * chosen_BXE
        kept_BXE = chosen_BXE * (slot_BXE < capacity)
        slots_BKLEC = jax.nn.one_hot(slot_BXE, capacity, dtype=dt) * kept_BXE[..., None].astype(dt)
        slots_BKLEC = slots_BKLEC.reshape(batch, k, seq_len, num_e, capacity)
        dispatch_BLEC = slots_BKLEC.sum(axis=1)
        combine_BLEC = jnp.einsum("bklec,blk->blec", slots_BKLEC, weights_BLK.astype(dt))

        tokens_BECD = jnp.einsum("blec,bld->becd", dispatch_BLEC, x_BLD)
        tokens_BECD = nn.with_logical_constraint(tokens_BECD, EXPERT_TOKENS)
        gate_BECF = jax.nn.silu(jnp.einsum("becd,edf->becf", tokens_BECD, w_gate_EDF.astype(dt)))
        up_BECF = jnp.einsum("becd,edf->becf", tokens_BECD, w_up_EDF.astype(dt))
        out_BECD = jnp.einsum("becf,efd->becd", gate_BECF * up_BECF, w_down_EFD.astype(dt))
        out_BECD = nn.with_logical_constraint(out_BECD, EXPERT_TOKENS)

        assigned_BE = chosen_BXE.sum(axis=1).astype(jnp.float32)
        share_BE = assigned_BE / (k * seq_len)
        self.sow(
            "intermediates",
            "router",
            RouterSums(
                balance=num_e * jnp.sum(share_BE * probs_BLE.mean(axis=1)),
                z=jnp.sum(jax.nn.logsumexp(logits_BLE, axis=-1) ** 2),
                dropped=jnp.sum(chosen_BXE - kept_BXE).astype(jnp.float32),
                load_NE=assigned_BE.sum(axis=0)[None],
            ),
        )
        return jnp.einsum("blec,becd->bld", combine_BLEC, out_BECD)


def router_sums(intermediates: dict, moe: MoeConfig, num_moe_layers: int) -> RouterSums:
    """The sums every MoE layer sowed in one `apply`, added up (loads stacked by layer). A scan
    over layers sows one `RouterSums` per stack position with a leading axis of the layers it
    covers, in layer order."""
    sown = jax.tree.leaves(intermediates, is_leaf=lambda x: isinstance(x, RouterSums))
    loads = [s.load_NE.reshape(-1, moe.num_experts) for s in sown]
    assert sum(len(x) for x in loads) == num_moe_layers, (
        f"{sum(len(x) for x in loads)} MoE layers sowed, {num_moe_layers} expected"
    )
    return RouterSums(
        balance=sum(jnp.sum(s.balance) for s in sown),
        z=sum(jnp.sum(s.z) for s in sown),
        dropped=sum(jnp.sum(s.dropped) for s in sown),
        load_NE=jnp.concatenate(loads),
    )


def loss_terms(sums: RouterSums, moe: MoeConfig, seq_len: int) -> jax.Array:
    """The router losses to add to a token-loss sum: divided by the step's token count, they give
    `balance_weight x mean balance loss + z_weight x mean z-loss`, summed over the MoE layers
    (each layer's router weighted alike whatever the depth, as in Switch and ST-MoE)."""
    balance = moe.balance_weight * sums.balance * seq_len  # per sequence: seq_len tokens
    return balance + moe.z_weight * sums.z


def router_metrics(
    sums: RouterSums, moe: MoeConfig, num_tokens: int, seq_len: int, num_moe_layers: int
) -> dict[str, jax.Array]:
    """A step's router metrics: its two losses (means over MoE layers, unweighted), the fraction
    of assignments dropped, and each expert's load relative to uniform (1.0), [layer, expert]:
    its share of the layer's assignments (before dropping) x num_experts. One step's loads are
    noisy (a few thousand assignments); `expert_load_extremes` judges them over a window."""
    assignments = num_tokens * moe.top_k
    uniform = assignments / moe.num_experts
    return {
        "moe_balance_loss": sums.balance * seq_len / (num_tokens * num_moe_layers),
        "moe_z_loss": sums.z / (num_tokens * num_moe_layers),
        "moe_dropped_fraction": sums.dropped / (assignments * num_moe_layers),
        "moe_expert_load": sums.load_NE / uniform,
    }


def expert_load_extremes(loads: list) -> tuple[float, float]:
    """The idlest and the busiest expert's load relative to uniform, each expert's load averaged
    over `loads` (the `moe_expert_load` of consecutive steps, [layer, expert] each)."""
    mean_NE = np.mean(np.asarray(loads, np.float64), axis=0)
    return float(mean_NE.min()), float(mean_NE.max())
