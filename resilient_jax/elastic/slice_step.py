"""The two compiled halves of an elastic step, and the train state as one host buffer.

`gradient_sums` runs on one part of the global batch (the rows of one of `elastic.slices` parts,
scanned in microbatches) and returns its gradient sums, its token-loss sum and, for a mixture of
experts, the router's sums (the loss without the router's terms, the load-balance and z sums, the
dropped assignments, each expert's load) as one flat float32 vector `[vector_width]` on the host's
side of the exchange. Every entry is a sum over the part's tokens, so the sum of every part's
vector is the global batch's. `apply` takes that sum and makes the update and the metrics the
single-runtime step makes (`train.step.make_update`: in-band health, optimizer, a bad step leaves
the state as it was; `train.step.make_router_metrics`). Both are compiled once per slice shape:
a lost or returning slice changes how many parts a slice computes, never a shape. They go through
the per-process executable cache (`resilient_jax.executables`, keyed like the train step), so a
replacement slice loads what the slice it replaces compiled instead of compiling it again.

`apply` donates its state; its non-donating twin (`keeping_apply`, "elastic_apply_keep" in the
cache) runs on a state a save keeps (`train.keep`), so an elastic save copies nothing either.

With a sync interval (`elastic.sync_every_steps` > 1) the slices exchange, every H steps, the
delta of their parameters from the outer ones (`delta`), and `outer` makes the outer step. `outer`
needs no twin: it takes the state the round's last inner step (an `apply`) made in the same call,
never the one the loop holds.

`state_bytes` / `state_from_bytes` turn the state into one uint8 buffer and back, for a joining
slice to heal from a live one (device to host, the exchange's broadcast, host to device): this
process's pieces of it, so that in slices of several processes each heals its counterpart. Host
arrays go into the programs through `global_array` (each process puts its own devices' pieces).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from resilient_jax import mesh as mesh_lib
from resilient_jax.train.compile import background_program, load_or_compile_program
from resilient_jax.train.context import RunContext
from resilient_jax.train.deferred import DeferredProgram
from resilient_jax.train.outer import nesterov_step
from resilient_jax.train.shard_list import list_shards
from resilient_jax.train.state import TrainState
from resilient_jax.train.step import (
    Metrics,
    make_gradient_sums,
    make_router_metrics,
    make_update,
    router_zeros,
)

APPLY_KEEP_PROGRAM = "elastic_apply_keep"  # `apply` without donation, in the executable cache


def part_rows(ctx: RunContext) -> int:
    """Rows of one part of the global batch."""
    return ctx.config.global_batch_size // ctx.config.elastic.slices


def part_shape(ctx: RunContext) -> tuple[int, int, int]:
    """[microbatches, rows per microbatch, seq_len + 1] of one part, as this slice computes it."""
    microbatches = ctx.plan.microbatches
    return (microbatches, part_rows(ctx) // microbatches, ctx.config.data.seq_len + 1)


def vector_width(ctx: RunContext) -> int:
    """Entries of a part's vector: the gradient sums, the loss sum, the router's sums (if any)."""
    router = router_zeros(ctx.config)
    router_size = ravel_pytree(router)[0].size if router is not None else 0
    return num_params(ctx) + 1 + router_size


def compile_gradient_sums(ctx: RunContext) -> tuple[object, bool]:
    """(params, part batch) -> flat [vector_width] float32: gradient sums, the loss sum, then the
    router's sums (a mixture of experts). Returns (compiled, loaded from the cache)."""
    gradient_sums = make_gradient_sums(ctx.config)
    mesh = ctx.mesh

    def fn(params, batch):
        with (
            jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
            nn.logical_axis_rules(mesh_lib.LOGICAL_AXIS_RULES),
        ):
            loss_sum, grad_sum, router = gradient_sums(params, batch)
        parts = [ravel_pytree(grad_sum)[0], loss_sum[None]]
        if router is not None:
            parts.append(ravel_pytree(router)[0])
        return jnp.concatenate([p.astype(jnp.float32) for p in parts])

    batch = jax.ShapeDtypeStruct(part_shape(ctx), jnp.int32, sharding=mesh_lib.batch_sharding(mesh))
    params = ctx.abstract_state.params
    shardings = jax.tree.map(lambda a: a.sharding, params)
    jitted = jax.jit(
        fn,
        in_shardings=(shardings, mesh_lib.batch_sharding(mesh)),
        out_shardings=mesh_lib.replicated(mesh),
    )
    return load_or_compile_program(
        ctx, "elastic_gradient_sums", lambda: jitted.lower(params, batch)
    )


