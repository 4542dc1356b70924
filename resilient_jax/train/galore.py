"""GaLore (gradient low-rank projection, Zhao et al. 2024) as an Optax transformation.

`galore(inner, ...)` wraps any Optax transformation. Each weight with at least `min_size` elements
and two or more axes is viewed as a matrix G of shape [m, n]; its gradient is projected onto a
rank-r subspace (left, P^T G of shape [r, n], when m <= n; right, G P of shape [m, r], otherwise:
the smaller side is the one projected), the inner transformation runs on the projected gradient,
and its update is projected back and multiplied by `scale`. P holds the top-r singular vectors of
the gradient, recomputed every `update_interval` updates (the first update included). Every other
leaf, and those `exclude` names by path ("layers__mlp__w_up"), goes through the inner
transformation unchanged. The inner state of a projected leaf has the projected shape, which is
where the memory goes: Adam's two moments of an [m, n] weight shrink from 2mn to 2r*max(m, n),
plus the m*r or n*r of P.

A stack of matrices, such as a mixture of experts' [experts, d_model, d_ff] weights, is projected
matrix by matrix: `batch_dims(path)` says how many leading axes index the stack, and each matrix
gets its own P from its own gradient's SVD (batched), so P is [experts, side, r] and the inner
state [experts, r, n] or [experts, m, r].

Refreshing P turns the subspace the inner state lives in. With `rotate_state`, the state is
carried into the new basis at each refresh: R = P_new^T P_old maps old coordinates to new ones,
first moments (and any other projected-shape leaf) become R m, and second moments (leaves under
a field named `nu`, Adam's) become (R * R) v, the variance of the rotated coordinates when the
old ones are independent. Without it (the paper's reference code) the moments keep their
coordinates while the basis under them changes: singular vectors come back permuted or with
flipped signs, so a kept first moment can point backwards after a refresh.

The inner transformation is called without parameters: what needs them (weight decay) and the
learning rate belong after `galore` in the chain, in full space, as in the reference
implementation.

Matrix view of weights with more than two axes (after the stacked ones): `matrix_split(shape)`
says how many leading axes form the rows (the rest are the columns), so the matrix is the one the
model multiplies by, e.g. [d_model, heads * head_dim] for a query weight. Any split gives a valid
GaLore; the default (`1`) keeps the first axis as rows.

Sharding: under `flax.linen` logical partitioning the boxed parameters given to `init` carry
their logical axis names; the stacked axes keep theirs (experts stay on the `expert` axis), P and
the projected inner state take the name of the weight's side they span (rows or columns, when that
side is a single axis) and leave the rank axis unsharded, so P of an fsdp-sharded [m, n] weight is
fsdp-sharded along m. A side made of several axes (heads x head_dim) is replicated: it is small
(r x side).
"""

from __future__ import annotations

import dataclasses
import functools
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
    """How one leaf is projected: a stack (`batch`, the leading axes) of matrices [rows, cols],
    each viewed from `split` of the remaining axes, and which side."""

    batch: tuple[int, ...]
    split: int  # leading axes (after the batch) that form the rows
    rows: int
    cols: int
    rank: int

    @property
    def left(self) -> bool:  # project the rows (the smaller side): P is [rows, rank]
        return self.rows <= self.cols

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        return (*self.batch, self.rows, self.cols)

    @property
    def projection_shape(self) -> tuple[int, ...]:
        return (*self.batch, self.rows if self.left else self.cols, self.rank)

    @property
    def low_rank_shape(self) -> tuple[int, ...]:
        return (*self.batch, *((self.rank, self.cols) if self.left else (self.rows, self.rank)))

    def project(self, proj: jax.Array, matrix: jax.Array) -> jax.Array:
        if self.left:  # P^T G
            return jnp.einsum("...mr,...mn->...rn", proj, matrix)
        return jnp.einsum("...mn,...nr->...mr", matrix, proj)  # G P

    def project_back(self, proj: jax.Array, low: jax.Array) -> jax.Array:
        if self.left:  # P L
            return jnp.einsum("...mr,...rn->...mn", proj, low)
        return jnp.einsum("...mr,...nr->...mn", low, proj)  # L P^T

    def rotate(self, rotation: jax.Array, low: jax.Array) -> jax.Array:
        """`low` expressed in the new basis; `rotation` is [..., r_new, r_old]."""
        if self.left:
            return jnp.einsum("...ij,...jn->...in", rotation, low)
        return jnp.einsum("...mj,...ij->...mi", low, rotation)


# A pytree's leaves with their paths, as `jax.tree_util.tree_flatten_with_path` lists them.
_Flat = list[tuple[tuple[Any, ...], Any]]
_PlanOf = Callable[[str, tuple[int, ...]], _Plan | None]


