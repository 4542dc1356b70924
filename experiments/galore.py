"""GaLore against AdamW on the same model: optimizer-state bytes, checkpoint bytes, save and restore
time, and the loss after N steps.

    python experiments/galore.py [--config=configs/tiny_cpu.py] [--model=larger] [--steps=100]
    -> experiments/results/galore.json (galore_larger.json), and the .png next to it

One process on the JAX devices present (one CPU device by default). For each optimizer: N
training steps of the model on the config's data (the learning-rate schedule spans the N steps),
then one persistent checkpoint of the final state through the run's `Checkpointer` (save time:
from `after_step` to committed; bytes: the step's directory on disk) and one verified restore of
it onto the same mesh. `--model=larger` widens and deepens the config's model (`_LARGER`);
`--rank=0` picks a quarter of `model.d_model`, the issue's bar (GaLore's optimizer state at most
half of AdamW's). GaLore's other settings are the config's defaults unless a flag sets them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import in_process
import report
from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_cpu.py", "Experiment config.")
_STEPS = flags.DEFINE_integer("steps", 100, "Training steps per optimizer.")
_MODEL = flags.DEFINE_enum(
    "model", "config", ["config", "larger"], "The config's model or _LARGER."
)
_RANK = flags.DEFINE_integer("rank", 0, "GaLore rank; 0 = model.d_model // 4.")
_INTERVAL = flags.DEFINE_integer("update_interval", 0, "SVD refresh interval; 0 = the config's.")
_SCALE = flags.DEFINE_float("scale", 0.0, "GaLore scale; 0 = the config's.")
_OUT = flags.DEFINE_string(
    "out", "", "Result file; empty = experiments/results/galore[_larger].json"
)

# The larger CPU model: tiny_cpu's d_model 256 widened to 384 (6 heads of 64, d_ff 1152), 4 layers
# still: 7.7M parameters against 3.7M, so twice the step time on a CPU.
_LARGER = {
    "model.d_model": 384,
    "model.num_heads": 6,
    "model.num_kv_heads": 6,
    "model.d_ff": 1152,
}

_TAIL = 10  # steps averaged for "final loss": single-batch losses are noisy


def _dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


def _measure(name: str, config, root: str) -> dict:
    import jax
    import jax.numpy as jnp

    from resilient_jax.checkpoint import Checkpointer
    from resilient_jax.data.position import DataPosition
    from resilient_jax.train.hooks import StepInfo

    workdir = os.path.join(root, name)
    ctx, step_fn, state, loader = in_process.session(config, workdir)
    losses, start = [], time.perf_counter()
    for _ in range(config.total_steps):
        _, batch = loader.next()
        state, metrics = step_fn(state, batch, jnp.float32(1.0))
        losses.append(float(metrics["loss"]))
    train_s = time.perf_counter() - start
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))

    steps = config.total_steps
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    ck.on_start(ctx, state)
    start = time.perf_counter()
    ck.after_step(ctx, state, StepInfo(steps, steps - 1, DataPosition(next_batch=steps), 0.0))
    ck.wait_until_finished()
    save_s = time.perf_counter() - start
    ck.close()
    checkpoint_bytes = _dir_bytes(os.path.join(workdir, "checkpoints", str(steps)))

    ck = Checkpointer(ctx, handle_sigterm=False).open()
    start = time.perf_counter()
    restored = ck.restore_latest(ctx)
    jax.block_until_ready(restored.state)
    restore_s = time.perf_counter() - start
    ck.close()
    assert restored.step == steps
    return {
        "optimizer_state_bytes": opt_bytes,
        "param_bytes": param_bytes,
        "checkpoint_bytes": checkpoint_bytes,
        "persistent_save_s": round(save_s, 3),
        "restore_s": round(restore_s, 3),
        "train_s": round(train_s, 1),
        "final_loss": sum(losses[-_TAIL:]) / _TAIL,
        "losses": losses,
    }


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    base = _CONFIG.value
    # The persistent tier alone (no local tier): the bytes a recovery reads.
    in_process.quiet(base, _STEPS.value, checkpoint_every=1)
    if _MODEL.value == "larger":
        base.update_from_flattened_dict(_LARGER)
    rank = _RANK.value or base.model.d_model // 4
    galore = base.copy_and_resolve_references()
    galore.optimizer.galore.rank = rank
    galore.optimizer.galore.update_interval = (
        _INTERVAL.value or galore.optimizer.galore.update_interval
    )
    galore.optimizer.galore.scale = _SCALE.value or galore.optimizer.galore.scale
    out = _OUT.value or (
        "experiments/results/galore_larger.json"
        if _MODEL.value == "larger"
        else "experiments/results/galore.json"
    )
    root = tempfile.mkdtemp(prefix="galore_")
    try:
        runs = {"adamw": _measure("adamw", base, root), "galore": _measure("galore", galore, root)}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    a, g = runs["adamw"], runs["galore"]
    ratios = {
        key: g[key] / a[key]
        for key in ("optimizer_state_bytes", "checkpoint_bytes", "persistent_save_s", "restore_s")
    }
    ratios["final_loss"] = g["final_loss"] / a["final_loss"]
    print(f"{'':24}{'AdamW':>12}{'GaLore':>12}{'ratio':>8}")
    for key, ratio in ratios.items():
        print(f"{key:24}{a[key]:>12.4g}{g[key]:>12.4g}{ratio:>8.3f}")
    result = {
        "config": {
            "model_choice": _MODEL.value,
            "model": base.model.to_dict(),
            "steps": base.total_steps,
            "global_batch_size": base.global_batch_size,
            "seq_len": base.data.seq_len,
            "galore": galore.optimizer.galore.to_dict(),
        },
        "machine": report.jax_machine(),
        "final_loss_is_mean_of_last_steps": _TAIL,
        "ratios_galore_over_adamw": {k: round(v, 4) for k, v in ratios.items()},
        "runs": runs,
    }
    report.write_json(out, result, indent=1)
    m = base.model
    title = f"GaLore vs AdamW: {m.num_layers} layers, d_model {m.d_model}, {base.total_steps} steps"
    _plot(runs, rank, title, os.path.splitext(out)[0] + ".png")


def _plot(runs: dict, rank: int, title: str, path: str) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, run in runs.items():
        label = f"GaLore (rank {rank})" if name == "galore" else "AdamW"
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], label=label)
    ax.set(xlabel="step", ylabel="training loss", title=title)
    ax.legend()
    fig.tight_layout()
    report.save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    app.run(main)
