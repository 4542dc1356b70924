"""Training state and its sharded initialisation.

`init_state` never materialises the unsharded model on a host: `jax.eval_shape` gives the state's
shapes and logical axes, the mesh rules turn those into shardings, and `jax.jit(init,
out_shardings=...)` creates every array directly in its shards.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from resilient_jax import executables
from resilient_jax import mesh as mesh_lib
from resilient_jax.model import ModelConfig, Transformer
from resilient_jax.model import layers as layers_lib
from resilient_jax.train.galore import galore, path_key
from resilient_jax.train.in_band import HealthStats
from resilient_jax.train.outer import with_outer_state


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps applied
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32[2] raw key data: a plain array any checkpoint reader can load
    health: HealthStats  # running loss / grad-norm statistics of the in-band anomaly detector


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
    o = config.optimizer
    warmup = min(o.warmup_steps, max(config.total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(config.total_steps, warmup + 1),
        end_value=o.learning_rate * o.min_lr_ratio,
    )


def _decay_mask(params: Any) -> Any:
    """Decay on matrices, none on norms (a stacked layer's norm is [layers, d_model])."""

    def matrix(path: tuple[Any, ...], p: Any) -> bool:
        return p.ndim - _is_stacked_layer(path_key(path)) > 1

    return jax.tree_util.tree_map_with_path(matrix, params)


def _is_stacked_layer(path: str) -> bool:
    return path.split("__", 1)[0] in (layers_lib.STACK, layers_lib.TAIL)


def _is_expert_weight(path: str) -> bool:
    return "__moe__" in path and path.rsplit("__", 1)[-1] in ("w_gate", "w_up", "w_down")


def _keeps_full_adam(path: str) -> bool:
    """Embedding gradients touch only the rows of the tokens seen: a low-rank basis of one
    batch's rows fits the next batch poorly, so the embeddings keep full Adam (as in the GaLore
    paper, which projects attention and MLP weights only); so does a router, [d_model, experts]
    with experts far below any useful rank."""
    return path in ("embed", "unembed") or path.endswith("__router")


def _galore_adamw(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """AdamW's three stages with Adam's moments inside GaLore's projection; decay and learning
    rate act on the full update, as in plain AdamW."""
    o, g = config.optimizer, config.optimizer.galore
    d_model = config.model.d_model

    def matrix_split(shape: tuple[int, ...]) -> int:
        # The matrix the model multiplies by: [d_model, heads*head_dim] for wq/wk/wv,
        # [heads*head_dim, d_model] for wo (d_model last).
        return len(shape) - 1 if len(shape) > 2 and shape[-1] == d_model else 1

    return optax.chain(
        galore(
            optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
            rank=g.rank,
            update_interval=g.update_interval,
            scale=g.scale,
            min_size=g.min_size,
            rotate_state=g.rotate_state,
            matrix_split=matrix_split,
            # Stacked layers [layers, ...] and a mixture of experts' [experts, d_model, d_ff]
            # weights: one matrix per layer and per expert, each with its own projection.
            batch_dims=lambda path: _is_stacked_layer(path) + _is_expert_weight(path),
            exclude=_keeps_full_adam,
        ),
        optax.add_decayed_weights(o.weight_decay, _decay_mask),
        optax.scale_by_learning_rate(learning_rate_schedule(config)),
    )


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    o = config.optimizer
    if o.galore.rank > 0:
        adamw = _galore_adamw(config)
    else:
        adamw = optax.adamw(
            learning_rate_schedule(config),
            b1=o.b1,
            b2=o.b2,
            eps=o.eps,
            weight_decay=o.weight_decay,
            mask=_decay_mask,
        )
    if o.grad_clip_norm > 0:
        adamw = optax.chain(optax.clip_by_global_norm(o.grad_clip_norm), adamw)
    if config.elastic.enabled and config.elastic.sync_every_steps > 1:
        return with_outer_state(adamw)  # the inner optimizer; the outer state rides beside it
    return adamw


def make_model(config: ml_collections.ConfigDict) -> Transformer:
    return Transformer(ModelConfig.from_config(config.model))


def _init_fn(config: ml_collections.ConfigDict):
    model, optimizer = make_model(config), make_optimizer(config)

    def init() -> TrainState:
        key = jax.random.key(config.seed)
        params_key, state_key = jax.random.split(key)
        tokens = jnp.zeros((1, config.data.seq_len), jnp.int32)
        params = model.init(params_key, tokens)["params"]
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            rng=jax.random.key_data(state_key),
            health=HealthStats.init(),
        )

    return init


def logical_state(config: ml_collections.ConfigDict) -> tuple[TrainState, TrainState]:
    """The state's shapes and dtypes (`jax.ShapeDtypeStruct`s) and each leaf's logical axes (a
    `PartitionSpec` of model axis names), from `jax.eval_shape`: nothing is allocated."""
    boxed = jax.eval_shape(_init_fn(config))
    return nn.unbox(boxed), nn.get_partition_spec(boxed)


def state_shardings(config: ml_collections.ConfigDict, mesh: Mesh) -> TrainState:
    """NamedSharding for every leaf of the state, from the parameters' logical axes."""
    _, logical = logical_state(config)
    return mesh_lib.logical_sharding(logical, mesh)


def abstract_state(config: ml_collections.ConfigDict, mesh: Mesh) -> TrainState:
    """Shapes, dtypes and shardings of the state: the target a checkpoint restores onto."""
    abstract, logical = logical_state(config)
    shardings = mesh_lib.logical_sharding(logical, mesh)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


# The init programs of the last few (config, mesh) pairs: a process that makes a fresh state
# again (calibration's probes, a rollback before anything was saved) reuses the compiled program
# instead of loading or compiling it again. Across processes the executable cache holds it.
_INIT_PROGRAMS: collections.OrderedDict[tuple[str, Mesh], Callable[[], TrainState]] = (
    collections.OrderedDict()
)
_INIT_PROGRAMS_KEPT = 4


def init_state(config: ml_collections.ConfigDict, mesh: Mesh) -> TrainState:
    """A fresh state from `config.seed`, created shard by shard on the mesh."""
    key = (config.to_json(sort_keys=True), mesh)
    program = _INIT_PROGRAMS.pop(key, None)
    with jax.set_mesh(mesh):
        if program is None:
            program = _load_or_compile_init(config, mesh)
        _INIT_PROGRAMS[key] = program  # the newest last
        while len(_INIT_PROGRAMS) > _INIT_PROGRAMS_KEPT:
            _INIT_PROGRAMS.popitem(last=False)
        return program()


def _load_or_compile_init(
    config: ml_collections.ConfigDict, mesh: Mesh
) -> Callable[[], TrainState]:
    """The init program from the executable cache, or compiled and stored there: a worker has
    JAX's own cache off, and compiling init took 1.7 of a small run's 5.6 CPU-seconds on CPU."""
    init = _init_fn(config)
    jitted = jax.jit(lambda: nn.unbox(init()), out_shardings=state_shardings(config, mesh))
    lowered = jitted.lower()  # a fraction of the compile; the key is the program itself
    key = executables.lowered_key("init", lowered, mesh.devices.flat)
    compiled, _ = executables.load_or_compile(
        key, lambda: lowered, mesh.devices.flat, executables.default_dir()
    )
    return compiled
