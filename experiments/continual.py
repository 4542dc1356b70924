"""Continual pretraining on a new domain: how much of the old domain does each variant forget?

    python experiments/continual.py [--base_steps=400] [--steps=300] [--ratio=0.25]
    -> experiments/results/continual.json, experiments/results/continual.png

Old domain: the bundled English corpus (`pydoc_data.topics`, ~0.5 MB of prose). New domain:
Python source code, the first of this interpreter's standard-library modules (sorted by name) up
to ~0.5 MB. One small model (d_model 128, 4 layers, the bundled 1,024-token BPE, 64-token
sequences) is pretrained on English (`--base_steps`), then trained on code from that checkpoint
(`checkpoint.init_from`) for `--steps` steps in three variants that differ only in
`rehearsal.mode`:

- none: code only;
- replay: a `--ratio` share of every batch from a held sample of the English training data
  (`--sequences` sequences);
- synthetic: the same share from `--sequences` sequences the base model writes itself from a
  newline before training (self-synthesized rehearsal: no English data used after pretraining).

Every run is `launch/train.py` on one CPU device, evaluated every `--eval_every` steps on the
held-out part of both domains (`eval.datasets`), the same examples each time. Reported per
variant: eval loss on English and on code at each evaluation; forgetting = final English loss
minus the base model's; the code loss reached.
"""

from __future__ import annotations

import json
import os
import platform
import sysconfig
import tempfile

import report
from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BASE_STEPS = flags.DEFINE_integer("base_steps", 400, "Pretraining steps on English.")
_STEPS = flags.DEFINE_integer("steps", 300, "Continual steps on code, per variant.")
_RATIO = flags.DEFINE_float("ratio", 0.25, "Share of rehearsal examples (replay, synthetic).")
_SEQUENCES = flags.DEFINE_integer("sequences", 512, "Size of the rehearsal set.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 25, "Steps between evaluations.")
_OUT = flags.DEFINE_string("out", "experiments/results/continual.json", "Result file.")

CODE_BYTES = 500_000
MODEL = {
    "model.d_model": 128,
    "model.num_layers": 4,
    "model.num_heads": 4,
    "model.num_kv_heads": 4,
    "model.head_dim": 32,
    "model.d_ff": 384,
    "data.seq_len": 64,
    "global_batch_size": 16,
    "log.progress_bar": False,
    "log.tensorboard": False,
    "checkpoint.local_dir": "",
    "eval.steps": 4,
}
VARIANTS = {
    "none": {},
    "replay": {"rehearsal.mode": "replay"},
    "synthetic": {"rehearsal.mode": "synthetic", "rehearsal.chunk_sequences": 64},
}


def code_corpus(directory: str) -> list[str]:
    """The first standard-library modules, by name, up to CODE_BYTES, as .txt files."""
    stdlib = sysconfig.get_paths()["stdlib"]
    names, total = [], 0
    for name in sorted(n for n in os.listdir(stdlib) if n.endswith(".py")):
        with open(os.path.join(stdlib, name), encoding="utf-8") as f:
            text = f.read()
        with open(os.path.join(directory, name[:-3] + ".txt"), "w", encoding="utf-8") as f:
            f.write(text)
        names.append(name)
        total += len(text)
        if total >= CODE_BYTES:
            break
    return names


def train(workdir: str, overrides: dict) -> float:
    """`launch/train.py` with tiny_cpu and `overrides`; its wall time."""
    args = [f"--config.{k}={v}" for k, v in {**MODEL, **overrides}.items()]
    return report.run_trainer(["--config=configs/tiny_cpu.py", *args], workdir, timeout_s=3600)


def eval_curve(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [
        {"step": r["step"], "english": r["eval_loss/english"], "code": r["eval_loss/code"]}
        for r in rows
        if "eval_loss/english" in r
    ]


def plot(result: dict, path: str) -> None:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    base = result["base"]
    for ax, domain, title in (
        (axes[0], "english", "old domain: English"),
        (axes[1], "code", "new domain: Python code"),
    ):
        for name, variant in result["variants"].items():
            curve = [{"step": 0, **base}, *variant["curve"]]
            ax.plot([p["step"] for p in curve], [p[domain] for p in curve], marker=".", label=name)
        ax.axhline(base[domain], color="gray", linestyle="--", linewidth=0.8, label="base model")
        ax.set_title(title)
        ax.set_xlabel("continual training step")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"Continual pretraining, rehearsal ratio {result['ratio']}")
    fig.tight_layout()
    report.save_figure(fig, path, dpi=120)


def main(argv: list[str]) -> None:
    del argv
    root = tempfile.mkdtemp(prefix="continual-")
    code_dir = os.path.join(root, "code")
    os.makedirs(code_dir)
    modules = code_corpus(code_dir)
    datasets = f"english=,code={code_dir}"
    evals = {"eval.every_steps": _EVAL_EVERY.value, "eval.datasets": datasets}
    base_dir = os.path.join(root, "base")
    base_s = train(
        base_dir,
        {"total_steps": _BASE_STEPS.value, "checkpoint.every_steps": _BASE_STEPS.value, **evals},
    )
    base = eval_curve(base_dir)[-1]
    print(
        f"base: {_BASE_STEPS.value} steps on English in {base_s:.0f} s; "
        f"eval English {base['english']:.3f}, code {base['code']:.3f}"
    )
    common = {
        "total_steps": _STEPS.value,
        "data.path": code_dir,
        "checkpoint.init_from": os.path.join(base_dir, "checkpoints"),
        "checkpoint.every_steps": 0,
        "optimizer.learning_rate": 1e-3,
        "rehearsal.ratio": _RATIO.value,
        "rehearsal.sequences": _SEQUENCES.value,
        **evals,
    }
    variants = {}
    print(f"{'variant':>10} {'English':>8} {'forgetting':>10} {'code':>8} {'wall s':>7}")
    for name, overrides in VARIANTS.items():
        workdir = os.path.join(root, name)
        wall_s = train(workdir, {**common, **overrides})
        curve = eval_curve(workdir)
        final = curve[-1]
        variants[name] = {
            "curve": curve,
            "final_english": final["english"],
            "final_code": final["code"],
            "forgetting": final["english"] - base["english"],
            "wall_s": wall_s,
        }
        print(
            f"{name:>10} {final['english']:8.3f} {final['english'] - base['english']:10.3f} "
            f"{final['code']:8.3f} {wall_s:7.0f}"
        )
    result = {
        "base": {"english": base["english"], "code": base["code"]},
        "base_steps": _BASE_STEPS.value,
        "steps": _STEPS.value,
        "ratio": _RATIO.value,
        "sequences": _SEQUENCES.value,
        "model": MODEL,
        "code_modules": modules,
        "python": platform.python_version(),
        "variants": variants,
    }
    out = os.path.join(REPO, _OUT.value)
    report.write_json(out, result, indent=1)
    plot(result, out.removesuffix(".json") + ".png")


if __name__ == "__main__":
    app.run(main)
