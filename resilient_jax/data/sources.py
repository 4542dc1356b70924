"""Random-access sources of fixed-length token sequences, each `seq_len + 1` tokens long (inputs
and next-token targets overlap by all but one token). All three implement Grain's
`RandomAccessDataSource` protocol (`__len__`, `__getitem__`), so Grain can shuffle them.
"""

from __future__ import annotations

import glob

import grain
import ml_collections
import numpy as np

from resilient_jax.config import ConfigError

TOKEN_DTYPE = np.int32


class TokenStreamSource:
    """Consecutive, non-overlapping windows of one token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self._tokens = tokens
        self._window = seq_len + 1
        self._len = (len(tokens) - 1) // seq_len
        if self._len < 1:
            raise ConfigError(
                f"config.data.seq_len={seq_len} is invalid: the text has only {len(tokens)} tokens"
            )
        self._seq_len = seq_len

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        start = (index % self._len) * self._seq_len
        return self._tokens[start : start + self._window].astype(TOKEN_DTYPE)

    def __repr__(self) -> str:
        return f"TokenStreamSource(examples={self._len}, window={self._window})"


class ArrayRecordSource:
    """ArrayRecord files whose records are little-endian int32 token sequences (see `convert`)."""

    def __init__(self, pattern: str, seq_len: int) -> None:
        paths = sorted(glob.glob(pattern)) or [pattern]
        self._source = grain.sources.ArrayRecordDataSource(paths)
        self._window = seq_len + 1
        if len(self._source) == 0:
            raise ConfigError(f"config.data.path={pattern!r} is invalid: it holds no records")
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


def make_source(config: ml_collections.ConfigDict):
    """The configured source. Raises ValueError with a one-line reason on unusable data."""
    from resilient_jax.data import corpus

    d = config.data
    if d.source == "synthetic":
        return SyntheticSource(config.model.vocab_size, d.seq_len)
    if d.source == "arrayrecord":
        return ArrayRecordSource(d.path, d.seq_len)
    if config.model.vocab_size < 256:
        raise ConfigError(
            f"config.model.vocab_size={config.model.vocab_size} is invalid: "
            "byte-level text needs at least 256"
        )
    return TokenStreamSource(corpus.byte_tokens(corpus.read_text(d.path)), d.seq_len)
