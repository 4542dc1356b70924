"""configs/tiny_cpu.py made small enough that a step takes tens of milliseconds on a 2-core CPU:
d_model 64, 2 layers of 2 heads, 32 tokens per sequence. The tests train it, and the benchmarks
that measure a recovery against a step shorter than the failure detector's bound.

    python launch/train.py --config=configs/small_cpu.py --workdir=/tmp/small

`MODEL` is the same shrinking as dotted overrides, for code that starts from tiny_cpu's config or
passes `--config.KEY=VALUE` flags; `SHORT_RUN` adds what the tests' runs share (tests/conftest.py's
`SMALL`), so that most tests train, and compile, the same programs.
"""

import os
import runpy

# By path, not `from configs import tiny_cpu`: the launcher loads a config file by its path, with
# no `configs` package on sys.path.
_tiny_cpu = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_cpu.py"))

MODEL = {
    "model.d_model": 64,
    "model.num_layers": 2,
    "model.num_heads": 2,
    "model.num_kv_heads": 2,
    "model.head_dim": 32,
    "model.d_ff": 128,
    "data.seq_len": 32,
}

# MODEL for 20 steps with nothing beside the steps: no progress bar, TensorBoard or evaluation
# (the runs that check those turn them on).
SHORT_RUN = {
    **MODEL,
    "total_steps": 20,
    "log.progress_bar": False,
    "log.tensorboard": False,
    "eval.every_steps": 0,
}


def get_config():
    config = _tiny_cpu["get_config"]()
    config.update_from_flattened_dict(MODEL)
    return config
