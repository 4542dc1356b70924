"""Step time of the framework's loop against a bare `jax.jit` loop of the same model and batch.

    python experiments/bench_step.py [--config=configs/tiny_cpu.py] [--blocks=6] [--steps=10]

Both run in one process on the same mesh, interleaved in blocks (framework, bare, framework, ...)
so machine noise hits both alike. The framework side is the real `Loop`: the Grain loader, the
hooks (metrics to jsonl, step events) and the one-step-late metric pulls. The bare side feeds one
pre-built batch to the same jitted step and pulls nothing until the block ends. Target: ratio
<= 1.02.
On a GPU, the MFU estimate of the framework's loop is reported too. Writes
experiments/results/bench_step.json.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile

import report
from absl import app, flags
from ml_collections import config_flags
from step_timing import interleaved_blocks, model_flops_utilization

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_cpu.py", "Experiment config.")
_BLOCKS = flags.DEFINE_integer("blocks", 6, "Interleaved blocks per side.")
_STEPS = flags.DEFINE_integer("steps", 10, "Steps per block.")
_OUT = flags.DEFINE_string("out", "experiments/results/bench_step.json", "Result file.")


def main(argv: list[str]) -> None:
    del argv
    import jax

    from resilient_jax.data import BatchLoader, make_source
    from resilient_jax.events import EventLog
    from resilient_jax.run import compile_step, prepare
    from resilient_jax.train.metrics import MetricsLogger
    from resilient_jax.train.state import init_state

    config = _CONFIG.value
    config.log.progress_bar = False
    config.log.tensorboard = False
    config.log.every_steps = 1
    config.total_steps = 10**9  # the schedule's horizon; blocks stop the loop themselves
    workdir = tempfile.mkdtemp(prefix="bench_step_")
    ctx = prepare(config, workdir, EventLog(workdir))
    step_fn = compile_step(ctx)  # (state, batch, fault scale): the bare side calls it as it is
    loader = BatchLoader(config, ctx.mesh, ctx.plan, make_source(config))
    hooks = [MetricsLogger(ctx)]
    framework, bare = interleaved_blocks(
        ctx,
        step_fn,
        loader,
        hooks,
        init_state(config, ctx.mesh),
        init_state(config, ctx.mesh),
        _BLOCKS.value,
        _STEPS.value,
    )
    for hook in hooks:
        hook.close()

    tokens = config.global_batch_size * config.data.seq_len
    f_med, b_med = statistics.median(framework), statistics.median(bare)
    mfu = model_flops_utilization(ctx, f_med)
    result = {
        "config": _CONFIG.value.model.to_dict() | {"global_batch_size": config.global_batch_size},
        "device": jax.devices()[0].device_kind,
        "num_devices": jax.device_count(),
        "host": platform.node(),
        "steps_per_block": _STEPS.value,
        "framework_step_s": framework,
        "bare_step_s": bare,
        "framework_median_step_s": f_med,
        "bare_median_step_s": b_med,
        "ratio": f_med / b_med,
        "framework_tokens_per_s": tokens / f_med,
        "bare_tokens_per_s": tokens / b_med,
        "mfu": mfu,
    }
    print(f"{'':12}{'step s':>10}{'tokens/s':>12}")
    print(f"{'framework':12}{f_med:>10.4f}{tokens / f_med:>12,.0f}")
    print(f"{'bare jit':12}{b_med:>10.4f}{tokens / b_med:>12,.0f}")
    print(f"ratio framework/bare = {f_med / b_med:.3f} (target <= 1.02) on {result['device']}")
    if mfu is not None:
        print(f"MFU estimate: {100 * mfu:.1f}%")
    report.write_json(_OUT.value, result)


if __name__ == "__main__":
    app.run(main)
