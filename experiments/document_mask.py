"""Document-aware attention (`data.document_mask`) on the default run: what it costs per step, what
it does to the held-out loss, and how closely a document's logits in a packed row match its own.

    python experiments/document_mask.py [--config=configs/tiny_cpu.py] [--blocks=10] [--steps=5]
        [--seeds=2] [--train=false]
    -> experiments/results/document_mask.json

The parts run one after another, never two at once on the CPU:

- data: the share of the config's training windows that hold an end-of-text token (the only rows
  the mask changes) and the share of input tokens that follow one in their window.
- step time: the config's train step (`train.step.make_train_step`) compiled with and without the
  mask on the devices present (one CPU device by default), timed alternately (off, on, off, ...)
  in `--blocks` blocks of `--steps` steps on one batch of the config's data, after a warm-up block
  each. Reported: each side's median block, and the median of the ratios of neighbouring blocks
  (on / the off block just before it), which a load that comes and goes on the shared host
  disturbs least. XLA's temporary buffer size of each compiled step is reported beside it: what
  the mask adds to a step's memory.
- logits: the config's model with random parameters (its zero-initialised output layer made random
  too) on a packed row [A, eos, B, eos, C...] with the mask, against each document alone without
  it: the largest difference at each document's positions (and, for contrast, without the mask).
- eval loss (`--train`): `launch/train.py` runs the config for its `total_steps` each way on one
  CPU device, for each of `--seeds` seeds (initialisation and data order), each run evaluated
  with its own setting (the eval_loss rows of its metrics.jsonl). Then each run's final
  parameters are evaluated again on the same held-out batches with the mask off and on, which
  separates what training with the mask changed from what evaluating with it changes.

The host is shared: the load average before, between the parts and after is in the result.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Any

import in_process
import report
from absl import app, flags
from ml_collections import config_flags
from step_timing import bare_block

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_cpu.py", "Experiment config.")
_BLOCKS = flags.DEFINE_integer("blocks", 10, "Timed blocks per side, alternating.")
_STEPS = flags.DEFINE_integer("steps", 5, "Steps per timed block.")
_TRAIN = flags.DEFINE_boolean("train", True, "Train the config each way and compare eval_loss.")
_SEEDS = flags.DEFINE_integer("seeds", 2, "Training runs each way, seeds 0, 1, ...")
_OUT = flags.DEFINE_string("out", "experiments/results/document_mask.json", "Result file.")

SIDES = ("off", "on")
# Document lengths of the packed row of the logits check: A, B and the start of C (with the two
# end-of-text tokens, 128 tokens: tiny_cpu's seq_len).
_DOCUMENTS = (39, 60, 27)
_MAX_WINDOWS = 50_000  # training windows the data share is counted over, at most


def _with_mask(config: Any, on: bool) -> Any:
    changed = config.copy_and_resolve_references()
    changed.data.document_mask = on
    return changed


def _load() -> dict[str, Any]:
    """The load average (1, 5, 15 minutes) and `uptime`'s line."""
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"loadavg": list(os.getloadavg()), "uptime": uptime}


def data_share(config: Any) -> dict[str, Any]:
    """How many training windows hold an end-of-text token in the model's input, and how many
    input tokens follow one (their attention is what the mask cuts)."""
    import numpy as np

    from resilient_jax.data import make_source
    from resilient_jax.train.step import document_eos_id

    eos_id = document_eos_id(_with_mask(config, True))
    source = make_source(config)
    count = min(len(source), _MAX_WINDOWS)  # a synthetic source has a million
    windows = np.stack([source[i][:-1] for i in range(count)])
    is_eos = windows == eos_id
    after = np.cumsum(is_eos, axis=1) - is_eos > 0  # the token's document started in the window
    return {
        "windows": len(windows),
        "windows_with_eos": float(is_eos.any(axis=1).mean()),
        "tokens_after_eos": float(after.mean()),
        "eos_per_window": float(is_eos.sum(axis=1).mean()),
    }


