"""Experiment configuration: the keys every config file starts from, and their validation.

Config files in `configs/` call `default_config()` and change what they need (derivation by
function call, never by inheritance). The config it returns is locked (`ConfigDict.lock()`): a key
it does not define cannot be set, whether by a config file, by `--config.KEY=VALUE` (the launcher
loads files with `config_flags.DEFINE_config_file(..., lock_config=True)`) or by
`update_from_flattened_dict`, and the refusal names the key. `validate()` runs before any work
starts; every problem it finds is a `ConfigError` whose message is one line naming the key, the
value and what is allowed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Any

import ml_collections

COMPUTE_DTYPES = ("float32", "bfloat16")
DATA_SOURCES = ("text", "arrayrecord", "synthetic")
REHEARSAL_MODES = ("", "replay", "synthetic")


class BadInput(Exception):
    """Input the run refuses (config, flags, workdir, data, a checkpoint of another model).

    Fatal: the process exits with `ExitCode.BAD_INPUT` and this one-line message, and the
    supervisor does not restart it, since a restart would only repeat it. Raise it (or a subclass)
    only for what the user must fix; anything else is a failure worth a restart.
    """


class ConfigError(BadInput, ValueError):
    """A configuration problem, reported as one line before any work starts."""


def default_config() -> ml_collections.ConfigDict:
    """Every key a config may set, with defaults for a tiny byte-level model on CPU; locked."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # parameter initialisation and the data order derive from it
    c.total_steps = 200  # optimizer steps to train; the learning-rate schedule spans them
    c.global_batch_size = 16  # sequences per optimizer step, whatever the mesh
    # Rows one device processes at once; 0 = all its rows in one microbatch. When the mesh
    # shrinks, more accumulation microbatches keep the global batch unchanged.
    c.per_device_batch_size = 0

    # The decoder-only transformer (resilient_jax.model).
    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 256  # byte-level: nothing to download
    c.model.d_model = 256  # width of the residual stream
    c.model.num_layers = 4  # transformer blocks
    c.model.num_heads = 4  # query heads
    c.model.num_kv_heads = 4  # key/value heads; fewer than num_heads is grouped-query attention
    c.model.head_dim = 64  # per head; even, as rotary positions rotate pairs
    c.model.d_ff = 768  # hidden width of the gated MLP
    c.model.max_seq_len = 512  # longest sequence the model is meant for; >= data.seq_len
    c.model.rope_theta = 10000.0  # rotary base; larger reaches further
    c.model.norm_eps = 1e-6  # RMSNorm epsilon
    c.model.remat = False  # recompute each block in the backward pass: less memory, more compute
    c.model.compute_dtype = "float32"  # activations' dtype; parameters stay float32
    c.model.tie_embeddings = True  # the output projection reuses the input embedding
    c.model.moe = ml_collections.ConfigDict()  # mixture of experts (resilient_jax.model.moe)
    c.model.moe.num_experts = 0  # experts per MoE layer; 0 = dense
    c.model.moe.every = 1  # layers every-1, 2*every-1, ... are MoE layers
    c.model.moe.top_k = 2  # experts per token: 1 (Switch) or 2 (GShard)
    c.model.moe.capacity_factor = 1.25  # x top_k x seq_len / num_experts: slots per expert and row
    c.model.moe.d_ff = 0  # hidden width of one expert; 0 = model.d_ff
    c.model.moe.balance_weight = 0.1  # per MoE layer; Switch's 0.01 left tiny_cpu's experts idle
    c.model.moe.z_weight = 0.001  # router z-loss weight (ST-MoE)

    # The training data (resilient_jax.data): batch s is a pure function of (data, seed, s).
    c.data = ml_collections.ConfigDict()
    c.data.source = "text"  # text | arrayrecord | synthetic
    # text: a .txt file or directory (empty = bundled corpus); arrayrecord: a file or glob
    c.data.path = ""
    c.data.seq_len = 128  # tokens per training sequence
    # Text to token ids (resilient_jax.data.tokenizer): "" = bytes (vocabulary 256), "bundled" =
    # the byte-level BPE shipped for the bundled corpus, or a path to any tokenizer.json.
    # model.vocab_size must be at least the tokenizer's vocabulary.
    c.data.tokenizer = ""
    # A weighted mixture of datasets instead of data.path: "PATH:WEIGHT,PATH:WEIGHT,...", each
    # PATH of data.source's kind (text: a file, directory or glob, "" = the bundled corpus;
    # arrayrecord: a file or glob), each WEIGHT a positive number, relative to the others. Example
    # k of the stream is drawn from the shuffled datasets in a fixed interleaving with these
    # proportions (resilient_jax.data.mixture); "" = no mixture, data.path alone.
    c.data.mixture = ""
    c.data.prefetch = 2  # steps loaded ahead of the one running
    c.data.num_threads = 2  # Grain threads reading records

    # AdamW with linear warmup, then cosine decay over total_steps (resilient_jax.train.state).
    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 3e-3  # peak, reached after warmup_steps
    c.optimizer.warmup_steps = 20  # linear rise from 0 to learning_rate
    c.optimizer.min_lr_ratio = 0.1  # cosine decays to learning_rate * min_lr_ratio
    c.optimizer.weight_decay = 0.1  # decoupled; matrices only, never norms
    c.optimizer.b1 = 0.9  # Adam's first-moment decay
    c.optimizer.b2 = 0.95  # Adam's second-moment decay
    c.optimizer.eps = 1e-8  # Adam's denominator floor
    c.optimizer.grad_clip_norm = 1.0  # clip the global gradient norm to this; 0 = no clipping
    # GaLore (resilient_jax.train.galore): Adam on gradients projected to their top singular vectors
    c.optimizer.galore = ml_collections.ConfigDict()
    c.optimizer.galore.rank = 0  # rank of the projection; 0 = off (plain AdamW)
    c.optimizer.galore.update_interval = 200  # optimizer steps between SVD refreshes of the basis
    # x the update projected back: 2 = sqrt(d/r) at r = d/4 gives AdamW's update RMS (README)
    c.optimizer.galore.scale = 2.0
    c.optimizer.galore.min_size = 4096  # weights with fewer elements (and all 1-D) stay plain Adam

    # Mesh axes: replica crosses slices, fsdp and tensor stay inside one (resilient_jax.topology).
    c.mesh = ml_collections.ConfigDict()
    c.mesh.replica = -1  # -1: one per slice
    c.mesh.fsdp = -1  # -1: the devices of a slice left after tensor
    c.mesh.tensor = 1  # tensor-parallel ways; divides num_heads and num_kv_heads
    c.mesh.expert = 1  # expert-parallel ways in a slice (data-parallel outside MoE layers)

    # Checkpoint tiers and policies (resilient_jax.checkpoint).
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.dir = ""  # persistent tier: "" = <workdir>/checkpoints; a path or gs:// URL
    c.checkpoint.every_steps = 100  # persistent tier; 0 = off
    c.checkpoint.every_minutes = 0.0  # temporary persistent saves, deleted once superseded; 0 = off
    c.checkpoint.keep = 3  # newest persistent steps kept; older ones are deleted
    c.checkpoint.keep_period = 0  # also keep every K-th step for good; 0 = off
    c.checkpoint.local_dir = "/dev/shm/resilient_jax"  # local RAM-disk tier root; "" = off
    c.checkpoint.local_every_steps = 10  # 0 = off
    # Local saves at the Young/Daly interval (measured save cost and step time, the supervisor's
    # observed MTBF or checkpoint.mtbf_s), at most local_every_steps apart.
    c.checkpoint.local_auto_interval = True
    c.checkpoint.local_keep = 2  # newest local steps kept per process
    # Persistent saves at the Young/Daly interval from the measured save cost and mtbf_s,
    # instead of every_steps.
    c.checkpoint.auto_interval = False
    c.checkpoint.mtbf_s = 3600.0  # mean time between failures assumed when none is observed
    c.checkpoint.init_from = ""  # a checkpoint dir of another run/model to initialise from
    # A Hugging Face Llama directory (config.json, model.safetensors) whose weights start a fresh
    # run (resilient_jax.hf; `python -m resilient_jax.hf config --hf_dir=DIR` derives the model
    # section); restarts resume from the run's own checkpoints. Excludes init_from.
    c.checkpoint.init_from_hf = ""
    c.checkpoint.sync_timeout_s = 300.0  # bound on waiting for peers to agree (restore, saves)
    # An object-store outage (resilient_jax.checkpoint.outage): a persistent save not committed
    # this long after it began, or a store not answering within it, counts as failed; training
    # goes on with the local tier and the next persistent save is tried on schedule.
    c.checkpoint.persistent_timeout_s = 30.0
    # Persistent tier unreachable for longer than this (checked at each scheduled persistent save):
    # a final local save, then exit ExitCode.STORAGE_UNREACHABLE.
    c.checkpoint.persistent_outage_limit_s = 1800.0

    # In-band anomaly detection and self-healing (resilient_jax.health).
    c.health = ml_collections.ConfigDict()
    c.health.enabled = True  # refuse anomalous updates inside the step; off: stop at a NaN
    c.health.zscore = 6.0  # a loss or grad-norm this many std above its running mean is a spike
    c.health.warmup_steps = 20  # no spike verdicts before the running statistics settle
    c.health.ema_decay = 0.98  # memory of the running mean and variance, per step
    c.health.max_skips = 3  # anomalous steps skipped in a row before rolling back
    c.health.rollback_skip_batches = 4  # data window skipped after a rollback
    c.health.max_rollbacks = 2  # then stop with a reason
    # PID control of the learning rate on the spike score (max of loss and grad-norm z-scores).
    c.health.pid_enabled = False
    c.health.pid_target_z = 2.0  # scores below this train at the full learning rate
    c.health.pid_kp = 0.5  # proportional gain, on the score's excess over the target
    c.health.pid_ki = 0.3  # integral gain: keeps the rate low a few steps after a spike
    c.health.pid_kd = 0.1  # derivative gain, on the change of the excess
    c.health.pid_min_scale = 0.05  # the controller never cuts the learning rate below this
    c.health.straggler_factor = 1.5  # median step time this many times the job's is a straggler
    c.health.straggler_window = 20  # step times per process behind a straggler verdict
    c.health.watchdog_timeout_s = 300.0  # no step completed for this long: hang; 0 = off
    c.health.watchdog_startup_timeout_s = 1800.0  # budget for restore + compile before step 1

    # Multi-controller supervision (resilient_jax.control, launch/local_cluster.py).
    c.coordinator = ml_collections.ConfigDict()
    c.coordinator.heartbeat_interval_s = 0.5  # worker -> supervisor
    c.coordinator.heartbeat_timeout_s = 5.0  # no heartbeat for this long: the process is lost
    # jax.distributed's own timeout: survivors of a dead peer are aborted after it. Longer than
    # heartbeat_timeout_s, so the supervisor names the lost process before JAX aborts the rest.
    c.coordinator.jax_heartbeat_timeout_s = 10
    c.coordinator.hang_factor = 10.0  # no step for max(hang_factor x median step time,
    c.coordinator.hang_floor_s = 60.0  # hang_floor_s) while training is a hang
    c.coordinator.startup_timeout_s = 600.0  # JAX init + restore + compile; also saves
    # Every process restored and compiled, the first step still not done: it sets up the
    # collectives (minutes for NCCL at thousands of GPUs), nothing else.
    c.coordinator.first_step_timeout_s = 300.0
    c.coordinator.min_slices = 1  # fewer healthy slices: wait for one to return, then stop
    c.coordinator.wait_for_slices_s = 300.0  # how long to wait below min_slices before stopping
    c.coordinator.max_restarts = 20  # failures only: preemptions and scale-ups are free
    c.coordinator.crash_loop_limit = 3  # failures in a row that never get past the last one's step
    c.coordinator.backoff_s = 1.0  # the 2nd failure in a row waits this, doubling each time
    c.coordinator.backoff_max_s = 60.0  # the doubling stops here
    c.coordinator.readmit_after_s = 60.0  # an evicted slice is healthy again after this; < 0 never
    # Re-admit a returned slice only when the measured speed-up over the observed time between
    # failures outweighs the measured restart cost (False: at once, at the next save).
    c.coordinator.scale_up_when_faster = True
    c.coordinator.kill_grace_s = 0.5  # after a failure: SIGTERM, this long, then SIGKILL
    c.coordinator.save_grace_s = 60.0  # asked to save and stop: SIGTERM, this long, then SIGKILL
    # A straggler (health.straggler_factor over health.straggler_window steps) is always reported;
    # with this on its slice is evicted (after a save) when that makes the job faster: a spare
    # replaces it, or the other slices alone step faster than the job waiting for it.
    c.coordinator.evict_stragglers = True
    # The local supervisor starts the next generation's workers while the job trains, so that a
    # restart does not wait for Python's imports (launch/local_cluster.py only).
    c.coordinator.standby_workers = True
    # JAX's persistent compilation cache for supervised workers, so a restart skips the XLA
    # compile of the step: a relative path is under the workdir; "" = off.
    c.coordinator.compilation_cache_dir = ".jax_cache"
    # Host agents (resilient_jax.control.agent): a host whose agent is silent this long is lost
    # (heartbeats every heartbeat_interval_s, like the workers').
    c.coordinator.agent_timeout_s = 5.0
    # An agent without a supervisor for this long asks its workers to save and stop, then exits
    # with ExitCode.SUPERVISOR_LOST; a supervisor restarted sooner finds the run still training.
    c.coordinator.orphan_timeout_s = 120.0
    # The health probe before a host is admitted: start a JAX process and count its devices
    # (False: only the workdir, the local tier and free disk are checked).
    c.coordinator.probe_jax = True
    c.coordinator.probe_min_free_gb = 1.0  # free disk the workdir needs for a host to be admitted

    # What process 0 reports while training (resilient_jax.train.metrics).
    c.log = ml_collections.ConfigDict()
    c.log.every_steps = 10  # a metrics.jsonl row (and TensorBoard point) every this many steps
    c.log.peak_flops_per_device = 0.0  # 0: guess from the device kind (for the MFU estimate)
    c.log.progress_bar = True  # drawn only when stdout is a terminal
    c.log.tensorboard = True  # event files under <workdir>/tensorboard

    # Held-out evaluation (resilient_jax.train.eval): eval_loss and its perplexity in
    # metrics.jsonl, TensorBoard and the progress line.
    c.eval = ml_collections.ConfigDict()
    # Evaluate every this many training steps, and after the last one; 0 = off.
    c.eval.every_steps = 50
    c.eval.steps = 4  # global batches of the validation split per evaluation, the same each time
    # The last fraction of the data source's examples is the validation split; training never
    # sees them (whether evaluation is on or off, so the training data does not change with it).
    c.eval.fraction = 0.05
    # More datasets to evaluate on, "NAME=PATH,NAME=PATH" (data.source's kind; PATH "" = the
    # bundled corpus): the held-out part of each (its last eval.fraction) is evaluated with the
    # training data's and logged as eval_loss/NAME, e.g. the old and the new domain of a
    # continual-pretraining run. "" = none.
    c.eval.datasets = ""

    # Continual pretraining (resilient_jax.rehearsal): a run that starts from another model
    # (checkpoint.init_from or init_from_hf) on new data forgets the old domain less when a share
    # of its examples rehearses it (interleaved as in data.mixture, the rest from the new data).
    c.rehearsal = ml_collections.ConfigDict()
    # "" = off; "replay" = a seeded sample of the old data (rehearsal.old_data, when it is
    # still at hand); "synthetic" = text the base model writes before training starts (seeded,
    # committed in chunks under <workdir>/rehearsal: an interrupted run resumes generating and
    # gets the same tokens), when the old data is gone.
    c.rehearsal.mode = ""
    c.rehearsal.ratio = 0.25  # share of the training examples drawn from the rehearsal set
    c.rehearsal.sequences = 256  # size of the rehearsal set, in sequences of data.seq_len tokens
    # replay: the old data, of data.source's kind ("" = the bundled corpus); the sample comes
    # from its training part only (its last eval.fraction stays held out, as for evaluation)
    c.rehearsal.old_data = ""
    c.rehearsal.prompt = "\n"  # synthetic: the text every generated sequence starts from
    c.rehearsal.temperature = 1.0  # synthetic: how the base model samples (resilient_jax.decode)
    c.rehearsal.top_k = 0  # synthetic: 0 = all tokens
    c.rehearsal.top_p = 1.0  # synthetic: 1 = all tokens
    c.rehearsal.chunk_sequences = 32  # synthetic: sequences generated (and committed) together

    # A jax.profiler trace of some steps into <workdir>/profile/ (resilient_jax.train.profile).
    c.profile = ml_collections.ConfigDict()
    c.profile.steps = ""  # "START:STOP": steps START..STOP-1 (steps count from 1); "" = off
    c.lock()
    return c


