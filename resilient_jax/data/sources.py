"""Random-access sources of fixed-length token sequences, each `seq_len + 1` tokens long (inputs
and next-token targets overlap by all but one token). All three implement Grain's
`RandomAccessDataSource` protocol (`__len__`, `__getitem__`), so Grain can shuffle them; text and
ArrayRecord sources are tokenized with the configured tokenizer, and `config.data.mixture` makes
a `Mixture` of them.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import grain
import ml_collections
import numpy as np

from resilient_jax.config import ConfigError, parse_mixture
from resilient_jax.data import corpus, store
from resilient_jax.data import tokenizer as tokenizer_lib
from resilient_jax.data.mixture import Mixture
from resilient_jax.data.tokenizer import Tokenizer

TOKEN_DTYPE = np.int32
META_SUFFIX = ".meta.json"  # the sidecar of a converted ArrayRecord file: how it was made


class TokenStreamSource:
    """Consecutive, non-overlapping windows of one token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int, key: str = "config.data.seq_len") -> None:
        self._tokens = tokens
        self._window = seq_len + 1
        self._len = (len(tokens) - 1) // seq_len
        if self._len < 1:
            raise ConfigError(f"{key}={seq_len} is invalid: the text has only {len(tokens)} tokens")
        self._seq_len = seq_len

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        start = (index % self._len) * self._seq_len
        return self._tokens[start : start + self._window].astype(TOKEN_DTYPE)

    def __repr__(self) -> str:
        return f"TokenStreamSource(examples={self._len}, window={self._window})"


class ArrayRecordSource:
    """ArrayRecord files whose records are little-endian int32 token sequences (see `convert`).

    The records of a converted file are consecutive windows of its text's token stream
    (`corpus.token_stream`), so its documents are those of the text, each ended by the
    tokenizer's end-of-text token (recorded as `eos_id` in the sidecar); a window may span the
    end of one document and the start of the next.

    Each file written by the converter has a sidecar `<file>.meta.json` naming the tokenizer that
    made it; a file made with another tokenizer than `tokenizer` is refused. (A file without one,
    from another tool, is taken as it is.)
    """

    def __init__(self, pattern: str, seq_len: int, tokenizer: Tokenizer, key: str) -> None:
        paths = [p for p in sorted(glob.glob(pattern)) if not p.endswith(META_SUFFIX)] or [pattern]
        for path in paths:
            check_tokenizer(path, tokenizer)
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


def write_meta(path: str, tokenizer: Tokenizer, seq_len: int, sequences: int) -> None:
    """Records how the ArrayRecord file at `path` was made, next to it."""
    meta = {
        "tokenizer": tokenizer.identity,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,  # ends every document in the records (None: joined by text)
        "seq_len": seq_len,
        "sequences": sequences,
    }
    with open(path + META_SUFFIX, "w") as f:
        json.dump(meta, f, indent=1)


def check_tokenizer(path: str, tokenizer: Tokenizer) -> None:
    """Refuses the ArrayRecord file at `path` if its sidecar names another tokenizer."""
    meta_path = path + META_SUFFIX
    if not os.path.exists(meta_path):
        return
    with open(meta_path) as f:
        recorded = json.load(f).get("tokenizer")
    if recorded != tokenizer.identity:
        raise ConfigError(
            f"config.data.tokenizer is invalid: {path!r} was tokenized with {recorded} "
            f"(its {META_SUFFIX}), the configured tokenizer is {tokenizer.identity}"
        )


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
        return ArrayRecordSource(path, seq_len, tokenizer, key)
    if path and store.is_store(path):  # a prepared corpus: recognised by its plan or manifest
        return store.open_source(path, seq_len, tokenizer, key)
    return TokenStreamSource(corpus.token_stream(tokenizer, path, f"config.{key}"), seq_len)