def step_times(config: Any, root: str) -> dict[str, Any]:
    """Seconds per step of each side, alternating blocks, and each compiled step's memory."""
    import jax.numpy as jnp

    one = jnp.float32(1.0)
    sides: dict[str, dict[str, Any]] = {}
    for side in SIDES:
        side_config = _with_mask(config, side == "on")
        in_process.quiet(side_config, 10**9)  # the schedule's horizon; the blocks stop themselves
        _, step_fn, state, loader = in_process.session(side_config, os.path.join(root, side))
        _, batch = loader.next()
        loader.close()
        start = time.perf_counter()
        compiled = step_fn.lower(state, batch, one).compile()
        compile_s = time.perf_counter() - start
        memory = compiled.memory_analysis()
        state, _ = bare_block(compiled, state, batch, 2)  # warm-up
        sides[side] = {
            "run": (compiled, state, batch),
            "compile_s": compile_s,
            "temp_mb": memory.temp_size_in_bytes / 1e6 if memory is not None else None,
            "block_step_s": [],
        }
    for _ in range(_BLOCKS.value):
        for side in SIDES:
            compiled, state, batch = sides[side]["run"]
            state, seconds = bare_block(compiled, state, batch, _STEPS.value)
            sides[side]["run"] = (compiled, state, batch)
            sides[side]["block_step_s"].append(seconds)
    result: dict[str, Any] = {}
    for side in SIDES:
        del sides[side]["run"]
        result[side] = sides[side] | {
            "median_step_s": statistics.median(sides[side]["block_step_s"])
        }
    pairs = zip(result["on"]["block_step_s"], result["off"]["block_step_s"], strict=True)
    result["block_ratios"] = [on / off for on, off in pairs]
    result["ratio_on_off"] = statistics.median(result["block_ratios"])
    result["ratio_of_medians"] = result["on"]["median_step_s"] / result["off"]["median_step_s"]
    return result


