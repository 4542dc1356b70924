"""A Llama-3.2-1B-shaped model for one GPU: 16 layers, d_model 2048, 32 heads (8 kv heads),
gated MLP 8192, context 2048, bf16 compute, rematerialised blocks.

    python launch/train.py --config=configs/llama_1b.py --workdir=/tmp/llama1b

Expected: 0.97B parameters (the byte-level vocabulary keeps the embedding small; Llama's is 1.2B).
On one H100 in bf16 the MFU estimate in metrics.jsonl (`mfu`) is the figure of merit (see
experiments/bench_step.py); no GPU figure has been measured here yet.
"""

from resilient_jax.config import default_config


def get_config():
    config = default_config()
    config.total_steps = 10_000
    config.global_batch_size = 64
    config.per_device_batch_size = 8
    config.model.d_model = 2048
    config.model.num_layers = 16
    config.model.num_heads = 32
    config.model.num_kv_heads = 8
    config.model.head_dim = 64
    config.model.d_ff = 8192
    config.model.max_seq_len = 2048
    config.model.rope_theta = 500_000.0
    config.model.remat = "full"
    config.model.compute_dtype = "bfloat16"
    config.data.seq_len = 2048
    config.optimizer.learning_rate = 3e-4
    config.optimizer.warmup_steps = 500
    config.checkpoint.every_steps = 500
    config.checkpoint.local_every_steps = 50
    return config
