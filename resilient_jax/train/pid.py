"""PID feedback on the learning rate: damp the update when the step looks like a spike.

After PID-control-based self-healing of training: the measured variable is the step's spike score
(the larger of the loss and log grad-norm z-scores, see `in_band`), the set point is
`pid_target_z`. The control output `u` turns into a multiplier on the optimizer updates,
`scale = max(1 / (1 + u), pid_min_scale)`, so a calm run (score below target, `u <= 0`) trains at
full learning rate and a run whose gradients jump trains more gently until the jump has passed.

The proportional and derivative terms act on the excess of the score over the target only. The
integral term takes the signed error, so it remembers recent spikes and keeps the rate low for a
few steps after one while calm steps drain it; it is clamped to [0, INTEGRAL_MAX] so a long calm
stretch cannot bank "credit" that would later cancel a real spike (anti-windup). The error is
clamped to ERROR_MAX so one NaN step or a huge outlier cannot drive the rate to the floor for
hundreds of steps.

Pure and jittable: all state lives in two float32 scalars of `HealthStats`.
"""

from __future__ import annotations

import jax.numpy as jnp

ERROR_MAX = 10.0  # z-score units above target that one step may contribute
INTEGRAL_MAX = 20.0


def pid_scale(
    integral: jnp.ndarray,
    prev_error: jnp.ndarray,
    score: jnp.ndarray,
    active: jnp.ndarray,
    *,
    target: float,
    kp: float,
    ki: float,
    kd: float,
    min_scale: float,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """One controller step: returns (update scale, new integral, new previous excess error).

    `score` must already be finite (the caller maps NaN/Inf to a large score). While `active` is
    false (statistics still warming up) the controller holds its state and outputs 1.
    """
    error = jnp.minimum(score - target, ERROR_MAX)
    # Calm steps (negative error) drain the integral; only excess above target acts directly,
    # so ordinary noise below the set point never moves the learning rate.
    new_integral = jnp.clip(integral + error, 0.0, INTEGRAL_MAX)
    excess = jnp.maximum(error, 0.0)
    u = kp * excess + ki * new_integral + kd * (excess - prev_error)
    scale = jnp.maximum(1.0 / (1.0 + jnp.maximum(u, 0.0)), min_scale)
    return (
        jnp.where(active, scale, 1.0).astype(jnp.float32),
        jnp.where(active, new_integral, integral).astype(jnp.float32),
        jnp.where(active, excess, prev_error).astype(jnp.float32),
    )
