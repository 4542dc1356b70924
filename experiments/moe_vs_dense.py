"""A mixture of experts against a dense model of the same step time on this machine, as in
"Revisiting MoE and Dense Speed-Accuracy Comparisons for LLM Training" (Du et al., 2024): not
equal parameters, equal cost per step, then loss against tokens and against wall-clock time.

    python experiments/moe_vs_dense.py [--config=configs/tiny_cpu.py] [--steps=150]
    -> experiments/results/moe_vs_dense.json, experiments/results/moe_vs_dense.png

One process on the JAX devices present (one CPU device by default). The MoE model is the config's
model with every MLP a mixture of `--experts` experts of width `d_ff / top_k` (top-2 routing, so
each token's expert FLOPs equal the dense MLP's). Its step time is measured; then dense models of
growing depth and width are timed the same way, and the one whose step time is closest to the
MoE's is the dense side of the comparison. Both train `--steps` steps on the config's data with
the config's schedule; the loss compared is the token loss without the router's terms
(`lm_loss`), averaged over `_SMOOTH` steps. Step times are medians of steady steps (the first,
compiling step excluded); wall-clock on the plot is the cumulative measured step time.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import in_process
import report
from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_cpu.py", "Experiment config.")
_STEPS = flags.DEFINE_integer("steps", 150, "Training steps per model.")
_EXPERTS = flags.DEFINE_integer("experts", 8, "Experts per MoE layer.")
_TIMING_STEPS = flags.DEFINE_integer("timing_steps", 6, "Steady steps timed per candidate.")
_OUT = flags.DEFINE_string("out", "experiments/results/moe_vs_dense.json", "Result file.")

_SMOOTH = 10  # steps in the moving average of the loss: single-batch losses are noisy
# The router's balance is judged from this step on: warmup (20 steps) and the router's first
# settling are over. Every expert's load, averaged over windows of _SMOOTH steps (as metrics.jsonl
# reports it), must then stay within 2x of uniform.
_SETTLED = 50
# Dense candidates, as (num_layers, d_model multiplier, d_ff multiplier) of the config's model.
_DENSE_SHAPES = ((1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2), (2, 1.5, 1.5), (3, 1.5, 1.5))


def _train(config, root: str, name: str, steps: int) -> dict:
    """`steps` steps: each step's loss, token loss, step time and router metrics."""
    import jax
    import jax.numpy as jnp

    _, step_fn, state, loader = in_process.session(config, os.path.join(root, name))
    rows = []
    for _ in range(steps):
        _, batch = loader.next()
        start = time.perf_counter()
        state, metrics = step_fn(state, batch, jnp.float32(1.0))
        values = {  # waits for the step
            k: float(v) if v.ndim == 0 else v.tolist() for k, v in jax.device_get(metrics).items()
        }
        values["step_time_s"] = time.perf_counter() - start
        rows.append(values)
    return {"rows": rows, "step_time_s": statistics.median(r["step_time_s"] for r in rows[1:])}


def _dense_variant(base, layers: float, width: float, ff: float):
    config = base.copy_and_resolve_references()
    m = config.model
    heads = max(1, round(m.num_heads * width))
    m.num_layers = int(m.num_layers * layers)
    m.num_heads = m.num_kv_heads = heads
    m.d_model = heads * m.head_dim
    m.d_ff = int(m.d_ff * ff) // 64 * 64
    return config


def _num_params(config, active: bool = False) -> int:
    from resilient_jax.model import ModelConfig

    return ModelConfig.from_config(config.model).num_params(active=active)


