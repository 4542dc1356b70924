"""Checks of a config that need no devices, each failing with one line naming the key, the value
and what is allowed; the parsers of the keys that hold small specs (mixture, eval datasets,
profiled steps)."""

from __future__ import annotations

import glob
import math
import os
from typing import Any

import ml_collections

from resilient_jax.config.errors import ConfigError

COMPUTE_DTYPES = ("float32", "bfloat16")
# `model.remat`'s policies (resilient_jax.model.layers gives each its meaning).
REMAT_POLICIES = ("none", "full", "save_dots")
DATA_SOURCES = ("text", "arrayrecord", "synthetic")
RECONFIGURATION_POLICIES = ("cost", "reshape", "wait")  # control.reconfigure
REHEARSAL_MODES = ("", "replay", "synthetic")


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
    _validate_model(config.model)
    _validate_data(config)
    _validate_optimizer(config.optimizer)
    _validate_galore(config)
    _validate_moe(config)
    _validate_mesh(config)
    _validate_health(config.health)
    _validate_checkpoint(config.checkpoint)
    _validate_coordinator(config.coordinator)
    _validate_eval(config.eval, config.data.source)
    _validate_rehearsal(config)
    _validate_elastic(config)
    profile_steps(config.profile.steps)


def _validate_model(m: ml_collections.ConfigDict) -> None:
    if m.compute_dtype not in COMPUTE_DTYPES:
        _fail("model.compute_dtype", m.compute_dtype, f"allowed: {', '.join(COMPUTE_DTYPES)}")
    if m.remat not in REMAT_POLICIES:
        hint = " (True is now 'full')" if str(m.remat).lower() in ("true", "false") else ""
        _fail("model.remat", m.remat, f"allowed: {', '.join(REMAT_POLICIES)}{hint}")
    if m.scan_unroll < 1:
        _fail("model.scan_unroll", m.scan_unroll, "must be >= 1 (num_layers unrolls every layer)")
    if m.num_heads % m.num_kv_heads:
        _fail("model.num_kv_heads", m.num_kv_heads, f"must divide model.num_heads={m.num_heads}")
    if m.head_dim % 2:
        _fail("model.head_dim", m.head_dim, "must be even (rotary positions rotate pairs)")


def _validate_data(config: ml_collections.ConfigDict) -> None:
    d, max_seq_len = config.data, config.model.max_seq_len
    if d.seq_len > max_seq_len:
        _fail("data.seq_len", d.seq_len, f"must be <= model.max_seq_len={max_seq_len}")
    if d.source not in DATA_SOURCES:
        _fail("data.source", d.source, f"allowed: {', '.join(DATA_SOURCES)}")
    if d.source == "arrayrecord" and not (d.path or d.mixture):
        _fail("data.path", d.path, "data.source='arrayrecord' needs a file or glob")
    if d.source in ("text", "arrayrecord") and d.path:
        _check_data_path("data.path", d.path)
    if d.source == "synthetic" and d.path:
        _fail("data.path", d.path, "data.source='synthetic' takes no path")
    _validate_tokenizer_and_mixture(d)
    # Whether the tokenizer has an end-of-text token to split at is known only once it is loaded:
    # the train step refuses one without (`train.step.document_eos_id`).
    if not isinstance(d.document_mask, bool):
        _fail("data.document_mask", d.document_mask, "must be true or false")
    if d.prefetch < 0 or d.num_threads < 1:
        _fail("data.prefetch", d.prefetch, "prefetch >= 0 and num_threads >= 1")