def path_key(path: tuple[Any, ...]) -> str:
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
    rotate_state: bool = True,
    matrix_split: Callable[[tuple[int, ...]], int] = lambda shape: 1,
    batch_dims: Callable[[str], int] = lambda path: 0,
    exclude: Callable[[str], bool] = lambda path: False,
) -> optax.GradientTransformation:
    """GaLore around `inner`; see the module docstring. Raises ValueError when `rank` exceeds the
    smaller side of a weight it would project."""
    _check_settings(rank, update_interval, min_size, scale)
    plan_of = functools.partial(
        _plan_of,
        rank=rank,
        min_size=min_size,
        matrix_split=matrix_split,
        batch_dims=batch_dims,
        exclude=exclude,
    )

    def init(params: Any) -> GaLoreState:
        flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)
        inner_params, projections = _init_leaves(flat, plan_of)
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
        plans, matrices, projections = _refreshed_projections(
            flat, state.projections, refresh, plan_of
        )
        inner_state = state.inner
        if rotate_state and plans:
            inner_state = _rotated_on_refresh(
                inner_state, refresh, plans, state.projections, projections
            )
        low_rank = _low_rank(flat, plans, matrices, projections)
        inner_updates, inner_state = inner.update(treedef.unflatten(low_rank), inner_state)
        out = _projected_back(flat, jax.tree.leaves(inner_updates), plans, projections, scale)
        new_state = GaLoreState(
            count=state.count + 1,
            refreshed_at=jnp.where(refresh, state.count, state.refreshed_at),
            projections=projections,
            inner=inner_state,
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init, update)


def _check_settings(rank: int, update_interval: int, min_size: int, scale: float) -> None:
    if rank < 1 or update_interval < 1 or min_size < 0 or not scale > 0:
        raise ValueError(
            f"galore needs rank >= 1, update_interval >= 1, min_size >= 0 and scale > 0; got "
            f"rank={rank} update_interval={update_interval} min_size={min_size} scale={scale}"
        )


def _plan_of(
    key: str,
    shape: tuple[int, ...],
    *,
    rank: int,
    min_size: int,
    matrix_split: Callable[[tuple[int, ...]], int],
    batch_dims: Callable[[str], int],
    exclude: Callable[[str], bool],
) -> _Plan | None:
    """How the leaf at `key` is projected, or None when it goes through the inner transformation
    unchanged."""
    if exclude(key):
        return None
    batch = tuple(shape[: batch_dims(key)])
    matrix = shape[len(batch) :]
    if len(matrix) < 2 or math.prod(matrix) < min_size:
        return None
    split = matrix_split(matrix)
    plan = _Plan(batch, split, math.prod(matrix[:split]), math.prod(matrix[split:]), rank)
    if rank > min(plan.rows, plan.cols):
        raise ValueError(
            f"galore rank {rank} exceeds the smaller side of a {plan.rows}x{plan.cols} matrix"
        )
    return plan


def _init_leaves(flat: _Flat, plan_of: _PlanOf) -> tuple[list[Any], dict[str, Any]]:
    """The parameters the inner state is initialised from (projected leaves at their low-rank
    shape) and each projected leaf's P, zero until the first update computes it; boxed leaves
    keep their logical axis names (module docstring, "Sharding")."""
    inner_params, projections = [], {}
    for path, leaf in flat:
        value = leaf.value if _is_box(leaf) else leaf
        plan = plan_of(path_key(path), value.shape)
        if plan is None:
            inner_params.append(leaf)
            continue
        low = jnp.zeros(plan.low_rank_shape, value.dtype)
        proj = jnp.zeros(plan.projection_shape, jnp.float32)
        if _is_box(leaf):
            stacked = tuple(leaf.names[: len(plan.batch)])
            names = leaf.names[len(plan.batch) :]
            rows, cols = _side_name(names[: plan.split]), _side_name(names[plan.split :])
            low = leaf.replace(
                value=low, names=(*stacked, None, cols) if plan.left else (*stacked, rows, None)
            )
            proj = leaf.replace(value=proj, names=(*stacked, rows if plan.left else cols, None))
        inner_params.append(low)
        projections[path_key(path)] = proj
    return inner_params, projections


