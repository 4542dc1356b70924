"""The embedded default: a 3.5M-parameter byte-level model that trains on a 2-core CPU.

    python launch/train.py --config=configs/tiny_cpu.py --workdir=/tmp/run

Expected: about a minute on a 2-core CPU; the loss falls from about 7 to about 1.5 on the bundled
English corpus; `/tmp/run` then holds config.json, events.jsonl, metrics.jsonl, tensorboard/ and
checkpoints/.
"""

from resilient_jax.config import default_config


def get_config():
    config = default_config()
    config.total_steps = 200
    config.global_batch_size = 16
    config.data.seq_len = 128
    return config
