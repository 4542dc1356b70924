"""The embedded default: a 3.9M-parameter model on 1,024 subword tokens that trains on a 2-core CPU.

    python launch/train.py --config=configs/tiny_cpu.py --workdir=/tmp/run

The bundled English corpus, tokenized with the byte-level BPE shipped for it (data.tokenizer =
"bundled", 2.9 characters per token), so losses are per subword token. Expected (measured on a
quiet 2-core CPU: 62 s in all, about 0.27 s per step): exit 0; the training loss falls from 6.93
(ln 1024: the output layer starts at zero) at step 1 to 6.38, 4.80, 3.97 and 3.26 at steps 10, 50,
100 and 200 (tests/golden/tiny_cpu.json holds steps 10/50/100), and the held-out eval_loss from
4.96 at step 50 to 3.95, 3.60 and 3.46 at steps 100, 150 and 200 (perplexity 32); the last line
printed is the run's goodput. `/tmp/run` then holds config.json, events.jsonl, metrics.jsonl,
tensorboard/ and checkpoints/ (steps 100 and 200).
"""

from resilient_jax.config import default_config


def get_config():
    config = default_config()
    config.total_steps = 200
    config.global_batch_size = 16
    config.data.seq_len = 128
    config.data.tokenizer = "bundled"  # a 1024-token byte-level BPE of the bundled corpus
    config.model.vocab_size = 1024  # the tokenizer's vocabulary, a multiple of 128 for sharding
    # Recomputing each layer in the backward pass is faster here than keeping its activations:
    # a scanned stack of them costs a 2-core CPU's memory bandwidth more than the recompute costs
    # its cores (0.93x the step without remat, the losses bit for bit the same;
    # experiments/compile_depth.py).
    config.model.remat = "full"
    return config
