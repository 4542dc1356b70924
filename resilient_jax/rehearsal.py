"""Continual pretraining: the rehearsal set of a run and the training data mixed with it.

With `rehearsal.mode = "synthetic"` the base model (the parameters the run starts from:
`checkpoint.init_from` or `init_from_hf`) first writes `rehearsal.sequences` sequences, each
`rehearsal.prompt` continued to `data.seq_len + 1` tokens (self-synthesized rehearsal: the model's
own samples stand in for the old data it was trained on). Generation runs in chunks of
`rehearsal.chunk_sequences` rows, each drawn with a seed derived from (`seed`, chunk index), so a
chunk's tokens do not depend on which chunks were generated before it. Process 0 writes each
chunk to a temporary file, renames it into place, and then records its checksum in the manifest
(renamed into place too): a run killed while generating resumes at the first chunk the manifest
does not name, and the set it ends with is byte for byte the set an uninterrupted run writes (same
devices and backend). Every process computes the chunks (the decode step is one program over the
run's mesh); the others then wait for process 0's complete manifest and read the files.
Generation happens before the first step, so its time counts against the start-up budgets
(`health.watchdog_startup_timeout_s`, `coordinator.startup_timeout_s`): raise them for large sets.

`rehearsal.mode = "replay"` mixes in a seeded sample of the old data instead
(`data.rehearsal.replay_sample`); nothing is generated.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from resilient_jax.config import BadInput
from resilient_jax.contracts.event_types import EventType
from resilient_jax.data import tokenizer as tokenizer_lib
from resilient_jax.data.mixture import component_seed
from resilient_jax.data.rehearsal import (
    MANIFEST,
    GeneratedSet,
    chunk_name,
    file_digest,
    read_manifest,
    rehearsal_dir,
    replay_sample,
    with_rehearsal,
)
from resilient_jax.decode import Decoder, Sampling
from resilient_jax.events import EventLog
from resilient_jax.model import ModelConfig

# Seconds between looks at process 0's manifest while it generates.
_POLL_S = 0.5


def spec(config: ml_collections.ConfigDict, prompt_ids: list[int]) -> dict[str, Any]:
    """What defines a synthetic set: a manifest with another spec belongs to another set."""
    r, c = config.rehearsal, config.checkpoint
    return {
        "base": c.init_from or c.init_from_hf,
        "prompt_ids": prompt_ids,
        "seq_len": config.data.seq_len,
        "sequences": r.sequences,
        "chunk_sequences": r.chunk_sequences,
        "sampling": [r.temperature, r.top_k, r.top_p],
        "seed": config.seed,
    }


@functools.lru_cache(maxsize=4)
def _decoder(model: ModelConfig, sampling: Sampling, vocab: int, max_len: int) -> Decoder:
    """One Decoder (and its compiled steps) per model and sampling in a process."""
    return Decoder(model, sampling, vocab, max_len)


def chunk_seed(seed: int, chunk: int) -> int:
    return component_seed(seed, chunk) & 0x7FFFFFFF


def _write_atomically(path: str, write) -> None:
    temporary = path + ".tmp"
    with open(temporary, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    _write_atomically(os.path.join(directory, MANIFEST), lambda f: f.write(text))


def _committed(directory: str, manifest: dict[str, Any], index: int) -> bool:
    path = os.path.join(directory, chunk_name(index))
    digest = manifest["chunks"].get(str(index))
    return digest is not None and os.path.exists(path) and file_digest(path) == digest


def _prompt_ids(config: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer) -> list[int]:
    """`rehearsal.prompt`'s tokens; raises `BadInput` when they leave no room in a sequence."""
    r, seq_len = config.rehearsal, config.data.seq_len
    prompt_ids = tokenizer.encode(r.prompt)
    if not 0 < len(prompt_ids) <= seq_len:
        raise BadInput(
            f"config.rehearsal.prompt={r.prompt!r} is invalid: it is {len(prompt_ids)} tokens, "
            f"must be 1 to data.seq_len={seq_len}"
        )
    return prompt_ids


