"""Random-access sources of fixed-length token sequences, each `seq_len + 1` tokens long (inputs
and next-token targets overlap by all but one token): a token store (`data.store`, prepared
once), a small corpus tokenized in memory, ArrayRecord files of another pipeline, or synthetic
tokens. All implement Grain's `RandomAccessDataSource` protocol (`__len__`, `__getitem__`), so
Grain can shuffle them, and `config.data.mixture` makes a `Mixture` of them.
"""

from __future__ import annotations

import glob
from typing import Any

import grain
import ml_collections
import numpy as np

from resilient_jax.config import ConfigError, parse_mixture
from resilient_jax.data import corpus, store
from resilient_jax.data import tokenizer as tokenizer_lib
from resilient_jax.data.mixture import Mixture
from resilient_jax.data.store import TOKEN_DTYPE, TokenStreamSource
from resilient_jax.data.tokenizer import Tokenizer


class ArrayRecordSource:
    """ArrayRecord files (from another pipeline) whose records are little-endian int32 token
    sequences of `seq_len + 1` tokens. A corpus of your own is better prepared into a token store
    (`data.prepare`): any seq_len reads it, and it checks its tokenizer and its bytes."""

    def __init__(self, pattern: str, seq_len: int, key: str) -> None:
        paths = sorted(glob.glob(pattern)) or [pattern]
        self._source = grain.sources.ArrayRecordDataSource(paths)
        self._window = seq_len + 1
        if len(self._source) == 0:
            raise ConfigError(f"config.{key}={pattern!r} is invalid: it holds no records")
        first = self._decode(self._source[0])
        if len(first) != self._window:
            raise ConfigError(
                f"config.data.seq_len={seq_len} is invalid: {pattern!r} holds sequences of "
                f"{len(first)} tokens, which fits seq_len={len(first) - 1}"
            )

    @staticmethod
    def _decode(record: bytes) -> np.ndarray:
        return np.frombuffer(record, dtype="<i4").astype(TOKEN_DTYPE)

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> np.ndarray:
        return self._decode(self._source[index % len(self._source)])

    def __repr__(self) -> str:
        return f"ArrayRecordSource(examples={len(self)}, window={self._window})"


class SyntheticSource:
    """Seeded random tokens for benchmarks: no I/O, any size, same bytes everywhere."""

    def __init__(self, vocab_size: int, seq_len: int, num_examples: int = 1 << 20) -> None:
        self._vocab, self._window, self._len = vocab_size, seq_len + 1, num_examples

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng(index % self._len)
        return rng.integers(0, self._vocab, self._window, dtype=TOKEN_DTYPE)


def make_source(config: ml_collections.ConfigDict) -> Any:
    """The configured source, or `Mixture` of sources; unusable data is a one-line ConfigError."""
    d = config.data
    if d.source == "synthetic":
        return SyntheticSource(config.model.vocab_size, d.seq_len)
    tokenizer = tokenizer_lib.from_config(config)
    if not d.mixture:
        return _dataset(d.source, d.path, d.seq_len, tokenizer, "data.path")
    return Mixture(
        [
            (_dataset(d.source, path, d.seq_len, tokenizer, "data.mixture"), weight)
            for path, weight in parse_mixture(d.mixture)
        ]
    )


def make_dataset(config: ml_collections.ConfigDict, path: str, key: str) -> Any:
    """One dataset at `path` of `data.source`'s kind, tokenized as the training data is;
    `key` names the setting for the one-line error on unusable input."""
    d = config.data
    return _dataset(d.source, path, d.seq_len, tokenizer_lib.from_config(config), key)


def _dataset(kind: str, path: str, seq_len: int, tokenizer: Tokenizer, key: str) -> Any:
    if kind == "arrayrecord":
        return ArrayRecordSource(path, seq_len, key)
    if path and store.is_store(path):  # a prepared corpus: recognised by its plan or manifest
        return store.open_source(path, seq_len, tokenizer, key)
    return TokenStreamSource(corpus.token_stream(tokenizer, path, f"config.{key}"), seq_len)