def num_params(ctx: RunContext) -> int:
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(ctx.abstract_state.params))


def compile_apply(ctx: RunContext) -> tuple[object, bool]:
    """(state, summed [vector_width]) -> (state, metrics): the update from every part's sums,
    and the single-runtime step's metrics (the router's too). Returns (compiled, loaded from the
    cache)."""
    return load_or_compile_program(ctx, "elastic_apply", apply_lowering(ctx))


def keeping_apply(ctx: RunContext) -> DeferredProgram:
    """`apply` compiled without donating its state (`train.keep`: the update after a save, which
    leaves the saved state valid), loaded or compiled in the background once started."""
    return background_program(ctx, APPLY_KEEP_PROGRAM, apply_lowering(ctx, donate=False))


def apply_lowering(ctx: RunContext, donate: bool = True) -> Callable[[], jax.stages.Lowered]:
    """Traces and lowers `apply` when called (only on an executable cache miss); `donate=False`:
    its non-donating twin, bitwise the same results in fresh buffers."""
    config = ctx.config
    update, router_metrics = make_update(config), make_router_metrics(config)
    num_tokens = config.global_batch_size * config.data.seq_len
    n = num_params(ctx)
    zeros = router_zeros(config)

    def fn(state: TrainState, summed: jax.Array) -> tuple[TrainState, Metrics]:
        _, unravel = ravel_pytree(state.params)
        grads = unravel(summed[:n] / num_tokens)
        router = None
        if zeros is not None:
            router = ravel_pytree(zeros)[1](summed[n + 1 :])
        state, metrics = update(state, summed[n] / num_tokens, grads, jnp.float32(1.0))
        return state, {**metrics, **router_metrics(router, num_tokens)}

    def lower() -> jax.stages.Lowered:
        shardings = jax.tree.map(lambda a: a.sharding, ctx.abstract_state)
        replicated = mesh_lib.replicated(ctx.mesh)
        summed = jax.ShapeDtypeStruct((vector_width(ctx),), jnp.float32, sharding=replicated)
        jitted = jax.jit(
            fn,
            in_shardings=(shardings, replicated),
            out_shardings=(shardings, replicated),
            donate_argnums=0 if donate else (),
        )
        return jitted.lower(ctx.abstract_state, summed)

    return lower


