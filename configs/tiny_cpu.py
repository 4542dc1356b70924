"""The embedded default: a 3.5M-parameter byte-level model that trains on a 2-core CPU.

    python launch/train.py --config=configs/tiny_cpu.py --workdir=/tmp/run

Expected (measured on a 2-core CPU shared with other work): exit 0 after about 5 minutes, 1.3 s per
step; the loss falls from 7.07 at step 1 to 3.30, 2.24, 1.74 and 1.36 at steps 10, 50, 100 and 200
on the bundled English corpus (tests/golden/tiny_cpu.json holds the first three); the last line
printed is the run's goodput. `/tmp/run` then holds config.json, events.jsonl, metrics.jsonl,
tensorboard/ and checkpoints/ (steps 100 and 200).
"""

from resilient_jax.config import default_config


def get_config():
    config = default_config()
    config.total_steps = 200
    config.global_batch_size = 16
    config.data.seq_len = 128
    return config
