"""Text corpora as token streams: the bundled English corpus, or the user's .txt files.

The bundled corpus is built on first use from `pydoc_data.topics`, which ships with every CPython:
about 0.5 MB of English prose (the Python language reference topics), in a fixed order, so every
machine builds exactly the same bytes without downloading anything.

Documents: one topic of the bundled corpus, one .txt file of the user's (leading and trailing
whitespace stripped; files in sorted path order). The token stream is every document encoded on
its own and followed by the tokenizer's end-of-text token, in that order: a pure function of the
files and the tokenizer, so the examples cut from it (and batch(step)) stay a pure function of
(dataset, seed, step, global batch). A tokenizer without an end-of-text token (see
`Tokenizer.special_tokens_summary`) gets the documents joined by DOCUMENT_SEPARATOR instead.
"""

from __future__ import annotations

import glob
import itertools
import os

import numpy as np
from absl import logging

from resilient_jax.config import ConfigError
from resilient_jax.data.tokenizer import HFTokenizer, Tokenizer

DOCUMENT_SEPARATOR = b"\n\n"  # between documents, for a tokenizer without end-of-text


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


def token_stream(tokenizer: Tokenizer, path: str, key: str = "config.data.path") -> np.ndarray:
    """The documents at `path` as one stream of token ids, each followed by end-of-text."""
    documents = [d for d in read_documents(path, key) if d]  # whitespace alone is no document
    if not isinstance(tokenizer, HFTokenizer):
        # As UTF-8 text, like a BPE reads them: bytes that are no UTF-8 become U+FFFD, so the
        # end-of-text byte (0xFF, never in UTF-8) occurs nowhere else in the stream.
        end = bytes([tokenizer.eos_id])
        texts = [d.decode("utf-8", errors="replace").encode("utf-8") for d in documents]
        return np.frombuffer(b"".join(t + end for t in texts), dtype=np.uint8)
    texts = [d.decode("utf-8", errors="replace") for d in documents]
    if tokenizer.eos_id is None:
        logging.warning("tokenizer %s: %s", tokenizer.path, tokenizer.special_tokens_summary())
        # Each document after the first is encoded with the separator in front: byte-level BPE
        # splits text before every whitespace run, so these ids are exactly those of the joined
        # text, and the library encodes the documents on its threads.
        separator = DOCUMENT_SEPARATOR.decode()
        texts = [(separator if i else "") + t for i, t in enumerate(texts)]
        ends: list[int] = []
    else:
        ends = [tokenizer.eos_id]
    encoded = tokenizer.encode_batch(texts)
    return np.fromiter(itertools.chain.from_iterable(e + ends for e in encoded), dtype=np.int32)