def config_to_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
    return json.loads(config.to_json())


def fingerprint(config: ml_collections.ConfigDict) -> str:
    """Hash of what defines the trained function: model shapes, data (with the held-out share) and
    seed (not logging)."""
    d = config_to_dict(config)
    keep = {k: d[k] for k in ("model", "seed", "global_batch_size") if k in d}
    data_keys = ("source", "path", "seq_len", "tokenizer", "mixture")
    keep["data"] = {k: d["data"].get(k) for k in data_keys}
    keep["eval_fraction"] = d["eval"]["fraction"]  # the held-out share is not trained on
    if d["rehearsal"]["mode"]:  # what the run rehearses is part of its data (absent when off)
        keep["rehearsal"] = d["rehearsal"]
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"config.{key}={value!r} is invalid: {allowed}")


def _check_positive(config: ml_collections.ConfigDict, *keys: str) -> None:
    for key in keys:
        value = _get(config, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            _fail(key, value, "must be a positive integer")


def _get(config: ml_collections.ConfigDict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node[part]
    return node


def validate(config: ml_collections.ConfigDict) -> None:
    """Checks that need no devices. Device-dependent checks live in `topology.plan_mesh`."""
    _check_positive(
        config,
        "total_steps",
        "global_batch_size",
        "model.vocab_size",
        "model.d_model",
        "model.num_layers",
        "model.num_heads",
        "model.num_kv_heads",
        "model.head_dim",
        "model.d_ff",
        "model.max_seq_len",
        "data.seq_len",
        "log.every_steps",
    )
    if config.per_device_batch_size < 0:
        _fail("per_device_batch_size", config.per_device_batch_size, "must be >= 0 (0 = automatic)")
    m = config.model
    if m.compute_dtype not in COMPUTE_DTYPES:
        _fail("model.compute_dtype", m.compute_dtype, f"allowed: {', '.join(COMPUTE_DTYPES)}")
    if m.num_heads % m.num_kv_heads:
        _fail("model.num_kv_heads", m.num_kv_heads, f"must divide model.num_heads={m.num_heads}")
    if m.head_dim % 2:
        _fail("model.head_dim", m.head_dim, "must be even (rotary positions rotate pairs)")
    if config.data.seq_len > m.max_seq_len:
        _fail("data.seq_len", config.data.seq_len, f"must be <= model.max_seq_len={m.max_seq_len}")
    if config.data.source not in DATA_SOURCES:
        _fail("data.source", config.data.source, f"allowed: {', '.join(DATA_SOURCES)}")
    if config.data.source == "arrayrecord" and not (config.data.path or config.data.mixture):
        _fail("data.path", config.data.path, "data.source='arrayrecord' needs a file or glob")
    if config.data.source in ("text", "arrayrecord") and config.data.path:
        _check_data_path("data.path", config.data.path)
    if config.data.source == "synthetic" and config.data.path:
        _fail("data.path", config.data.path, "data.source='synthetic' takes no path")
    _validate_tokenizer_and_mixture(config.data)
    if config.data.prefetch < 0 or config.data.num_threads < 1:
        _fail("data.prefetch", config.data.prefetch, "prefetch >= 0 and num_threads >= 1")
    o = config.optimizer
    if not o.learning_rate > 0:
        _fail("optimizer.learning_rate", o.learning_rate, "must be > 0")
    if o.warmup_steps < 0:
        _fail("optimizer.warmup_steps", o.warmup_steps, "must be >= 0")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        _fail("optimizer.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    if o.grad_clip_norm < 0:
        _fail("optimizer.grad_clip_norm", o.grad_clip_norm, "must be >= 0 (0 = no clipping)")
    _validate_galore(config)
    _validate_moe(config)
    for axis in ("replica", "fsdp", "tensor"):
        value = config.mesh[axis]
        if value == 0 or value < -1:
            _fail(f"mesh.{axis}", value, "must be a positive integer or -1 (automatic)")
    if config.mesh.tensor == -1:
        _fail("mesh.tensor", -1, "must be a positive integer (never automatic)")
    if m.num_heads % config.mesh.tensor or m.num_kv_heads % config.mesh.tensor:
        _fail("mesh.tensor", config.mesh.tensor, "must divide num_heads and num_kv_heads")
    _validate_health(config.health)
    _validate_checkpoint(config.checkpoint)
    _validate_coordinator(config.coordinator)
    _validate_eval(config.eval, config.data.source)
    _validate_rehearsal(config)
    profile_steps(config.profile.steps)


def _validate_galore(config: ml_collections.ConfigDict) -> None:
    g = config.optimizer.galore
    for key in ("rank", "min_size"):
        if not isinstance(g[key], int) or isinstance(g[key], bool) or g[key] < 0:
            _fail(f"optimizer.galore.{key}", g[key], "must be an integer >= 0")
    _check_positive(config, "optimizer.galore.update_interval")
    if not g.scale > 0:
        _fail("optimizer.galore.scale", g.scale, "must be > 0")
    m = config.model  # GaLore projects MLP and attention matrices; embeddings keep full Adam
    heads = [m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim]
    matrices = [(m.d_model, m.d_ff), (m.d_ff, m.d_model)] + [(m.d_model, w) for w in heads]
    projected = [min(r, c) for r, c in matrices if r * c >= g.min_size]
    if projected and g.rank > min(projected):
        _fail("optimizer.galore.rank", g.rank, f"must be <= {min(projected)}, a projected side")


def _validate_moe(config: ml_collections.ConfigDict) -> None:
    moe, experts, axis = config.model.moe, config.model.moe.num_experts, config.mesh.expert
    _check_positive(config, "mesh.expert", "model.moe.every", "model.moe.top_k")
    for key in ("num_experts", "capacity_factor", "d_ff", "balance_weight", "z_weight"):
        if not moe[key] >= 0 or (key == "capacity_factor" and not moe[key] > 0):
            _fail(f"model.moe.{key}", moe[key], "must be >= 0 (capacity_factor > 0)")
    if experts % axis or (not experts and axis != 1):
        _fail("mesh.expert", axis, f"must divide model.moe.num_experts={experts} (1 when dense)")
    if experts and (moe.top_k > min(2, experts) or moe.every > config.model.num_layers):
        key, value = ("top_k", moe.top_k) if moe.top_k > min(2, experts) else ("every", moe.every)
        _fail(f"model.moe.{key}", value, "top_k <= min(2, num_experts), every <= num_layers")


def _validate_checkpoint(c: ml_collections.ConfigDict) -> None:
    for key in ("every_steps", "keep_period", "local_every_steps"):
        if c[key] < 0:
            _fail(f"checkpoint.{key}", c[key], "must be >= 0 (0 = off)")
    if c.every_minutes < 0:
        _fail("checkpoint.every_minutes", c.every_minutes, "must be >= 0 (0 = off)")
    for key in ("keep", "local_keep"):
        if c[key] < 1:
            _fail(f"checkpoint.{key}", c[key], "must be >= 1")
    if not c.mtbf_s > 0:
        _fail("checkpoint.mtbf_s", c.mtbf_s, "must be > 0 seconds")
    for key in ("sync_timeout_s", "persistent_timeout_s", "persistent_outage_limit_s"):
        if not c[key] > 0:
            _fail(f"checkpoint.{key}", c[key], "must be > 0 seconds")
    if c.init_from and c.init_from_hf:
        _fail("checkpoint.init_from_hf", c.init_from_hf, "excludes checkpoint.init_from (pick one)")


def _validate_health(h: ml_collections.ConfigDict) -> None:
    if not h.zscore > 0:
        _fail("health.zscore", h.zscore, "must be > 0")
    if not 0.0 < h.ema_decay < 1.0:
        _fail("health.ema_decay", h.ema_decay, "must be in (0, 1)")
    for key in ("warmup_steps", "rollback_skip_batches", "max_rollbacks"):
        if h[key] < 0:
            _fail(f"health.{key}", h[key], "must be >= 0")
    if h.max_skips < 1:
        _fail("health.max_skips", h.max_skips, "must be >= 1")
    for key in ("pid_kp", "pid_ki", "pid_kd"):
        if h[key] < 0:
            _fail(f"health.{key}", h[key], "must be >= 0")
    if not 0.0 < h.pid_min_scale <= 1.0:
        _fail("health.pid_min_scale", h.pid_min_scale, "must be in (0, 1]")
    if not h.straggler_factor > 1.0:
        _fail("health.straggler_factor", h.straggler_factor, "must be > 1")
    if h.straggler_window < 1:
        _fail("health.straggler_window", h.straggler_window, "must be >= 1")
    for key in ("watchdog_timeout_s", "watchdog_startup_timeout_s"):
        if h[key] < 0:
            _fail(f"health.{key}", h[key], "must be >= 0 (0 = off)")


def _validate_coordinator(c: ml_collections.ConfigDict) -> None:
    for key in (
        "heartbeat_interval_s",
        "agent_timeout_s",
        "orphan_timeout_s",
        "hang_floor_s",
        "startup_timeout_s",
        "first_step_timeout_s",
    ):
        if not c[key] > 0:
            _fail(f"coordinator.{key}", c[key], "must be > 0")
    if not c.heartbeat_timeout_s >= 2 * c.heartbeat_interval_s:
        _fail(
            "coordinator.heartbeat_timeout_s",
            c.heartbeat_timeout_s,
            f"must be >= 2 x heartbeat_interval_s={c.heartbeat_interval_s}",
        )
    jax_timeout = c.jax_heartbeat_timeout_s
    if not isinstance(jax_timeout, int) or not jax_timeout > c.heartbeat_timeout_s:
        _fail(
            "coordinator.jax_heartbeat_timeout_s",
            jax_timeout,
            f"must be an integer > heartbeat_timeout_s={c.heartbeat_timeout_s}",
        )
    if not c.hang_factor >= 1:
        _fail("coordinator.hang_factor", c.hang_factor, "must be >= 1")
    for key in ("min_slices", "crash_loop_limit"):
        if c[key] < 1:
            _fail(f"coordinator.{key}", c[key], "must be >= 1")
    for key in ("max_restarts", "wait_for_slices_s", "backoff_s", "kill_grace_s", "save_grace_s"):
        if c[key] < 0:
            _fail(f"coordinator.{key}", c[key], "must be >= 0")
    if c.probe_min_free_gb < 0:
        _fail("coordinator.probe_min_free_gb", c.probe_min_free_gb, "must be >= 0")
    if c.backoff_max_s < c.backoff_s:
        _fail("coordinator.backoff_max_s", c.backoff_max_s, f"must be >= backoff_s={c.backoff_s}")


def parse_eval_datasets(spec: str) -> tuple[tuple[str, str], ...]:
    """`eval.datasets` as (name, path) pairs; a malformed entry or a repeated name is a
    ConfigError."""
    if not spec:
        return ()
    entries = []
    for entry in spec.split(","):
        name, eq, path = entry.strip().partition("=")
        if not eq or not name.isidentifier():
            _fail("eval.datasets", spec, f"entry {entry.strip()!r} is not NAME=PATH (NAME a word)")
        if name in (n for n, _ in entries):
            _fail("eval.datasets", spec, f"the name {name!r} is given twice")
        entries.append((name, path.strip()))
    return tuple(entries)


def _validate_eval(e: ml_collections.ConfigDict, source: str) -> None:
    for _, path in parse_eval_datasets(e.datasets):
        if source == "synthetic":
            _fail("eval.datasets", e.datasets, "data.source='synthetic' takes no datasets")
        if source == "arrayrecord" and not path:
            _fail("eval.datasets", e.datasets, "data.source='arrayrecord' needs a path each")
        if path:
            _check_data_path("eval.datasets", path)
    if e.every_steps < 0:
        _fail("eval.every_steps", e.every_steps, "must be >= 0 (0 = off)")
    if e.steps < 1:
        _fail("eval.steps", e.steps, "must be >= 1")
    if not 0.0 <= e.fraction < 1.0:
        _fail("eval.fraction", e.fraction, "must be in [0, 1)")
    if e.every_steps and not e.fraction > 0:
        _fail("eval.fraction", e.fraction, "must be > 0 when eval.every_steps > 0 (held-out data)")


def _validate_rehearsal(config: ml_collections.ConfigDict) -> None:
    r = config.rehearsal
    if r.mode not in REHEARSAL_MODES:
        _fail("rehearsal.mode", r.mode, "allowed: '' (off), replay, synthetic")
    if not r.mode:
        return
    if config.data.source == "synthetic":
        _fail("rehearsal.mode", r.mode, "data.source='synthetic' has no old domain to rehearse")
    if not 0.0 < r.ratio < 1.0:
        _fail("rehearsal.ratio", r.ratio, "must be in (0, 1): a share of the training examples")
    _check_positive(config, "rehearsal.sequences", "rehearsal.chunk_sequences")
    if r.mode == "replay":
        if config.data.source == "arrayrecord" and not r.old_data:
            _fail("rehearsal.old_data", "", "data.source='arrayrecord' needs a file or glob")
        if r.old_data:
            _check_data_path("rehearsal.old_data", r.old_data)
        return
    c = config.checkpoint
    if not (c.init_from or c.init_from_hf):
        _fail(
            "rehearsal.mode",
            r.mode,
            "'synthetic' needs the base model that writes the text: set checkpoint.init_from or "
            "checkpoint.init_from_hf",
        )
    if not r.prompt:
        _fail("rehearsal.prompt", r.prompt, "must be a non-empty text")
    if not r.temperature >= 0:
        _fail("rehearsal.temperature", r.temperature, "must be >= 0 (0: greedy)")
    if r.top_k < 0:
        _fail("rehearsal.top_k", r.top_k, "must be >= 0 (0: off)")
    if not 0 < r.top_p <= 1:
        _fail("rehearsal.top_p", r.top_p, "must be in (0, 1] (1: off)")


def profile_steps(value: str) -> range | None:
    """The steps `profile.steps` asks to trace ("START:STOP": START..STOP-1), or None for ""."""
    if not value:
        return None
    bounds = value.split(":")
    if len(bounds) != 2 or not all(b.strip().lstrip("-").isdigit() for b in bounds):
        _fail("profile.steps", value, 'must be "START:STOP", two integers')
    start, stop = (int(b) for b in bounds)
    if start < 1 or stop <= start:
        _fail("profile.steps", value, "needs 1 <= START < STOP (steps START..STOP-1 are traced)")
    return range(start, stop)


def _check_data_path(key: str, path: str) -> None:
    if path.startswith("gs://"):
        return
    if not glob.glob(path) and not os.path.exists(path):
        _fail(key, path, "no such file, directory or glob match")


def parse_mixture(spec: str) -> tuple[tuple[str, float], ...]:
    """`data.mixture` as (path, weight) pairs; a malformed entry or a weight <= 0 is a ConfigError.

    A path may hold colons (gs://...): the weight is what follows the last one.
    """
    entries = []
    for entry in spec.split(","):
        path, colon, weight_text = entry.strip().rpartition(":")
        if not colon:
            _fail("data.mixture", spec, f"entry {entry.strip()!r} is not PATH:WEIGHT")
        try:
            weight = float(weight_text)
        except ValueError:
            weight = float("nan")
        if not weight > 0 or weight == float("inf"):
            _fail("data.mixture", spec, f"the weight of {path!r} must be a positive number")
        entries.append((path, weight))
    return tuple(entries)


def _validate_tokenizer_and_mixture(d: ml_collections.ConfigDict) -> None:
    """The tokenizer file exists; the mixture parses and names datasets that exist. (The model's
    vocabulary is checked against the tokenizer's where it is loaded: data.tokenizer.)"""
    special = ("", "bundled")  # bytes; the tokenizer shipped in resilient_jax/data/assets
    if d.tokenizer not in special and not os.path.isfile(d.tokenizer):
        _fail("data.tokenizer", d.tokenizer, "no such file (a tokenizer.json, '' or 'bundled')")
    if not d.mixture:
        return
    if d.source == "synthetic":
        _fail("data.mixture", d.mixture, "data.source='synthetic' takes no mixture")
    if d.path:
        _fail("data.mixture", d.mixture, f"give data.path={d.path!r} or a mixture, not both")
    for path, _ in parse_mixture(d.mixture):
        if d.source == "arrayrecord" and not path:
            _fail("data.mixture", d.mixture, "data.source='arrayrecord' needs a path each")
        if path:
            _check_data_path("data.mixture", path)