def logit_agreement(config: Any) -> dict[str, Any]:
    """The largest differences, at each document's positions of a packed row, between the model
    with the mask and the document alone; float32, random parameters."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from resilient_jax.model import segments
    from resilient_jax.train.state import make_model
    from resilient_jax.train.step import document_eos_id

    config = _with_mask(config, True)
    config.model.compute_dtype = "float32"
    eos_id = document_eos_id(config)
    model = make_model(config)
    c = model.cfg
    init_tokens = jnp.zeros((1, 8), jnp.int32)
    params = nn.meta.unbox(model.init(jax.random.key(0), init_tokens))["params"]
    if "unembed" in params:  # zero at initialisation: every logit would be 0
        unembed = jax.random.normal(jax.random.key(1), (c.d_model, c.vocab_size))
        params["unembed"] = unembed * c.d_model**-0.5
    rng = np.random.default_rng(0)
    ordinary = np.setdiff1d(np.arange(c.vocab_size), [eos_id])
    a, b, prefix = (rng.choice(ordinary, n).tolist() for n in _DOCUMENTS)
    pieces = {"A": [*a, eos_id], "B": [*b, eos_id], "C prefix": prefix}
    row = jnp.array([[t for doc in pieces.values() for t in doc]], jnp.int32)
    apply = jax.jit(lambda p, t, d: model.apply({"params": p}, t, documents=d))
    masked = np.asarray(apply(params, row, segments.documents(row, eos_id)))[0]
    unmasked = np.asarray(apply(params, row, None))[0]
    result, start = {}, 0
    for name, doc in pieces.items():
        alone = np.asarray(apply(params, jnp.array([doc], jnp.int32), None))[0]
        span = slice(start, start + len(doc))
        scale = float(np.abs(alone).max())
        result[name] = {
            "positions": [start, start + len(doc)],
            "max_abs_error": float(np.abs(masked[span] - alone).max()),
            "max_relative_error": float(np.abs(masked[span] - alone).max() / scale),
            "unmasked_max_abs_error": float(np.abs(unmasked[span] - alone).max()),
            "max_abs_logit": scale,
        }
        start += len(doc)
    return result


def train_run(run_flags: list[str], workdir: str, on: bool, seed: int) -> dict[str, Any]:
    """`launch/train.py` with `run_flags` (the config), `seed` and the mask on or off: its eval
    and train losses. No progress bar, TensorBoard or RAM-disk tier: nothing the losses depend
    on."""
    quiet = [
        "--config.log.progress_bar=false",
        "--config.log.tensorboard=false",
        "--config.checkpoint.local_dir=",
    ]
    mask = [f"--config.data.document_mask={str(on).lower()}", f"--config.seed={seed}"]
    wall_s = report.run_trainer([*run_flags, *quiet, *mask], workdir, timeout_s=1800)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {
        "wall_s": wall_s,
        "eval_loss": {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r},
        "final_train_loss": rows[-1]["loss"],
        "median_step_time_s": statistics.median(
            r["step_time_s"] for r in rows if r.get("step_time_s") == r.get("step_time_s")
        ),
    }


def cross_eval(workdir: str) -> dict[str, Any]:
    """The newest parameters of the run in `workdir` evaluated as its evaluations are (the same
    `eval.steps` held-out batches, from the split's first), with the mask off and on."""
    from resilient_jax import topology as topology_lib
    from resilient_jax.checkpoint.reader import inference_mesh, load_run_config, restore_newest
    from resilient_jax.data import BatchLoader, make_source
    from resilient_jax.data.split import holdout
    from resilient_jax.train.eval import make_eval_step

    config = load_run_config(workdir)
    restored = restore_newest(config, workdir)  # onto `inference_mesh`'s mesh
    topology, _, mesh = inference_mesh(config)
    plan = topology_lib.plan_mesh(config, topology)  # the run's own batch split on that mesh
    _, held_out = holdout(make_source(config), config.eval.fraction)
    loader = BatchLoader(config, mesh, plan, held_out)
    batches = [loader.next()[1] for _ in range(config.eval.steps)]
    loader.close()
    result: dict[str, Any] = {"step": restored.step}
    for side in SIDES:
        step = make_eval_step(_with_mask(config, side == "on"), mesh)
        losses = [float(step(restored.state.params, batch)) for batch in batches]
        result[f"eval_loss_mask_{side}"] = sum(losses) / len(losses)
    return result


def training(run_flags: list[str], root: str) -> dict[str, Any]:
    """Each seed's run each way, then the cross-evaluation of every run; means over the seeds."""
    runs: dict[str, dict[str, Any]] = {side: {} for side in SIDES}
    for seed in range(_SEEDS.value):
        for side in SIDES:
            workdir = os.path.join(root, f"run_{side}_{seed}")
            runs[side][str(seed)] = train_run(run_flags, workdir, side == "on", seed)
    for seed in range(_SEEDS.value):  # in-process: after the runs, not beside them
        for side in SIDES:
            runs[side][str(seed)] |= cross_eval(os.path.join(root, f"run_{side}_{seed}"))
    mean = lambda side, key: statistics.fmean(r[key] for r in runs[side].values())
    summary = {
        side: {
            key: mean(side, key)
            for key in ("final_train_loss", "eval_loss_mask_off", "eval_loss_mask_on")
        }
        for side in SIDES
    }
    return {"runs": runs, "mean_over_seeds": summary}


def main(argv: list[str]) -> None:
    del argv
    import jax

    config = _CONFIG.value
    # The training runs get the same config: its file and the --config.KEY=VALUE overrides given.
    config_flag = flags.FLAGS["config"]
    run_flags = [f"--config={config_flags.get_config_filename(config_flag)}"] + [
        f"--config.{key}={str(value).lower() if isinstance(value, bool) else value}"
        for key, value in config_flags.get_override_values(config_flag).items()
    ]
    result: dict[str, Any] = {
        "machine": report.host_line(),
        "device": jax.devices()[0].device_kind,
        "num_devices": jax.device_count(),
        "config": config.model.to_dict()
        | {"global_batch_size": config.global_batch_size, "seq_len": config.data.seq_len},
        "load_before": _load(),
    }
    root = tempfile.mkdtemp(prefix="document_mask_")
    try:
        result["data"] = data_share(config)
        result["step_time"] = step_times(config, root)
        result["logits"] = logit_agreement(config)
        if _TRAIN.value:
            result["load_before_training"] = _load()
            result["training"] = training(run_flags, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["load_after"] = _load()
    _print(result)
    report.write_json(_OUT.value, report.finite(result))


def _print(result: dict[str, Any]) -> None:
    d, t = result["data"], result["step_time"]
    print(
        f"data: {100 * d['windows_with_eos']:.1f}% of {d['windows']} windows hold an end-of-text "
        f"token; {100 * d['tokens_after_eos']:.1f}% of input tokens follow one"
    )
    print(f"{'':30}{'mask off':>12}{'mask on':>12}")
    off, on = t["off"], t["on"]
    print(f"{'step s (median block)':30}{off['median_step_s']:>12.4f}{on['median_step_s']:>12.4f}")
    print(f"{'XLA temp MB':30}{off['temp_mb'] or 0:>12.1f}{on['temp_mb'] or 0:>12.1f}")
    print(f"{'compile s':30}{off['compile_s']:>12.1f}{on['compile_s']:>12.1f}")
    if "training" in result:
        runs = result["training"]["runs"]
        for seed in runs["off"]:
            for step in runs["off"][seed]["eval_loss"]:
                label = f"seed {seed} eval_loss step {step}"
                print(
                    f"{label:30}{runs['off'][seed]['eval_loss'][step]:>12.4f}"
                    f"{runs['on'][seed]['eval_loss'][step]:>12.4f}"
                )
        mean = result["training"]["mean_over_seeds"]
        for key in ("final_train_loss", "eval_loss_mask_off", "eval_loss_mask_on"):
            print(f"{'mean ' + key:30}{mean['off'][key]:>12.4f}{mean['on'][key]:>12.4f}")
    print(
        f"step time ratio on/off: {t['ratio_on_off']:.3f} (median of neighbouring blocks), "
        f"{t['ratio_of_medians']:.3f} (of the medians)"
    )
    for name, r in result["logits"].items():
        print(
            f"logits of {name:9} in a packed row vs alone: max abs error {r['max_abs_error']:.2e} "
            f"(relative {r['max_relative_error']:.1e}); without the mask "
            f"{r['unmasked_max_abs_error']:.2e}"
        )
    before, after = result["load_before"]["loadavg"], result["load_after"]["loadavg"]
    print(f"load average before {before}, after {after}")


if __name__ == "__main__":
    app.run(main)