def _local_pieces(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> list[tuple]:
    """The distinct indices of an array's pieces that this process holds, in a fixed order (the
    same on every slice of the same shape: process p of one slice holds the pieces process p of
    another holds)."""
    held = sharding.addressable_devices_indices_map(shape).values()
    indices = {_index_key(i, shape): i for i in held}
    return [indices[k] for k in sorted(indices)]


def _index_key(index: tuple, shape: tuple[int, ...]) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def state_bytes(state: TrainState) -> np.ndarray:
    """Every leaf of the state, in tree order, as one uint8 buffer (pulls the state to the host):
    of each leaf, one copy of each distinct piece this process holds, in `_local_pieces` order.
    A slice of one process holds every piece; in a slice of several, process p of one slice
    heals process p of another (the same slice shape: the same pieces)."""
    parts = []
    for a in jax.tree.leaves(list_shards(state)):  # a kept state's writers may be reading it
        shards = {_index_key(s.index, a.shape): s for s in a.addressable_shards}
        for key in sorted(shards):
            parts.append(np.ascontiguousarray(shards[key].data).reshape(-1).view(np.uint8))
    return np.concatenate(parts)


def _pieces(a: jax.ShapeDtypeStruct) -> list[tuple[tuple, tuple[int, ...], int]]:
    """(index key, shape, bytes) of each piece of a leaf in `state_bytes`."""
    itemsize = np.dtype(a.dtype).itemsize
    out = []
    for index in _local_pieces(a.sharding, a.shape):
        key = _index_key(index, a.shape)
        shape = tuple(stop - start for start, stop in key)
        out.append((key, shape, int(np.prod(shape)) * itemsize))
    return out


def state_nbytes(ctx: RunContext) -> int:
    return sum(n for a in jax.tree.leaves(ctx.abstract_state) for _, _, n in _pieces(a))


def state_from_bytes(ctx: RunContext, buffer: np.ndarray) -> TrainState:
    """The state `state_bytes` made, on this slice's mesh with the run's shardings (each device
    gets the piece of its index)."""
    leaves, tree = jax.tree.flatten(ctx.abstract_state)
    arrays, offset = [], 0
    for a in leaves:
        pieces = {}
        for key, shape, size in _pieces(a):
            pieces[key] = buffer[offset : offset + size].view(a.dtype).reshape(shape)
            offset += size
        arrays.append(
            jax.make_array_from_callback(
                a.shape, a.sharding, lambda i, a=a, p=pieces: p[_index_key(i, a.shape)]
            )
        )
    return jax.tree.unflatten(tree, arrays)


def global_array(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array every process of the slice holds alike, as a program's input: each process
    puts only its own devices' pieces (a slice may span several processes)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def replicated_input(ctx: RunContext, host: np.ndarray) -> jax.Array:
    """A host vector (the exchanged sums, a mean delta) replicated over this slice's mesh."""
    return global_array(host, mesh_lib.replicated(ctx.mesh))


def compile_delta(ctx: RunContext) -> tuple[object, bool]:
    """state -> flat float32 [num_params]: the outer parameters minus this slice's inner ones
    (the sync interval's "outer gradient"; `train.outer`). Returns (compiled, loaded from the
    cache)."""

    def fn(state: TrainState) -> jax.Array:
        delta = jax.tree.map(
            lambda outer, inner: outer.astype(jnp.float32) - inner.astype(jnp.float32),
            state.opt_state.params,
            state.params,
        )
        return ravel_pytree(delta)[0]

    shardings = jax.tree.map(lambda a: a.sharding, ctx.abstract_state)
    jitted = jax.jit(fn, in_shardings=(shardings,), out_shardings=mesh_lib.replicated(ctx.mesh))
    return load_or_compile_program(ctx, "elastic_delta", lambda: jitted.lower(ctx.abstract_state))


def compile_outer(ctx: RunContext) -> tuple[object, bool]:
    """(state, mean delta [num_params]) -> state: the outer step (Nesterov SGD), and the inner
    parameters restarted from the new outer ones. Returns (compiled, loaded from the cache)."""
    e = ctx.config.elastic
    learning_rate, beta = float(e.outer_learning_rate), float(e.outer_momentum)

    def fn(state: TrainState, mean_delta: jax.Array) -> TrainState:
        o = state.opt_state
        _, unravel = ravel_pytree(o.params)
        outer, momentum = nesterov_step(
            o.params, o.momentum, unravel(mean_delta), learning_rate, beta
        )
        return state.replace(params=outer, opt_state=o._replace(params=outer, momentum=momentum))

    shardings = jax.tree.map(lambda a: a.sharding, ctx.abstract_state)
    replicated = mesh_lib.replicated(ctx.mesh)
    mean = jax.ShapeDtypeStruct((num_params(ctx),), jnp.float32, sharding=replicated)
    jitted = jax.jit(
        fn, in_shardings=(shardings, replicated), out_shardings=shardings, donate_argnums=0
    )
    return load_or_compile_program(
        ctx, "elastic_outer", lambda: jitted.lower(ctx.abstract_state, mean)
    )


def host_copy(state: TrainState) -> np.ndarray:
    """The state on the host, in a buffer of its own (the device's may be donated later): this
    process's pieces, as `state_bytes`."""
    return state_bytes(state)


def to_device(ctx: RunContext, host: np.ndarray) -> TrainState:
    """A `host_copy` back on this slice's mesh with the run's shardings."""
    return state_from_bytes(ctx, host)
