"""How evenly the router spreads tokens over the experts on the default data, with the default
router settings (balance and z-loss weights, capacity factor).

    python experiments/moe_balance.py [--config=configs/tiny_cpu.py] [--steps=150]
    -> experiments/results/moe_balance.json, experiments/results/moe_balance.png

One process on the JAX devices present (one CPU device by default). The model is the one of
`moe_vs_dense.py`: the config's model with every MLP a mixture of `--experts` experts of width
`d_ff / 2`, top-2 routing. Each step reports every expert's load (`moe_expert_load`: its share
of its layer's assignments before dropping, relative to uniform, 1.0). Utilisation is judged the
way `metrics.jsonl` reports it: each expert's load averaged over a window of `--window` steps
(one step's load is a sample of a few thousand assignments); the bar is every expert of every
layer within 2x of uniform (0.5 to 2.0) in every window from `--settled` on, after warmup and
the router's first settling. The script exits non-zero when the bar is missed.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile

import in_process
import report
from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_cpu.py", "Experiment config.")
_STEPS = flags.DEFINE_integer("steps", 150, "Training steps.")
_EXPERTS = flags.DEFINE_integer("experts", 8, "Experts per MoE layer.")
_WINDOW = flags.DEFINE_integer("window", 10, "Steps each expert's load is averaged over.")
_SETTLED = flags.DEFINE_integer("settled", 50, "First step the bar applies to.")
_OUT = flags.DEFINE_string("out", "experiments/results/moe_balance.json", "Result file.")


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from resilient_jax.model.moe import expert_load_extremes

    in_process.quiet(_CONFIG.value, _STEPS.value)
    config = in_process.with_experts(_CONFIG.value, _EXPERTS.value)
    workdir = tempfile.mkdtemp(prefix="moe_balance_")
    try:
        _, step_fn, state, loader = in_process.session(config, workdir)
        rows = []
        for _ in range(config.total_steps):
            _, batch = loader.next()
            state, metrics = step_fn(state, batch, jnp.float32(1.0))
            rows.append(jax.tree.map(np.asarray, metrics))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    loads = [r["moe_expert_load"].tolist() for r in rows]  # [step][layer][expert]
    width, settled = _WINDOW.value, _SETTLED.value
    windows = []  # (first step, last step, idlest, busiest)
    for first in range(0, len(loads) - width + 1, width):
        low, high = expert_load_extremes(loads[first : first + width])
        windows.append({"steps": [first + 1, first + width], "min": low, "max": high})
    judged = [w for w in windows if w["steps"][0] >= settled]
    single = np.asarray(loads[settled - 1 :])
    summary = {
        "window_min": round(min(w["min"] for w in judged), 3),
        "window_max": round(max(w["max"] for w in judged), 3),
        "mean_from_settled": [round(x, 3) for x in expert_load_extremes(loads[settled - 1 :])],
        "single_step_min": round(float(single.min()), 3),
        "single_step_max": round(float(single.max()), 3),
        "dropped_fraction_mean": round(
            statistics.mean(float(r["moe_dropped_fraction"]) for r in rows[settled - 1 :]), 4
        ),
        "balance_loss_mean": round(
            statistics.mean(float(r["moe_balance_loss"]) for r in rows[settled - 1 :]), 4
        ),
        "final_lm_loss": round(statistics.mean(float(r["lm_loss"]) for r in rows[-10:]), 4),
    }
    print(f"{'steps':>10}{'idlest':>9}{'busiest':>9}  (expert load / uniform, {width}-step mean)")
    for w in windows:
        print(f"{w['steps'][0]:>4}-{w['steps'][1]:<5}{w['min']:>9.3f}{w['max']:>9.3f}")
    print(
        f"from step {settled}: windows {summary['window_min']}..{summary['window_max']} x uniform"
        f" (single steps {summary['single_step_min']}..{summary['single_step_max']}), dropped "
        f"{summary['dropped_fraction_mean']:.2%}, lm_loss {summary['final_lm_loss']}"
    )
    result = {
        "config": {
            "model": config.model.to_dict(),
            "steps": config.total_steps,
            "global_batch_size": config.global_batch_size,
            "seq_len": config.data.seq_len,
            "window": width,
            "settled": settled,
        },
        "machine": report.jax_machine(),
        "summary": summary,
        "windows": windows,
        "expert_load": [[round(x, 4) for x in np.ravel(step)] for step in loads],
    }
    report.write_json(_OUT.value, result, indent=1)
    _plot(np.asarray(loads), windows, os.path.splitext(_OUT.value)[0] + ".png")
    if not 0.5 <= summary["window_min"] <= summary["window_max"] <= 2.0:
        sys.exit(
            f"expert load {summary['window_min']}..{summary['window_max']} of uniform from step "
            f"{settled}: not within 2x"
        )


def _plot(loads, windows: list[dict], path: str) -> None:
    plt = report.pyplot()
    steps, layers, experts = loads.shape
    fig, (heat, band) = plt.subplots(1, 2, figsize=(11, 4))
    image = heat.imshow(
        loads.reshape(steps, layers * experts).T, aspect="auto", cmap="coolwarm", vmin=0, vmax=2
    )
    heat.set(xlabel="step", ylabel="layer x expert", title="each step's expert load / uniform")
    fig.colorbar(image, ax=heat)
    middle = [(w["steps"][0] + w["steps"][1]) / 2 for w in windows]
    band.plot(middle, [w["max"] for w in windows], "o-", label="busiest expert")
    band.plot(middle, [w["min"] for w in windows], "o-", label="idlest expert")
    for bound in (0.5, 2.0):
        band.axhline(bound, color="grey", linestyle="--", linewidth=1)
    band.set(xlabel="step", ylabel="load / uniform", title="window means", ylim=(0, 2.5))
    band.legend()
    fig.tight_layout()
    report.save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    app.run(main)
