"""GaLore (gradient low-rank projection, Zhao et al. 2024) as an Optax transformation.

`galore(inner, ...)` wraps any Optax transformation. Each weight with at least `min_size` elements
and two or more axes is viewed as a matrix G of shape [m, n]; its gradient is projected onto a
rank-r subspace (left, P^T G of shape [r, n], when m <= n; right, G P of shape [m, r], otherwise:
the smaller side is the one projected), the inner transformation runs on the projected gradient,
and its update is projected back and multiplied by `scale`. P holds the top-r singular vectors of
the gradient, recomputed every `update_interval` updates (the first update included). Every other
leaf, and those `exclude` names by path ("layer_0__mlp__w_up"), goes through the inner
transformation unchanged. The inner state of a projected leaf has the
projected shape, which is where the memory goes: Adam's two moments of an [m, n] weight shrink
from 2mn to 2r*max(m, n), plus the m*r or n*r of P.

The inner transformation is called without parameters: what needs them (weight decay) and the
learning rate belong after `galore` in the chain, in full space, as in the reference
implementation.

Matrix view of weights with more than two axes: `matrix_split(shape)` says how many leading axes
form the rows (the rest are the columns), so the matrix is the one the model multiplies by, e.g.
[d_model, heads * head_dim] for a query weight. Any split gives a valid GaLore; the default
(`1`) keeps the first axis as rows.

Sharding: under `flax.linen` logical partitioning the boxed parameters given to `init` carry
their logical axis names; P and the projected inner state take the name of the weight's side
they span (rows or columns, when that side is a single axis) and leave the rank axis
unsharded, so P of an fsdp-sharded [m, n] weight is fsdp-sharded along m. A side made of
several axes (heads x head_dim) is replicated: it is small (r x side).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class GaLoreState(NamedTuple):
    count: jax.Array  # int32: updates applied so far
    refreshed_at: jax.Array  # int32: the count at which the projections were last recomputed
    projections: dict[str, jax.Array]  # P of each projected leaf, keyed by its path
    inner: optax.OptState  # the wrapped transformation's state, on projected shapes


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one leaf is projected: the matrix [rows, cols] it is viewed as, and which side."""

    split: int  # leading axes that form the rows
    rows: int
    cols: int
    rank: int

    @property
    def left(self) -> bool:  # project the rows (the smaller side): P is [rows, rank]
        return self.rows <= self.cols

    @property
    def projection_shape(self) -> tuple[int, int]:
        return (self.rows, self.rank) if self.left else (self.cols, self.rank)

    @property
    def low_rank_shape(self) -> tuple[int, int]:
        return (self.rank, self.cols) if self.left else (self.rows, self.rank)


def _path_key(path: tuple[Any, ...]) -> str:
    # "__" rather than "/" or ".": checkpoint writers give those a meaning of their own.
    return "__".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.Partitioned)


def _side_name(names: tuple[Any, ...]) -> Any:
    return names[0] if len(names) == 1 else None


def galore(
    inner: optax.GradientTransformation,
    *,
    rank: int,
    update_interval: int,
    scale: float,
    min_size: int,
    matrix_split: Callable[[tuple[int, ...]], int] = lambda shape: 1,
    exclude: Callable[[str], bool] = lambda path: False,
) -> optax.GradientTransformation:
    """GaLore around `inner`; see the module docstring. Raises ValueError when `rank` exceeds the
    smaller side of a weight it would project."""
    if rank < 1 or update_interval < 1 or min_size < 0 or not scale > 0:
        raise ValueError(
            f"galore needs rank >= 1, update_interval >= 1, min_size >= 0 and scale > 0; got "
            f"rank={rank} update_interval={update_interval} min_size={min_size} scale={scale}"
        )

    def plan_of(shape: tuple[int, ...]) -> _Plan | None:
        if len(shape) < 2 or math.prod(shape) < min_size:
            return None
        split = matrix_split(shape)
        plan = _Plan(split, math.prod(shape[:split]), math.prod(shape[split:]), rank)
        if rank > min(plan.rows, plan.cols):
            raise ValueError(
                f"galore rank {rank} exceeds the smaller side of a {plan.rows}x{plan.cols} matrix"
            )
        return plan

    def init(params: Any) -> GaLoreState:
        flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)
        inner_params, projections = [], {}
        for path, leaf in flat:
            value = leaf.value if _is_box(leaf) else leaf
            plan = None if exclude(_path_key(path)) else plan_of(value.shape)
            if plan is None:
                inner_params.append(leaf)
                continue
            low = jnp.zeros(plan.low_rank_shape, value.dtype)
            proj = jnp.zeros(plan.projection_shape, jnp.float32)
            if _is_box(leaf):
                rows = _side_name(leaf.names[: plan.split])
                cols = _side_name(leaf.names[plan.split :])
                low_names = (None, cols) if plan.left else (rows, None)
                proj_names = (rows if plan.left else cols, None)
                low = leaf.replace(value=low, names=low_names)
                proj = leaf.replace(value=proj, names=proj_names)
            inner_params.append(low)
            projections[_path_key(path)] = proj
        return GaLoreState(
            count=jnp.zeros((), jnp.int32),
            refreshed_at=jnp.zeros((), jnp.int32),
            projections=projections,
            inner=inner.init(treedef.unflatten(inner_params)),
        )

    def update(updates: Any, state: GaLoreState, params: Any = None) -> tuple[Any, GaLoreState]:
        del params  # the inner transformation works in the projected space, where there are none
        refresh = state.count % update_interval == 0
        flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
        low_rank, projections, plans = [], {}, []
        for path, grad in flat:
            key = _path_key(path)
            plan = plan_of(grad.shape) if key in state.projections else None
            plans.append((key, plan))
            if plan is None:
                low_rank.append(grad)
                continue
            matrix = grad.reshape(plan.rows, plan.cols).astype(jnp.float32)
            proj = jax.lax.cond(
                refresh,
                lambda m, _, plan=plan: _top_singular_vectors(m, plan),
                lambda _, old: old,
                matrix,
                state.projections[key],
            )
            projections[key] = proj
            low = proj.T @ matrix if plan.left else matrix @ proj
            low_rank.append(low.astype(grad.dtype))
        inner_updates, inner_state = inner.update(treedef.unflatten(low_rank), state.inner)
        out = []
        for (key, plan), (_, grad), low in zip(
            plans, flat, jax.tree.leaves(inner_updates), strict=True
        ):
            if plan is None:
                out.append(low)
                continue
            proj = projections[key]
            full = proj @ low if plan.left else low @ proj.T
            out.append((scale * full).reshape(grad.shape).astype(grad.dtype))
        new_state = GaLoreState(
            count=state.count + 1,
            refreshed_at=jnp.where(refresh, state.count, state.refreshed_at),
            projections=projections,
            inner=inner_state,
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init, update)


def _top_singular_vectors(matrix: jax.Array, plan: _Plan) -> jax.Array:
    """The rank-r basis of the side `plan` projects: left singular vectors for rows, right for
    columns."""
    u, _, vt = jnp.linalg.svd(matrix, full_matrices=False)
    return u[:, : plan.rank] if plan.left else vt[: plan.rank].T
