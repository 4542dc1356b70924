"""Llama-2 7B pretraining with the published recipe (Touvron et al. 2023; HLAT, Fan et al. 2024).

Model: 32 layers, d_model 4096, 32 heads of 128 (no grouped-query attention at 7B), SwiGLU MLP
11008, RMSNorm eps 1e-5, rotary base 10000, untied 32,000-token embeddings: 6.74B parameters.
Training: sequences of 4,096 tokens, 1,024 per step (4.19M tokens), AdamW (b1 0.9, b2 0.95, eps
1e-5, weight decay 0.1), peak learning rate 3e-4 after 2,000 warmup steps, cosine decay to 10%
(3e-5), gradients clipped at norm 1.0, 480,000 steps (2.0T tokens). bf16 compute; the parameters
and the optimizer state stay float32 (the model always keeps float32 master weights and casts
them per use), blocks rematerialised. One row per device per microbatch; on fewer devices the
step accumulates more microbatches, so the 4M-token batch never changes.

Check it against a cluster first, in seconds and without touching a device:

    python launch/train.py --config=configs/llama_7b.py --plan \\
        --cluster=devices=64,memory_gb=80,slices=8

prints per device the bytes of parameters, optimizer state, gradients, gathered weights,
activations per microbatch and checkpoint shards, for the whole cluster and after losing one or
two slices, and whether each fits. Expected on 8 slices of 8 80 GB GPUs: 21.5 GB per device
(params 3.4, optimizer 6.7, gradients 6.7, gathered weights 0.8, activations 3.8), fits; on 7 or
6 slices there is no mesh: 1,024 rows do not split over 56 or 48 data-parallel devices. So keep a
spare slice in the allocation (the supervisor swaps it in for a lost one; below: 9 nodes), or
plan slices whose survivors still divide the batch (4 slices of 8: 2 left fit, 3 do not).

Then train. What is on by default: auto-resume (every start restores the newest verified step of
either checkpoint tier, on whatever mesh is alive), checkpoints at the Young/Daly interval from the
measured save cost and the observed MTBF (persistent tier: `checkpoint.auto_interval`, at most
`every_steps` apart; local RAM-disk tier every few minutes of steps), every 10,000th step kept for
good, and the event log the goodput report reads (`python -m resilient_jax.goodput WORKDIR`).
Point the data at a corpus prepared once into a token store, and at its tokenizer (the default
trains on the bundled English text so that the recipe runs anywhere; launch/slurm/prepare.sbatch
runs the preparation as an array job):

    python -m resilient_jax.data.prepare --input='gs://BUCKET/corpus/*.jsonl.zst' \\
        --output=/shared/stores/corpus --tokenizer=/path/to/llama2/tokenizer.json
    --config.data.path=/shared/stores/corpus --config.data.tokenizer=/path/to/llama2/tokenizer.json

SLURM (launch/slurm/, see launch/README.md for the current knobs), 8 nodes of 8 GPUs plus a spare:

    CONFIG=configs/llama_7b.py WORKDIR=/shared/runs/llama7b NUM_SLICES=8 NODES_PER_SLICE=1 \\
        sbatch --nodes=9 launch/slurm/train.sbatch --config.data.path=...

Kubernetes: `launch/k8s/jobset-gpu.yaml` with `CONFIG=configs/llama_7b.py`, 8 replicated jobs of
one 8-GPU node each (TPU: `launch/k8s/jobset-tpu-multislice.yaml`).

Expected: the loss of Llama-2 7B (about 1.75 at 2T tokens on its data); no figure measured here.
"""

from resilient_jax.config import default_config


def get_config():
    config = default_config()
    config.seed = 0
    config.total_steps = 480_000  # x 4.19M tokens = 2.0T tokens
    config.global_batch_size = 1024  # x 4096 tokens = 4.19M tokens per step
    config.per_device_batch_size = 1  # rows per device per microbatch (plan: ~6 GB activations)

    m = config.model
    m.vocab_size = 32_000
    m.d_model = 4096
    m.num_layers = 32
    m.num_heads = 32
    m.num_kv_heads = 32
    m.head_dim = 128
    m.d_ff = 11_008
    m.max_seq_len = 4096
    m.rope_theta = 10_000.0
    m.norm_eps = 1e-5
    m.remat = "full"
    m.compute_dtype = "bfloat16"  # float32 master weights and optimizer state, bf16 matmuls
    m.tie_embeddings = False

    config.data.seq_len = 4096

    o = config.optimizer
    o.learning_rate = 3e-4
    o.warmup_steps = 2000
    o.min_lr_ratio = 0.1
    o.weight_decay = 0.1
    o.b1 = 0.9
    o.b2 = 0.95
    o.eps = 1e-5
    o.grad_clip_norm = 1.0

    c = config.checkpoint
    c.auto_interval = True  # Young/Daly from the measured save cost and the run's MTBF
    c.every_steps = 1000  # the persistent interval's upper bound (about 2 hours at ~7 s a step)
    c.keep = 3
    c.keep_period = 10_000  # milestones kept for good
    c.local_every_steps = 100
    c.local_auto_interval = True
    c.mtbf_s = 4 * 3600.0  # assumed until the supervisor observes failures

    config.log.every_steps = 10
    config.eval.every_steps = 1000
    config.eval.steps = 8
    config.eval.fraction = 0.001
    config.health.watchdog_startup_timeout_s = 3600.0  # restoring 80 GB and compiling 32 layers
    return config
