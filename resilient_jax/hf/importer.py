"""A Hugging Face Llama directory as the initial parameters of a run, on the run's mesh.

`config.checkpoint.init_from_hf` names the directory. The launcher first makes the run's config
that model (`configure`: the model section and tokenizer from the directory, explicit overrides
checked against it); `run.py` then opens it (`HFSource.open`, which
refuses another architecture or a model that differs from `config.model`, BadInput: exit 2)
before it writes anything, and takes its parameters (`load_params`) only when the run has no
checkpoint of its own to resume: restarts resume from the run's checkpoints, as with `init_from`.
Each process reads the tensors one at a time and places only the shards its own devices hold, so
any mesh works.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import jax
import ml_collections
import numpy as np

from resilient_jax.config import BadInput
from resilient_jax.data import tokenizer as tokenizer_lib
from resilient_jax.hf import hf_config, layout
from resilient_jax.model import ModelConfig

if TYPE_CHECKING:
    from resilient_jax.hf.files import Weights

_MAX_PROBLEMS = 3  # named in the one-line refusal


@dataclasses.dataclass
class HFSource:
    hf_dir: str
    model: ModelConfig
    weights: Weights
    hf_tied: bool  # the HF model reuses its input embedding as its output layer

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> HFSource | None:
        """The source `config.checkpoint.init_from_hf` names (None: the key is empty)."""
        hf_dir = config.checkpoint.init_from_hf
        return cls.open(hf_dir, ModelConfig.from_config(config.model)) if hf_dir else None

    @classmethod
    def open(cls, hf_dir: str, model: ModelConfig) -> HFSource:
        """Checks the directory against `model` from config.json and the tensor headers."""
        Weights = _weights_class()
        hf = hf_config.read(hf_dir)
        section = hf_config.model_section(hf)
        problems = hf_config.mismatches(model, section)
        if problems:
            raise BadInput(_refusal(hf_dir, "is another model than config.model", problems))
        weights = Weights(hf_dir)
        hf_tied = bool(hf.get("tie_word_embeddings", False)) or layout.LM_HEAD not in weights
        problems = layout.shape_problems(weights.shapes, model, hf_tied)
        if problems:
            raise BadInput(_refusal(hf_dir, "does not match config.model", problems))
        return cls(hf_dir, model, weights, hf_tied)

    def load_params(self, abstract_params: Any) -> Any:
        """Our params tree on the shardings of `abstract_params` (ShapeDtypeStructs)."""
        loaders = layout.from_hf(self.weights.get, self.model, self.hf_tied, self.hf_dir)
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
        leaves = []
        for keys, target in flat:
            path = tuple(str(k.key) for k in keys)
            # The blocks of this host's devices, each HF tensor read once for all of them.
            indices = list(target.sharding.addressable_devices_indices_map(target.shape).values())
            blocks = dict(zip(map(_block_key, indices), loaders[path](indices), strict=True))

            def block(index: layout.Index, blocks=blocks, target=target, path=path) -> np.ndarray:
                value = blocks[_block_key(index)].astype(target.dtype)
                shape = target.shape
                wanted = tuple(len(range(*i.indices(n))) for i, n in zip(index, shape, strict=True))
                assert value.shape == wanted, (path, value.shape, wanted)
                return value

            leaves.append(jax.make_array_from_callback(target.shape, target.sharding, block))
        return jax.tree_util.tree_unflatten(treedef, leaves)


def _block_key(index: layout.Index) -> tuple[tuple[int | None, ...], ...]:
    """A hashable stand-in for an index (slices are not hashable before Python 3.12)."""
    return tuple((i.start, i.stop, i.step) for i in index)


def derived_model_section(hf_dir: str) -> dict[str, Any]:
    """The `config.model` keys an import of `hf_dir` needs (see `hf_config` for the mapping),
    once its weights are checked against its config.json (BadInput, one line, if they differ)."""
    hf = hf_config.read(hf_dir)
    section = hf_config.model_section(hf)
    weights = _weights_class()(hf_dir)
    hf_tied = bool(hf.get("tie_word_embeddings", False)) or layout.LM_HEAD not in weights
    m = ModelConfig(**section, remat="none", compute_dtype="float32", tie_embeddings=hf_tied)
    problems = layout.shape_problems(weights.shapes, m, hf_tied)
    if problems:
        unlike = f"has weights unlike its {hf_config.CONFIG_FILE}"
        raise BadInput(_refusal(hf_dir, unlike, problems))
    tied = hf_tied
    if not tied and weights.shapes[layout.LM_HEAD] == weights.shapes[layout.EMBED]:
        # Our own export of a tied model: an untied lm_head that is the scaled embedding.
        tied = layout.is_scaled_copy(weights.get(layout.LM_HEAD), weights.get(layout.EMBED), m)
    section["tie_embeddings"] = tied
    return section


def configure(config: ml_collections.ConfigDict, explicit: Collection[str]) -> None:
    """Makes `config` the model of `config.checkpoint.init_from_hf` (nothing when it is empty):
    its `model` keys from the directory (`derived_model_section`) and `data.tokenizer` its
    tokenizer.json, if it has one. A key in `explicit` (the command line's `--config.KEY`s) must
    agree with the directory, or the run is refused (BadInput, one line) before any work: never
    a run from a random initialisation. Two explicit keys stay as given: `model.max_seq_len`
    (any context at least `data.seq_len`) and `model.tie_embeddings` (`HFSource.open` checks it
    against the weights)."""
    hf_dir = config.checkpoint.init_from_hf
    if not hf_dir:
        return
    section = derived_model_section(hf_dir)
    # A run may train on longer sequences than the directory's model was trained on.
    section["max_seq_len"] = max(section["max_seq_len"], config.data.seq_len)
    for key, value in section.items():
        if f"model.{key}" not in explicit:
            config.model[key] = value
        elif key not in ("max_seq_len", "tie_embeddings") and config.model[key] != value:
            theirs = hf_config.HF_NAMES[key]
            raise BadInput(
                f"config.model.{key}={config.model[key]} is invalid: checkpoint.init_from_hf="
                f"{hf_dir} has {theirs}={value} (drop the override: the directory sets it)"
            )
    tokenizer = os.path.join(hf_dir, hf_config.TOKENIZER_FILE)
    if not os.path.isfile(tokenizer):
        return
    if "data.tokenizer" in explicit:
        ours, theirs = tokenizer_lib.from_config(config), tokenizer_lib.load(tokenizer)
        if ours.identity != theirs.identity:
            raise BadInput(
                f"config.data.tokenizer={config.data.tokenizer!r} is invalid: it is not the "
                f"tokenizer of checkpoint.init_from_hf={hf_dir} ({ours.identity} here, "
                f"{theirs.identity} there; drop the override: the directory sets it)"
            )
        return
    config.data.tokenizer = tokenizer


def _weights_class() -> type[Weights]:
    """`files.Weights`, imported here, not at the top: safetensors is the `hf` extra, and run.py
    imports this module. Without it, BadInput."""
    try:
        from resilient_jax.hf.files import Weights
    except ImportError as e:
        raise BadInput(
            f"config.checkpoint.init_from_hf needs the hf extra ({e.name} is missing): "
            "pip install 'resilient_jax[hf]'"
        ) from None
    return Weights


def _refusal(hf_dir: str, what: str, problems: list[str]) -> str:
    more = len(problems) - _MAX_PROBLEMS
    listed = "; ".join(problems[:_MAX_PROBLEMS]) + (f"; and {more} more" if more > 0 else "")
    return f"Hugging Face directory {hf_dir} {what}: {listed}"
