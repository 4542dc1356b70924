"""A Hugging Face Llama `config.json` from our model section, and our model section from one.

Derivation (HF -> ours): hidden_size -> d_model, intermediate_size -> d_ff, num_hidden_layers ->
num_layers, num_attention_heads -> num_heads, num_key_value_heads -> num_kv_heads (default:
num_heads), head_dim (default: hidden_size / num_attention_heads), max_position_embeddings ->
max_seq_len, rope_theta, rms_norm_eps -> norm_eps, vocab_size. `tie_embeddings` depends on the
weights as well as on `tie_word_embeddings` (see `layout.tied_in_ours`); `remat` and
`compute_dtype` are ours alone. Features our decoder lacks (biases, rope scaling, another
activation) are refused, not ignored.
"""

from __future__ import annotations

import json
import os
from typing import Any

from resilient_jax.config import BadInput
from resilient_jax.model import ModelConfig

ARCHITECTURE = "LlamaForCausalLM"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"  # a directory's tokenizer (`tokenizers` format), if it has one

# Our model keys that define the parameters' shapes and the function they compute: an import
# needs them equal to the HF model's. (`tie_embeddings` is decided with the weights.)
MATCHED_KEYS = (
    "vocab_size",
    "d_model",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "d_ff",
    "rope_theta",
    "norm_eps",
)
# Our key -> the LlamaConfig field it is stored as.
HF_NAMES = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "d_ff": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
}


def to_hf(
    m: ModelConfig, dtype: str, context: int, special_token_ids: dict[str, int | None]
) -> dict[str, Any]:
    """The LlamaConfig of an export. Always untied: see the package docstring. `context` is the
    sequence length trained on (`max_position_embeddings`); `special_token_ids` holds
    `bos_token_id`, `eos_token_id` and `pad_token_id`."""
    fields = {HF_NAMES[key]: getattr(m, key) for key in HF_NAMES}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        **fields,
        "max_position_embeddings": context,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        **special_token_ids,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
    }


def read(hf_dir: str) -> dict[str, Any]:
    """The directory's config.json, refused (BadInput) unless it is a Llama we can run."""
    path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.isdir(hf_dir):
        raise BadInput(f"Hugging Face directory {hf_dir} does not exist")
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise BadInput(f"Hugging Face directory {hf_dir} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise BadInput(f"{path} is unreadable: {e}") from None
    # A config saved without `architectures` still names its family in `model_type`.
    architectures = hf.get("architectures") or (
        [ARCHITECTURE] if hf.get("model_type") == "llama" else [hf.get("model_type", "unknown")]
    )
    if architectures != [ARCHITECTURE]:
        raise BadInput(
            f"{path} describes {', '.join(map(str, architectures))}, not {ARCHITECTURE}: "
            "only Llama models can be imported"
        )
    unsupported = {
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(hf.get("attention_bias")),
        "mlp_bias": bool(hf.get("mlp_bias")),
        "rope_scaling": hf.get("rope_scaling") is not None,
    }
    refused = [f"{k}={hf.get(k)!r}" for k, bad in unsupported.items() if bad]
    if refused:
        raise BadInput(f"{path} uses what our decoder lacks: {', '.join(refused)}")
    return hf


def model_section(hf: dict[str, Any]) -> dict[str, Any]:
    """Our model keys (those `HF_NAMES` lists) from a LlamaConfig dict (checked by `read`)."""
    heads = hf["num_attention_heads"]
    defaults = {
        "num_key_value_heads": heads,
        "head_dim": hf["hidden_size"] // heads,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
    }
    section = {}
    for ours, theirs in HF_NAMES.items():
        value = hf.get(theirs)
        section[ours] = defaults[theirs] if value is None else value
    section["rope_theta"] = float(section["rope_theta"])
    section["norm_eps"] = float(section["norm_eps"])
    return section


def mismatches(m: ModelConfig, section: dict[str, Any]) -> list[str]:
    """`MATCHED_KEYS` where the config's model differs from the HF model's, as `key=ours/theirs`."""
    return [
        f"{key}={getattr(m, key)} here, {HF_NAMES[key]}={section[key]} there"
        for key in MATCHED_KEYS
        if getattr(m, key) != section[key]
    ]