def _refreshed_projections(
    flat: _Flat,
    previous: dict[str, jax.Array],
    refresh: jax.Array,
    plan_of: _PlanOf,
) -> tuple[dict[str, _Plan], dict[str, jax.Array], dict[str, jax.Array]]:
    """The plan, the float32 matrix view of the gradient and the P (recomputed when `refresh`,
    else the previous one) of each projected leaf, keyed by its path."""
    plans: dict[str, _Plan] = {}
    matrices, projections = {}, {}
    for path, grad in flat:
        key = path_key(path)
        if key not in previous:
            continue
        plan = plans[key] = plan_of(key, grad.shape)
        matrices[key] = matrix = grad.reshape(plan.matrix_shape).astype(jnp.float32)
        projections[key] = jax.lax.cond(
            refresh,
            lambda m, _, plan=plan: _top_singular_vectors(m, plan),
            lambda _, old: old,
            matrix,
            previous[key],
        )
    return plans, matrices, projections


def _low_rank(
    flat: _Flat,
    plans: dict[str, _Plan],
    matrices: dict[str, jax.Array],
    projections: dict[str, jax.Array],
) -> list[jax.Array]:
    """The gradient leaves the inner transformation sees: projected leaves projected (in their
    gradient's dtype), the others as they are."""
    return [
        plans[key].project(projections[key], matrices[key]).astype(grad.dtype)
        if (key := path_key(path)) in plans
        else grad
        for path, grad in flat
    ]


def _projected_back(
    flat: _Flat,
    inner_updates: list[jax.Array],
    plans: dict[str, _Plan],
    projections: dict[str, jax.Array],
    scale: float,
) -> list[jax.Array]:
    """The inner transformation's updates in full space: projected leaves projected back, scaled
    and in their gradient's shape and dtype; the others as they are."""
    out = []
    for (path, grad), low in zip(flat, inner_updates, strict=True):
        key = path_key(path)
        if key not in plans:
            out.append(low)
            continue
        full = plans[key].project_back(projections[key], low)
        out.append((scale * full).reshape(grad.shape).astype(grad.dtype))
    return out


def _top_singular_vectors(matrix: jax.Array, plan: _Plan) -> jax.Array:
    """The rank-r basis of the side `plan` projects: left singular vectors for rows, right for
    columns (of every matrix of a stack)."""
    u, vt = jax.lax.platform_dependent(matrix, cpu=_svd_one_by_one, default=_svd_batched)
    return u[..., : plan.rank] if plan.left else jnp.swapaxes(vt[..., : plan.rank, :], -1, -2)


def _svd_batched(matrix: jax.Array) -> tuple[jax.Array, jax.Array]:
    u, _, vt = jnp.linalg.svd(matrix, full_matrices=False)
    return u, vt


def _svd_one_by_one(matrix: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The stack's matrices decomposed one at a time. jaxlib's CPU LAPACK kernel splits a batch
    over XLA's intra-op thread pool and blocks its own thread until the parts are done: with
    several devices of one process each doing so (8 simulated devices on 2 cores), every thread
    of the pool ends up waiting and the step never finishes."""
    if matrix.ndim == 2:
        return _svd_batched(matrix)
    flat = matrix.reshape(-1, *matrix.shape[-2:])
    u, vt = jax.lax.map(_svd_batched, flat)
    return u.reshape(*matrix.shape[:-2], *u.shape[-2:]), vt.reshape(
        *matrix.shape[:-2], *vt.shape[-2:]
    )


def _rotated_on_refresh(
    inner_state: optax.OptState,
    refresh: jax.Array,
    plans: dict[str, _Plan],
    old: dict[str, jax.Array],
    new: dict[str, jax.Array],
) -> optax.OptState:
    """`_rotate` on the steps that recomputed the projections; the inner state as it is on the
    others, where the bases did not change."""
    return jax.lax.cond(refresh, lambda s: _rotate(s, plans, old, new), lambda s: s, inner_state)


def _rotate(
    inner_state: optax.OptState,
    plans: dict[str, _Plan],
    old: dict[str, jax.Array],
    new: dict[str, jax.Array],
) -> optax.OptState:
    """The inner state carried from the old bases into the new ones (module docstring): each leaf
    of a projected leaf's low-rank shape whose path ends with that leaf's path."""
    rotations = {key: jnp.einsum("...sr,...sq->...rq", new[key], old[key]) for key in plans}
    longest_first = sorted(plans.items(), key=lambda item: -len(item[0]))  # "a__w" before "w"

    def carry(path: tuple[Any, ...], leaf: Any) -> Any:
        names = path_key(path).split("__")
        second_moment = any(getattr(k, "name", None) == "nu" for k in path)
        for key, plan in longest_first:
            parts = key.split("__")
            if names[-len(parts) :] == parts and leaf.shape == plan.low_rank_shape:
                rotation = rotations[key] ** 2 if second_moment else rotations[key]
                return plan.rotate(rotation, leaf.astype(jnp.float32)).astype(leaf.dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(carry, inner_state)
