"""Text corpora as byte streams: the bundled English corpus, or the user's .txt files.

The bundled corpus is built on first use from `pydoc_data.topics`, which ships with every CPython:
about 0.5 MB of English prose (the Python language reference topics), in a fixed order, so every
machine builds exactly the same bytes without downloading anything.
"""

from __future__ import annotations

import glob
import os

import numpy as np

from resilient_jax.config import ConfigError

DOCUMENT_SEPARATOR = b"\n\n"


def bundled_corpus() -> bytes:
    from pydoc_data import topics

    docs = (topics.topics[name].strip().encode("utf-8") for name in sorted(topics.topics))
    return DOCUMENT_SEPARATOR.join(docs)


def text_files(path: str) -> list[str]:
    """A .txt file, a directory (every .txt under it, sorted) or a glob."""
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(path, "**", "*.txt"), recursive=True))
    return sorted(glob.glob(path)) or [path]


def read_text(path: str) -> bytes:
    """The concatenated bytes of the text files at `path` ('' = the bundled corpus)."""
    if not path:
        return bundled_corpus()
    files = text_files(path)
    chunks = []
    for name in files:
        with open(name, "rb") as f:
            chunks.append(f.read().strip())
    data = DOCUMENT_SEPARATOR.join(chunks)
    if not data:
        raise ConfigError(f"config.data.path={path!r} is invalid: the text files are empty")
    return data


def byte_tokens(data: bytes) -> np.ndarray:
    """Byte-level tokens: token id = byte value (vocabulary of 256)."""
    return np.frombuffer(data, dtype=np.uint8)
