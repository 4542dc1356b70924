"""Held-out evaluation: the loss of the current parameters on the validation split.

Every `eval.every_steps` training steps, and after the last step, `eval.steps` global batches of the
validation split (`data.split.holdout`), and of each `eval.datasets` entry's held-out part, go
through a jitted loss-only step (no gradients, no
update) on the training mesh. Evaluation `k` of a run reads batches `0 .. eval.steps - 1` of the
split's seeded shuffle every time, so its examples are a pure function of (dataset, seed, global
batch) and the eval loss of step s is the same whether or not the run was restarted in between
(bitwise on the same mesh). Nothing about evaluation needs saving in a checkpoint.

The loss-only step may come as a `DeferredProgram`: its compile (or load from the executable cache)
then starts once the first train step of the process has completed, in a thread, off the path to
that step. An evaluation pauses training: it waits for the step it evaluates, then runs. Its
time is an `eval` event (`duration_s`), which goodput accounts as evaluation; its loss and
perplexity reach `metrics.jsonl`, TensorBoard and the progress line through the `MetricsLogger`,
in the row of the step evaluated.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh

from resilient_jax import mesh as mesh_lib
from resilient_jax.contracts.event_types import EventType
from resilient_jax.data import BatchLoader
from resilient_jax.data.position import DataPosition
from resilient_jax.train.deferred import DeferredProgram
from resilient_jax.train.hooks import Hook, StepInfo
from resilient_jax.train.state import make_model, state_shardings
from resilient_jax.train.step import make_documents, token_loss_sum

if TYPE_CHECKING:
    from resilient_jax.train.context import RunContext
    from resilient_jax.train.metrics import MetricsLogger
    from resilient_jax.train.state import TrainState

# The jitted (or compiled) loss-only step: (params, batch) -> mean token loss of the batch.
EvalStepFn = Callable[[Any, jax.Array], jax.Array]


def make_eval_step(config: ml_collections.ConfigDict, mesh: Mesh) -> EvalStepFn:
    """The loss-only step, jitted with the parameters' and the batch's shardings fixed. The batch
    has the training layout `[microbatches, rows, seq_len + 1]`; scanning over microbatches keeps
    the activations' memory that of a training step's forward pass."""
    model, documents = make_model(config), make_documents(config)  # as the train step has them

    def eval_loss(params: Any, batch_MBL: jax.Array) -> jax.Array:
        def microbatch(total: jax.Array, tokens_BL: jax.Array) -> tuple[jax.Array, None]:
            inputs_BL = tokens_BL[:, :-1]
            logits = model.apply({"params": params}, inputs_BL, documents=documents(inputs_BL))
            return total + token_loss_sum(logits, tokens_BL[:, 1:]), None

        # As in the train step: the mesh and the rules make the activation constraints real.
        with (
            jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
            nn.logical_axis_rules(mesh_lib.LOGICAL_AXIS_RULES),
        ):
            loss_sum, _ = jax.lax.scan(microbatch, jnp.zeros((), jnp.float32), batch_MBL)
        num_tokens = batch_MBL.shape[0] * batch_MBL.shape[1] * (batch_MBL.shape[2] - 1)
        return loss_sum / num_tokens

    return jax.jit(
        eval_loss,
        in_shardings=(state_shardings(config, mesh).params, mesh_lib.batch_sharding(mesh)),
        out_shardings=mesh_lib.replicated(mesh),
    )


def due(config: ml_collections.ConfigDict, step: int) -> bool:
    """Whether training step `step` is followed by an evaluation."""
    every = config.eval.every_steps
    return every > 0 and (step % every == 0 or step == config.total_steps)


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709


class Evaluator(Hook):
    """Evaluates the state after each step that `due` names, on every process (the loss-only step
    is a collective); process 0's `MetricsLogger` writes the result."""

    def __init__(
        self,
        ctx: RunContext,
        held_out: Any,
        eval_step: EvalStepFn | DeferredProgram,
        metrics: MetricsLogger,
        datasets: dict[str, Any] | None = None,
    ) -> None:
        """`held_out`: the training data's validation split (`eval_loss`); `datasets`: more
        held-out sources by name (`eval_loss/NAME`)."""
        self._batches = ctx.config.eval.steps
        self._eval_step = eval_step
        self._metrics = metrics
        # Each positioned at its split's first batch, so the first evaluation's batches are
        # loaded while training runs; after each evaluation it goes back there.
        sets = {"eval_loss": held_out}
        sets.update({f"eval_loss/{name}": source for name, source in (datasets or {}).items()})
        self._loaders = {
            key: BatchLoader(ctx.config, ctx.mesh, ctx.plan, source) for key, source in sets.items()
        }

    def on_metrics(self, ctx: RunContext, step: int, metrics: dict[str, float]) -> None:
        # The first train step has completed: a deferred eval step may compile now.
        if isinstance(self._eval_step, DeferredProgram):
            self._eval_step.start()

    def after_step(self, ctx: RunContext, state: TrainState, info: StepInfo) -> None:
        if not due(ctx.config, info.step):
            return
        jax.block_until_ready(state.params)  # the evaluation's time starts after the step's
        if isinstance(self._eval_step, DeferredProgram):
            self._eval_step.wait()  # rarely waits: it had the steps since the first to compile
        start = time.perf_counter()
        values = {}
        for key, loader in self._loaders.items():
            batches = (loader.next()[1] for _ in range(self._batches))
            losses = [self._eval_step(state.params, batch) for batch in batches]
            # Every batch has the same number of tokens: the mean of the means is the token mean.
            values[key] = sum(float(x) for x in jax.device_get(losses)) / self._batches
            loader.seek(DataPosition())
        duration_s = time.perf_counter() - start
        values["eval_perplexity"] = perplexity(values["eval_loss"])
        ctx.events.emit(
            EventType.EVAL,
            step=info.step,
            duration_s=duration_s,
            batches=self._batches,
            **values,
        )
        self._metrics.record_eval(info.step, values, duration_s)

    def close(self) -> None:
        for loader in self._loaders.values():
            loader.close()
