"""Every key a config may set, with its default and a comment saying what it does; the config's
fingerprint."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import ml_collections


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
    # What the backward pass keeps of each layer (resilient_jax.model.layers): "none" (every
    # activation: fastest, most memory), "full" (each layer's input only; the rest is recomputed:
    # least memory, about a third more compute), "save_dots" (also the outputs of the products
    # with weights: most of full's saving on long sequences, little recompute).
    c.model.remat = "none"
    # Layers are stacked and scanned: one layer is compiled whatever the depth. Units (layers, or
    # groups of moe.every layers) unrolled per scan iteration; num_layers unrolls them all.
    c.model.scan_unroll = 1
    c.model.compute_dtype = "float32"  # activations' dtype; parameters stay float32
    # False: an output layer of its own, zero at initialisation (a first loss of exactly ln V);
    # True: the output projection reuses the input embedding (fewer parameters, a first loss
    # above ln V: resilient_jax/model/__init__.py).
    c.model.tie_embeddings = False
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
    # text: a token store (`python -m resilient_jax.data.prepare`: opened in milliseconds, any
    # seq_len), or corpus files tokenized at every start, up to 256 MiB (.txt, .jsonl[.gz|.zst],
    # .parquet, Arrow: a file, directory or glob; empty = the bundled corpus); arrayrecord: a
    # file or glob of records of seq_len + 1 int32 tokens from another pipeline.
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
    # Block-causal attention: a training row holds windows of several documents (each ended by
    # the tokenizer's end-of-text token); with this on, a token attends only to earlier tokens of
    # its own document and rotary positions restart at 0 after each end-of-text
    # (resilient_jax.model.segments). The loss still covers every position. Needs a tokenizer
    # with an end-of-text token. Measured cost and effect: README.md, "Document-aware attention".
    c.data.document_mask = False
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
    # Optimizer steps between SVD refreshes of the basis. The paper's 200 is for runs of 10k+
    # steps; with the moments rotated into each new basis, refreshing often costs only the SVDs.
    c.optimizer.galore.update_interval = 20
    # x the update projected back: sqrt(d/r), 2 at r = d/4, matches AdamW's update RMS; 3 (the
    # paper's 0.25 at 10x AdamW's learning rate is 2.5) measured best: experiments/README.md
    c.optimizer.galore.scale = 3.0
    c.optimizer.galore.min_size = 4096  # weights with fewer elements (and all 1-D) stay plain Adam
    # Carry Adam's moments into the new basis at each refresh (False: keep their coordinates)
    c.optimizer.galore.rotate_state = True

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
    # A snapshot of the state to the RAM disk every this many steps (0 = off): the loop waits only
    # for the copy off the devices, the write overlaps the next step, and a worker kill loses at
    # most this many steps (the RAM disk outlives the worker; every slice holds a full copy).
    c.checkpoint.local_every_steps = 1
    # Local saves at the Young/Daly interval (measured save cost and step time, the supervisor's
    # observed MTBF or checkpoint.mtbf_s), at most local_every_steps apart.
    c.checkpoint.local_auto_interval = True
    c.checkpoint.local_keep = 2  # newest local steps kept per process
    # What a save holds while both tiers read the state in the background (resilient_jax.
    # checkpoint.save_method): "always" keeps it on the device (the step after the save runs
    # without donation: no copy, but one extra params + optimizer state in device memory until
    # the tiers have read it); "never" copies it straight to pinned host memory, array by array
    # (no second device copy; the save blocks for the device-to-host transfer); "auto" keeps it
    # where the save step's peak (`--plan`) fits the device's memory, else copies.
    c.checkpoint.keep_state = "auto"
    # Memory of one device in GB for keep_state=auto; 0 = what the device reports (GPU, TPU).
    # A CPU reports none: there device memory is host memory, and the state is kept.
    c.checkpoint.device_memory_gb = 0.0
    # A replaced host (new machine, empty RAM disk) fetches the local-tier pieces it lacks from the
    # other hosts' agents, which serve their RAM disks read-only (resilient_jax.checkpoint.
    # peer_fetch), so the job resumes from the newest local step, not the older persistent one.
    # Needs host agents (the supervisor tells each worker its peers); off: this host's pieces only.
    c.checkpoint.peer_fetch = True
    # Bound on one request to a peer host (its manifests, or up to 64 MiB of pieces): a peer that
    # has not answered in full within it is skipped, its pieces taken from another copy or the
    # candidate step given up for the next one.
    c.checkpoint.peer_timeout_s = 10.0
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
    # An object-store outage (resilient_jax.checkpoint.store_outage): a persistent save not
    # committed this long after it began, or a store not answering within it, counts as failed;
    # training goes on with the local tier and the next persistent save is tried on schedule.
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
    # How the job goes on when a slice is lost or returns (resilient_jax.control.reconfigure):
    # "cost" = the plan (a spare, reshape now, wait for the slice, re-admit now or at the next
    # restart) with the lowest expected time to the end of the run, from the step-time model,
    # the measured restart cost and the run's own MTBF; "reshape" = a spare, else restart at once
    # on the slices left; "wait" = a spare, else wait for a slice back within wait_for_slices_s.
    c.coordinator.reconfiguration = "cost"
    # A restart's cost (stop to the next first step) until the run has measured one.
    c.coordinator.restart_cost_s = 120.0
    # Step-time calibration of the devices (python -m resilient_jax.train.calibrate --out=FILE);
    # "" = accelerator-like defaults, scaled to the step time the run measures.
    c.coordinator.step_time_calibration = ""
    c.coordinator.kill_grace_s = 0.5  # after a failure: SIGTERM, this long, then SIGKILL
    c.coordinator.save_grace_s = 60.0  # asked to save and stop: SIGTERM, this long, then SIGKILL
    # A straggler (health.straggler_factor over health.straggler_window steps) is always reported;
    # with this on its slice is evicted (after a save) when that makes the job faster: a spare
    # replaces it, or the other slices alone step faster than the job waiting for it.
    c.coordinator.evict_stragglers = True
    # The local supervisor starts the next generation's workers while the job trains, so that a
    # restart does not wait for Python's imports (launch/local_cluster.py only).
    c.coordinator.standby_workers = True
    # Run the standbys under SCHED_IDLE until they are given a place (control/standby_cpu.py, as
    # elastic.standby_idle_cpu does for elastic mode's standby; only where the host agent may
    # raise a thread back: CAP_SYS_NICE or RLIMIT_NICE 20, Linux). Off: measured on 2 cores
    # (experiments/standby_cpu_restart.py), a restart's first step came 0.81-0.83x as late, but
    # its imports (about 2 CPU-s), spread over the steps after it, made them 1.5x as slow: no
    # net gain in the time to regain progress. Elastic mode's start-up (about 20 s of CPU) is
    # what the idle policy pays for.
    c.coordinator.standby_idle_cpu = False
    # JAX's persistent compilation cache for supervised workers, so a restart skips the XLA
    # compile of the step: a relative path is under the workdir; "" = off.
    c.coordinator.compilation_cache_dir = ".jax_cache"
    # While the job trains on S >= 2 slices, compile the step for S - 1 slices (the mesh a lost
    # slice leads to) in a niced background job and keep it in the cache above, so that reshaped
    # restart loads it instead of compiling (resilient_jax.precompile). A spare swapped in keeps
    # the mesh, whose step the running job has stored already. Needs the cache; not on TPU, whose
    # chips one process holds.
    c.coordinator.precompile_candidates = True
    # Host agents (resilient_jax.control.agent): a host whose agent is silent this long is lost
    # (heartbeats every heartbeat_interval_s, like the workers').
    c.coordinator.agent_timeout_s = 5.0
    # An agent without a supervisor for this long asks its workers to save and stop, then exits
    # with ExitCode.SUPERVISOR_LOST; a supervisor restarted sooner finds the run still training.
    c.coordinator.orphan_timeout_s = 120.0
    # An agent started before any supervisor (by a scheduler, on every host at once) waits this
    # long for the first one (its --connect_timeout_s), then exits with SUPERVISOR_LOST.
    c.coordinator.agent_connect_timeout_s = 600.0
    # The control ports (heartbeat, quorum) against clients that are not the run's. A connection
    # that has sent no line with the run token after this long is closed (refused):
    c.coordinator.auth_timeout_s = 10.0
    c.coordinator.max_pending_connections = 64  # such connections at once; more: closed at once
    # Every refusal is logged, at most this many per peer host and refusal_log_window_s; the
    # rest are counted, and their count is logged when the window ends.
    c.coordinator.refusals_logged_per_peer = 10
    c.coordinator.refusal_log_window_s = 60.0  # the window of refusals_logged_per_peer
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

    # Elastic data parallelism across slices (resilient_jax.elastic; the `elastic` extra, torch):
    # each slice its own JAX runtime, gradients summed across slices by a membership that may
    # change every step; survivors of a lost slice take over its rows. Off: one JAX runtime.
    c.elastic = ml_collections.ConfigDict()
    c.elastic.enabled = False  # on: launch/local_cluster.py runs the slices elastically
    c.elastic.slices = 2  # parts of the global batch (the slices the job starts with)
    c.elastic.backend = "gloo"  # the exchange's collective library (elastic.exchange)
    c.elastic.host = ""  # address this slice's rendezvous store listens on; "" = the hostname
    # a collective that has not completed after this long (a hung peer) fails and is redone
    c.elastic.timeout_s = 5.0
    # after a failed exchange, a connected slice that has not asked for a quorum within this
    # (hung) is left out of the next one
    c.elastic.join_timeout_s = 1.0
    # how long a slice without a usable exchange group (its exchange failed, or it is starting)
    # waits for a quorum before it exits non-zero
    c.elastic.quorum_timeout_s = 120.0
    # A warm standby slice: one spare slice process kept started ahead (imported, its runtime
    # built, its steps loaded from the job's executable cache, its exchange open), waiting idle
    # (no CPU) at the join point; a lost slice's identity is given to it, and it heals and joins
    # within about a second instead of a cold start's tens of seconds; a new standby is then
    # started. Costs one process's memory while idle; it runs under a host agent of its own (on
    # a cluster: a spare host), and the host a lost slice leaves takes the next standby.
    c.elastic.standby = True
    # The standby runs under SCHED_IDLE (only on CPU no slice wants) until it is given a slice,
    # then under the supervisor's own policy again: on a host it shares with training slices its
    # start-up (about 20 s of CPU) does not slow their steps. Only where the supervisor may raise
    # a thread back (CAP_SYS_NICE or RLIMIT_NICE 20, Linux); elsewhere it starts at normal priority.
    c.elastic.standby_idle_cpu = True
    c.elastic.check_every_steps = 0  # a sha256 of the parameters in every Nth step's event; 0 = off
    # Sync interval (DiLoCo): every slice takes this many inner steps with its own optimizer on
    # its share of each global batch, then the slices average their parameter deltas and an outer
    # optimizer (SGD, Nesterov momentum) moves the shared parameters. 1 = exchange the gradients
    # of every step (the same bits as without the key).
    c.elastic.sync_every_steps = 1
    c.elastic.outer_learning_rate = 0.7  # the outer optimizer's learning rate (DiLoCo's 0.7)
    c.elastic.outer_momentum = 0.9  # its Nesterov momentum, in [0, 1)

    # A jax.profiler trace of some steps into <workdir>/profile/ (resilient_jax.train.profile).
    c.profile = ml_collections.ConfigDict()
    c.profile.steps = ""  # "START:STOP": steps START..STOP-1 (steps count from 1); "" = off
    c.lock()
    return c


def config_to_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
    return json.loads(config.to_json())


# Model keys that say how the layers are computed, not what: left out of the fingerprint.
_HOW_LAYERS_RUN = ("remat", "scan_unroll")


def fingerprint(config: ml_collections.ConfigDict) -> str:
    """Hash of what defines the trained function: model shapes, data (with the held-out share) and
    seed (not logging, and not how the layers are computed: `model.remat` and `model.scan_unroll`
    change memory and speed, not the parameters, so a run may change them and resume)."""
    d = config_to_dict(config)
    keep = {k: d[k] for k in ("model", "seed", "global_batch_size") if k in d}
    keep["model"] = {k: v for k, v in keep["model"].items() if k not in _HOW_LAYERS_RUN}
    data_keys = ("source", "path", "seq_len", "tokenizer", "mixture")
    keep["data"] = {k: d["data"].get(k) for k in data_keys}
    keep["eval_fraction"] = d["eval"]["fraction"]  # the held-out share is not trained on
    if d["rehearsal"]["mode"]:  # what the run rehearses is part of its data (absent when off)
        keep["rehearsal"] = d["rehearsal"]
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]
