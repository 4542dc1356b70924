"""The newest verified checkpoint of a run, written as a Hugging Face Llama directory.

`restore_params` restores like a resuming run (`checkpoint.reader.restore_newest`: newest step of
any tier that verifies, read without writing into the run) onto this process's devices, with the
run's own `config.json`; `export`
writes `config.json`, `generation_config.json`, `model.safetensors` (PyTorch layout, `format: pt`)
and, for a subword tokenizer, `tokenizer.json` with the `tokenizer_config.json` and
`special_tokens_map.json` that `AutoTokenizer` reads, every file mode 0644. The special token ids
(`special_token_ids`) are the same in all of them; the context (`max_position_embeddings`,
`model_max_length`, the generation's `max_length`) is the one trained, `data.seq_len`. A
bytes-tokenizer run has no Hugging Face tokenizer to write (its end-of-text is byte 0xFF). One
process; no events are written into the run's directory.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import ml_collections
import numpy as np

from resilient_jax.checkpoint.reader import load_run_config, restore_newest
from resilient_jax.config import BadInput
from resilient_jax.data import tokenizer as tokenizer_lib
from resilient_jax.hf import files, hf_config, layout
from resilient_jax.model import ModelConfig

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"


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
    context = config.data.seq_len  # the positions it was trained on, not model.max_seq_len
    # Rounded first, so a tied model's lm_head is derived from the embedding as it is stored
    # (what an import checks it against).
    stored = files.EXPORT_DTYPES[dtype]
    params = jax.tree.map(lambda x: np.asarray(x).astype(stored).astype(np.float32), params)
    os.makedirs(output, exist_ok=True)
    ids = special_token_ids(tokenizer)
    if tokenizer.path is not None:
        shutil.copyfile(tokenizer.path, os.path.join(output, hf_config.TOKENIZER_FILE))
        _write_tokenizer_config(tokenizer, ids, context, output)
    files.write(os.path.join(output, files.WEIGHTS_FILE), layout.to_hf(params, m), dtype)
    # config.json declares no padding token: transformers makes `pad_token_id` the embedding's
    # `padding_idx`, whose row never receives a gradient, and ours is end-of-text, a token we
    # train on. Padding stays in the tokenizer's files and generation_config.json.
    model_ids = {**ids, "pad_token_id": None}
    _write_json(output, hf_config.CONFIG_FILE, hf_config.to_hf(m, dtype, context, model_ids))
    generation = {key: value for key, value in ids.items() if value is not None}
    _write_json(output, GENERATION_CONFIG_FILE, {**generation, "max_length": context})
    # Readable by everyone, as a model directory is shared: safetensors writes its file 0600.
    for name in os.listdir(output):
        os.chmod(os.path.join(output, name), 0o644)


def special_token_ids(tokenizer: tokenizer_lib.Tokenizer) -> dict[str, int | None]:
    """`bos_token_id`, `eos_token_id` and `pad_token_id` of an export.

    In training every document follows the previous one's end-of-text, so a tokenizer without a
    begin-of-text token of its own starts a text with end-of-text (GPT-2's convention); padding
    is the tokenizer's (`Tokenizer.pad_id`: end-of-text when it has no padding token)."""
    bos = tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id
    return {"bos_token_id": bos, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}


def _write_tokenizer_config(
    tokenizer: tokenizer_lib.Tokenizer, ids: dict[str, int | None], context: int, output: str
) -> None:
    """tokenizer_config.json and special_tokens_map.json for `PreTrainedTokenizerFast`: a Llama
    takes `input_ids` and `attention_mask` only (without `model_input_names` the tokenizer also
    returns `token_type_ids`, which `generate` refuses)."""
    special = {
        name.removesuffix("_id"): tokenizer.token(token_id)
        for name, token_id in ids.items()
        if token_id is not None
    }
    settings: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context,
        "model_input_names": ["input_ids", "attention_mask"],
        # Decoding gives back the text as the tokenizer has it (no spaces removed before
        # punctuation), as `Tokenizer.decode` does.
        "clean_up_tokenization_spaces": False,
        **special,
    }
    _write_json(output, TOKENIZER_CONFIG_FILE, settings)
    _write_json(output, SPECIAL_TOKENS_FILE, special)


def _write_json(output: str, name: str, value: dict[str, Any]) -> None:
    with open(os.path.join(output, name), "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
