"""How the decoder's layers are stacked, scanned and rematerialised.

The layers' parameters are stacked on a leading axis (logical axis `layers`, never sharded) and
the forward pass is one `nn.scan` over them, so XLA compiles one layer whatever the depth. A scan
needs every iteration to compute the same function, so the unit it scans is a group of
`group_size` consecutive layers: one layer for a dense model or one whose every layer has
experts, `model.moe.every` layers (the last one a mixture of experts) otherwise. The parameter
tree, for `L` layers, `k = group_size`, `G = L // k` groups and `r = L % k` layers left over:

- k == 1: `params["layers"]` is one layer's subtree (`attn`, `attn_norm`, `mlp_norm`, `mlp` or
  `moe`), every leaf [L, ...]: layer i at index i.
- k > 1: `params["layers"]["block_j"]` (j < k), every leaf [G, ...]: layer i < G*k is
  `block_{i % k}` at index `i // k`; the r dense layers after them are `params["tail"]`, leaves
  [r, ...], layer G*k + t at index t.

`locate(m, i)` says where layer i lives; Hugging Face export and import and checkpoint conversion
read and write single layers through it.

`model.remat` chooses what the backward pass keeps of each scanned unit (`REMAT_POLICIES`):
"none" keeps every activation, "full" keeps only the unit's input and recomputes the rest,
"save_dots" also keeps the outputs of the matrix multiplications with weights (q/k/v and the
attention output projection, the MLP's gate, up and down) and recomputes the cheap element-wise
work and the attention scores. `model.scan_unroll` unrolls that many units per iteration of the
scan: 1 compiles one unit, `L // k` unrolls them all (the program grows with depth again, as it
would without a scan; a partial unroll can let XLA overlap one unit's collectives with the next).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from resilient_jax.config.validation import REMAT_POLICIES as REMAT_NAMES

# The names `model.remat` accepts, and the `jax.checkpoint` policy of each (None: no remat).
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Dots without batch dimensions are the products with weights; the attention scores'
    # einsums batch over (batch, heads) and are recomputed, as the "full" policy does.
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
assert tuple(REMAT_POLICIES) == REMAT_NAMES, "config validation and the model name alike"
STACK, TAIL = "layers", "tail"  # the two stacks' names in the params tree


def group_size(m: Any) -> int:
    """Layers per scanned unit (`m`: a `ModelConfig`)."""
    return m.moe.every if m.moe.num_experts else 1


@dataclasses.dataclass(frozen=True)
class LayerPlace:
    """Where one layer's parameters are: `path` into the params tree, then `index` on the
    stack's leading axis."""

    path: tuple[str, ...]
    index: int


def locate(m: Any, layer: int) -> LayerPlace:
    """Where layer `layer` of a model `m` lives in the params tree (module docstring)."""
    k = group_size(m)
    groups = m.num_layers // k
    if layer < groups * k:
        path = (STACK,) if k == 1 else (STACK, f"block_{layer % k}")
        return LayerPlace(path, layer // k)
    return LayerPlace((TAIL,), layer - groups * k)


def scan_over_layers(unit: type[nn.Module], length: int, remat: str, unroll: int) -> Any:
    """`unit` (a module called as `(x, cache, start, documents) -> (x, cache)`) scanned `length`
    times over stacked parameters: the carry is the residual stream, a cache (decoding) is
    sliced per iteration, `start` and `documents` are the same for every iteration. What a
    mixture of experts sows is stacked like the parameters."""
    policy = REMAT_POLICIES[remat]
    if remat != "none":
        # prevent_cse=False: inside a scan, XLA's common-subexpression elimination cannot undo the
        # recomputation, and the barrier it would otherwise add slows the step (jax.checkpoint).
        unit = nn.remat(unit, policy=policy, prevent_cse=False)
    return nn.scan(
        unit,
        variable_axes={"params": 0, "intermediates": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast, nn.broadcast),
        length=length,
        unroll=max(1, min(unroll, length)),
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
