"""The train step held against an implementation this project did not write: transformers' PyTorch
`LlamaForCausalLM` trained with `torch.optim.AdamW`, step for step on the same batches.

    python experiments/hf_parity.py [--steps=200] [--variants=...] [--out=...]
    -> experiments/results/hf_parity.json and hf_parity.png (both loss curves, relative difference)

A small model (the bundled 1024-token BPE, d_model 128, 2 layers, 4 query and 2 key/value heads;
the in-band health check off, as the reference has none) is initialised here
(`train.state.init_state`), exported with `hf.exporter.write` and loaded by
`LlamaForCausalLM.from_pretrained`. Both then train `--steps` steps on the same batches (batch k =
examples k*B..(k+1)*B-1 of the config's example stream, what `BatchLoader` feeds step k) with the
config's learning-rate schedule, clipping and weight-decay rules, and the loss of every step (before
its update, as `metrics.jsonl` reports it) is compared.

Variants, each against the reference of its compute dtype: float32 on one device; float32 with
gradient accumulation over 4 microbatches; float32 on a mesh of fsdp=2 x tensor=2 (4 of 8
simulated CPU devices); and the same three with bfloat16 compute, where the reference runs under
`torch.autocast(bfloat16)`. The bfloat16 noise band is the reference's own spread: the largest
relative difference of the bfloat16 reference from the float32 reference over the run.

Conventions, and how the reference is made to follow them (where the two differ):
- Loss: the mean token cross-entropy over all B * seq_len predictions (packed sequences, nothing
  masked). Our batch rows carry seq_len + 1 tokens; the reference gets all of them as `input_ids`
  and as `labels` (transformers shifts labels itself), so the last position's prediction is
  computed and dropped: causal attention keeps it from changing the others.
- Tied output layer: ours is `embed.T / sqrt(d_model)` (T5's scaled tied head); transformers ties
  `lm_head` to the embedding unscaled. The export writes the scaled copy as an untied `lm_head`;
  for training, the reference's `lm_head` is replaced by a module computing the same product from
  the (trained) embedding, so both paths' gradients reach the one tensor as in ours.
- Weight decay: decoupled (AdamW), scaled by the scheduled learning rate, on every parameter of
  two or more dimensions (the embedding and all projections), never on norm scales: a torch
  parameter group with the decay and one without. optax adds `wd * p` to the Adam update; torch
  multiplies p by (1 - lr * wd) before the Adam step: the same update, rounded differently.
- Learning rate: linear warmup from 0 over `warmup_steps`, then cosine to `min_lr_ratio` of the
  peak at `total_steps` (`optax.warmup_cosine_decay_schedule`), evaluated at the number of updates
  already applied: the first update has rate 0 (its moments still count). The reference uses
  `LambdaLR` with the same formula written out.
- Clipping: by global norm before Adam, (g / norm) * max_norm when the norm reaches max_norm, as
  `optax.clip_by_global_norm` does; the reference applies that rule itself instead of
  `torch.nn.utils.clip_grad_norm_`, which divides by (norm + 1e-6) (a relative 1e-6 apart in every
  clipped step, which float32 chaos then grows).
- Adam: bias-corrected moments and eps outside the square root in both (optax `eps_root` 0).
- Embedding: every row trains on both sides. The export's config.json declares no padding token;
  transformers would make it the embedding's `padding_idx`, a row that never gets a gradient.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import time
from typing import Any

# Before JAX is imported: the mesh variant needs four devices, and the tests use eight.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import in_process
import numpy as np
import report
import torch
import transformers
from absl import app, flags

_STEPS = flags.DEFINE_integer("steps", 200, "Training steps (the schedule spans them).")
_VARIANTS = flags.DEFINE_list(
    "variants",
    [
        "float32",
        "float32_accum4",
        "float32_fsdp2_tensor2",
        "bfloat16",
        "bfloat16_accum4",
        "bfloat16_fsdp2_tensor2",
    ],
    "Our runs compared with the reference.",
)
_OUT = flags.DEFINE_string("out", "experiments/results/hf_parity.json", "Result file.")
_PLOT = flags.DEFINE_bool("plot", True, "Also write the PNG next to the result file.")
_TIED = flags.DEFINE_bool(
    "tied",
    False,
    "The tied output layer (model.tie_embeddings=True) instead of the default untied one.",
)

_FLOAT32_TOLERANCE = flags.DEFINE_float(
    "float32_tolerance", 1e-4, "Max relative loss difference over the run, float32 (the target)."
)
# bfloat16: ours may differ from the bfloat16 reference by this multiple of the reference's own
# bfloat16-vs-float32 spread (the two round in different places: transformers under autocast
# keeps a float32 residual stream, ours computes it in bfloat16).
BFLOAT16_BAND_FACTOR = 2.0

MODEL = {
    "model.d_model": 128,
    "model.num_layers": 2,
    "model.num_heads": 4,
    "model.num_kv_heads": 2,
    "model.head_dim": 32,
    "model.d_ff": 352,
    "model.max_seq_len": 128,
    "data.seq_len": 64,
    "global_batch_size": 8,
    # The in-band health check refuses a step it judges a spike; the reference has none, so a
    # refused step would end the comparison rather than test the step.
    "health.enabled": False,
}
# name -> (devices, our overrides)
MESHES = {
    "": (1, {}),
    "_accum4": (1, {"per_device_batch_size": 2}),  # 8 rows in 4 microbatches of 2
    "_fsdp2_tensor2": (4, {"mesh.fsdp": 2, "mesh.tensor": 2}),
}


def make_config(steps: int, compute_dtype: str = "float32", **overrides: Any):
    """configs/tiny_cpu.py with the small parity model, quiet, `steps` steps."""
    config = _tiny_cpu()
    in_process.quiet(config, steps)
    config.update_from_flattened_dict({**MODEL, "model.compute_dtype": compute_dtype, **overrides})
    config.model.tie_embeddings = _TIED.value
    return config


def _tiny_cpu():
    from configs.tiny_cpu import get_config

    return get_config()


def batches(config, steps: int) -> np.ndarray:
    """[steps, B, seq_len + 1]: batch k is examples k*B..(k+1)*B-1 of the example stream."""
    from resilient_jax.data import make_source
    from resilient_jax.data.mixture import example_stream

    examples = example_stream(make_source(config), config.seed)
    b = config.global_batch_size
    return np.stack(
        [np.stack([examples[k * b + i] for i in range(b)]) for k in range(steps)]
    ).astype(np.int32)


def learning_rate(config, t: int) -> float:
    """The schedule, written out: linear warmup from 0, cosine to min_lr_ratio of the peak."""
    o = config.optimizer
    warmup = min(o.warmup_steps, max(config.total_steps - 1, 0))
    if t < warmup:
        return o.learning_rate * t / warmup
    decay = max(config.total_steps, warmup + 1) - warmup
    progress = min(t - warmup, decay) / decay
    alpha = o.min_lr_ratio
    return o.learning_rate * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * progress)) + alpha)


def ours(config, num_devices: int, data: np.ndarray) -> tuple[list[float], Any]:
    """Our losses over `data` on the first `num_devices` devices, and the initial parameters."""
    import jax

    from resilient_jax import mesh as mesh_lib
    from resilient_jax import topology
    from resilient_jax.train.state import init_state
    from resilient_jax.train.step import make_train_step

    topo = mesh_lib.discover(jax.devices()[:num_devices])
    plan = topology.plan_mesh(config, topo)
    mesh = mesh_lib.make_mesh(plan, topo)
    state = init_state(config, mesh)
    initial = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state.params)
    step = make_train_step(config, mesh)
    sharding = mesh_lib.batch_sharding(mesh)
    unit_scale = np.float32(1.0)
    losses = []
    for batch in data:
        laid_out = batch.reshape(plan.microbatches, -1, batch.shape[-1])
        state, metrics = step(state, jax.device_put(laid_out, sharding), unit_scale)
        metrics = jax.device_get(metrics)
        losses.append(float(metrics["loss"]))
    return losses, initial


class ScaledTiedHead(torch.nn.Module):
    """Our tied output layer in torch: logits = h @ (embed * scale).T from the live embedding."""

    def __init__(self, embedding: torch.nn.Embedding, scale: np.float32) -> None:
        super().__init__()
        self.embedding = embedding  # its weight is the embedding's parameter, trained once
        self.register_buffer("scale", torch.tensor(scale, dtype=torch.float32))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embedding.weight * self.scale
        return torch.nn.functional.linear(hidden, weight.to(hidden.dtype))


def reference(config, hf_dir: str, data: np.ndarray, bfloat16: bool) -> list[float]:
    """transformers' LlamaForCausalLM from `hf_dir` trained with torch AdamW on `data`."""
    from resilient_jax.hf import layout
    from resilient_jax.model import ModelConfig

    # One thread: a model this small steps in milliseconds, and on a busy host more threads than
    # free cores make each step wait for the slowest (20 times slower here at load 10).
    torch.set_num_threads(1)
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    if config.model.tie_embeddings:
        scale = layout.output_scale(ModelConfig.from_config(config.model))
        model.lm_head = ScaledTiedHead(model.model.embed_tokens, scale)
    params = dict(model.named_parameters())  # a shared tensor once, under its first name
    o = config.optimizer
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params.values() if p.ndim >= 2]},
            {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=o.learning_rate,
        betas=(o.b1, o.b2),
        eps=o.eps,
        weight_decay=o.weight_decay,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: learning_rate(config, t) / o.learning_rate
    )
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bfloat16 else contextlib.nullcontext()
    losses = []
    for batch in data:
        tokens = torch.from_numpy(batch.astype(np.int64))
        with autocast:
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if o.grad_clip_norm > 0:
            _clip_like_optax(list(params.values()), o.grad_clip_norm)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _clip_like_optax(params: list[Any], max_norm: float) -> None:
    """`optax.clip_by_global_norm`'s rule, (g / norm) * max_norm when norm >= max_norm, in
    place of `torch.nn.utils.clip_grad_norm_`'s g * max_norm / (norm + 1e-6): a difference of a
    relative 1e-6 in every clipped update would start the two runs apart for no reason."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    if norm >= max_norm:
        for g in grads:
            g.div_(norm).mul_(max_norm)


def _same_tree(a: Any, b: Any) -> bool:
    import jax

    return all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def relative(a: list[float], b: list[float]) -> np.ndarray:
    return np.abs(np.asarray(a) - np.asarray(b)) / np.abs(np.asarray(b))


def compare(steps: int, variants: list[str]) -> dict[str, Any]:
    """Every variant's and each needed reference's losses, the differences and the verdicts."""
    from resilient_jax.hf import exporter

    dtypes = sorted({v.split("_", 1)[0] for v in variants} | {"float32"})
    base = make_config(steps)
    data = batches(base, steps)
    runs: dict[str, Any] = {}
    initial = None
    for name in variants:
        dtype, _, mesh_name = name.partition("_")
        devices, overrides = MESHES["_" + mesh_name if mesh_name else ""]
        start = time.perf_counter()
        losses, params = ours(make_config(steps, dtype, **overrides), devices, data)
        if initial is None:
            initial = params
        runs[name] = {
            "losses": losses,
            "devices": devices,
            "same_initial_params": _same_tree(params, initial),
            "seconds": time.perf_counter() - start,
        }
    references: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as hf_dir:
        exporter.write(base, initial, hf_dir, "float32")
        for dtype in dtypes:
            start = time.perf_counter()
            references[dtype] = reference(base, hf_dir, data, dtype == "bfloat16")
            print(f"reference {dtype}: {time.perf_counter() - start:.1f} s")
    band = None
    if "bfloat16" in references:
        band = float(relative(references["bfloat16"], references["float32"]).max())
    for name, run in runs.items():
        dtype = name.split("_", 1)[0]
        diff = relative(run["losses"], references[dtype])
        limit = _FLOAT32_TOLERANCE.value if dtype == "float32" else BFLOAT16_BAND_FACTOR * band
        run.update(
            relative_difference=diff.tolist(),
            max_relative_difference=float(diff.max()),
            worst_step=int(diff.argmax()) + 1,
            limit=limit,
            within=bool(diff.max() <= limit) and run["same_initial_params"],
        )
    return {
        "steps": steps,
        "model": {**MODEL, "model.tie_embeddings": _TIED.value},
        "optimizer": base.optimizer.to_dict(),
        "bfloat16_band": band,
        "bfloat16_band_factor": BFLOAT16_BAND_FACTOR,
        "float32_tolerance": _FLOAT32_TOLERANCE.value,
        "reference": references,
        "runs": runs,
    }


def _plot(result: dict[str, Any], path: str) -> None:
    plt = report.pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    steps = np.arange(1, result["steps"] + 1)
    for dtype, losses in result["reference"].items():
        top.plot(steps, losses, lw=3, alpha=0.4, label=f"transformers + torch AdamW, {dtype}")
    for name, run in result["runs"].items():
        top.plot(steps, run["losses"], lw=0.8, label=f"ours, {name}")
        bottom.semilogy(steps, np.maximum(run["relative_difference"], 1e-9), lw=0.8, label=name)
    bottom.axhline(result["float32_tolerance"], color="k", ls="--", lw=0.8, label="float32 limit")
    if result["bfloat16_band"] is not None:
        bottom.axhline(result["bfloat16_band"], color="gray", ls=":", lw=0.8, label="bfloat16 band")
    top.set_ylabel("training loss")
    top.legend(fontsize=7)
    bottom.set_ylabel("|ours - reference| / reference")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=7, ncol=2)
    top.set_title("Train step vs transformers LlamaForCausalLM + torch AdamW")
    report.save_figure(fig, path)


def main(argv: list[str]) -> None:
    del argv
    result = compare(_STEPS.value, _VARIANTS.value)
    result["machine"] = report.host_line()
    print(f"bfloat16 band (reference bf16 vs f32, max relative): {result['bfloat16_band']}")
    print(f"{'variant':26} {'max rel diff':>13} {'at step':>8} {'limit':>10} {'ok':>4} {'s':>6}")
    for name, run in result["runs"].items():
        print(
            f"{name:26} {run['max_relative_difference']:13.3e} {run['worst_step']:8d} "
            f"{run['limit']:10.2e} {'yes' if run['within'] else 'NO':>4} {run['seconds']:6.1f}"
        )
    report.write_json(_OUT.value, result)
    if _PLOT.value:
        _plot(result, os.path.splitext(_OUT.value)[0] + ".png")
    if not all(run["within"] for run in result["runs"].values()):
        sys.exit("hf_parity: a variant's losses left its limit (see the table)")


if __name__ == "__main__":
    app.run(main)