def _smooth(values: list[float]) -> list[float]:
    return [
        sum(values[max(0, i - _SMOOTH + 1) : i + 1]) / (i + 1 - max(0, i - _SMOOTH + 1))
        for i in range(len(values))
    ]


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    from resilient_jax.model.moe import expert_load_extremes

    base = _CONFIG.value
    in_process.quiet(base, _STEPS.value)
    moe = in_process.with_experts(base, _EXPERTS.value)
    tokens_per_step = base.global_batch_size * base.data.seq_len
    root = tempfile.mkdtemp(prefix="moe_vs_dense_")
    try:
        timing = 1 + _TIMING_STEPS.value
        moe_time = _train(moe, root, "moe_timing", timing)["step_time_s"]
        candidates = []
        for shape in _DENSE_SHAPES:
            config = _dense_variant(base, *shape)
            step_s = _train(config, root, f"dense_{len(candidates)}", timing)["step_time_s"]
            candidates.append({"shape": shape, "config": config, "step_time_s": step_s})
            print(
                f"dense {config.model.num_layers}L d{config.model.d_model} ff{config.model.d_ff}"
                f": {step_s:.3f} s/step (MoE {moe_time:.3f})",
                flush=True,
            )
        chosen = min(candidates, key=lambda c: abs(c["step_time_s"] - moe_time))
        dense = chosen["config"]
        runs = {
            "dense": _train(dense, root, "dense", _STEPS.value),
            "moe": _train(moe, root, "moe", _STEPS.value),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)

    summary = {}
    for name, config in (("dense", dense), ("moe", moe)):
        rows = runs[name]["rows"]
        lm = [r.get("lm_loss", r["loss"]) for r in rows]
        clock = [sum(r["step_time_s"] for r in rows[1 : i + 1]) for i in range(len(rows))]
        runs[name].update(lm_loss=lm, lm_loss_smoothed=_smooth(lm), wall_clock_s=clock)
        summary[name] = {
            "num_layers": config.model.num_layers,
            "d_model": config.model.d_model,
            "d_ff": config.model.d_ff,
            "params": _num_params(config),
            "active_params": _num_params(config, active=True),
            "step_time_s": round(runs[name]["step_time_s"], 4),
            "final_lm_loss": round(_smooth(lm)[-1], 4),
            "train_s": round(clock[-1], 1),
        }
    router = runs["moe"]["rows"][_SETTLED - 1 :]
    # Each expert's load averaged over windows of _SMOOTH steps, as metrics.jsonl reports it.
    windows = [
        expert_load_extremes([r["moe_expert_load"] for r in router[i : i + _SMOOTH]])
        for i in range(0, len(router) - _SMOOTH + 1, _SMOOTH)
    ]
    summary["moe"].update(
        experts=_EXPERTS.value,
        top_k=2,
        expert_d_ff=moe.model.moe.d_ff,
        load_max=round(max(high for _, high in windows), 3),
        load_min=round(min(low for low, _ in windows), 3),
        dropped_fraction_mean=round(statistics.mean(r["moe_dropped_fraction"] for r in router), 4),
    )
    # Tokens to reach the dense model's final loss (smoothed), for the MoE: sample efficiency.
    target = summary["dense"]["final_lm_loss"]
    reached = next((i for i, v in enumerate(runs["moe"]["lm_loss_smoothed"]) if v <= target), None)
    summary["moe_steps_to_dense_final_loss"] = None if reached is None else reached + 1

    print(f"{'':26}{'dense':>12}{'MoE':>12}")
    for key in ("params", "active_params", "step_time_s", "final_lm_loss", "train_s"):
        print(f"{key:26}{summary['dense'][key]:>12}{summary['moe'][key]:>12}")
    print(
        f"MoE router after step {_SETTLED}: load {summary['moe']['load_min']}.."
        f"{summary['moe']['load_max']} x uniform, dropped "
        f"{summary['moe']['dropped_fraction_mean']:.2%}; MoE reaches the dense final loss at "
        f"step {summary['moe_steps_to_dense_final_loss']} of {_STEPS.value}"
    )
    result = {
        "config": {
            "base_model": base.model.to_dict(),
            "steps": _STEPS.value,
            "global_batch_size": base.global_batch_size,
            "seq_len": base.data.seq_len,
            "tokens_per_step": tokens_per_step,
            "moe": moe.model.moe.to_dict(),
        },
        "machine": report.jax_machine(),
        "moe_timing_step_s": round(moe_time, 4),
        "dense_candidates": [
            {
                "shape": c["shape"],
                "step_time_s": round(c["step_time_s"], 4),
                "num_layers": c["config"].model.num_layers,
                "d_model": c["config"].model.d_model,
                "d_ff": c["config"].model.d_ff,
            }
            for c in candidates
        ],
        "summary": summary,
        "runs": {
            name: {k: run[k] for k in ("lm_loss", "lm_loss_smoothed", "wall_clock_s")}
            | {"step_time_s": [r["step_time_s"] for r in run["rows"]]}
            for name, run in runs.items()
        },
    }
    report.write_json(_OUT.value, result, indent=1)
    _plot(runs, summary, tokens_per_step, os.path.splitext(_OUT.value)[0] + ".png")
    if not 0.5 <= summary["moe"]["load_min"] <= summary["moe"]["load_max"] <= 2.0:
        sys.exit(
            f"expert load {summary['moe']['load_min']}..{summary['moe']['load_max']} of "
            f"uniform from step {_SETTLED}: not within 2x"
        )


def _plot(runs: dict, summary: dict, tokens_per_step: int, path: str) -> None:
    plt = report.pyplot()
    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for name, run in runs.items():
        s = summary[name]
        label = (
            f"MoE {s['experts']}x{s['expert_d_ff']} top-2, {s['num_layers']}L d{s['d_model']}"
            if name == "moe"
            else f"dense {s['num_layers']}L d{s['d_model']} ff{s['d_ff']}"
        ) + f" ({s['params'] / 1e6:.1f}M, {s['step_time_s']:.2f} s/step)"
        tokens = [(i + 1) * tokens_per_step for i in range(len(run["lm_loss_smoothed"]))]
        by_tokens.plot(tokens, run["lm_loss_smoothed"], label=label)
        by_time.plot(run["wall_clock_s"], run["lm_loss_smoothed"], label=label)
    by_tokens.set(xlabel="training tokens", ylabel=f"token loss ({_SMOOTH}-step mean)")
    by_time.set(xlabel="wall-clock s (measured step times)")
    by_tokens.legend(fontsize=7)
    fig.suptitle("MoE vs dense at equal step time")
    fig.tight_layout()
    report.save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    app.run(main)
