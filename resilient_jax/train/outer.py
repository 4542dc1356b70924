"""The outer optimizer of elastic mode's sync interval (`elastic.sync_every_steps` > 1, DiLoCo).

With a sync interval of H steps, each slice takes H inner steps with its own inner optimizer on
its share of every global batch, starting from the shared outer parameters; then the slices
average their deltas (outer minus inner parameters, the "outer gradient") and the outer
optimizer, SGD with Nesterov momentum as in DiLoCo, moves the outer parameters; every slice
restarts its inner steps from them.

The outer state (the outer parameters and the momentum buffer) rides in the train state's
`opt_state`: `with_outer_state` wraps the inner optimizer and carries it through every inner
update untouched, so checkpoints, the in-band health check's "leave a bad step's state as it
was" and a joining slice's heal carry it with no change to `TrainState`. With H = 1 nothing is
wrapped: the optimizer state is exactly the single-runtime one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class OuterState(NamedTuple):
    inner: Any  # the inner optimizer's state (this slice's own)
    params: Any  # the outer parameters: the same bits on every slice
    momentum: Any  # the outer optimizer's momentum buffer, like the parameters


def with_outer_state(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner`, with the outer state beside its own (initialised to the parameters and zeros)."""

    def init(params: Any) -> OuterState:
        return OuterState(
            inner=inner.init(params),
            params=jax.tree.map(jnp.copy, params),
            momentum=jax.tree.map(jnp.zeros_like, params),
        )

    def update(updates: Any, state: OuterState, params: Any = None):
        updates, inner_state = inner.update(updates, state.inner, params)
        return updates, state._replace(inner=inner_state)

    return optax.GradientTransformation(init, update)


def nesterov_step(
    outer: Any, momentum: Any, delta: Any, learning_rate: float, beta: float
) -> tuple[Any, Any]:
    """One outer step on the averaged delta (PyTorch's SGD with nesterov=True, as in DiLoCo):
    m <- beta * m + delta;  outer <- outer - lr * (delta + beta * m). Returns (outer, m)."""
    momentum = jax.tree.map(lambda m, d: beta * m + d, momentum, delta)
    outer = jax.tree.map(
        lambda p, d, m: (p - learning_rate * (d + beta * m)).astype(p.dtype), outer, delta, momentum
    )
    return outer, momentum
