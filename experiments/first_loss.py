"""The loss of a freshly initialised model on its config's first training batch, against ln(vocab).

    python experiments/first_loss.py [--configs=configs/tiny_cpu.py,configs/llama_1b.py]
        [--rows=4] [--seq_len=128] [--label=...]
    -> experiments/results/first_loss.json

A model that knows nothing should predict every token with probability 1/V: its first loss is
ln(V). One process, the model's parameters initialised from the config's seed as a run does
(`train.state`'s init, on one device), one forward pass in the config's compute dtype over the
first `--rows` sequences of its training data cut to `--seq_len` tokens (the llama_1b shapes,
0.97B parameters, fit a CPU at a short batch; the loss at initialisation does not depend on the
batch size). `--label` names the rows written (the initialisation measured); rows of other labels
and other keys of the result file are kept.
"""

from __future__ import annotations

import math
import os
import runpy
import time

import in_process  # noqa: F401  (puts this checkout on the path)
import report
from absl import app, flags

_CONFIGS = flags.DEFINE_list(
    "configs", ["configs/tiny_cpu.py", "configs/llama_1b.py"], "Config files measured."
)
_ROWS = flags.DEFINE_integer("rows", 4, "Sequences of the first batch used.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Tokens per sequence (at most the config's).")
_LABEL = flags.DEFINE_string("label", "zero_readout", "Name of the initialisation measured.")
_OUT = flags.DEFINE_string(
    "out", "experiments/results/first_loss.json", "Result file (rows of other labels are kept)."
)


def _first_loss(config_path: str) -> dict:
    import jax
    import jax.numpy as jnp

    from resilient_jax.data import make_source
    from resilient_jax.data.mixture import example_stream
    from resilient_jax.data.split import holdout
    from resilient_jax.train.state import make_model
    from resilient_jax.train.step import token_loss_sum

    config = runpy.run_path(config_path)["get_config"]()
    config.data.seq_len = min(config.data.seq_len, _SEQ_LEN.value)
    model = make_model(config)
    train, _ = holdout(make_source(config), config.eval.fraction)
    examples = example_stream(train, config.seed)
    tokens = jnp.asarray([examples[i] for i in range(_ROWS.value)])

    def loss() -> jax.Array:
        # The run's init: the parameter key is the first half of the seed's split.
        params_key, _ = jax.random.split(jax.random.key(config.seed))
        params = model.init(params_key, tokens[:1, :-1])["params"]
        logits = model.apply({"params": params}, tokens[:, :-1])
        return token_loss_sum(logits, tokens[:, 1:]) / tokens[:, 1:].size

    start = time.perf_counter()
    value = float(jax.jit(loss)())
    ln_v = math.log(config.model.vocab_size)
    return {
        "config": config_path,
        "label": _LABEL.value,
        "vocab_size": config.model.vocab_size,
        "d_model": config.model.d_model,
        "num_layers": config.model.num_layers,
        "params": model.cfg.num_params(),
        "compute_dtype": config.model.compute_dtype,
        "tokens": int(tokens[:, 1:].size),
        "ln_vocab": ln_v,
        "first_loss": value,
        "excess_nats": value - ln_v,
        "seconds": time.perf_counter() - start,
    }


def main(argv: list[str]) -> None:
    del argv
    import json

    rows = [_first_loss(path) for path in _CONFIGS.value]
    previous: dict = {}
    if os.path.exists(_OUT.value):
        with open(_OUT.value) as f:
            previous = json.load(f)
    kept = [r for r in previous.get("rows", []) if r["label"] != _LABEL.value]
    print(f"{'config':28} {'init':12} {'V':>6} {'ln V':>7} {'loss':>8} {'excess':>8}")
    for r in rows:
        print(
            f"{r['config']:28} {r['label']:12} {r['vocab_size']:6d} {r['ln_vocab']:7.3f} "
            f"{r['first_loss']:8.3f} {r['excess_nats']:+8.3f}"
        )
    report.write_json(
        _OUT.value,
        previous
        | {
            "machine": report.host_line(),
            "rows_per_batch": _ROWS.value,
            "seq_len": _SEQ_LEN.value,
            "rows": kept + rows,
        },
    )


if __name__ == "__main__":
    app.run(main)
