"""In-band anomaly detection: a pure, jittable verdict on every step, computed inside the step.

The train step computes the loss and the global gradient norm, then calls

    ok, health, flags = assess(state.health, loss, grad_norm, config.health)

and applies the update only when `ok` (`where_ok`), always incrementing the step, so a NaN or a
spike never reaches the parameters or the optimizer moments. Nothing here syncs with the host: the
verdict is a device scalar and the flags travel with the step's metrics.

A step is anomalous when its loss or gradient norm is not finite, or (once `warmup_steps` healthy
steps have been seen) when the loss or the log gradient norm lies more than `zscore` standard
deviations above its exponential moving average. Only upward jumps count: a falling loss is
progress. The log of the gradient norm is tracked because gradient norms vary multiplicatively.
Anomalous steps are kept out of the running statistics, so a spike does not raise the bar for the
next one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from resilient_jax.train import pid

# Floors on the standard deviations: late in a smooth run the running variance can get so small
# that ordinary batch-to-batch noise would read as many sigmas.
LOSS_STD_FLOOR_REL = 0.005  # of the running mean loss
LOG_GRAD_STD_FLOOR = 0.02  # in log units: a 2% change in gradient norm
_TINY = 1e-30
# A variance needs two samples; with fewer, every step would look like a spike and, never being
# learned from, keep the statistics empty for good.
MIN_SAMPLES = 2


@flax.struct.dataclass
class HealthStats:
    """Running statistics of healthy steps and the controller state; float32 scalars."""

    count: jax.Array  # healthy steps folded into the statistics
    loss_mean: jax.Array
    loss_var: jax.Array
    log_grad_mean: jax.Array
    log_grad_var: jax.Array
    pid_integral: jax.Array  # controller memory of recent spikes
    pid_error: jax.Array  # last excess of the spike score over the target
    lr_scale: jax.Array  # the controller's last output, 1 when it is off

    @classmethod
    def init(cls) -> HealthStats:
        zeros = {field.name: jnp.zeros((), jnp.float32) for field in dataclasses.fields(cls)}
        return cls(**{**zeros, "lr_scale": jnp.ones((), jnp.float32)})  # full rate until a spike


def _ema(mean: jax.Array, var: jax.Array, x: jax.Array, decay: jax.Array):
    """Exponentially weighted mean and variance (West's incremental form)."""
    delta = x - mean
    new_mean = mean + (1.0 - decay) * delta
    new_var = decay * (var + (1.0 - decay) * delta * delta)
    return new_mean, new_var


def _zscore(x: jax.Array, mean: jax.Array, var: jax.Array, floor: jax.Array) -> jax.Array:
    return (x - mean) / jnp.maximum(jnp.sqrt(var), floor)


def assess(
    stats: HealthStats, loss: jax.Array, grad_norm: jax.Array, cfg: Any
) -> tuple[jax.Array, HealthStats, dict[str, jax.Array]]:
    """Verdict on one step. `cfg` is `config.health` (read at trace time, so it is static).

    Returns `(ok, new_stats, flags)`: `ok` a bool scalar (apply this step's update?), the updated
    statistics, and float32 scalars for the step metrics: `nonfinite`, `loss_spike`, `grad_spike`,
    `skipped` (0/1), `loss_z`, `grad_z` (0 where undefined) and `lr_scale` (multiply the updates by
    it, see `scale_updates`; 1 unless `cfg.pid_enabled`).
    """
    loss = jnp.asarray(loss, jnp.float32)
    grad_norm = jnp.asarray(grad_norm, jnp.float32)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    log_grad = jnp.log(jnp.maximum(grad_norm, _TINY))

    loss_z, grad_z = _zscores(stats, loss, log_grad, finite)
    warm = stats.count >= max(cfg.warmup_steps, MIN_SAMPLES)
    loss_spike = warm & finite & (loss_z > cfg.zscore)
    grad_spike = warm & finite & (grad_z > cfg.zscore)
    anomaly = ~finite | loss_spike | grad_spike
    ok = ~anomaly if cfg.enabled else jnp.asarray(True)

    # Early on the average is exact (decay count/(count+1)), then it forgets at ema_decay.
    learn = ok & finite
    decay = jnp.minimum(jnp.float32(cfg.ema_decay), stats.count / (stats.count + 1.0))
    loss_mean, loss_var = _ema(stats.loss_mean, stats.loss_var, loss, decay)
    grad_mean, grad_var = _ema(stats.log_grad_mean, stats.log_grad_var, log_grad, decay)

    lr_scale, integral, error = _controller(stats, finite, warm, loss_z, grad_z, cfg)

    new_stats = HealthStats(
        count=stats.count + learn.astype(jnp.float32),
        loss_mean=jnp.where(learn, loss_mean, stats.loss_mean),
        loss_var=jnp.where(learn, loss_var, stats.loss_var),
        log_grad_mean=jnp.where(learn, grad_mean, stats.log_grad_mean),
        log_grad_var=jnp.where(learn, grad_var, stats.log_grad_var),
        pid_integral=integral,
        pid_error=error,
        lr_scale=lr_scale,
    )
    flags = {
        "nonfinite": (~finite).astype(jnp.float32),
        "loss_spike": loss_spike.astype(jnp.float32),
        "grad_spike": grad_spike.astype(jnp.float32),
        "skipped": (~ok).astype(jnp.float32),
        "loss_z": loss_z,
        "grad_z": grad_z,
        "lr_scale": lr_scale,
    }
    return ok, new_stats, flags


def _zscores(
    stats: HealthStats, loss: jax.Array, log_grad: jax.Array, finite: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The z-scores of the loss and the log gradient norm against the running statistics, 0 on a
    non-finite step."""
    loss_floor = jnp.maximum(LOSS_STD_FLOOR_REL * jnp.abs(stats.loss_mean), 1e-6)
    loss_z = jnp.where(finite, _zscore(loss, stats.loss_mean, stats.loss_var, loss_floor), 0.0)
    grad_z = jnp.where(
        finite,
        _zscore(log_grad, stats.log_grad_mean, stats.log_grad_var, jnp.float32(LOG_GRAD_STD_FLOOR)),
        0.0,
    )
    return loss_z, grad_z


def _controller(
    stats: HealthStats,
    finite: jax.Array,
    warm: jax.Array,
    loss_z: jax.Array,
    grad_z: jax.Array,
    cfg: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The learning-rate scale, integral and error after this step: the PID controller's when
    `cfg.pid_enabled`, else full rate and the controller state as it was."""
    if not cfg.pid_enabled:
        return jnp.float32(1.0), stats.pid_integral, stats.pid_error
    # A non-finite step is the worst spike there is: full error.
    score = jnp.where(finite, jnp.maximum(loss_z, grad_z), cfg.pid_target_z + pid.ERROR_MAX)
    return pid.pid_scale(
        stats.pid_integral,
        stats.pid_error,
        score,
        warm,
        target=cfg.pid_target_z,
        kp=cfg.pid_kp,
        ki=cfg.pid_ki,
        kd=cfg.pid_kd,
        min_scale=cfg.pid_min_scale,
    )


def where_ok(ok: jax.Array, new: Any, old: Any) -> Any:
    """`new` where the step is healthy, else `old`, leaf by leaf (params, optimizer state...)."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def scale_updates(updates: Any, lr_scale: jax.Array) -> Any:
    """Optimizer updates times the controller's scale, keeping each update's dtype."""
    return jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
