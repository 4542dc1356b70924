"""Text corpora as token streams: the bundled English corpus, or the user's .txt files.

The bundled corpus is built on first use from `pydoc_data.topics`, which ships with every CPython:
about 0.5 MB of English prose (the Python language reference topics), in a fixed order, so every
machine builds exactly the same bytes without downloading anything.
"""

from __future__ import annotations

import glob
import os

import numpy as np

from resilient_jax.config import ConfigError
from resilient_jax.data.tokenizer import HFTokenizer, Tokenizer

DOCUMENT_SEPARATOR = b"\n\n"


def bundled_documents() -> list[bytes]:
    from pydoc_data import topics

    return [topics.topics[name].strip().encode("utf-8") for name in sorted(topics.topics)]


def text_files(path: str) -> list[str]:
    """A .txt file, a directory (every .txt under it, sorted) or a glob."""
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(path, "**", "*.txt"), recursive=True))
    return sorted(glob.glob(path)) or [path]


def read_documents(path: str, key: str = "config.data.path") -> list[bytes]:
    """The text files at `path`, one document each ('' = the bundled corpus's documents).

    `key` is the setting that named `path`, for the one-line error on unusable input.
    """
    if not path:
        return bundled_documents()
    documents = []
    for name in text_files(path):
        if not os.path.isfile(name):
            raise ConfigError(f"{key}={path!r} is invalid: no such file, directory or glob match")
        with open(name, "rb") as f:
            documents.append(f.read().strip())
    if not any(documents):
        raise ConfigError(f"{key}={path!r} is invalid: the text files are empty")
    return documents


def read_text(path: str, key: str = "config.data.path") -> bytes:
    """The concatenated bytes of the text files at `path` ('' = the bundled corpus)."""
    return DOCUMENT_SEPARATOR.join(read_documents(path, key))


def token_stream(tokenizer: Tokenizer, path: str, key: str = "config.data.path") -> np.ndarray:
    """The text at `path` as one stream of token ids, documents joined by DOCUMENT_SEPARATOR."""
    if not isinstance(tokenizer, HFTokenizer):
        return byte_tokens(read_text(path, key))
    # Each document after the first is encoded with the separator in front: byte-level BPE splits
    # text before every whitespace run, so these ids are exactly those of the joined text, and the
    # library encodes the documents on its threads.
    separator = DOCUMENT_SEPARATOR.decode()
    texts = [
        (separator if i else "") + d.decode("utf-8", errors="replace")
        for i, d in enumerate(read_documents(path, key))
    ]
    return np.asarray([i for ids in tokenizer.encode_batch(texts) for i in ids], dtype=np.int32)


def byte_tokens(data: bytes) -> np.ndarray:
    """Byte-level tokens: token id = byte value (vocabulary of 256)."""
    return np.frombuffer(data, dtype=np.uint8)
