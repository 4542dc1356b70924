"""configs/tiny_cpu.py made small enough that a step takes tens of milliseconds on a 2-core CPU:
d_model 64, 2 layers of 2 heads, 32 tokens per sequence. The tests train it, and the benchmarks
that measure a recovery against a step shorter than the failure detector's bound.

    python launch/train.py --config=configs/small_cpu.py --workdir=/tmp/small

`MODEL` is the same shrinking as dotted overrides, for code that starts from tiny_cpu's config or
passes `--config.KEY=VALUE` flags.
"""

from configs import tiny_cpu

MODEL = {
    "model.d_model": 64,
    "model.num_layers": 2,
    "model.num_heads": 2,
    "model.num_kv_heads": 2,
    "model.head_dim": 32,
    "model.d_ff": 128,
    "data.seq_len": 32,
}


def get_config():
    config = tiny_cpu.get_config()
    config.update_from_flattened_dict(MODEL)
    return config
