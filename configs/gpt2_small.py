"""GPT-2 small shapes (124M parameters with a GPT-2 vocabulary; 85M at the byte level): 12 layers,
d_model 768, 12 heads, context 1024, bf16 compute.

    python launch/train.py --config=configs/gpt2_small.py --workdir=/tmp/gpt2

Expected: on one GPU about 1 s per step of 0.5M tokens in bf16 (an estimate, not yet measured
here). On CPU use it only to check shapes:

    python launch/train.py --config=configs/gpt2_small.py --workdir=/tmp/gpt2 \
        --config.total_steps=2 --config.global_batch_size=8 --config.data.seq_len=128

finishes (exit 0) in about a minute on a 2-core CPU, with a checkpoint of step 2 in the workdir.
"""

from resilient_jax.config import default_config


def get_config():
    config = default_config()
    config.total_steps = 20_000
    config.global_batch_size = 512
    config.per_device_batch_size = 16
    config.model.d_model = 768
    config.model.num_layers = 12
    config.model.num_heads = 12
    config.model.num_kv_heads = 12
    config.model.head_dim = 64
    config.model.d_ff = 2048  # gated MLP: 3 matrices of 768x2048 ~ GPT-2's 2 of 768x3072
    config.model.max_seq_len = 1024
    config.model.compute_dtype = "bfloat16"
    config.data.seq_len = 1024
    config.optimizer.learning_rate = 6e-4
    config.optimizer.warmup_steps = 700
    config.checkpoint.every_steps = 1000
    config.checkpoint.local_every_steps = 100
    return config
