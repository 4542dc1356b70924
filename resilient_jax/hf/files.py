"""Safetensors in a Hugging Face directory: one `model.safetensors` or shards listed by
`model.safetensors.index.json`. Read lazily (headers first, one tensor at a time), no PyTorch."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import ml_dtypes
import numpy as np
import safetensors
from safetensors.numpy import save_file

from resilient_jax.config import BadInput

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EXPORT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


class Weights:
    """The tensors of a directory by name: shapes from the headers, data on demand."""

    def __init__(self, hf_dir: str) -> None:
        self._dir = hf_dir
        self._file_of: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in self._files():
            path = os.path.join(hf_dir, name)
            try:
                with safetensors.safe_open(path, framework="np") as f:
                    for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                        self._file_of[key] = path
                        self.shapes[key] = tuple(f.get_slice(key).get_shape())
            except (OSError, safetensors.SafetensorError) as e:
                raise BadInput(f"{path} is not a readable safetensors file: {e}") from None

    def _files(self) -> list[str]:
        index = os.path.join(self._dir, INDEX_FILE)
        if os.path.exists(os.path.join(self._dir, WEIGHTS_FILE)):
            return [WEIGHTS_FILE]
        if os.path.exists(index):
            try:
                with open(index) as f:
                    return sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError) as e:
                raise BadInput(f"{index} is unreadable: {e}") from None
        raise BadInput(
            f"Hugging Face directory {self._dir} has no {WEIGHTS_FILE} (nor {INDEX_FILE}); "
            "only safetensors weights can be imported"
        )

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def get(self, name: str) -> np.ndarray:
        """The tensor in the dtype it is stored in (bfloat16 as `ml_dtypes.bfloat16`)."""
        with safetensors.safe_open(self._file_of[name], framework="np") as f:
            return np.asarray(f.get_tensor(name))


def write(path: str, tensors: Mapping[str, np.ndarray], dtype: str) -> None:
    """One safetensors file in the PyTorch layout (`format: pt`, what `from_pretrained` reads)."""
    target = EXPORT_DTYPES[dtype]
    arrays = {name: np.ascontiguousarray(t.astype(target)) for name, t in tensors.items()}
    save_file(arrays, path, metadata={"format": "pt"})
