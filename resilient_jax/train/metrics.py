"""Training metrics: `metrics.jsonl`, TensorBoard event files, a progress bar (tqdm), MFU.

Throughput is measured between consecutive metric arrivals on the host, which in steady state is
the step time (the loop dispatches step s+1 before it pulls step s's metrics). An evaluation after
step s (`train.eval`) lands in step s's row, which is then always written; its time is taken out
of that row's step time, while the `step` event keeps the whole host interval (goodput accounting
gives the evaluation's part of it to the evaluation).

A mixture of experts' step reports each expert's load (`moe_expert_load`, [layer, expert],
relative to uniform). One step's loads are noisy, so a row carries them averaged over the steps
since the previous row (up to `log.every_steps`), and `moe_load_min`/`moe_load_max`, the idlest
and the busiest expert of any layer over that window.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from tqdm import tqdm

from resilient_jax.contracts.event_types import EventType
from resilient_jax.events import strict_json
from resilient_jax.model import ModelConfig
from resilient_jax.model.moe import expert_load_extremes
from resilient_jax.train.hooks import Hook, StepInfo

if TYPE_CHECKING:
    from resilient_jax.train.context import RunContext
    from resilient_jax.train.state import TrainState

METRICS_FILE = "metrics.jsonl"

# Dense bf16 peak FLOP/s per device, for the MFU estimate when the config gives none.
PEAK_FLOPS = {
    "h200": 989e12,
    "h100": 989e12,
    "a100": 312e12,
    "tpu v6": 918e12,
    "tpu v5p": 459e12,
    "tpu v5": 197e12,  # v5e ("TPU v5 lite")
    "tpu v4": 275e12,
}


def peak_flops_per_device(configured: float) -> float:
    if configured > 0:
        return configured
    kind = jax.devices()[0].device_kind.lower()
    return next((flops for name, flops in PEAK_FLOPS.items() if name in kind), 0.0)


class MetricsLogger(Hook):
    """Writes metrics on process 0; every process still times steps for the event log."""

    def __init__(self, ctx: RunContext) -> None:
        config = ctx.config
        self._every = config.log.every_steps
        self._total = config.total_steps
        self._tokens_per_step = config.global_batch_size * config.data.seq_len
        model = ModelConfig.from_config(config.model)
        self._flops_per_step = model.flops_per_token(config.data.seq_len) * self._tokens_per_step
        self._peak = peak_flops_per_device(config.log.peak_flops_per_device) * len(
            ctx.topology.devices
        )
        self._writes = jax.process_index() == 0
        self._progress = self._writes and config.log.progress_bar
        self._bar: tqdm | None = None  # opened at the first metrics: a restored run starts later
        self._jsonl = None
        if self._writes:
            self._jsonl = open(os.path.join(ctx.workdir, METRICS_FILE), "a")  # noqa: SIM115
        self._tb = None
        if self._writes and config.log.tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(ctx.workdir, "tensorboard"))
        self._last_time: float | None = None
        self._evals: dict[int, tuple[dict[str, float], float]] = {}  # step -> (values, seconds)
        self._last_eval_loss: float | None = None  # shown on the progress line
        self.last: dict[str, Any] = {}
        self._expert_loads: list[list] = []  # each step's `moe_expert_load` since the last row

    def record_eval(self, step: int, values: dict[str, float], duration_s: float) -> None:
        """An evaluation of the state after `step`: `values` join that step's row."""
        self._evals[step] = (values, duration_s)

    def on_metrics(self, ctx: RunContext, step: int, metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        interval = now - self._last_time if self._last_time is not None else float("nan")
        self._last_time = now
        evaluation, eval_s = self._evals.pop(step, ({}, 0.0))
        step_time = interval - eval_s
        row: dict[str, Any] = {"step": step, **metrics, "step_time_s": step_time, **evaluation}
        if "moe_expert_load" in metrics:
            self._expert_loads.append(metrics["moe_expert_load"])
            row["moe_load_min"], row["moe_load_max"] = expert_load_extremes(self._expert_loads)
        if step_time == step_time:  # not NaN: from the second step on
            row["tokens_per_s"] = self._tokens_per_step / step_time
            if self._peak:
                row["mfu"] = self._flops_per_step / step_time / self._peak
        ctx.events.emit(
            EventType.STEP,
            step=step,
            duration_s=interval,
            data_wait_s=metrics.get("data_wait_s"),
            loss=metrics.get("loss"),
        )
        self.last = row
        if evaluation:
            self._last_eval_loss = evaluation["eval_loss"]
        if step % self._every == 0 or step == self._total or evaluation:
            if self._expert_loads:
                row["moe_expert_load"] = [
                    [round(load, 4) for load in layer]
                    for layer in np.mean(np.asarray(self._expert_loads), axis=0).tolist()
                ]
                self._expert_loads = []
            self._write(row)
        if self._progress:
            self._show(row)

    def _write(self, row: dict[str, Any]) -> None:
        if self._jsonl:
            self._jsonl.write(strict_json(row) + "\n")
            self._jsonl.flush()
        if self._tb:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and value == value:
                    self._tb.add_scalar(key, value, row["step"])
            self._tb.flush()

    def _show(self, row: dict[str, Any]) -> None:
        if self._bar is None:
            # disable=None: tqdm draws only when stdout is a terminal, never into a log file.
            self._bar = tqdm(
                total=self._total,
                initial=row["step"] - 1,
                unit="step",
                file=sys.stdout,
                disable=None,
                dynamic_ncols=True,
            )
        postfix = f"loss {row['loss']:.4f}"
        if self._last_eval_loss is not None:
            postfix += f" eval_loss {self._last_eval_loss:.4f}"
        if "tokens_per_s" in row:
            postfix += f" {row['tokens_per_s']:,.0f} tok/s"
        self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.update(row["step"] - self._bar.n)  # negative after a rollback

    def on_end(self, ctx: RunContext, state: TrainState, info: StepInfo | None) -> None:
        # The final step's row is already written: `on_metrics` writes step == total_steps.
        self._close_bar()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        self._close_bar()
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