def _manifest_to_complete(directory: str, wanted: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest of the set in `directory` (a fresh one when it has none), or None when the
    set is complete; raises `BadInput` when it was made with another spec than `wanted`."""
    manifest = read_manifest(directory)
    if manifest is not None and manifest["spec"] != wanted:
        raise BadInput(
            f"the rehearsal set in {directory} was made with other settings ({manifest['spec']}):"
            " use another workdir or delete it"
        )
    if manifest is not None and manifest.get("complete"):
        return None
    return manifest or {"spec": wanted, "chunks": {}, "complete": False}


def _commit_chunk(
    directory: str, manifest: dict[str, Any], index: int, tokens_BL: np.ndarray
) -> None:
    """Writes chunk `index`, then names it in the manifest: a chunk the manifest names is whole."""
    path = os.path.join(directory, chunk_name(index))
    _write_atomically(path, lambda f: np.save(f, tokens_BL))
    manifest["chunks"][str(index)] = file_digest(path)
    _write_manifest(directory, manifest)


def _wait_for_writer(directory: str, wait_s: float) -> None:
    """Returns once process 0 has marked the set complete; raises after `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while not (read_manifest(directory) or {}).get("complete"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"process 0 did not complete the rehearsal set in {wait_s:.0f} s")
        time.sleep(_POLL_S)


def generate(
    config: ml_collections.ConfigDict,
    directory: str,
    params: Any,
    events: EventLog,
    writer: bool = True,
    wait_s: float = 600.0,
) -> None:
    """Completes the synthetic set in `directory` with the base model's `params` (see the module
    docstring); returns at once when it is complete. Raises `BadInput` when `directory` holds a set
    made with other settings, or when the prompt leaves no room in a sequence."""
    r, seq_len = config.rehearsal, config.data.seq_len
    tokenizer = tokenizer_lib.from_config(config)
    prompt_ids = _prompt_ids(config, tokenizer)
    manifest = _manifest_to_complete(directory, spec(config, prompt_ids))
    if manifest is None:
        return
    if writer:
        os.makedirs(directory, exist_ok=True)
    sampling = Sampling(r.temperature, r.top_k, r.top_p)
    model = ModelConfig.from_config(config.model)
    decoder = _decoder(model, sampling, tokenizer.vocab_size, seq_len + 1)
    prompt_BP = np.asarray(prompt_ids, np.int32)[None, :]
    for index in range(math.ceil(r.sequences / r.chunk_sequences)):
        if _committed(directory, manifest, index):
            continue
        start = time.perf_counter()
        rows = min(r.chunk_sequences, r.sequences - index * r.chunk_sequences)
        # Every chunk decodes chunk_sequences rows (one compiled shape); the last keeps `rows`.
        prompts_BP = np.repeat(prompt_BP, r.chunk_sequences, axis=0)
        new_BN = decoder.generate_rows(
            params, prompts_BP, seq_len + 1 - len(prompt_ids), chunk_seed(config.seed, index)
        )
        if not writer:
            continue
        tokens_BL = np.concatenate([prompts_BP, new_BN], axis=1)[:rows].astype(np.int32)
        _commit_chunk(directory, manifest, index, tokens_BL)
        events.emit(
            EventType.REHEARSAL,
            chunk=index,
            sequences=rows,
            duration_s=time.perf_counter() - start,
        )
    if writer:
        manifest["complete"] = True
        _write_manifest(directory, manifest)
        events.emit(EventType.REHEARSAL, complete=True, sequences=r.sequences)
        return
    _wait_for_writer(directory, wait_s)


def open_replay(config: ml_collections.ConfigDict) -> Any:
    """The replay sample of `rehearsal.mode = "replay"` (else None), opened before the run
    writes anything, so that unusable old data is refused first."""
    return replay_sample(config) if config.rehearsal.mode == "replay" else None


def training_source(
    config: ml_collections.ConfigDict,
    workdir: str,
    source: Any,
    replay: Any,
    params: Any,
    step: int,
    events: EventLog,
) -> Any:
    """The training data with its rehearsal share mixed in (`source` itself with rehearsal off).

    `replay`: `open_replay`'s sample. `params` and `step` are the state the run starts from: a
    synthetic set still incomplete is generated from them only at step 0, where they are the
    base model's."""
    r = config.rehearsal
    if not r.mode:
        return source
    if replay is not None:
        return with_rehearsal(source, replay, r.ratio)
    directory = rehearsal_dir(workdir)
    complete = (read_manifest(directory) or {}).get("complete")
    if not complete and step > 0:
        raise BadInput(
            f"the rehearsal set in {directory} is incomplete, and the run's checkpoints (step "
            f"{step}) are past the base model that writes it: restore the set or start afresh"
        )
    generate(
        config,
        directory,
        params,
        events,
        writer=jax.process_index() == 0,
        wait_s=config.coordinator.startup_timeout_s,
    )
    return with_rehearsal(source, GeneratedSet(directory, config.data.seq_len), r.ratio)
