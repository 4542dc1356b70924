"""The newest verified checkpoint of a run, written as a Hugging Face Llama directory.

`restore_params` restores like a resuming run (`checkpoint.reader.restore_newest`: newest step of
any tier that verifies, read without writing into the run) onto this process's devices, with the
run's own `config.json`; `export`
writes `config.json`, `model.safetensors` (PyTorch layout, `format: pt`) and, for a subword
tokenizer, `tokenizer.json` with a `tokenizer_config.json` that `AutoTokenizer` reads. A
bytes-tokenizer run has no Hugging Face tokenizer to write. One process; no events are written
into the run's directory.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import ml_collections
import numpy as np
import tokenizers

from resilient_jax.checkpoint.reader import load_run_config, restore_newest
from resilient_jax.config import BadInput
from resilient_jax.data import tokenizer as tokenizer_lib
from resilient_jax.hf import files, hf_config, layout
from resilient_jax.model import ModelConfig

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def restore_params(workdir: str) -> tuple[ml_collections.ConfigDict, int, Any]:
    """The run's config, and the step and parameters (host numpy arrays) of its newest
    verified checkpoint. BadInput if the run has none."""
    config = load_run_config(workdir)
    restored = restore_newest(config, workdir)
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), restored.state.params)
    return config, restored.step, params


def export(workdir: str, output: str, dtype: str = "float32") -> str:
    """Writes the HF directory `output` (new or empty); returns a one-line summary."""
    if dtype not in files.EXPORT_DTYPES:
        raise BadInput(f"--dtype={dtype} is invalid: allowed: {', '.join(files.EXPORT_DTYPES)}")
    if os.path.isdir(output) and os.listdir(output):
        raise BadInput(f"--output={output} is not empty: export into a new directory")
    config, step, params = restore_params(workdir)
    write(config, params, output, dtype)
    return f"exported step {step} of {workdir} to {output} ({dtype})"


def write(config: ml_collections.ConfigDict, params: Any, output: str, dtype: str) -> None:
    """The HF directory for `params` (our tree, host arrays) of a model configured by `config`."""
    m = ModelConfig.from_config(config.model)
    tokenizer = tokenizer_lib.from_config(config)
    # Rounded first, so a tied model's lm_head is derived from the embedding as it is stored
    # (what an import checks it against).
    stored = files.EXPORT_DTYPES[dtype]
    params = jax.tree.map(lambda x: np.asarray(x).astype(stored).astype(np.float32), params)
    os.makedirs(output, exist_ok=True)
    eos_token_id = None
    if tokenizer.path is not None:
        shutil.copyfile(tokenizer.path, os.path.join(output, TOKENIZER_FILE))
        eos_token_id = _write_tokenizer_config(tokenizer.path, m, output)
    files.write(os.path.join(output, files.WEIGHTS_FILE), layout.to_hf(params, m), dtype)
    with open(os.path.join(output, hf_config.CONFIG_FILE), "w") as f:
        json.dump(hf_config.to_hf(m, dtype, None, eos_token_id), f, indent=2)


def _write_tokenizer_config(path: str, m: ModelConfig, output: str) -> int | None:
    """tokenizer_config.json for `PreTrainedTokenizerFast`; returns the end-of-text id, if any."""
    eos_token_id = tokenizers.Tokenizer.from_file(path).token_to_id(tokenizer_lib.END_OF_TEXT)
    settings: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": m.max_seq_len,
    }
    if eos_token_id is not None:
        settings["eos_token"] = tokenizer_lib.END_OF_TEXT
    with open(os.path.join(output, TOKENIZER_CONFIG_FILE), "w") as f:
        json.dump(settings, f, indent=2)
    return eos_token_id
