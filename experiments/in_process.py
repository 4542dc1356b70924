"""What the one-process training experiments share (`galore.py`, `moe_balance.py`,
`moe_vs_dense.py`): the config made quiet for a script that drives the train step itself, the
mixture-of-experts variant of a model, and the step function, state and loader of a config on the
JAX devices present.

Scripts import it as `in_process` (an experiment runs as `python experiments/<name>.py`, which
puts this folder on the path).
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple

import ml_collections

# The scripts that import this module then find resilient_jax in this checkout.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Session(NamedTuple):
    """A config prepared on the devices present, ready to step."""

    ctx: Any  # resilient_jax.run.RunContext: the mesh, plan and workdir
    step_fn: Any  # (state, batch, lr_scale) -> (state, metrics)
    state: Any  # the freshly initialised train state
    loader: Any  # resilient_jax.data.BatchLoader over the config's data


def quiet(config: ml_collections.ConfigDict, steps: int, checkpoint_every: int = 0) -> None:
    """Sets `config` up for `steps` steps that a script runs itself: no progress bar, TensorBoard
    or eval, no local tier, a persistent save every `checkpoint_every` steps (0: none)."""
    config.total_steps = steps
    config.log.progress_bar = False
    config.log.tensorboard = False
    config.checkpoint.local_dir = ""
    config.checkpoint.every_steps = checkpoint_every
    config.eval.every_steps = 0


def with_experts(config: ml_collections.ConfigDict, experts: int) -> ml_collections.ConfigDict:
    """A copy of `config` whose model has every MLP a mixture of `experts` experts of width
    `d_ff / 2` with top-2 routing, so that each token's expert FLOPs equal the dense MLP's."""
    moe = config.copy_and_resolve_references()
    moe.model.moe.num_experts = experts
    moe.model.moe.top_k = 2
    moe.model.moe.d_ff = config.model.d_ff // 2
    return moe


def session(config: ml_collections.ConfigDict, workdir: str) -> Session:
    """`config` prepared in `workdir` on the devices present: its jitted train step, a freshly
    initialised state and a loader of its data from the first batch."""
    from resilient_jax.data import BatchLoader, make_source
    from resilient_jax.events import EventLog
    from resilient_jax.run import prepare
    from resilient_jax.train.state import init_state
    from resilient_jax.train.step import make_train_step

    ctx = prepare(config, workdir, EventLog(workdir))
    loader = BatchLoader(config, ctx.mesh, ctx.plan, make_source(config))
    return Session(ctx, make_train_step(config, ctx.mesh), init_state(config, ctx.mesh), loader)
