"""Training metrics: `metrics.jsonl`, TensorBoard event files, a console progress line, MFU.

Throughput is measured between consecutive metric arrivals on the host, which in steady state is
the step time (the loop dispatches step s+1 before it pulls step s's metrics).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import jax

from resilient_jax.model import ModelConfig
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


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60:02d}:{rem % 60:02d}"


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
        self._tty = sys.stderr.isatty()
        self._jsonl = None
        if self._writes:
            self._jsonl = open(os.path.join(ctx.workdir, METRICS_FILE), "a")  # noqa: SIM115
        self._tb = None
        if self._writes and config.log.tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(ctx.workdir, "tensorboard"))
        self._last_time: float | None = None
        self._start_time = time.time()
        self._start_step: int | None = None
        self._step_times: list[float] = []
        self.last: dict[str, Any] = {}

    def on_metrics(self, ctx: RunContext, step: int, metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        step_time = now - self._last_time if self._last_time is not None else float("nan")
        self._last_time = now
        if self._start_step is None:
            self._start_step, self._start_time = step, time.time()
        row: dict[str, Any] = {"step": step, **metrics, "step_time_s": step_time}
        if step_time == step_time:  # not NaN: from the second step on
            self._step_times.append(step_time)
            row["tokens_per_s"] = self._tokens_per_step / step_time
            if self._peak:
                row["mfu"] = self._flops_per_step / step_time / self._peak
        ctx.events.emit(
            "step",
            step=step,
            duration_s=step_time,
            data_wait_s=metrics.get("data_wait_s"),
            loss=metrics.get("loss"),
        )
        self.last = row
        if step % self._every == 0 or step == self._total:
            self._write(row)
        # On a terminal the progress line redraws every step; in a log, one line per log interval.
        if self._progress and (self._tty or step % self._every == 0 or step == self._total):
            self._show(row)

    def _write(self, row: dict[str, Any]) -> None:
        if self._jsonl:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._tb:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and value == value:
                    self._tb.add_scalar(key, value, row["step"])
            self._tb.flush()

    def _show(self, row: dict[str, Any]) -> None:
        step = row["step"]
        done = step - (self._start_step or 0)
        elapsed = time.time() - self._start_time
        rate = done / elapsed if elapsed > 0 and done > 0 else 0.0
        eta = (self._total - step) / rate if rate else 0.0
        width = 24
        filled = int(width * step / self._total)
        bar = "#" * filled + "." * (width - filled)
        extra = f" {row['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in row else ""
        start, end = ("\r", "\n" if step == self._total else "") if self._tty else ("", "\n")
        sys.stderr.write(
            f"{start}[{bar}] {step}/{self._total} loss {row['loss']:.4f}{extra} "
            f"eta {format_duration(eta)}  {end}"
        )
        sys.stderr.flush()

    def on_end(self, ctx: RunContext, state: TrainState, info: StepInfo | None) -> None:
        if self.last and self.last["step"] % self._every:
            self._write(self.last)  # the final step always lands in metrics.jsonl

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