def _validate_optimizer(o: ml_collections.ConfigDict) -> None:
    if not o.learning_rate > 0:
        _fail("optimizer.learning_rate", o.learning_rate, "must be > 0")
    if o.warmup_steps < 0:
        _fail("optimizer.warmup_steps", o.warmup_steps, "must be >= 0")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        _fail("optimizer.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    if o.grad_clip_norm < 0:
        _fail("optimizer.grad_clip_norm", o.grad_clip_norm, "must be >= 0 (0 = no clipping)")


def _validate_mesh(config: ml_collections.ConfigDict) -> None:
    mesh, m = config.mesh, config.model
    for axis in ("replica", "fsdp", "tensor"):
        value = mesh[axis]
        if value == 0 or value < -1:
            _fail(f"mesh.{axis}", value, "must be a positive integer or -1 (automatic)")
    if mesh.tensor == -1:
        _fail("mesh.tensor", -1, "must be a positive integer (never automatic)")
    if m.num_heads % mesh.tensor or m.num_kv_heads % mesh.tensor:
        _fail("mesh.tensor", mesh.tensor, "must divide num_heads and num_kv_heads")


def _validate_galore(config: ml_collections.ConfigDict) -> None:
    g = config.optimizer.galore
    for key in ("rank", "min_size"):
        if not isinstance(g[key], int) or isinstance(g[key], bool) or g[key] < 0:
            _fail(f"optimizer.galore.{key}", g[key], "must be an integer >= 0")
    _check_positive(config, "optimizer.galore.update_interval")
    if not g.scale > 0:
        _fail("optimizer.galore.scale", g.scale, "must be > 0")
    if not isinstance(g.rotate_state, bool):
        _fail("optimizer.galore.rotate_state", g.rotate_state, "must be true or false")
    # GaLore projects MLP, expert and attention matrices; embeddings and routers keep full Adam.
    m = config.model
    heads = [m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim]
    matrices = [(m.d_model, w) for w in heads]
    if m.moe.num_experts == 0 or m.moe.every > 1:  # some layers keep the dense MLP
        matrices.append((m.d_model, m.d_ff))
    if m.moe.num_experts > 0:
        matrices.append((m.d_model, m.moe.d_ff or m.d_ff))  # each expert's own matrix
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
    for key in (
        "sync_timeout_s",
        "persistent_timeout_s",
        "persistent_outage_limit_s",
        "peer_timeout_s",
    ):
        if not c[key] > 0:
            _fail(f"checkpoint.{key}", c[key], "must be > 0 seconds")
    if c.peer_fetch and not c.peer_timeout_s < c.sync_timeout_s:
        _fail(
            "checkpoint.peer_timeout_s",
            c.peer_timeout_s,
            f"must be below checkpoint.sync_timeout_s={c.sync_timeout_s:g} (the other processes "
            "wait for a fetch inside the restore's agreement)",
        )
    if c.init_from and c.init_from_hf:
        _fail("checkpoint.init_from_hf", c.init_from_hf, "excludes checkpoint.init_from (pick one)")
    if c.keep_state not in ("auto", "always", "never"):
        _fail("checkpoint.keep_state", c.keep_state, "one of auto, always, never")
    if not c.device_memory_gb >= 0 or math.isinf(c.device_memory_gb):
        _fail("checkpoint.device_memory_gb", c.device_memory_gb, "must be >= 0 GB (0 = reported)")


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
    for key in ("standby_workers", "standby_idle_cpu"):
        if not isinstance(c[key], bool):
            _fail(f"coordinator.{key}", c[key], "must be true or false")
    for key in (
        "heartbeat_interval_s",
        "agent_timeout_s",
        "orphan_timeout_s",
        "hang_floor_s",
        "startup_timeout_s",
        "first_step_timeout_s",
        "auth_timeout_s",
        "refusal_log_window_s",
    ):
        if not c[key] > 0:
            _fail(f"coordinator.{key}", c[key], "must be > 0")
    for key in ("max_pending_connections", "refusals_logged_per_peer"):
        if not isinstance(c[key], int) or c[key] < 1:
            _fail(f"coordinator.{key}", c[key], "must be an integer >= 1")
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
    if c.reconfiguration not in RECONFIGURATION_POLICIES:
        allowed = ", ".join(RECONFIGURATION_POLICIES)
        _fail("coordinator.reconfiguration", c.reconfiguration, f"one of {allowed}")
    if not c.restart_cost_s > 0:
        _fail("coordinator.restart_cost_s", c.restart_cost_s, "must be > 0")
    if c.step_time_calibration and not os.path.isfile(c.step_time_calibration):
        _fail("coordinator.step_time_calibration", c.step_time_calibration, "no such file")
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
    """Each of a comma-separated list of files, directories and globs must match something."""
    for item in path.split(","):
        if item.startswith("gs://"):
            continue
        if not glob.glob(item) and not os.path.exists(item):
            _fail(key, path, f"no such file, directory or glob match: {item}")


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


def _validate_elastic(config: ml_collections.ConfigDict) -> None:
    e = config.elastic
    every = e.sync_every_steps
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        _fail("elastic.sync_every_steps", e.sync_every_steps, "must be an integer >= 1")
    if not e.enabled:
        if e.sync_every_steps != 1:
            _fail("elastic.sync_every_steps", e.sync_every_steps, "needs elastic.enabled=true")
        return
    if not e.outer_learning_rate > 0:
        _fail("elastic.outer_learning_rate", e.outer_learning_rate, "must be > 0")
    if not 0 <= e.outer_momentum < 1:
        _fail("elastic.outer_momentum", e.outer_momentum, "must be in [0, 1)")
    _check_positive(config, "elastic.slices")
    for key in ("timeout_s", "join_timeout_s", "quorum_timeout_s"):
        if not e[key] > 0:
            _fail(f"elastic.{key}", e[key], "must be > 0")
    if e.backend != "gloo":
        _fail("elastic.backend", e.backend, "allowed: gloo")
    if config.global_batch_size % e.slices:
        _fail(
            "elastic.slices", e.slices, f"must divide global_batch_size={config.global_batch_size}"
        )
    for key in ("standby", "standby_idle_cpu"):
        if not isinstance(e[key], bool):
            _fail(f"elastic.{key}", e[key], "must be true or false")
    if e.check_every_steps < 0:
        _fail("elastic.check_every_steps", e.check_every_steps, "must be >= 0 (0 = off)")
